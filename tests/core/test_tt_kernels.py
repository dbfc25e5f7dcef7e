"""The CUDA kernel path of ``xferlib.tt`` against the float64 reference and the NumPy path."""

import zlib

import numpy as np
import pytest

from xferlib import tt
from xferlib.testing import assert_outputs_match, for_each_backend, reference_check
from xferlib.tt.plan import uses_kernels

pytestmark = pytest.mark.gpu
on_gpu = for_each_backend("cupy")

# d = 2, 3, 4; several with p_k > R_k * q_k * R_{k+1} (rows FBTT's launch never reached), and
# FBTT's benchmark shape.
SHAPES = [
    tt.TTShape([40, 3], [2, 2], [2]),
    tt.TTShape([7, 5], [3, 2], [4]),
    tt.TTShape([11, 13, 17], [2, 4, 2], [3, 5]),
    tt.TTShape([20, 22, 25], [4, 2, 4], [8, 6]),
    tt.TTShape([3, 4, 5, 6], [2, 3, 2, 2], [3, 4, 5]),
    tt.TTShape([5, 6, 7, 3], [2, 2, 2, 2], [2, 3, 2]),
    tt.TTShape([200, 220, 250], [4, 4, 4], [32, 32]),
]
CASES = [  # mode, weighted, few distinct rows (duplicates), optimizer, index dtype, last offset
    ("sum", False, False, "sgd", np.int64, True),
    ("mean", True, True, "adagrad", np.int32, True),
    ("sum", True, False, "rowwise_adagrad", np.int64, False),
    ("mean", False, True, "rowwise_adam", np.int32, True),
    ("sum", True, True, "lamb", np.int64, True),
    ("mean", False, False, "lars_sgd", np.int64, True),
    ("sum", False, True, "partial_rowwise_adam", np.int32, False),
    ("sum", True, False, "partial_rowwise_lamb", np.int64, True),
]


def _batch(rng, shape, bags, max_len, duplicates, dtype, include_last):
    counts = rng.integers(0, max_len + 1, bags)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    high = min(shape.num_rows, 6) if duplicates else shape.num_rows
    idx = rng.integers(0, high, int(counts.sum())).astype(dtype)
    return idx, (offsets if include_last else offsets[:-1])


def _close(actual, expected, rtol, atol=0.0, what="output"):
    """Within ``rtol`` of the largest ``|expected|`` (plus ``atol``): sums in another order
    move small entries by the rounding of large ones."""
    assert_outputs_match(actual, expected, rtol=rtol, atol=atol + rtol * 1e-6,
                         relative_to_max=True, what=what)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[3]}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s.p_shapes)))
