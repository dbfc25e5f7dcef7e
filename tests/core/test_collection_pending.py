"""Uncached host tables defer their write-back: the forward stages whole rows, the update
leaves its host rows in HBM and the next forward's staging writes them back while it reads
its own rows. Every order of calls must give the bits of a
collection that writes host rows through at each update: steps back to back, a lookup
between a forward and its backward, two forwards before their backwards (in either order;
a pending row both batches take is written back by neither staging), a forward left
without its backward, batches larger than the pending buffer (before a backward, between
steps), refused batches, and host reads and writes (state dicts, saves, rows written by
hand) in between."""

from __future__ import annotations

import numpy as np
import pytest

from tests.core.test_collection import make_batch
from xferlib.collection import EmbeddingCollection, TableConfig

pytestmark = pytest.mark.gpu

ROWS = [400, 37, 50]


def build(optimizer, defer=True, narrow_first=False):
    """Two host tables and an HBM table; ``defer=False``: the same collection writing host
    rows through. One host table is 3 wide (rows not in whole words: written through, not
    held), after the other or (``narrow_first``) before it in the keys' order."""
    from xferlib.testing import get_backend

    get_backend("cupy")
    dims = (3, 16) if narrow_first else (16, 3)
    coll = EmbeddingCollection([TableConfig(ROWS[0], dims[0], placement="host"),
                                TableConfig(ROWS[1], dims[1], placement="host"),
                                TableConfig(ROWS[2], 8)],
                               optimizer, {"lr": 0.2}, device="cuda", seed=4)
    side = coll._gpu_side()
    assert side.staging.defers
    side.staging.defers = defer
    return coll


def batch(rng, B, max_len=6):
    """A Zipf batch: consecutive batches share most of their rows."""
    import cupy

    indices, offsets = make_batch(rng, ROWS, B, max_len=max_len, zipf=True)
    return cupy.asarray(indices), cupy.asarray(offsets)


def grad_for(rng, out):
    import cupy

    return cupy.asarray(rng.standard_normal(out.shape).astype(np.float32))


def script(coll, tmp_path):
    """A run of every order of calls; the outputs it pooled, as bytes."""
    import cupy

    rng = np.random.default_rng(9)
    seen = []

    def step(B=16):
        out, ctx = coll.forward(*batch(rng, B))
        coll.backward(ctx, grad_for(rng, out))
        seen.append(out.get().tobytes())

    for _ in range(4):  # back to back: each forward finds the last update's rows pending
        step()
    out, ctx = coll.forward(*batch(rng, 16))  # a lookup between a forward and its backward
    seen.append(coll.lookup(*batch(rng, 16)).get().tobytes())
    coll.backward(ctx, grad_for(rng, out))
    first, ctx1 = coll.forward(*batch(rng, 16))  # two forwards, then both backwards
    second, ctx2 = coll.forward(*batch(rng, 16))
    coll.backward(ctx1, grad_for(rng, first))
    coll.backward(ctx2, grad_for(rng, second))
    seen += [first.get().tobytes(), second.get().tobytes()]
    first, ctx1 = coll.forward(*batch(rng, 16))  # two forwards, the later one's backward first
    second, ctx2 = coll.forward(*batch(rng, 16))
    coll.backward(ctx2, grad_for(rng, second))
    coll.backward(ctx1, grad_for(rng, first))
    seen += [first.get().tobytes(), second.get().tobytes()]
    out, ctx = coll.forward(*batch(rng, 16))
    coll.forward(*batch(rng, 40))  # a forward left without its backward, the buffer grown
    coll.backward(ctx, grad_for(rng, out))
    seen.append(out.get().tobytes())
    step(B=64)  # more lookups than the pending buffer holds: it grows
    step()
    seen.append(repr(sorted(coll.state_dict().items(), key=lambda kv: kv[0])).encode())
    step()
    coll.write_rows(0, np.array([0, 1, 5]), np.full((3, coll.dims[0]), 0.25, np.float32))
    step()
    coll.save(tmp_path / "mid.xft")
    step()
    state = coll.state_dict()
    step()
    coll.load_state_dict(state)  # back to the state before the last step
    step()
    indices, offsets = batch(rng, 16)
    bad = indices.copy()
    bad[-1] = 10_000  # out of the HBM table's range: refused, nothing written
    with pytest.raises(IndexError):
        out, ctx = coll.forward(bad, offsets)
        coll.backward(ctx, grad_for(rng, out))
        coll.check()
    step()
    step()
    cupy.cuda.Device().synchronize()
    return seen


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("narrow_first", [False, True])
def test_deferred_write_back_gives_the_bits_of_writing_through(optimizer, narrow_first,
                                                                tmp_path):
    deferred = build(optimizer, narrow_first=narrow_first)
    through = build(optimizer, False, narrow_first)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    seen_deferred = script(deferred, tmp_path / "a")
    seen_through = script(through, tmp_path / "b")
    assert deferred._gpu_side().staging.pending is not None  # the path under test was taken
    assert through._gpu_side().staging.pending is None
    assert len(seen_deferred) == len(seen_through)
    for k, (a, b) in enumerate(zip(seen_deferred, seen_through)):
        assert a == b, f"output {k} differs"
    got, want = deferred.state_dict(), through.state_dict()
    for key in want:
        assert got[key].tobytes() == want[key].tobytes(), key
    saved = EmbeddingCollection.load(tmp_path / "a" / "mid.xft", device="cpu").state_dict()
    again = EmbeddingCollection.load(tmp_path / "b" / "mid.xft", device="cpu").state_dict()
    for key in again:
        assert saved[key].tobytes() == again[key].tobytes(), key


