"""EmbeddingCollection's GPU paths against the NumPy path and the float64 references: large
and hot-row batches whose runs cross many chunks of the gradient sums, the radix sort of
every placement mix, the GPU cache, short bags, NumPy inputs, refused batches and bad inputs
on the device, the lane groups, the gradient read in words or columns. Each test needs a
CUDA GPU with CuPy (skipped without one); the tests of every backend are in
``test_collection.py``."""

from __future__ import annotations

import numpy as np
import pytest

from xferlib.collection import (EmbeddingCollection, TableConfig, collection_step_reference,
                                pooled_lookup_reference)
from xferlib.testing import get_backend
from tests.core.test_collection import HYPER, _host, make_batch, state_arrays, tolerance


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["sgd", "adam", "rowwise_adagrad"])
def test_gpu_large_zipf_batch_matches_reference(optimizer):
    """A batch of 40k lookups on the GPU: the sort's merge rounds, hot rows whose runs cross
    hundreds of the gradient sums' chunks, tables of different widths, host and HBM."""
    import cupy

    rng = np.random.default_rng(5)
    rows, dims, B = [5000, 300, 70_000], [16, 8, 128], 2000
    coll = EmbeddingCollection([TableConfig(rows[0], dims[0], placement="host"),
                                TableConfig(rows[1], dims[1]), TableConfig(rows[2], dims[2])],
                               optimizer, {"lr": 0.01}, device="cuda", seed=2)
    indices, offsets = make_batch(rng, rows, B=B, max_len=13, zipf=True)
    weights = [coll.weights(t).astype(np.float64) for t in range(3)]
    states = [state_arrays(coll, t) for t in range(3)]
    out, ctx = coll.forward(cupy.asarray(indices), cupy.asarray(offsets))
    np.testing.assert_allclose(_host(out), pooled_lookup_reference(weights, indices, offsets),
                               rtol=1e-4, atol=1e-4)
    grad = rng.standard_normal((B, sum(dims))) / 10
    coll.backward(ctx, cupy.asarray(grad.astype(np.float32)))
    new_w, new_s, new_steps = collection_step_reference(
        optimizer, coll.hypers, weights, [s for s, _ in states], [st for _, st in states],
        indices, offsets, grad)
    for t in range(3):
        np.testing.assert_allclose(coll.weights(t), new_w[t], rtol=1e-4, atol=2e-5)
        for k, v in new_s[t].items():
            np.testing.assert_allclose(coll.state(t, k), v, rtol=1e-3, atol=1e-5)
        np.testing.assert_array_equal(coll.state(t, "step"), new_steps[t])


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_gpu_run_across_a_thousand_chunks_matches_reference(optimizer):
    """One row looked up about 37,000 times among others: its gradient sum crosses more
    than a thousand of the sums' chunks (dozens of rounds of 32 heads in the span pass);
    weighted lookups, so every position's factor counts."""
    import cupy

    rng = np.random.default_rng(11)
    rows, dim, B = 3000, 24, 8192
    lengths = rng.integers(0, 11, B)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    indices = rng.integers(0, rows, int(offsets[-1])).astype(np.int64)
    indices[rng.random(indices.size) < 0.9] = 17  # the hot row
    assert (indices == 17).sum() > 33 * 32 * 32
    psw = rng.uniform(0.5, 1.5, indices.size)
    coll = EmbeddingCollection([TableConfig(rows, dim)], optimizer, {"lr": 0.01},
                               device="cuda", seed=3)
    weights = [coll.weights(0).astype(np.float64)]
    state, steps = state_arrays(coll, 0)
    out, ctx = coll.forward(cupy.asarray(indices), cupy.asarray(offsets),
                            cupy.asarray(psw.astype(np.float32)))
    grad = rng.standard_normal((B, dim)) / 10
    coll.backward(ctx, cupy.asarray(grad.astype(np.float32)))
    new_w, new_s, _ = collection_step_reference(optimizer, coll.hypers, weights, [state],
                                                [steps], indices, offsets, grad,
                                                per_sample_weights=psw)
    np.testing.assert_allclose(coll.weights(0), new_w[0], rtol=1e-4, atol=2e-5)
    for k, v in new_s[0].items():
        np.testing.assert_allclose(coll.state(0, k), v, rtol=1e-3, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("lead", [0, 1, 31])
def test_gpu_runs_across_a_few_or_many_chunks_match_the_numpy_path(dtype, lead):
    """Hot rows whose runs cross about LONG_SPAN chunks of the gradient sums, on both sides
    of it (the update sums a run across up to LONG_SPAN of them; longer runs are listed by
    the first pass and summed by a block each), shifted against the chunk boundaries by
    `lead` lookups of a row sorted first; a width past one block's 64 columns and not a
    multiple of them; row-wise Adagrad, whose row sum sees every column. Two backwards of
    the one lookup: the second lists the long runs afresh (the first's update emptied the
    list the forward zeroed)."""
    import cupy

    from xferlib._kernels.collection import LONG_SPAN, SUM_CHUNK

    rng = np.random.default_rng(lead)
    span = LONG_SPAN * SUM_CHUNK
    hot = [span - SUM_CHUNK + 1, span, span + 1, span + SUM_CHUNK, span + SUM_CHUNK + 1,
           2 * span + 7, 3]
    rows, dim = 400, 72
    indices = np.concatenate([np.zeros(lead, np.int64)]
                             + [np.full(c, 1 + k, np.int64) for k, c in enumerate(hot)]
                             + [rng.integers(10, rows, 3000)])
    rng.shuffle(indices)
    offsets = np.arange(indices.size + 1, dtype=np.int64)  # bags of one lookup
    grad = rng.standard_normal((indices.size, dim)) / 10

    def train(device):
        coll = EmbeddingCollection([TableConfig(rows, dim)], "rowwise_adagrad", {"lr": 0.05},
                                   dtype=dtype, device=device, seed=6)
        xp = cupy if device == "cuda" else np
        _, ctx = coll.forward(xp.asarray(indices), xp.asarray(offsets))
        coll.backward(ctx, xp.asarray(grad.astype(dtype)))
        coll.backward(ctx, xp.asarray(np.ascontiguousarray(grad[::-1], dtype=dtype)))
        return coll.weights(0), coll.state(0, "sum")

    (w_gpu, s_gpu), (w_cpu, s_cpu) = train("cuda"), train("cpu")
    tol = tolerance(np.dtype(dtype))
    np.testing.assert_allclose(w_gpu, w_cpu, **tol)
    np.testing.assert_allclose(s_gpu, s_cpu, **tol)


@pytest.mark.gpu
def test_gpu_pack_refuses_a_tables_bad_offsets():
    """GPU arrays in the dict form are not read back: a table's offsets that do not start at
    0 (or end at its indices) are refused by the collection's own check; nothing changes."""
    get_backend("cupy")
    import cupy

    coll = EmbeddingCollection([TableConfig(10, 2, name="user"), TableConfig(4, 3, name="ad")],
                               "sgd", {"lr": 1.0}, device="cuda")
    before = coll.state_dict()
    user = (cupy.asarray([1, 2, 9]), cupy.asarray([0, 2, 3]))
    for ad in ((cupy.asarray([3]), cupy.asarray([1, 1, 1])),
               (cupy.asarray([3, 1]), cupy.asarray([0, 0, 1]))):
        idx, off = coll.pack({"user": user, "ad": ad})
        with pytest.raises(ValueError, match=r"offsets\[0\] must be 0"):
            _, ctx = coll.forward(idx, off)
            coll.backward(ctx, cupy.ones((2, 5), cupy.float32))
            coll.check()
    idx, off = coll.pack({"user": user, "ad": (cupy.asarray([3]), cupy.asarray([0, 0, 1]))})
    assert cupy.asnumpy(off).tolist() == [0, 2, 3, 3, 4]
    for key, value in coll.state_dict().items():
        np.testing.assert_array_equal(value, before[key], err_msg=key)


@pytest.mark.gpu
def test_gpu_collection_takes_numpy_inputs():
    get_backend("cupy")
    tables = [TableConfig(40, 4, placement="host"), TableConfig(30, 8)]
    cpu = EmbeddingCollection(tables, "adam", device="cpu", seed=2)
    gpu = EmbeddingCollection(tables, "adam", device="cuda", seed=2)
    idx, off = np.array([1, 5, 5, 39, 0, 29]), np.array([0, 2, 4, 5, 6])
    a, ctx_a = cpu.forward(idx, off)
    b, ctx_b = gpu.forward(idx, off)
    assert isinstance(b, np.ndarray)
    np.testing.assert_allclose(a, b, rtol=1e-6)
    grad = np.random.default_rng(0).standard_normal(a.shape).astype(np.float32)
    cpu.backward(ctx_a, grad)
    gpu.backward(ctx_b, grad)
    for t in range(2):
        np.testing.assert_allclose(cpu.weights(t), gpu.weights(t), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_gpu_short_bags_match_the_numpy_path(pooling, weighted):
    """Bags of under two lookups on average (the pooled lookup then gives a group of lanes two
    bags): an odd number of bags, so the last group has one; tables of three widths, host
    and HBM; empty bags, repeated rows. Forward and one trained step against the NumPy path."""
    get_backend("cupy")
    import cupy

    rows, B = [50, 7, 300], 9  # 27 bags
    tables = [TableConfig(rows[0], 4, placement="host"), TableConfig(rows[1], 8),
              TableConfig(rows[2], 12)]
    cpu, gpu = (EmbeddingCollection(tables, "rowwise_adagrad", HYPER["rowwise_adagrad"],
                                    pooling=pooling, device=d, seed=4) for d in ("cpu", "cuda"))
    rng = np.random.default_rng(11)
    for _ in range(3):
        indices, offsets = make_batch(rng, rows, B=B, max_len=2)
        assert indices.size < 2 * len(rows) * B
        psw = rng.random(indices.size).astype(np.float32) if weighted else None
        a, ctx_a = cpu.forward(indices, offsets, psw)
        b, ctx_b = gpu.forward(cupy.asarray(indices), cupy.asarray(offsets),
                               None if psw is None else cupy.asarray(psw))
        np.testing.assert_allclose(a, b.get(), rtol=1e-6, atol=1e-7)
        grad = rng.standard_normal(a.shape).astype(np.float32)
        cpu.backward(ctx_a, grad)
        gpu.backward(ctx_b, cupy.asarray(grad))
    for t in range(len(rows)):
        np.testing.assert_allclose(cpu.weights(t), gpu.weights(t), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["sgd", "adam", "rowwise_adagrad"])
def test_gpu_cache_trains_as_uncached(optimizer):
    """Host tables with a GPU cache (small, so rows are admitted and evicted, dirty rows
    written back) train as without one, and two cached runs give the same bits; two forwards
    before their backwards locate their rows again. Cached and uncached agree to rounding,
    not bitwise: a cache keys its host rows in set order, which moves their lookups in the
    sorted batch and so how a row's gradient sum is split into chunks."""
    get_backend("cupy")
    import cupy

    rows = [3000, 500, 64]

    def build(cache):
        return EmbeddingCollection(
            [TableConfig(rows[0], 8, placement="host", cache_rows=cache),
             TableConfig(rows[1], 8, placement="host", cache_rows=cache // 2),
             TableConfig(rows[2], 4)], optimizer, HYPER[optimizer], device="cuda", seed=1)

    plain, cached, again = build(0), build(96), build(96)
    rng = np.random.default_rng(3)
    for step in range(12):
        indices, offsets = make_batch(rng, rows, B=64, max_len=6, zipf=True)
        other = make_batch(rng, rows, B=64, max_len=6)
        grad = rng.standard_normal((64, 20)).astype(np.float32)
        outs = []
        for coll in (plain, cached, again):
            out, ctx = coll.forward(cupy.asarray(indices), cupy.asarray(offsets))
            if step % 3 == 2:  # a second forward before the first backward
                coll.forward(cupy.asarray(other[0]), cupy.asarray(other[1]))
            coll.backward(ctx, cupy.asarray(grad))
            outs.append(out.get())
        assert outs[1].tobytes() == outs[2].tobytes()
        # float32 rounding of a dozen steps' sums, far below any wrong row's or step's effect
        assert np.abs(outs[1] - outs[0]).max() <= 1e-5 * np.abs(outs[0]).max(), step
        assert outs[0][:, 16:].tobytes() == outs[1][:, 16:].tobytes()  # the HBM table's
    stats = cached.cache_stats()
    assert stats["hits"] > 0 and stats["evicted"] > 0, stats
    a, b, c = plain.state_dict(), cached.state_dict(), again.state_dict()
    for k in a:  # the cache's dirty rows written back: the state is the cached run's
        assert b[k].tobytes() == c[k].tobytes(), k
        np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-5 * np.abs(a[k]).max())
    cached.load_state_dict(a)  # the cache emptied first: the loaded rows are what is read
    out_a, _ = plain.forward(cupy.asarray(indices), cupy.asarray(offsets))
    out_b, _ = cached.forward(cupy.asarray(indices), cupy.asarray(offsets))
    assert out_a.get().tobytes() == out_b.get().tobytes()


@pytest.mark.gpu
def test_gpu_cache_counts_the_host_tables_rows_only():
    """The cache pass looks at host tables' rows alone: its lookups are the distinct host
    rows of each batch (an HBM table's rows never reach it)."""
    get_backend("cupy")
    import cupy

    rows, B = [3000, 500], 64
    coll = EmbeddingCollection([TableConfig(rows[0], 8, placement="host", cache_rows=96),
                                TableConfig(rows[1], 8)], "sgd", HYPER["sgd"], device="cuda",
                               seed=1)
    rng = np.random.default_rng(5)
    distinct = 0
    for _ in range(3):
        indices, offsets = make_batch(rng, rows, B=B, max_len=6, zipf=True)
        distinct += np.unique(indices[offsets[0]:offsets[B]]).size
        _, ctx = coll.forward(cupy.asarray(indices), cupy.asarray(offsets))
        coll.backward(ctx, cupy.zeros((B, 16), np.float32))
    stats = coll.cache_stats()
    assert stats["lookups"] == stats["hits"] + stats["misses"] == distinct, stats


@pytest.mark.gpu
@pytest.mark.parametrize("tables", ["hbm", "host", "mixed"])
def test_gpu_radix_sorted_batches_of_every_placement_mix_match_the_numpy_path(tables):
    """Batches the radix sort takes (past one tile), every placement mix (HBM only, host
    only with and without a cache, HBM beside cached and uncached host tables and a tt
    table), bags of 0-3 lookups, several steps: the pooled outputs and every table's weights
    and state match the NumPy path; a refused batch in between pools zeros and changes
    nothing."""
    get_backend("cupy")
    import cupy

    from xferlib.batch import SMALL_SORT_TILE

    rows = {"hbm": [700, 90], "host": [900, 300], "mixed": [700, 900, 300, 60]}[tables]
    configs = {"hbm": [TableConfig(700, 8), TableConfig(90, 12)],
               "host": [TableConfig(900, 8, placement="host", cache_rows=64),
                        TableConfig(300, 8, placement="host")],
               "mixed": [TableConfig(700, 8), TableConfig(900, 8, placement="host",
                                                          cache_rows=64),
                         TableConfig(300, 8, placement="host"),
                         TableConfig(60, 4, placement="tt", tt_ranks=3)]}[tables]
    B = 1200
    rng = np.random.default_rng(21)
    batches = [make_batch(rng, rows, B=B, max_len=3, zipf=True) for _ in range(4)]
    assert all(b[0].size > SMALL_SORT_TILE for b in batches)  # the radix sort's batches
    width = sum(c.dim for c in configs)
    grads = [rng.standard_normal((B, width)).astype(np.float32) for _ in batches]

    def train(device):
        optimizer = "rowwise_adagrad" if tables == "mixed" else "adam"  # tt: not adam
        coll = EmbeddingCollection(configs, optimizer, {"lr": 0.05}, device=device, seed=4)
        coll.raise_in_calls = False
        xp = cupy if device == "cuda" else np
        outs = []
        for k, ((indices, offsets), grad) in enumerate(zip(batches, grads)):
            if k == 2 and device == "cuda":  # a refused batch: zeros out, nothing trained
                bad = indices.copy()
                bad[-1] = rows[-1]
                out, ctx = coll.forward(cupy.asarray(bad), cupy.asarray(offsets))
                coll.backward(ctx, cupy.asarray(grad))
                assert not out.any()
                with pytest.raises(IndexError):
                    coll.check()
            out, ctx = coll.forward(xp.asarray(indices), xp.asarray(offsets))
            coll.backward(ctx, xp.asarray(grad))
            outs.append(cupy.asnumpy(out) if device == "cuda" else out)
        return outs, coll.state_dict()

    (outs_gpu, state_gpu), (outs_cpu, state_cpu) = train("cuda"), train("cpu")
    tol = tolerance(np.dtype(np.float32))
    for a, b in zip(outs_gpu, outs_cpu):
        np.testing.assert_allclose(a, b, **tol)
    for k in state_cpu:
        np.testing.assert_allclose(state_gpu[k], state_cpu[k], err_msg=k, **tol)


@pytest.mark.gpu
@pytest.mark.parametrize("sort", ["tile", "radix"])
def test_gpu_cached_collection_keys_host_rows_in_set_order(sort):
    """With a GPU cache, a host row's key is its set-ordered key (the kernels' twin of
    SetOrder) and the cache pass takes the runs as the batch sort left them (no sort by
    set): the batch's sorted keys are those SetOrder gives, the HBM table's keys past every
    host key, and over batches that fill the cache and evict from it, the cache's counts
    (lookups, hits, misses, admitted, evicted) are those of the NumPy model of the same
    sets; one tile of the sort or the radix sort."""
    get_backend("cupy")
    import cupy

    from xferlib.table.cache import CacheModel, SetOrder

    rows, cache_rows = [3000, 500, 700], 96
    coll = EmbeddingCollection([TableConfig(3000, 8, placement="host", cache_rows=cache_rows),
                                TableConfig(500, 8), TableConfig(700, 8, placement="host")],
                               "sgd", HYPER["sgd"], device="cuda", seed=1)
    order = SetOrder.for_cache(3000 + 700, cache_rows)
    model = CacheModel(cache_rows, 3000 + 700, set_order=order)
    rng = np.random.default_rng(9)
    B = 100 if sort == "tile" else 900
    for _ in range(6):
        indices, offsets = make_batch(rng, rows, B=B, max_len=4, zipf=True)
        table = np.repeat(np.arange(3), np.diff(offsets[::B]))
        x = indices + np.array([0, 0, 3000])[table]  # a host row's place among all host rows
        want = np.where(table == 1, order.span + indices, order.key(x))
        _, ctx = coll.forward(cupy.asarray(indices), cupy.asarray(offsets))
        np.testing.assert_array_equal(cupy.asnumpy(ctx.plan.keys), np.sort(want))
        model.access(x[table != 1])
        coll.backward(ctx, cupy.ones((B, 24), np.float32))
    coll.check()
    assert coll.cache_stats() == model.stats, (coll.cache_stats(), model.stats)
    assert model.stats["evicted"] > 0


@pytest.mark.gpu
def test_gpu_refused_batch_raises_only_from_check_when_asked():
    """raise_in_calls=False (a sharded step's collections): a refused batch changes nothing
    and pools zeros, the calls after it do not raise (other ranks would wait in a
    collective), and check() raises it once; the good batches after it train."""
    get_backend("cupy")
    import cupy

    def build():
        return EmbeddingCollection([TableConfig(10, 4, placement="host", cache_rows=4),
                                    TableConfig(5, 4)], "adam", device="cuda", seed=0)

    def step(coll, idx):
        # the output buffer full of NaN first: a refused batch must overwrite it
        out, ctx = coll.forward(cupy.asarray(idx), cupy.asarray([0, 1, 2, 3, 4]),
                                out=cupy.full((2, 8), np.nan, np.float32))
        coll.backward(ctx, cupy.ones((2, 8), np.float32))
        return out

    quiet, reference = build(), build()
    quiet.raise_in_calls = False
    refused = step(quiet, [1, 2, 3, 9])  # index 9 of the 5-row table: refused
    assert not refused.any()             # its pooled rows are zeros, not stale memory
    for _ in range(8):                 # more than the queue's limit of unread verdicts
        step(quiet, [1, 2, 3, 4])
        step(reference, [1, 2, 3, 4])
    cupy.cuda.Device().synchronize()
    with pytest.raises(IndexError, match="index 9 at position 3"):
        quiet.check()
    quiet.check()                      # reported once
    for k, v in reference.state_dict().items():
        assert quiet.state_dict()[k].tobytes() == v.tobytes(), k


@pytest.mark.gpu
def test_gpu_bad_inputs_change_nothing():
    """Out-of-range indices and broken offsets on the GPU: the batch's kernels write nothing
    (host tables, their cache, HBM tables), and check() raises the error naming them."""
    get_backend("cupy")
    import cupy

    coll = EmbeddingCollection([TableConfig(10, 4, placement="host", cache_rows=4),
                                TableConfig(5, 4)], "adam", device="cuda", seed=0)
    good_idx, off = cupy.asarray([1, 2, 3, 4]), cupy.asarray([0, 1, 2, 3, 4])
    _, ctx = coll.forward(good_idx, off)
    coll.backward(ctx, cupy.ones((2, 8), np.float32))
    before = coll.state_dict()
    cases = [(cupy.asarray([1, 2, 3, 5]), off, IndexError, "index 5 at position 3"),
             (cupy.asarray([1, 2, -7, 4]), off, IndexError, "index -7 at position 2"),
             (good_idx, cupy.asarray([0, 3, 2, 3, 4]), ValueError, "must not decrease"),
             (good_idx, cupy.asarray([0, 1, 2, 3, 9]), ValueError, r"offsets\[-1\]"),
             (good_idx, cupy.asarray([2, 1, 2, 3, 4]), ValueError, r"offsets\[0\]")]
    for idx, offsets, error, message in cases:
        # raised by the backward (the verdict arrived) or at the latest by check()
        with pytest.raises(error, match=message):
            out, ctx = coll.forward(idx, offsets)
            coll.backward(ctx, cupy.ones((2, 8), np.float32))
            coll.check()
        after = coll.state_dict()
        for k in before:
            assert after[k].tobytes() == before[k].tobytes(), (message, k)


def test_lane_groups_and_in_place_gradients():
    """The GPU kernels' launch choices, pure functions of shapes: lanes per row (enough for
    the row's vectors, a power of two, at most a warp) and which pooled gradients are read
    in place (rows of adjacent columns in the collection's dtype; others are copied)."""
    from xferlib.collection.device import _lane_group, _rows_of_columns

    assert [_lane_group(w, 4) for w in (1, 4, 8, 12, 64, 65, 128, 4096)] == \
        [1, 1, 2, 4, 16, 32, 32, 32]
    assert [_lane_group(w, 1) for w in (1, 2, 3, 31, 33)] == [1, 2, 4, 32, 32]
    wide = np.zeros((6, 40), np.float32)
    assert _rows_of_columns(wide, np.float32)
    assert _rows_of_columns(wide[:, 3:35], np.float32)  # a slice of wider rows
    assert _rows_of_columns(np.broadcast_to(wide[:1], (6, 40)), np.float32)  # stride 0
    assert not _rows_of_columns(wide[:, ::2], np.float32)  # columns apart
    assert not _rows_of_columns(wide[::-1], np.float32)  # rows backwards
    assert not _rows_of_columns(wide.T, np.float32)
    assert not _rows_of_columns(wide, np.float64)  # another dtype: converted


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gpu_gradient_read_in_words_or_columns_gives_the_same_bits(dtype):
    """The gradient sums read 16-byte words where the pooled gradient's rows allow and single
    columns where they do not (a slice of wider rows that starts off a word): the same sums
    in the same order, so both trainings end with the same bits."""
    import cupy

    rng = np.random.default_rng(9)
    rows, dims = [3000, 40, 700], [8, 4, 12]
    indices, offsets = make_batch(rng, rows, B=1500, max_len=9, zipf=True)
    grad = rng.standard_normal((1500, sum(dims))).astype(dtype)
    wide = cupy.zeros((1500, sum(dims) + 3), dtype=dtype)
    wide[:, 1:1 + sum(dims)] = cupy.asarray(grad)  # rows start one element off a word

    def train(gradient):
        coll = EmbeddingCollection([TableConfig(rows[0], dims[0], placement="host"),
                                    TableConfig(rows[1], dims[1]), TableConfig(rows[2], dims[2])],
                                   "adam", {"lr": 0.01}, dtype=dtype, device="cuda", seed=4)
        for _ in range(2):
            _, ctx = coll.forward(cupy.asarray(indices), cupy.asarray(offsets))
            coll.backward(ctx, gradient)
        return coll.state_dict()

    words, columns = train(cupy.asarray(grad)), train(wide[:, 1:1 + sum(dims)])
    for k in words:
        assert words[k].tobytes() == columns[k].tobytes(), k