@on_gpu
def test_kernels_match_the_reference(backend, shape, case):
    mode, weighted, duplicates, optimizer, dtype, include_last = case
    cupy = backend.xp
    # crc32, not hash(): str hashes change from process to process, and so would the data
    rng = np.random.default_rng(zlib.crc32(repr((shape.p_shapes, mode)).encode()))
    assert uses_kernels(shape, cupy.zeros(1, np.int64))
    cores = [3 * c for c in tt.init_tt_cores(shape, "normal", rng=rng)]
    idx, offsets = _batch(rng, shape, 37, 40, duplicates, dtype, include_last)
    psw = rng.standard_normal(len(idx)).astype(np.float32) if weighted else None
    kw = dict(mode=mode, include_last_offset=include_last)
    forwards = []

    def forward(cores, idx, offsets, psw):
        given = cupy.full((len(offsets) - include_last, shape.dim), np.nan, dtype=np.float32)
        out, plan = tt.tt_embedding_bag_fwd(cores, shape, idx, offsets, out=given,
                                            per_sample_weights=psw, **kw)
        assert isinstance(plan, tt.TTBagPlan) and out is given
        forwards.append((cores, idx, offsets, psw, plan))
        return out

    def reference(cores, idx, offsets, psw):
        return tt.tt_embedding_bag_reference(cores, shape, idx, offsets, per_sample_weights=psw,
                                             **kw)

    out = reference_check(backend, forward, reference, cores, idx, offsets, psw,
                          rtol=1e-5, atol=1e-5 * 1e-6, relative_to_max=True)
    gpu_cores, gpu_idx, gpu_offsets, gpu_psw, plan = forwards[0]
    gpu = dict(per_sample_weights=gpu_psw, **kw)
    # dense core gradients against the NumPy path (itself checked against autograd on CPU)
    g = rng.standard_normal(out.shape).astype(np.float32)
    _, res = tt.tt_embedding_bag_fwd(cores, shape, idx, offsets, per_sample_weights=psw, **kw)
    _close(backend.get(tt.tt_embedding_bag_bwd(gpu_cores, shape, plan, backend.array(g))),
           tt.tt_embedding_bag_bwd(cores, shape, res, g), 1e-4, what="core gradients")
    # two fused steps against the NumPy path's backward + sparse update
    states = tt.tt_sparse_state(shape, optimizer)
    gpu_states = backend.put(states)
    host_cores = [c.copy() for c in cores]
    for step in (1, 2):
        hyper = dict(lr=0.05, step=step, weight_decay=0.01)
        _, res = tt.tt_embedding_bag_fwd(host_cores, shape, idx, offsets, per_sample_weights=psw,
                                         **kw)
        tt.tt_fused_update(host_cores, shape, res, g, states, optimizer, **hyper)
        _, plan = tt.tt_embedding_bag_fwd(gpu_cores, shape, gpu_idx, gpu_offsets, check=False,
                                          **gpu)
        tt.tt_fused_update(gpu_cores, shape, plan, backend.array(g), gpu_states, optimizer,
                           **hyper)
    # Adagrad's first steps move an entry by about lr * sign(g) even where g is a rounding-level
    # sum of opposite terms, so those entries may differ by a fraction of lr between orders
    # (LAMB's elementwise second moment likewise, scaled by its trust ratio).
    atol = {"adagrad": 0.01 * 0.05, "rowwise_adagrad": 0.01 * 0.05, "lamb": 0.05}.get(
        optimizer, 0.0)
    _close(backend.get(gpu_cores), host_cores, 1e-4, atol=atol, what="cores")
    # sums of squares of those gradients
    assert_outputs_match(backend.get(gpu_states), states, rtol=1e-3, atol=1e-5, what="states")


@pytest.mark.parametrize("dist", ["uniform", "zipf"])
@on_gpu
def test_large_batches(backend, dist):
    """70,000 lookups (140,000 backward items): several tiles and merge passes per sort."""
    cupy = backend.xp
    shape = tt.TTShape([20, 22, 25], [4, 2, 4], [8, 6])
    rng = np.random.default_rng(1)
    cores = tt.init_tt_cores(shape, "normal", rng=rng)
    n = 70_000
    idx = (rng.zipf(1.3, n) % shape.num_rows if dist == "zipf"
           else rng.integers(0, shape.num_rows, n)).astype(np.int64)
    offsets = np.arange(0, n + 1, 20)
    offsets[-1] = n
    gpu_cores = [cupy.asarray(c) for c in cores]
    out, plan = tt.tt_embedding_bag_fwd(gpu_cores, shape, cupy.asarray(idx),
                                        cupy.asarray(offsets))
    _, res = tt.tt_embedding_bag_fwd(cores, shape, idx, offsets)
    _close(out.get(), tt.tt_embedding_bag(cores, shape, idx, offsets), 1e-5)
    g = rng.standard_normal(out.shape).astype(np.float32)
    for got, want in zip(tt.tt_embedding_bag_bwd(gpu_cores, shape, plan, cupy.asarray(g)),
                         tt.tt_embedding_bag_bwd(cores, shape, res, g)):
        _close(got.get(), want, 1e-4)


