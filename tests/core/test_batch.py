"""xferlib.batch: the batch plan against NumPy, the verdict's messages per family, and the
pending-check queue (limit, report once, graph replays)."""

import numpy as np
import pytest

import xferlib
from xferlib.batch import (NO_BAD, PendingChecks, RowsReport, Verdict, plan_batch,
                           sort_positions)
from xferlib.tt import TTReport


def _clean_words():
    return np.full(2, NO_BAD, dtype=np.uint64)


# ----------------------------------------------------------------------------- CPU


def test_public_names():
    assert xferlib.plan_batch is plan_batch and xferlib.PendingChecks is PendingChecks
    assert xferlib.Verdict is Verdict and xferlib.BatchPlan is xferlib.batch.BatchPlan


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_rows_report_messages(dtype):
    idx = np.array([3, 1, 12, 0], dtype=dtype)
    verdict = Verdict(None, RowsReport(idx, 10))
    verdict.raise_for(_clean_words())
    assert verdict.checked
    plain = Verdict(None, RowsReport(idx, 10))
    with pytest.raises(IndexError, match=r"^index 12 at position 2 is out of range for a "
                                         r"table of 10 rows \(valid: 0 <= index < 10\)$"):
        plain.raise_for(np.array([2, NO_BAD], dtype=np.uint64))
    assert not plain.checked
    with pytest.raises(ValueError, match=r"^sorted_indices=True, but index 1 at position 1 "
                                         r"comes after 3; nothing was written$"):
        plain.raise_for(np.array([NO_BAD, 1], dtype=np.uint64))
    late = Verdict(None, RowsReport(idx, 10, caller="gather_rows"))
    with pytest.raises(IndexError, match=r"^index 12 at position 2 .* \(in an earlier call of "
                                         r"gather_rows on the GPU; nothing was written\)$"):
        late.raise_for(np.array([2, 1], dtype=np.uint64))  # the bad index comes first
    with pytest.raises(ValueError, match=r"^sorted_indices=True, but index 1 at position 1 "
                                         r"comes after 3 \(in an earlier call of scatter_rows "
                                         r"on the GPU; nothing was written\)$"):
        Verdict(None, RowsReport(idx, 10, "scatter_rows")).raise_for(
            np.array([NO_BAD, 1], dtype=np.uint64))


def test_tt_report_messages():
    offsets = np.array([0, 2, 1])
    report = TTReport(np.array([5, 700, 1]), offsets, True, 3, 600)
    with pytest.raises(IndexError, match=r"^index 700 at position 1 is out of range for a TT "
                                         r"table of 600 rows \(valid: 0 <= index < 600\)$"):
        Verdict(None, report).raise_for(np.array([1, NO_BAD], dtype=np.uint64))
    with pytest.raises(ValueError, match=r"^offsets must start at 0, not decrease, and end at "
                                         r"3 \(include_last_offset=True\); got \[0, 2, 1\]$"):
        Verdict(None, report).raise_for(np.array([NO_BAD, 0], dtype=np.uint64))


def test_pending_checks_arguments_and_empty_polls():
    with pytest.raises(ValueError, match="limit must be >= 1, got 0"):
        PendingChecks(limit=0)
    checks = PendingChecks(limit=2)
    checks.poll()
    checks.poll(wait=True)
    assert len(checks) == 0 and not checks.pending()


# ----------------------------------------------------------------------------- GPU


def _cupy():
    if not xferlib.cupy_available():
        pytest.skip("needs a CUDA GPU with CuPy; none here")
    import cupy

    return cupy