def test_rows_are_pending_between_steps_and_written_back_by_synchronize():
    """After a step the updated host rows are in HBM only; synchronize() (what every host
    read calls) writes them back, and the host buffer then holds what the state says."""
    import cupy

    coll = build("sgd")
    rng = np.random.default_rng(1)
    indices, offsets = batch(rng, 16)
    before = coll.weights(0).copy()
    out, ctx = coll.forward(indices, offsets)
    coll.backward(ctx, grad_for(rng, out))
    cupy.cuda.Device().synchronize()
    side = coll._gpu_side()
    assert int(side.staging.pending.count.get()[0]) > 0  # held, not yet written back
    host = coll.buffers["host"]
    block = coll.blocks[0]
    raw = np.array(block.rows(host)[:, :16])  # host RAM as the update left it
    np.testing.assert_array_equal(raw, before)  # nothing written over the link yet
    after = coll.weights(0)  # synchronize(): written back
    assert int(side.staging.pending.count.get()[0]) == 0
    assert not np.array_equal(after, before)
    np.testing.assert_array_equal(np.array(block.rows(host)[:, :16]), after)


def test_eval_lookups_write_the_pending_rows_back_once():
    """A lookup for evaluation writes the pending rows back and leaves none pending (a loop
    of lookups moves no row over the link but its own), and training goes on as it would
    writing through."""
    import cupy

    def run(coll):
        rng = np.random.default_rng(2)
        out, ctx = coll.forward(*batch(rng, 16))
        coll.backward(ctx, grad_for(rng, out))
        looked = [coll.lookup(*batch(rng, 16)).get() for _ in range(3)]
        cupy.cuda.Device().synchronize()
        side = coll._gpu_side()
        held = 0 if side.staging.pending is None else int(side.staging.pending.count.get()[0])
        out, ctx = coll.forward(*batch(rng, 16))
        coll.backward(ctx, grad_for(rng, out))
        return held, looked, coll.state_dict()

    (held, looked, got), (_, looked_through, want) = run(build("rowwise_adagrad")), run(
        build("rowwise_adagrad", defer=False))
    assert held == 0
    for a, b in zip(looked, looked_through):
        assert a.tobytes() == b.tobytes()
    for key in want:
        assert got[key].tobytes() == want[key].tobytes(), key


WARP_FIND_TEST = r"""
extern "C" __global__ void find_each(const long long* keys, long long count,
                                     const long long* wants, long long m, long long* found) {
    const int lane = threadIdx.x & 31;
    const long long w = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (w >= m) return;  // the same for every lane of a warp
    const long long p = warp_find(keys, count, wants[w], lane);
    if (lane == 0) found[w] = p;
}
"""