@on_gpu
def test_bad_input_changes_nothing(backend):
    cupy = backend.xp
    shape = tt.TTShape([7, 5], [3, 2], [4])
    cores = [cupy.asarray(c) for c in tt.init_tt_cores(shape, "normal")]
    before = [c.get() for c in cores]
    cases = [([1, 35, 2], [0, 1, 3], IndexError, "index 35 at position 1"),
             ([1, -1, 2], [0, 1, 3], IndexError, "index -1 at position 1"),
             ([1, 2, 3], [0, 2, 1, 3], ValueError, "offsets"),
             ([1, 2, 3], [0, 1, 2], ValueError, "offsets"),
             ([1, 2, 3], [1, 3], ValueError, "offsets")]
    for idx, offsets, error, match in cases:
        with pytest.raises(error, match=match):
            tt.tt_embedding_bag_fwd(cores, shape, cupy.asarray(np.array(idx)),
                                    cupy.asarray(np.array(offsets)))
        # deferred: the forward returns, the update raises before touching anything
        _, plan = tt.tt_embedding_bag_fwd(cores, shape, cupy.asarray(np.array(idx)),
                                          cupy.asarray(np.array(offsets)), check=False)
        with pytest.raises(error, match=match):
            tt.tt_fused_update(cores, shape, plan, cupy.ones((plan.num_bags, 6), np.float32),
                               tt.tt_sparse_state(shape, "sgd", cupy), "sgd", lr=0.1)
    with pytest.raises(IndexError, match="index 30 at position 0"):
        tt.tt_embedding_bag_fwd(cores, shape, cupy.asarray(np.array([30])),
                                cupy.asarray(np.array([0, 1])), num_embeddings=30)
    for got, want in zip(cores, before):
        np.testing.assert_array_equal(got.get(), want)


@on_gpu
def test_empty_batch(backend):
    cupy = backend.xp
    shape = tt.TTShape([7, 5], [3, 2], [4])
    cores = [cupy.asarray(c) for c in tt.init_tt_cores(shape, "normal")]
    before = [c.get() for c in cores]
    out, plan = tt.tt_embedding_bag_fwd(cores, shape, cupy.zeros(0, np.int64),
                                        cupy.asarray(np.array([0, 0, 0])))
    assert out.shape == (2, 6) and not out.get().any()
    tt.tt_fused_update(cores, shape, plan, cupy.ones((2, 6), np.float32),
                       tt.tt_sparse_state(shape, "adagrad", cupy), "adagrad", lr=0.1)
    grads = tt.tt_embedding_bag_bwd(cores, shape, plan, cupy.ones((2, 6), np.float32))
    assert all(not g.get().any() for g in grads)
    for got, want in zip(cores, before):
        np.testing.assert_array_equal(got.get(), want)


@on_gpu
def test_deterministic(backend):
    """Sums run in sorted order, never through atomics: two runs agree bit for bit."""
    cupy = backend.xp
    shape = tt.TTShape([20, 22, 25], [4, 2, 4], [8, 6])
    rng = np.random.default_rng(3)
    cores = tt.init_tt_cores(shape, "normal", rng=rng)
    idx = cupy.asarray((rng.zipf(1.2, 5000) % shape.num_rows).astype(np.int64))
    offsets = cupy.arange(0, 5001, 10)
    g = cupy.asarray(rng.standard_normal((500, shape.dim)).astype(np.float32))
    results = []
    for _ in range(2):
        gpu_cores = [cupy.asarray(c) for c in cores]
        _, plan = tt.tt_embedding_bag_fwd(gpu_cores, shape, idx, offsets)
        tt.tt_fused_update(gpu_cores, shape, plan, g, tt.tt_sparse_state(shape, "adagrad", cupy),
                           "adagrad", lr=0.1)
        results.append([c.get() for c in gpu_cores])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


@on_gpu
def test_large_shapes_fall_back_to_the_array_path(backend):
    cupy = backend.xp
    import xferlib
    from xferlib.perf import reset_warnings

    shape = tt.TTShape([10, 10, 10], [8, 8, 8], [128, 128])
    reset_warnings()
    with pytest.warns(xferlib.XferlibPerformanceWarning, match="cuBLAS"):
        assert not uses_kernels(shape, cupy.zeros(1, np.int64))
    rng = np.random.default_rng(0)
    cores = tt.init_tt_cores(shape, "normal", rng=rng)
    idx, offsets = np.array([1, 999, 5]), np.array([0, 2, 3])
    out, residuals = tt.tt_embedding_bag_fwd([cupy.asarray(c) for c in cores], shape,
                                             cupy.asarray(idx), cupy.asarray(offsets))
    assert not isinstance(residuals, tt.TTBagPlan)
    _close(out.get(), tt.tt_embedding_bag_reference(cores, shape, idx, offsets), 1e-4)