@pytest.mark.gpu
@pytest.mark.parametrize("n", [0, 1, 5, 4097, 70_000])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_plan_batch_matches_numpy(rng, n, dtype):
    cupy = _cupy()
    num_rows = 1000
    idx = rng.integers(0, num_rows, size=n).astype(dtype)  # duplicates at every size
    stream = cupy.cuda.Stream(non_blocking=True)
    gpu_idx = cupy.asarray(idx)
    # made on the legacy default stream, which a non-blocking one does not wait for
    cupy.cuda.Device().synchronize()
    plan = plan_batch(gpu_idx, num_rows, stream=stream, runs=True)
    stream.synchronize()
    order = np.argsort(idx, kind="stable")
    np.testing.assert_array_equal(plan.keys.get(), idx[order])
    np.testing.assert_array_equal(plan.perm.get(), order)
    sorted_idx = idx[order]
    runs = np.concatenate([[0], np.cumsum(sorted_idx[1:] != sorted_idx[:-1])]) if n else []
    np.testing.assert_array_equal(plan.run.get(), runs)
    assert plan.n == n
    plan.verdict.raise_now(stream)
    assert plan.verdict.checked


def _sorts_like_numpy(cupy, idx, num_rows):
    """sort_positions on the device equals NumPy's stable sort, with a clean verdict."""
    keys, perm, words = sort_positions(cupy.asarray(idx), num_rows, tiled_max=idx.size)
    order = np.argsort(idx, kind="stable")
    np.testing.assert_array_equal(perm.get(), order)
    np.testing.assert_array_equal(keys.get(), idx[order])
    assert (words.get() == np.iinfo(np.uint64).max).all()


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2049, 4097, 6145, 40_000, 140_000, 600_000])
def test_device_sort_matches_numpy(rng, n):
    """The on-device sort past one tile (the radix sort: up to 293 tiles, a short last
    one) against NumPy's stable sort, few distinct keys (long runs of ties) and many."""
    cupy = _cupy()
    for num_rows in (7, 1 << 22):
        _sorts_like_numpy(cupy, rng.integers(0, num_rows, size=n).astype(np.int64), num_rows)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["tables", "tile-aligned tables", "sorted", "descending"])
def test_device_sort_of_runs_in_order_or_reversed(rng, case):
    """Keys in order or reversed by segments: a collection's tables (ascending key ranges,
    segments of any length, ties across their boundaries), already sorted keys, and
    descending segments."""
    cupy = _cupy()
    if case in ("tables", "tile-aligned tables"):
        lengths = ([16384] * 26 if case == "tile-aligned tables"
                   else rng.integers(1, 30_000, size=20))
        base = np.cumsum([0] + [int(k) for k in rng.integers(50, 5_000, size=len(lengths))])
        # each table's keys in [base, base + 2 x range]: neighbours share keys at the edges
        idx = np.concatenate([base[t] + rng.integers(0, 2 * (base[t + 1] - base[t]), size=k)
                              for t, k in enumerate(lengths)])
    elif case == "sorted":
        idx = np.sort(rng.integers(0, 1 << 20, size=300_000))
    else:
        idx = np.concatenate([s * 1000 + rng.integers(0, 1001, size=9_000)
                              for s in range(40, 0, -1)])
    _sorts_like_numpy(cupy, idx.astype(np.int64), int(idx.max()) + 1)


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", [1, 2, 200, 256, 257, 70_000, 8_000_000, 1 << 24,
                                      54_063_992, np.iinfo(np.int32).max])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_radix_sort_every_pass_count(rng, num_rows, dtype):
    """One to four 8-bit passes (key ranges of 1 to 31 bits), Zipf keys (a hot row holds
    a large share of a tile: one digit's count spans warps and tiles), both index widths."""
    cupy = _cupy()
    for n in (2049, 37_001, 426_000):
        zipf = (rng.zipf(1.05, size=n) - 1) % num_rows
        idx = rng.permutation(num_rows)[zipf] if num_rows <= 1 << 24 else zipf
        _sorts_like_numpy(cupy, idx.astype(dtype), num_rows)