@pytest.mark.parametrize("count", [0, 1, 2, 31, 32, 33, 1025, 25_600])
def test_warp_find_finds_each_key_and_nothing_else(count):
    """The staging's search of the pending keys (ascending, distinct): every key at its
    position; a value between two keys, below the first or past the last: -1."""
    import cupy

    from xferlib._kernels.collection import COLLECTION_HEAD, STAGING_HELPERS

    rng = np.random.default_rng(count)
    keys = np.sort(rng.choice(10 * count + 10, size=count, replace=False)).astype(np.int64)
    absent = np.setdiff1d(np.arange(-3, 10 * count + 14), keys)
    wants = np.concatenate([keys, rng.choice(absent, size=min(absent.size, 200),
                                             replace=False)]).astype(np.int64)
    module = cupy.RawModule(code=COLLECTION_HEAD + STAGING_HELPERS + WARP_FIND_TEST,
                            options=("--std=c++17",))
    found = cupy.full(wants.size, -7, dtype=np.int64)
    blocks = -(-wants.size * 32 // 256)
    module.get_function("find_each")((blocks,), (256,), (
        cupy.asarray(keys), np.int64(count), cupy.asarray(wants), np.int64(wants.size),
        found))
    where = np.searchsorted(keys, wants)
    hit = np.zeros(wants.size, bool) if count == 0 else (
        (where < count) & (keys[np.minimum(where, count - 1)] == wants))
    np.testing.assert_array_equal(found.get(), np.where(hit, where, -1))


HAS_KEY_TEST = r"""
extern "C" __global__ void has_each(const void* keys, int key_bytes, long long n,
                                    const long long* wants, long long m, int* found) {
    const int lane = threadIdx.x & 31;
    const long long w = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (w >= m) return;  // the same for every lane of a warp
    const bool has = warp_has_key(keys, key_bytes, n, wants[w], lane);
    if (lane == 0) found[w] = has ? 1 : 0;
}
"""


@pytest.mark.parametrize("key_bytes", [4, 8])
@pytest.mark.parametrize("n", [0, 1, 33, 65_536])
def test_warp_has_key_finds_keys_of_a_sorted_batch_with_repeats(key_bytes, n):
    """The staging's test of whether the batch (its sorted keys, repeated as a batch
    repeats rows; int32 or int64) holds a pending row's key: true for each key it holds,
    false for values between, below and past them."""
    import cupy

    from xferlib._kernels.collection import COLLECTION_HEAD, STAGING_HELPERS

    rng = np.random.default_rng(n + key_bytes)
    dtype = np.int32 if key_bytes == 4 else np.int64
    keys = np.sort(np.minimum(rng.zipf(1.1, n), 5 * n + 5) * 3).astype(dtype)
    wants = np.concatenate([keys, np.arange(-2, 3 * (5 * n + 5) + 4)]).astype(np.int64)
    module = cupy.RawModule(code=COLLECTION_HEAD + STAGING_HELPERS + HAS_KEY_TEST,
                            options=("--std=c++17",))
    found = cupy.full(wants.size, -7, dtype=np.int32)
    blocks = -(-wants.size * 32 // 256)
    module.get_function("has_each")((blocks,), (256,), (
        cupy.asarray(keys), np.int32(key_bytes), np.int64(n), cupy.asarray(wants),
        np.int64(wants.size), found))
    np.testing.assert_array_equal(found.get(), np.isin(wants, keys).astype(np.int32))


def fixed_batch(rng, B, L=2):
    """Bags of ``L`` lookups each (the shape a captured step replays), Zipf rows."""
    offsets = np.arange(0, len(ROWS) * B * L + 1, L)
    parts = [np.minimum(rng.zipf(1.2, B * L) - 1, n - 1) for n in ROWS]
    return np.concatenate(parts).astype(np.int64), offsets.astype(np.int64)


# Bags of the steps before the capture: its batch (24 bags) larger than the buffer they
# make, or not; a buffer grown just before it (the replaced one still held); or no step.
FIRST_BAGS = {"small": (4,), "large": (24,), "grown": (4, 24), "captured": ()}


def captured_script(coll, first):
    """Steps replayed from a CuPy-captured graph of 24 bags a table, between eager steps
    that defer (4 bags) and eager steps larger than the pending buffer (40 bags: it may not
    grow once a step was captured, the graph reads the buffer it recorded). ``first``: the
    step before the capture makes the buffer, smaller than the graph's batch ("small": the
    graph writes through) or not ("large": the graph defers; "grown": after a smaller
    buffer, replaced just before the capture); "captured": the capture comes first (its
    graph holds no buffer, and none is made after it)."""
    import cupy

    rng = np.random.default_rng(21)
    B = 24
    width = sum(coll.dims)
    static_idx, static_off = (cupy.asarray(a) for a in fixed_batch(rng, B))
    static_grad = cupy.zeros((B, width), np.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    pool = cupy.cuda.MemoryPool()
    cupy.cuda.Device().synchronize()  # made on the legacy stream: done before `stream` reads
    seen = []

    def eager(B):
        idx, off = fixed_batch(rng, B)
        out, ctx = coll.forward(cupy.asarray(idx), cupy.asarray(off), stream=stream)
        coll.backward(ctx, cupy.asarray(rng.standard_normal((B, width)), np.float32),
                      stream=stream)
        seen.append(out.get().tobytes())

    with stream:
        for bags in FIRST_BAGS[first]:
            eager(bags)
        with cupy.cuda.using_allocator(pool.malloc):
            stream.begin_capture()
            out, ctx = coll.forward(static_idx, static_off, stream=stream)
            coll.backward(ctx, static_grad, stream=stream)
            graph = stream.end_capture()
        for _ in range(3):
            idx, off = fixed_batch(rng, B)
            static_idx.set(idx, stream=stream)
            static_grad.set(rng.standard_normal((B, width)).astype(np.float32), stream=stream)
            graph.launch(stream)
            seen.append(out.get(stream=stream).tobytes())
            eager(4)
            eager(40)
        stream.synchronize()
    return seen


@pytest.mark.parametrize("first", sorted(FIRST_BAGS))
def test_captured_steps_give_the_bits_of_writing_through(first):
    import cupy

    if first == "captured":  # the kernels compiled and loaded outside the capture
        warm = build("sgd")
        out, ctx = warm.forward(*batch(np.random.default_rng(0), 4))
        warm.backward(ctx, cupy.ones(out.shape, np.float32))
        cupy.cuda.Device().synchronize()
    deferred, through = build("sgd"), build("sgd", defer=False)
    seen_deferred = captured_script(deferred, first)
    seen_through = captured_script(through, first)
    staging = deferred._gpu_side().staging
    capacity = None  # grown by the steps before the capture only
    for bags in FIRST_BAGS[first]:
        lookups = bags * 2 * len(ROWS)
        if capacity is None or capacity < lookups:
            capacity = max(lookups + lookups // 4, (capacity or 0) * 5 // 4)
    assert capacity == (staging.pending and staging.pending.capacity)
    for k, (a, b) in enumerate(zip(seen_deferred, seen_through)):
        assert a == b, f"output {k} differs"
    got, want = deferred.state_dict(), through.state_dict()
    for key in want:
        assert got[key].tobytes() == want[key].tobytes(), key


def test_steps_and_lookups_on_two_streams_give_the_bits_of_writing_through():
    """Training steps alternating between two streams, evaluation lookups on a third and a
    batch that grows the buffer (the replaced one kept until its write-back ran): each call
    waits for the last one's stream while rows are pending."""
    import cupy

    def run(coll):
        rng = np.random.default_rng(8)
        streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(3)]
        cupy.cuda.Device().synchronize()
        seen = []
        for k in range(8):
            with streams[k % 2] as stream:
                out, ctx = coll.forward(*batch(rng, 64 if k == 4 else 16), stream=stream)
                coll.backward(ctx, grad_for(rng, out), stream=stream)
                seen.append(out.get(stream=stream).tobytes())
            with streams[2] as stream:
                seen.append(coll.lookup(*batch(rng, 16), stream=stream).get(
                    stream=stream).tobytes())
        cupy.cuda.Device().synchronize()
        return seen, coll.state_dict()

    (seen, got), (seen_through, want) = run(build("sgd")), run(build("sgd", defer=False))
    assert seen == seen_through
    for key in want:
        assert got[key].tobytes() == want[key].tobytes(), key
