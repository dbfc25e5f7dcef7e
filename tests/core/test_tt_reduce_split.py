"""tt_reduce at large batches: a core row's long list of contributions is summed by several
blocks into partials that tt_reduce_join adds in order. Against the NumPy path (float64 where
it matters), for 2, 3 and 4 cores, hot rows, dense and sparse gradients, bit-for-bit repeats
and a rejected batch."""

import numpy as np
import pytest

from xferlib import tt
from xferlib.testing import assert_outputs_match, for_each_backend

pytestmark = pytest.mark.gpu
on_gpu = for_each_backend("cupy")

SHAPES = [
    tt.TTShape([40, 3], [2, 2], [2]),
    tt.TTShape([20, 22, 25], [4, 2, 4], [8, 6]),
    tt.TTShape([5, 6, 7, 3], [2, 2, 2, 2], [2, 3, 2]),
]
N = 40_000  # above xferlib.tt.grads._SPLIT_BATCH


def _close(actual, expected, rtol):
    assert_outputs_match(actual, expected, rtol=rtol, atol=rtol * 1e-6, relative_to_max=True,
                         what="core gradient")


def _hot_batch(rng, shape, n, dtype=np.int64):
    """Zipf rows plus one row taking a third of the batch: core rows with thousands of items
    beside rows with a few."""
    idx = rng.zipf(1.2, n) % shape.num_rows
    idx[rng.permutation(n)[: n // 3]] = shape.num_rows // 2
    offsets = np.arange(0, n + 1, 20)
    offsets[-1] = n
    return idx.astype(dtype), offsets


def test_split_threshold_is_below_the_test_batch():
    from xferlib.tt.grads import _SPLIT_BATCH

    assert N >= _SPLIT_BATCH


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s.p_shapes)))
@pytest.mark.parametrize("dtype", [np.int64, np.int32])
@on_gpu
def test_split_core_gradients_match_the_reference(backend, shape, dtype):
    cupy = backend.xp
    rng = np.random.default_rng(7)
    cores = tt.init_tt_cores(shape, "normal", rng=rng)
    idx, offsets = _hot_batch(rng, shape, N, dtype)
    gpu_cores = [cupy.asarray(c) for c in cores]
    out, plan = tt.tt_embedding_bag_fwd(gpu_cores, shape, cupy.asarray(idx),
                                        cupy.asarray(offsets))
    _, res = tt.tt_embedding_bag_fwd(cores, shape, idx, offsets)
    g = rng.standard_normal(out.shape).astype(np.float32)
    want = tt.tt_embedding_bag_bwd([c.astype(np.float64) for c in cores], shape, res,
                                   g.astype(np.float64))
    for got, ref in zip(tt.tt_embedding_bag_bwd(gpu_cores, shape, plan, cupy.asarray(g)), want):
        _close(got.get(), ref, 1e-4)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s.p_shapes)))
@on_gpu
def test_split_fused_update_matches_and_repeats_bit_for_bit(backend, shape):
    cupy = backend.xp
    rng = np.random.default_rng(8)
    cores = tt.init_tt_cores(shape, "normal", rng=rng)
    idx, offsets = _hot_batch(rng, shape, N)
    g = rng.standard_normal((len(offsets) - 1, shape.dim)).astype(np.float32)
    results = []
    for _ in range(2):
        gpu_cores = [cupy.asarray(c) for c in cores]
        _, plan = tt.tt_embedding_bag_fwd(gpu_cores, shape, cupy.asarray(idx),
                                          cupy.asarray(offsets))
        tt.tt_fused_update(gpu_cores, shape, plan, cupy.asarray(g),
                           tt.tt_sparse_state(shape, "rowwise_adagrad", cupy), "rowwise_adagrad",
                           lr=0.1)
        results.append([c.get() for c in gpu_cores])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
    host = [c.copy() for c in cores]
    _, res = tt.tt_embedding_bag_fwd(host, shape, idx, offsets)
    tt.tt_fused_update(host, shape, res, g, tt.tt_sparse_state(shape, "rowwise_adagrad", np),
                       "rowwise_adagrad", lr=0.1)
    for got, want in zip(results[0], host):
        _close(got, want, 1e-4)


@on_gpu
def test_split_rejected_batch_changes_nothing(backend):
    cupy = backend.xp
    shape = SHAPES[1]
    rng = np.random.default_rng(9)
    cores = tt.init_tt_cores(shape, "normal", rng=rng)
    idx, offsets = _hot_batch(rng, shape, N)
    idx[N - 3] = shape.num_rows  # out of range
    gpu_cores = [cupy.asarray(c) for c in cores]
    _, plan = tt.tt_embedding_bag_fwd(gpu_cores, shape, cupy.asarray(idx),
                                      cupy.asarray(offsets), check=False)
    g = cupy.ones((len(offsets) - 1, shape.dim), dtype=np.float32)
    with pytest.raises(IndexError, match=str(shape.num_rows)):
        tt.tt_fused_update(gpu_cores, shape, plan, g, tt.tt_sparse_state(shape, "sgd", cupy),
                           "sgd", lr=0.1)
    for got, want in zip(gpu_cores, cores):
        np.testing.assert_array_equal(got.get(), want)