@pytest.mark.gpu
@pytest.mark.parametrize("items", [2, 4, 8])
def test_radix_sort_every_tile_size(rng, items):
    """Tiles of 512, 1,024 and 2,048 keys (``items`` a thread) sort alike: a short last
    tile, one to three passes, Zipf keys (a hot row's ties across many tiles)."""
    cupy = _cupy()
    from xferlib.batch import radix_sort

    stream = cupy.cuda.Stream(non_blocking=True)
    for n, num_rows in ((2049, 300), (65_536, 8_000_000), (100_001, 70_000)):
        idx = ((rng.zipf(1.05, size=n) - 1) % num_rows).astype(np.int32)
        words = cupy.full(2, np.iinfo(np.uint64).max, dtype=np.uint64)
        gpu_idx = cupy.asarray(idx)
        # made on the legacy default stream, which a non-blocking one does not wait for
        cupy.cuda.Device().synchronize()
        with stream:
            rows, perm = radix_sort(gpu_idx, num_rows, stream, words,
                                    lambda name, size, dtype: cupy.empty(size, dtype),
                                    items=items)
        stream.synchronize()
        order = np.argsort(idx, kind="stable")
        np.testing.assert_array_equal(perm.get(), order)
        np.testing.assert_array_equal(rows.get(), idx[order])
        assert int(words.get()[0]) == np.iinfo(np.uint64).max


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_radix_sort_reports_the_first_key_out_of_range(rng, dtype):
    """Keys below 0 or past the table: the first such position in ``words[0]``, every
    position still sorted to a place inside the output (a permutation of the batch)."""
    cupy = _cupy()
    n, num_rows = 50_000, 3_000
    idx = rng.integers(0, num_rows, size=n).astype(dtype)
    idx[[40_000, 9_999, 31_337]] = [-5, num_rows, np.iinfo(dtype).max]
    keys, perm, words = sort_positions(cupy.asarray(idx), num_rows, tiled_max=n)
    assert int(words.get()[0]) == 9_999
    np.testing.assert_array_equal(np.sort(perm.get()), np.arange(n))
    good = (idx >= 0) & (idx < num_rows)
    order = np.argsort(np.where(good, idx, (1 << 12) - 1), kind="stable")
    np.testing.assert_array_equal(perm.get(), order)


@pytest.mark.gpu
def test_radix_sort_replays_in_a_cuda_graph(rng):
    """Captured once, replayed on new keys: each replay zeroes its counts again (the tile
    counters and look-back words) and sorts the keys now in the input."""
    cupy = _cupy()
    n, num_rows = 100_000, 8_000_000
    src = cupy.asarray(rng.integers(0, num_rows, size=n))
    stream = cupy.cuda.Stream(non_blocking=True)
    # made on the legacy default stream, which a non-blocking one does not wait for
    cupy.cuda.Device().synchronize()
    with stream:
        sort_positions(src, num_rows, stream=stream, tiled_max=n)  # compiled, pool warm
        stream.synchronize()
        stream.begin_capture()
        keys, perm, words = sort_positions(src, num_rows, stream=stream, tiled_max=n)
        graph = stream.end_capture()
        for _ in range(3):
            idx = rng.integers(0, num_rows, size=n)
            src.set(idx, stream=stream)
            graph.launch(stream)
            stream.synchronize()
            order = np.argsort(idx, kind="stable")
            np.testing.assert_array_equal(perm.get(), order)
            np.testing.assert_array_equal(keys.get(), idx[order])


@pytest.mark.gpu
@pytest.mark.parametrize("bad", [-1, 1000])
def test_plan_batch_verdict_raises_now_and_deferred(bad):
    cupy = _cupy()
    idx = cupy.asarray(np.array([4, 2, bad, 9, bad], dtype=np.int64))
    plan = plan_batch(idx, 1000)
    with pytest.raises(IndexError, match=f"^index {bad} at position 2 is out of range"):
        plan.verdict.raise_now()
    checks = PendingChecks(limit=3)
    plan_batch(idx, 1000, caller="gather_rows").verdict.defer(checks)
    assert len(checks) == 1
    with pytest.raises(IndexError, match=rf"^index {bad} at position .* of gather_rows "):
        checks.poll(wait=True)
    assert len(checks) == 0
    checks.poll(wait=True)  # reported once