@pytest.mark.parametrize("n", [0, 1, 5, 2048, 2049, 4097, 10_240, 20_480, 33_000, 70_000])
@on_gpu
def test_plan_sort_is_stable_and_reports_bad_keys(backend, n):
    """The plan's sort (one tile sort launch up to 2,048 keys, the radix sort past it)
    equals NumPy's stable argsort, its working buffers and result fresh or from the
    scratch; a key out of range is reported at its first position."""
    from xferlib.batch import NO_BAD
    from xferlib.tt.plan import sort_keys
    from xferlib.tt.scratch import Scratch

    cupy = backend.xp
    rng = np.random.default_rng(n)
    stream = cupy.cuda.Stream()
    scratch = Scratch()
    for dtype, num_keys in ((np.int64, 11_000), (np.int32, 37), (np.int64, 3)):
        keys = rng.integers(0, num_keys, n).astype(dtype)
        want = np.argsort(keys, kind="stable")
        for sc, result in ((None, False), (scratch, False), (scratch, True)):
            words = cupy.full(2, NO_BAD, dtype=np.uint64)
            with stream:
                rows, perm = sort_keys(cupy.asarray(keys), num_keys, stream, words, sc,
                                       result)
            stream.synchronize()
            np.testing.assert_array_equal(perm.get(), want)
            np.testing.assert_array_equal(rows.get(), keys[want])
            assert words.get().tolist() == [NO_BAD, NO_BAD]
    if n:
        keys = rng.integers(0, 50, n)
        bad = sorted(rng.choice(n, min(n, 3), replace=False))
        keys[bad] = 50
        words = cupy.full(2, NO_BAD, dtype=np.uint64)
        with stream:
            sort_keys(cupy.asarray(keys), 50, stream, words)
        assert words.get().tolist() == [bad[0], NO_BAD]


@on_gpu
def test_core_grads_flags_and_zeros_need_no_reset(backend):
    """The gradient kernel writes every touched flag (and every row of a dense gradient):
    buffers reused from a batch that touched other rows carry nothing over, and the counter
    counts every step but a rejected one."""
    from xferlib.tt.grads import gpu_core_grads
    from xferlib.tt.scratch import Scratch
    from xferlib.tt.shape import grad_spans

    cupy = backend.xp
    shape = tt.TTShape([11, 13, 17], [2, 4, 2], [3, 5])
    rng = np.random.default_rng(5)
    cores = tt.init_tt_cores(shape, "normal", rng=rng)
    gpu_cores = [cupy.asarray(c) for c in cores]
    stream = cupy.cuda.Stream()
    scratch = Scratch()
    counter = cupy.zeros(1, dtype=np.int64)
    batches = [rng.integers(0, shape.num_rows, 400), np.array([3, 3, 7]), np.array([5])]
    for idx in batches:
        offsets = np.array([0, len(idx) // 2, len(idx)])
        g = rng.standard_normal((2, shape.dim)).astype(np.float32)
        want_grad, want_touched = tt.tt_core_grads(
            cores, shape, tt.tt_embedding_bag_fwd(cores, shape, idx, offsets)[1], g)
        _, plan = tt.tt_embedding_bag_fwd(gpu_cores, shape, cupy.asarray(idx),
                                          cupy.asarray(offsets), stream=stream)
        for dense in (True, False):
            grad, touched = gpu_core_grads(gpu_cores, shape, plan, cupy.asarray(g), dense,
                                           stream, scratch, counter)
            stream.synchronize()
            np.testing.assert_array_equal(touched.get(), want_touched)
            got = grad.get()
            if dense:
                _close(got, want_grad, 1e-4, what="dense gradient")
            else:
                start = 0
                for k, (lo, hi) in enumerate(grad_spans(shape)):
                    rows = np.flatnonzero(want_touched[start:start + shape.p_shapes[k]])
                    width = (hi - lo) // shape.p_shapes[k]
                    _close(got[lo:hi].reshape(-1, width)[rows],
                           want_grad[lo:hi].reshape(-1, width)[rows], 1e-4, what="rows")
                    start += shape.p_shapes[k]
    # a rejected batch: nothing touched, zeros, and not counted
    _, plan = tt.tt_embedding_bag_fwd(gpu_cores, shape, cupy.asarray(np.array([1, 10**6])),
                                      cupy.asarray(np.array([0, 1, 2])), check=False,
                                      stream=stream)
    grad, touched = gpu_core_grads(gpu_cores, shape, plan, cupy.ones((2, shape.dim),
                                                                     np.float32),
                                   True, stream, scratch, counter)
    stream.synchronize()
    assert not touched.get().any() and not grad.get().any()
    assert int(counter.get()[0]) == 2 * len(batches)