@pytest.mark.gpu
def test_presorted_promise_is_checked():
    cupy = _cupy()
    plan = plan_batch(cupy.asarray(np.array([1, 1, 5, 3, 7], dtype=np.int32)), 10,
                      presorted=True)
    with pytest.raises(ValueError, match="index 3 at position 3 comes after 5"):
        plan.verdict.raise_now()
    good = plan_batch(cupy.asarray(np.array([1, 1, 5, 7], dtype=np.int32)), 10, presorted=True)
    good.verdict.raise_now()
    np.testing.assert_array_equal(good.perm.get(), np.arange(4))


@pytest.mark.gpu
def test_pending_checks_limit_and_order():
    cupy = _cupy()
    checks = PendingChecks(limit=2)
    good = cupy.asarray(np.array([0, 1], dtype=np.int64))
    bad = cupy.asarray(np.array([0, 11], dtype=np.int64))
    for _ in range(5):  # more pushes than the limit: polls before pushes keep it bounded
        checks.poll()
        plan_batch(good, 10).verdict.defer(checks)
        assert len(checks) <= 2
    checks.poll(wait=True)
    plan_batch(bad, 10).verdict.defer(checks)
    plan_batch(good, 10).verdict.defer(checks)
    cupy.cuda.get_current_stream().synchronize()
    with pytest.raises(IndexError, match="index 11 at position 1"):
        checks.poll()  # the verdict is in: raised without waiting
    checks.poll(wait=True)  # the later good batch is read, nothing raised


@pytest.mark.gpu
def test_captured_verdicts_are_read_after_replays():
    cupy = _cupy()
    checks = PendingChecks(limit=3)
    idx = cupy.zeros(64, dtype=np.int64)
    stream = cupy.cuda.Stream(non_blocking=True)
    pool = cupy.cuda.MemoryPool()
    # made on the legacy default stream, which a non-blocking one does not wait for
    cupy.cuda.Device().synchronize()
    with cupy.cuda.using_allocator(pool.malloc), stream:
        plan_batch(idx, 100, stream=stream).verdict.defer(checks, stream)  # warm up
        checks.poll(wait=True)
        stream.begin_capture()
        plan_batch(idx, 100, stream=stream).verdict.defer(checks, stream)
        graph = stream.end_capture()
    checks.poll(wait=True)  # not replayed yet: nothing to report
    graph.launch(stream)
    stream.synchronize()
    checks.poll(wait=True)
    idx[5] = 100
    cupy.cuda.Device().synchronize()
    graph.launch(stream)
    stream.synchronize()
    with pytest.raises(IndexError, match="index 100 at position 5"):
        checks.poll(wait=True)
    checks.poll(wait=True)  # reported once


@pytest.mark.gpu
def test_recordings_without_end_take_their_slots_round():
    """Each recording's verdict takes a pinned slot; recordings made without end (XLA records
    again whenever a step's buffers move) reuse the slots of the oldest, holding no more
    entries or memory, and the newest recording still reports a bad batch."""
    from xferlib.checks import _GRAPH_SLOTS

    cupy = _cupy()
    checks = PendingChecks(limit=3)
    idx = cupy.zeros(64, dtype=np.int64)
    stream = cupy.cuda.Stream(non_blocking=True)
    pool = cupy.cuda.MemoryPool()
    # made on the legacy default stream, which a non-blocking one does not wait for
    cupy.cuda.Device().synchronize()
    graphs = []
    with cupy.cuda.using_allocator(pool.malloc), stream:
        plan_batch(idx, 100, stream=stream).verdict.defer(checks, stream)  # warm up
        checks.poll(wait=True)
        for _ in range(_GRAPH_SLOTS + 6):
            stream.begin_capture()
            plan_batch(idx, 100, stream=stream).verdict.defer(checks, stream)
            graphs.append(stream.end_capture())
    assert len(checks.graph) == _GRAPH_SLOTS
    idx[7] = 100
    cupy.cuda.Device().synchronize()
    graphs[-1].launch(stream)
    stream.synchronize()
    with pytest.raises(IndexError, match="index 100 at position 7"):
        checks.poll(wait=True)
    checks.poll(wait=True)


def test_pending_checks_copy_and_pickle_as_an_empty_queue():
    import copy
    import pickle

    from xferlib.batch import PendingChecks

    checks = PendingChecks(limit=5)
    for clone in (copy.deepcopy(checks), pickle.loads(pickle.dumps(checks))):
        assert clone.limit == 5 and len(clone) == 0 and not clone.pending()
        clone.poll(wait=True)  # nothing pending


def test_a_failure_kept_for_check_raises_at_the_next_wait_only():
    """fail_at_check: a failure the caller's own raise may not carry to the user (a callback
    XLA records) raises from the next poll(wait=True) (check()), once; polls without a wait
    pass it by, and a second failure kept before that check is dropped."""
    from xferlib.batch import PendingChecks

    checks = PendingChecks()
    checks.fail_at_check(RuntimeError("first"))
    checks.fail_at_check(RuntimeError("second"))
    checks.poll()
    checks.poll(hold=True)
    with pytest.raises(RuntimeError, match="first"):
        checks.poll(wait=True)
    checks.poll(wait=True)  # raised once


def test_tt_fused_update_names_the_replacement_of_defer_check():
    import numpy as np

    from xferlib import tt

    shape = tt.TTShape([3, 4], [2, 2], [3])
    cores = tt.init_tt_cores(shape, "normal", rng=np.random.default_rng(0))
    with pytest.raises(TypeError, match="checks="):
        tt.tt_fused_update(cores, shape, None, None, None, "sgd", lr=0.1, defer_check=True)


# The radix sort's schedule, on the CPU: its kernels replaced by NumPy stand-ins that do what
# the CUDA ones do (the digit counts of every pass; a stable pass over one digit), so the
# passes, their shifts, the counts and zeroed words each gets and the buffers each reads
# and writes are checked here.

class _HostArray(np.ndarray):
    """A NumPy array with CuPy's ``data.ptr`` and ``data.memset_async``."""

    @property
    def data(self):
        import types

        def memset_async(value, size, stream):
            self.view(np.uint8)[:size] = value

        return types.SimpleNamespace(ptr=self.ctypes.data, memset_async=memset_async)


def _fake_radix(monkeypatch, log, made):
    import xferlib._kernels.radix as radix
    import xferlib.batch as batch

    def at(pointer, count, dtype):
        """The NumPy view of the working array at a kernel's pointer argument."""
        if not isinstance(pointer, int):
            return pointer  # an array passed as is
        work = made["radix_work"]
        offset = pointer - work.ctypes.data
        assert 0 <= offset and offset + count * np.dtype(dtype).itemsize <= work.nbytes
        return work.view(np.uint8)[offset:offset + count * np.dtype(dtype).itemsize].view(dtype)

    class Histogram:
        @staticmethod
        def launch(module, targs, grid, block, *, stream, idx, n, n_rows, bits, passes, hist,
                   first_bad):
            hist = at(hist, passes * radix.RADIX_BINS, np.uint32)
            assert (hist == 0).all(), "counts not zeroed"
            for p in range(passes):
                digits = (idx.astype(np.int64) >> (8 * p)) & 255
                hist[p * 256:(p + 1) * 256] += np.bincount(digits, minlength=256).astype(
                    np.uint32)
            log.append(("histogram", passes, grid, targs[1]))

    class Pass:
        @staticmethod
        def launch(module, targs, grid, block, *, stream, idx, keys_in, vals_in, n, n_rows,
                   bits, shift, hist, status, counter, keys_out, vals_out, perm_out):
            hist, counter = at(hist, 256, np.uint32), at(counter, 1, np.uint32)
            status = at(status, grid[0] * 256, np.uint32)
            keys_in, vals_in = at(keys_in, n, np.uint32), at(vals_in, n, np.uint32)
            keys_out, vals_out = at(keys_out, n, np.uint32), at(vals_out, n, np.uint32)
            if idx is not None:
                keys, vals = idx.astype(np.uint32), np.arange(n, dtype=np.uint32)
            else:
                assert keys_in is not keys_out, "a pass writes to the buffers it reads"
                keys, vals = keys_in, vals_in
            digits = (keys >> shift) & 255
            np.testing.assert_array_equal(hist, np.bincount(digits, minlength=256))
            assert counter[0] == 0 and (status == 0).all()
            status[:] = 1  # what the look-back leaves: the next pass's words lie apart
            counter[0] = grid[0]
            order = np.argsort(digits, kind="stable")
            keys_out[:] = keys[order]
            if perm_out is not None:
                perm_out[:] = vals[order]
            else:
                vals_out[:] = vals[order]
            log.append(("pass", shift, perm_out is not None, targs[1]))

    monkeypatch.setattr(batch, "RADIX_HISTOGRAM", Histogram)
    monkeypatch.setattr(batch, "RADIX_PASS", Pass)


def _host_buffers(made):
    def buffer(name, size, dtype):
        assert name not in made, f"{name} asked for twice"
        made[name] = np.zeros(size, dtype).view(_HostArray)
        made[name][:] = 7  # not zeroed unless the sort zeroes it
        return made[name]
    return buffer


@pytest.mark.parametrize("num_keys", [2, 256, 257, 70_000, 8_000_000, (1 << 31) - 1])
@pytest.mark.parametrize("n,items", [(2049, 8), (10_000, 8), (2049, 2), (10_000, 4)])
def test_radix_sort_schedule(monkeypatch, rng, n, items, num_keys):
    from xferlib.batch import radix_sort

    log, made = [], {}
    _fake_radix(monkeypatch, log, made)
    keys = rng.integers(0, num_keys, n)
    rows, perm = radix_sort(keys, num_keys, None, np.zeros(2, np.uint64), _host_buffers(made),
                            items=items)
    expect = np.argsort(keys, kind="stable")
    np.testing.assert_array_equal(perm, expect)
    np.testing.assert_array_equal(rows, keys[expect])
    assert rows is made["rows"] and perm is made["perm"]
    passes = -(-max(1, (num_keys - 1).bit_length()) // 8)
    tiles = -(-n // (256 * items))
    # the zeroed words (counts, tile counters, look-back words), then the passes' pairs
    zeroed = passes * (256 + 1 + tiles * 256)
    assert made["radix_work"].size == zeroed + 2 * n * min(2, passes - 1)
    assert log == [("histogram", passes, (tiles,), items)] + [
        ("pass", 8 * p, p == passes - 1, items) for p in range(passes)]


@pytest.mark.parametrize("n,items", [(1, 2), (32_768, 2), (32_769, 4), (131_072, 4),
                                     (131_073, 8)])
def test_radix_sort_picks_its_tile_size_by_batch(monkeypatch, rng, n, items):
    """Without ``items`` the sort launches the tile size measured fastest for its size."""
    from xferlib.batch import radix_sort

    log, made = [], {}
    _fake_radix(monkeypatch, log, made)
    keys = rng.integers(0, 1000, n)
    radix_sort(keys, 1000, None, np.zeros(2, np.uint64), _host_buffers(made))
    assert {entry[-1] for entry in log} == {items}
    assert log[0][2] == (-(-n // (256 * items)),)


def test_radix_sort_refuses_a_tile_size_it_has_no_kernel_for(monkeypatch, rng):
    from xferlib.batch import radix_sort

    log, made = [], {}
    _fake_radix(monkeypatch, log, made)
    with pytest.raises(ValueError, match=r"items must be one of \(2, 4, 8\), got 3"):
        radix_sort(rng.integers(0, 9, 3000), 9, None, np.zeros(2, np.uint64),
                   _host_buffers(made), items=3)
    assert not log and not made
