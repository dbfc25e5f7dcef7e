"""The host table's GPU cache: its policy (CacheModel, on every machine) and the device cache
against the model and the NumPy reference (GPU)."""

import numpy as np
import pytest

import xferlib
from xferlib.table import CacheModel
from xferlib.table.cache import WAYS, set_of
from xferlib.table.prefetch import Pending, must_wait
from xferlib.testing import assert_outputs_match, for_each_backend, reference_check, table_arrays

from tests.core.test_table import NUM_ROWS, VARIANTS, _batches, training_reference

# ----------------------------------------------------------------------------- the policy


def test_lru_evicts_the_least_recently_used():
    model = CacheModel(4, num_rows=100, policy="lru", admission="always")
    for row in (1, 2, 3, 4):
        assert model.access([row])[0] >= 0
    model.access([1])  # 2 is now the least recently used
    model.access([5])
    assert model.cached_rows().tolist() == [1, 3, 4, 5]
    assert model.stats == dict(lookups=6, hits=1, misses=5, admitted=5, evicted=1)


def test_lfu_evicts_the_least_often_used():
    model = CacheModel(3, num_rows=100, policy="lfu", admission="always")
    model.access([1, 2, 3])
    model.access([1, 3])
    model.access([1, 2])
    model.access([7])  # uses: 1 -> 3, 2 -> 2, 3 -> 2: 2 and 3 tie, the lower way (2's) goes
    assert model.cached_rows().tolist() == [1, 3, 7]


def test_second_sight_fills_empty_ways_then_admits_on_the_second_miss():
    model = CacheModel(32, num_rows=1000, admission="second-sight")  # one set of 32 ways
    assert (model.access(range(100, 132)) >= 0).all()  # empty ways take any miss
    assert (model.access([10, 20, 30]) == -1).all()  # the set is full: first sight
    assert (model.access([10, 30, 40]) >= 0).tolist() == [True, True, False]
    assert model.access([40])[0] >= 0
    assert model.stats["admitted"] == 35 and model.stats["evicted"] == 3
    assert model.stats["hits"] == 0


def test_a_batch_never_evicts_its_own_rows():
    model = CacheModel(2, num_rows=100, admission="always")
    slots = model.access([5, 6, 7])
    assert (slots >= 0).sum() == 2 and len(set(slots[slots >= 0])) == 2
    assert model.stats["evicted"] == 0


def test_prefetch_protects_the_previous_batch():
    model = CacheModel(2, num_rows=100, admission="always")
    model.access([1, 2])
    assert model.access([3], protect_prev=True)[0] == -1  # 1 and 2 may be being updated
    assert model.access([3])[0] >= 0


def test_a_second_prefetch_may_evict_the_lookups_rows():
    """lookup(a), prefetch(c), prefetch(d): c's pass cannot evict a's rows, d's can (it
    protects c's only), so an update of a beside d's pass must wait for it first."""
    model = CacheModel(4, num_rows=100, admission="always")
    model.access([1, 2, 3, 4])                                   # lookup(a)
    assert model.access([1, 9], protect_prev=True)[1] == -1      # prefetch(c): no victim
    assert model.cached_rows().tolist() == [1, 2, 3, 4]
    assert (model.access([5, 6], protect_prev=True) >= 0).all()  # prefetch(d)
    assert model.cached_rows().tolist() == [1, 4, 5, 6]          # a's rows 2, 3 evicted
    plan_a, plan_c, plan_d = object(), object(), object()
    assert not must_wait(None, plan_a)
    assert not must_wait(Pending("c", plan_c, None, None, protects=plan_a), plan_a)
    assert must_wait(Pending("d", plan_d, None, None, protects=plan_c), plan_a)


class _Protocol:
    """The host side's bookkeeping of cache passes (``DeviceSide.last_pass``, prefetch.py's
    ``Pending.protects``) over the policy model: lookups take a matching prefetch, prefetches
    protect the previous pass. ``update`` asserts the rule ``must_wait`` relies on: a batch
    whose update does not wait keeps every cached row in its slot through the pass of the
    prefetch in flight."""

    def __init__(self, cache_rows, num_rows):
        self.model = CacheModel(cache_rows, num_rows, admission="always")
        self.last_pass = self.pending = None
        self.moved = set()  # rows the in-flight prefetch's pass evicted or moved
        self.waits = 0

    def lookup(self, rows):
        pending, self.pending = self.pending, None
        self.moved = set()  # the lookup waited for the prefetch: nothing runs beside it now
        if pending is not None and pending.idx is rows:
            return pending.plan
        plan = (rows,)
        self.model.access(rows)
        self.last_pass = plan
        return plan

    def prefetch(self, rows):
        before = {int(r): i for i, r in enumerate(self.model.tags) if r >= 0}
        plan = (rows,)
        self.model.access(rows, protect_prev=True)
        after = {int(r): i for i, r in enumerate(self.model.tags) if r >= 0}
        self.moved = {r for r, slot in before.items() if after.get(r) != slot}
        self.pending = Pending(rows, plan, None, None, protects=self.last_pass)
        self.last_pass = plan

    def update(self, plan):
        if must_wait(self.pending, plan):
            self.waits += 1
        else:
            assert not self.moved & {int(r) for r in plan[0]}, "a protected row was evicted"


def test_updates_beside_a_prefetch_keep_their_rows(rng):
    """Random orders of lookups, prefetches and updates over a tiny cache: every update that
    does not wait for the prefetch in flight finds its rows where they were."""
    proto = _Protocol(cache_rows=8, num_rows=40)
    looked_up = []
    for _ in range(600):
        op = rng.integers(4)
        rows = np.unique(rng.zipf(1.3, size=12) % 40)
        if op == 0:
            looked_up.append(proto.lookup(rows))
        elif op == 1:
            if looked_up and rng.random() < 0.5:  # the next lookup takes it
                proto.prefetch(rows)
                looked_up.append(proto.lookup(rows))
            else:
                proto.prefetch(rows)
        elif op == 2 and looked_up:
            proto.update(looked_up.pop(rng.integers(len(looked_up))))
            looked_up = looked_up[-3:]
        else:  # raw indices: a batch no pass protects
            proto.update((rows,))
    assert proto.waits > 0


def test_sets_spread_neighbouring_rows():
    sets = set_of(np.arange(64 * WAYS), 64)
    counts = np.bincount(sets, minlength=64)
    assert counts.min() > WAYS // 4 and counts.max() < 4 * WAYS


@pytest.mark.parametrize("rows,cache_rows", [(1, 5), (2, 64), (10, 64), (1000, 96),
                                             (7919, 300), (2**20 + 7, 40_000),
                                             (17_307_354, 488_820)])
def test_set_ordered_keys_are_a_bijection_that_spreads_neighbours(rows, cache_rows):
    """A cached collection's host keys: one key per row, each turned back into its row, all
    below the span, their sets those of the cache; the first k * n_sets rows (the hottest
    of frequency-ranked ids) fill every set k times, any k * n_sets neighbouring rows put
    k - 1 to k + 1 in each, and rows n_sets apart spread as a hash would."""
    from xferlib.table.cache import SetOrder, cache_sets

    order = SetOrder.for_cache(rows, cache_rows)
    assert order.n_sets == cache_sets(min(cache_rows, rows))
    x = np.arange(min(rows, 1 << 21))
    keys = order.key(x)
    assert np.unique(keys).size == x.size and keys.min() >= 0 and keys.max() < order.span
    assert order.span < rows + order.n_sets
    np.testing.assert_array_equal(order.row(keys), x)
    sets = order.set(keys)
    assert sets.min() >= 0 and sets.max() < order.n_sets
    for start in (0, 12_345):
        k = min(4, (x.size - start) // order.n_sets)
        if k > 0:
            counts = np.bincount(sets[start:start + k * order.n_sets], minlength=order.n_sets)
            if start % order.n_sets == 0:  # whole blocks of n_sets rows: every set k times
                assert (counts == k).all()
            assert counts.min() >= k - 1 and counts.max() <= k + 1
    apart = order.set(order.key(np.arange(0, rows, order.n_sets)[:4096]))
    assert np.bincount(apart).max() <= max(8, apart.size // order.n_sets * 4)


def test_set_order_refuses_tables_past_its_key_range():
    from xferlib.table.cache import SetOrder

    for rows in (0, 2**31):
        with pytest.raises(ValueError, match="set-ordered keys"):
            SetOrder.for_cache(rows, 100)


def test_cache_of_fewer_rows_than_a_set():
    model = CacheModel(3, num_rows=100, admission="always")
    assert (model.access(np.arange(10)) >= 0).sum() == 3


def test_cpu_table_with_cache_trains_like_reference(rng):
    """Without a GPU the cache is not used; the configuration still trains exactly."""
    table = xferlib.HostTable(NUM_ROWS, 4, optimizer="adam", cache_rows=8, init="zeros")
    ref = xferlib.HostTable(NUM_ROWS, 4, optimizer="adam", init="zeros")
    for idx, grads in _batches(rng, 4, "int64"):
        table.apply_gradients(idx, grads[:, :4])
        ref.apply_gradients(idx, grads[:, :4])
    assert_outputs_match(table_arrays(table), table_arrays(ref), rtol=0, atol=0)
    table.check()  # nothing pending on the CPU


# ----------------------------------------------------------------------------- GPU

on_gpu = for_each_backend("cupy")  # GPU indices: the device side and its cache


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("admission", ["second-sight", "always"])
@on_gpu
def test_device_cache_follows_the_model(backend, rng, policy, admission):
    rows = 5000
    table = xferlib.HostTable(rows, 8, optimizer="sgd", cache_rows=100, cache_policy=policy,
                              cache_admission=admission, seed=0)
    model = CacheModel(100, rows, policy, admission)
    for _ in range(12):
        idx = (rng.zipf(1.2, size=700) % rows).astype(np.int64)
        table.lookup(backend.array(idx))
        model.access(idx)
        np.testing.assert_array_equal(table._gpu.cache.cached_rows(), model.cached_rows())
    assert table.cache_stats() | {"hit_rate": 0} == model.stats | {"hit_rate": 0}


@pytest.mark.parametrize("name, hyper, torch_name", VARIANTS)
@pytest.mark.parametrize("dim", [5, 16])
@on_gpu
def test_cached_training_matches_reference(backend, rng, name, hyper, torch_name, dim):
    """A cache far smaller than the rows touched: rows are admitted, updated in HBM, evicted
    (written back) and admitted again; every lookup, the weights, state and steps follow the
    reference."""
    init = rng.standard_normal((NUM_ROWS, dim)).astype(np.float32)

    def train(batches):
        table = xferlib.HostTable(NUM_ROWS, dim, optimizer=name, optimizer_kwargs=hyper,
                                  init=init.copy(), cache_rows=6, cache_admission="always")
        seen = []
        for i, (idx, grads) in enumerate(batches):
            rows, batch = table.lookup(idx, return_batch=True)
            seen.append(rows)
            # odd steps hand back the lookup's batch; even ones raw indices, located in the
            # cache again
            table.apply_gradients(batch if i % 2 else idx, grads)
        assert table.cache_stats()["evicted"] > 0
        return {"lookups": seen, **table_arrays(table)}

    reference_check(backend, train,
                    lambda b: training_reference(name, hyper, init, b, lookups=True),
                    list(_batches(rng, dim, "int64")), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("cache_rows", [0, 40])
@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
@on_gpu
def test_prefetch_while_updating(backend, rng, cache_rows, index_dtype):
    dim, rows_n = 8, 300
    kw = dict(optimizer="adam", optimizer_kwargs={"lr": 0.1}, seed=4)
    table = xferlib.HostTable(rows_n, dim, cache_rows=cache_rows, cache_admission="always", **kw)
    reference = xferlib.HostTable(rows_n, dim, **kw)
    batches = [backend.array((rng.zipf(1.3, size=257) % rows_n).astype(index_dtype))
               for _ in range(9)]
    rows, batch = table.lookup(batches[0], return_batch=True)
    for step in range(8):
        table.prefetch(batches[step + 1])  # overlaps the rows being trained
        grads = backend.array(rng.standard_normal((257, dim)).astype(np.float32))
        table.apply_gradients(batch, grads)
        reference.apply_gradients(batches[step], grads)
        rows, batch = table.lookup(batches[step + 1], return_batch=True)
        assert_outputs_match(backend.get(rows), backend.get(reference.lookup(batches[step + 1])),
                             rtol=0, atol=0, what=f"lookup {step + 1}")
    assert_outputs_match(table_arrays(table), table_arrays(reference), rtol=0, atol=0)


@on_gpu
def test_update_finds_its_rows_after_other_cache_passes(backend, rng):
    """An update finds its rows wherever they are now: after a second lookup, two prefetches
    or a scatter (which empties the cache) since its lookup. Every order trains like the
    uncached reference."""
    dim, rows_n, n = 8, 200, 300
    kw = dict(optimizer="adam", optimizer_kwargs={"lr": 0.1}, seed=2)
    table = xferlib.HostTable(rows_n, dim, cache_rows=32, cache_admission="always", **kw)
    reference = xferlib.HostTable(rows_n, dim, **kw)

    def batch():
        return backend.array((rng.zipf(1.2, size=n) % rows_n).astype(np.int64))

    def update(plan, idx):
        grads = backend.array(rng.standard_normal((n, dim)).astype(np.float32))
        table.apply_gradients(plan, grads)
        reference.apply_gradients(idx, grads)

    for _ in range(3):
        a, b, c, d = batch(), batch(), batch(), batch()
        _, plan_a = table.lookup(a, return_batch=True)
        _, plan_b = table.lookup(b, return_batch=True)  # may evict a's rows
        update(plan_a, a)
        update(plan_b, b)
        _, plan_a = table.lookup(a, return_batch=True)
        table.prefetch(c)
        table.prefetch(d)  # a second cache pass since a's lookup
        update(plan_a, a)
        _, plan_d = table.lookup(d, return_batch=True)
        update(plan_d, d)
        _, plan_c = table.lookup(c, return_batch=True)
        rows = backend.array(rng.standard_normal((5, dim)).astype(np.float32))
        table.scatter(c[:5], rows)  # empties the cache
        reference.scatter(c[:5], rows)
        update(plan_c, c)
    assert_outputs_match(table_arrays(table), table_arrays(reference), rtol=0, atol=0)


_STALL = r"""
extern "C" __global__ void stall(long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < ns);
}
"""


class _Orders:
    """Orders of lookups, prefetches, updates and scatters on a cached table and the uncached
    reference. Every lookup's rows are kept with the reference's rows at the same point;
    nothing is read back until the end, so the host runs ahead and the prefetch's side
    stream overlaps the caller's."""

    def __init__(self, rng, table, reference, n, dim, rows_n):
        self.rng, self.table, self.reference = rng, table, reference
        self.n, self.dim, self.rows_n = n, dim, rows_n
        self.seen = []

    def batch(self):
        import cupy

        return cupy.asarray((self.rng.zipf(1.2, size=self.n) % self.rows_n).astype(np.int64))

    def lookup(self, idx):
        rows, plan = self.table.lookup(idx, return_batch=True)
        self.seen.append((rows, self.reference.lookup(idx)))
        return plan

    def update(self, plan, idx):
        import cupy

        grads = cupy.asarray(self.rng.standard_normal((self.n, self.dim)).astype(np.float32))
        self.table.apply_gradients(plan, grads)
        self.reference.apply_gradients(idx, grads)

    def scatter(self, idx):
        import cupy

        rows = cupy.asarray(self.rng.standard_normal((idx.size, self.dim)).astype(np.float32))
        self.table.scatter(idx, rows)
        self.reference.scatter(idx, rows)

    # ---------------------------------------------------------------- the orders

    def two_lookups(self):
        a, b = self.batch(), self.batch()
        pa, pb = self.lookup(a), self.lookup(b)  # b's pass may evict a's rows
        self.update(pa, a)
        self.update(pb, b)

    def two_prefetches(self):
        a, c, d = self.batch(), self.batch(), self.batch()
        pa = self.lookup(a)
        self.table.prefetch(c)
        self.table.prefetch(d)  # protects c's rows only: may evict a's while a's update runs
        self.update(pa, a)
        pd = self.lookup(d)
        self.update(pd, d)
        pc = self.lookup(c)
        self.update(pc, c)

    def scatter_between(self):
        c = self.batch()
        pc = self.lookup(c)
        self.scatter(c[:5])  # empties the cache
        self.update(pc, c)

    def pipelined(self):  # the ordinary loop: lookup -> prefetch(next) -> update
        idx = [self.batch() for _ in range(4)]
        plan = self.lookup(idx[0])
        for step in range(3):
            self.table.prefetch(idx[step + 1])
            self.update(plan, idx[step])
            plan = self.lookup(idx[step + 1])
        self.update(plan, idx[3])

    def older_lookup_beside_prefetch(self):
        a, b, c = self.batch(), self.batch(), self.batch()
        pa, pb = self.lookup(a), self.lookup(b)
        self.table.prefetch(c)  # protects b's rows, not a's
        self.update(pa, a)
        self.update(pb, b)
        pc = self.lookup(c)
        self.update(pc, c)

    def raw_update_beside_prefetch(self):
        a, b = self.batch(), self.batch()
        self.lookup(a)
        self.table.prefetch(b)
        self.update(a, a)  # raw indices: located afresh, after the prefetch's pass
        pb = self.lookup(b)
        self.update(pb, b)

    def prefetch_not_taken(self):
        a, b, c = self.batch(), self.batch(), self.batch()
        pa = self.lookup(a)
        self.table.prefetch(b)
        self.update(pa, a)
        pc = self.lookup(c)  # not the prefetched object: waits for it, then its own pass
        self.update(pc, c)
        pb = self.lookup(b)
        self.update(pb, b)


_ORDERS = ["two_lookups", "two_prefetches", "scatter_between", "pipelined",
           "older_lookup_beside_prefetch", "raw_update_beside_prefetch", "prefetch_not_taken"]
_STRESS = [  # optimizer, hyperparameters, cache rows (32: one set; 48: ways disabled)
    ("adam", {"lr": 0.1, "weight_decay": 0.01, "amsgrad": True}, 32),
    ("sgd", {"lr": 0.1, "momentum": 0.9}, 48),
    ("rowwise_adagrad", {"lr": 0.1}, 96),
]


@pytest.mark.parametrize("order", _ORDERS)
@pytest.mark.parametrize("admission", ["always", None])  # None: the default (second-sight)
@pytest.mark.parametrize("seed", range(len(_STRESS)))
@on_gpu
def test_cache_orders_stress(backend, order, admission, seed):
    """Each order 30 times on a small table whose cache churns, with the caller's stream
    stalled at random points so the prefetch's side stream and the caller's run together:
    rows looked up, weights and every state array equal the uncached table's exactly."""
    cupy = backend.xp
    name, hyper, cache_rows = _STRESS[seed]
    rng = np.random.default_rng(1000 + seed)
    dim, rows_n, n = 8, 200, 300
    kw = dict(optimizer=name, optimizer_kwargs=hyper, seed=seed)
    extra = {} if admission is None else {"cache_admission": admission}
    table = xferlib.HostTable(rows_n, dim, cache_rows=cache_rows, **extra, **kw)
    reference = xferlib.HostTable(rows_n, dim, **kw)
    stall = cupy.RawKernel(_STALL, "stall")
    orders = _Orders(rng, table, reference, n, dim, rows_n)
    for _ in range(30):
        stall((1,), (1,), (np.int64(rng.choice([0, 20_000, 300_000])),))  # ns
        getattr(orders, order)()
    table.check()
    assert_outputs_match(backend.get([rows for rows, _ in orders.seen]),
                         backend.get([expected for _, expected in orders.seen]),
                         rtol=0, atol=0, what="lookups")
    assert_outputs_match(table_arrays(table), table_arrays(reference), rtol=0, atol=0)
    stats = table.cache_stats()
    # the cache took part (a scatter empties it every round, so that order may never hit)
    assert stats["admitted"] > 0 and (stats["hits"] > 0 or order == "scatter_between")


@pytest.mark.parametrize("schedule", [False, True])
@pytest.mark.parametrize("cache_rows", [0, 64])
@on_gpu
def test_graph_captured_step_matches_eager(backend, rng, cache_rows, schedule):
    """lookup + apply_gradients at a fixed batch size, captured once in a CUDA graph and
    replayed on new indices and gradients, trains exactly like the eager step; with
    ``schedule``, ``set_hyper`` between replays reaches the replays (the captured update
    reads its hyperparameters where it recorded them)."""
    cupy = backend.xp
    n, dim, rows_n = 512, 16, 2000
    kw = dict(optimizer="adam", optimizer_kwargs={"lr": 0.05}, seed=1, cache_rows=cache_rows,
              cache_admission="always")
    eager, graphed = xferlib.HostTable(rows_n, dim, **kw), xferlib.HostTable(rows_n, dim, **kw)
    stream = cupy.cuda.Stream(non_blocking=True)
    pool = cupy.cuda.MemoryPool()  # the graph's buffers: never handed to anyone else
    idx_buf = cupy.zeros(n, dtype=np.int64)
    grad_buf = cupy.zeros((n, dim), dtype=np.float32)
    out = cupy.zeros((n, dim), dtype=np.float32)
    # made on the legacy default stream, which a non-blocking one does not wait for
    cupy.cuda.Device().synchronize()

    def step(table):
        rows, batch = table.lookup(idx_buf, out=out, stream=stream, return_batch=True)
        table.apply_gradients(batch, grad_buf, stream=stream)

    data = [((rng.zipf(1.2, size=n) % rows_n).astype(np.int64),
             rng.standard_normal((n, dim)).astype(np.float32)) for _ in range(6)]
    with cupy.cuda.using_allocator(pool.malloc), stream:
        idx_buf.set(data[0][0], stream=stream)
        grad_buf.set(data[0][1], stream=stream)
        step(graphed)  # compiles and sizes every buffer outside the capture
        graphed.check()
        stream.begin_capture()
        step(graphed)
        graph = stream.end_capture()
    # Everything else allocates from the default pool: the graph's buffers stay its own.
    with stream:
        for i, (idx, grads) in enumerate(data):
            if i == 0:
                eager.lookup(cupy.asarray(idx))
                eager.apply_gradients(cupy.asarray(idx), cupy.asarray(grads))
                continue
            if schedule:  # a new learning rate every step, as a schedule sets it
                for table in (eager, graphed):
                    table.set_hyper(lr=0.05 / (i + 1))
            idx_buf.set(idx, stream=stream)
            grad_buf.set(grads, stream=stream)
            graph.launch(stream)
            rows = eager.lookup(cupy.asarray(idx))
            eager.apply_gradients(cupy.asarray(idx), cupy.asarray(grads))
            stream.synchronize()
            np.testing.assert_array_equal(out.get(), rows.get())
    graphed.check()
    assert_outputs_match(table_arrays(graphed), table_arrays(eager), rtol=0, atol=0)
    if schedule:  # refused while a capture runs: a replay would not run it
        with stream:
            stream.begin_capture()
            try:
                with pytest.raises(RuntimeError, match="while a CUDA graph is being captured"):
                    graphed.set_hyper(lr=1.0)
            finally:
                stream.end_capture()
        assert graphed.hyper["lr"] == pytest.approx(0.05 / len(data))  # unchanged


@pytest.mark.parametrize("bad", [-1, 300])
@on_gpu
def test_bad_batch_changes_no_row_state_or_cache_entry(backend, rng, bad):
    cupy = backend.xp
    table = xferlib.HostTable(300, 8, optimizer="adam", cache_rows=40, seed=2)
    for _ in range(3):  # a warm cache, some of it dirty
        idx = cupy.asarray(rng.integers(0, 60, size=100))
        rows, batch = table.lookup(idx, return_batch=True)
        table.apply_gradients(batch, cupy.ones((100, 8), np.float32))
    table.check()
    cache = table._gpu.cache
    before = {k: getattr(cache, k).get() for k in ("data", "tags", "score", "last", "dirty",
                                                     "door", "stats")}
    host_w = np.array(table._weights)
    host_s = np.array(table._state)
    idx = cupy.asarray(np.array([5, bad, 7, 100]))
    grads = cupy.ones((4, 8), np.float32)
    for call in (lambda: table.lookup(idx), lambda: table.apply_gradients(idx, grads),
                 lambda: table.prefetch(idx)):
        with pytest.raises(IndexError, match=f"index {bad} at position 1"):
            call()
            table.check()
    cupy.cuda.Device().synchronize()
    for key, value in before.items():
        np.testing.assert_array_equal(getattr(cache, key).get(), value, err_msg=key)
    np.testing.assert_array_equal(np.array(table._weights), host_w)
    np.testing.assert_array_equal(np.array(table._state), host_s)


@on_gpu
def test_dirty_rows_written_back_by_numpy_state_and_save(backend, tmp_path):
    cupy = backend.xp
    table = xferlib.HostTable(64, 4, optimizer="sgd", optimizer_kwargs={"lr": 1.0},
                              init="zeros", cache_rows=32, cache_admission="always")
    idx = cupy.arange(16)
    rows, batch = table.lookup(idx, return_batch=True)
    table.apply_gradients(batch, cupy.ones((16, 4), np.float32))
    np.testing.assert_array_equal(table.numpy()[:16], -1.0)
    np.testing.assert_array_equal(table.state("step")[:16], 1)
    rows, batch = table.lookup(idx, return_batch=True)
    table.apply_gradients(batch, cupy.ones((16, 4), np.float32))
    table.save(tmp_path / "t.npz")
    np.testing.assert_array_equal(xferlib.HostTable.load(tmp_path / "t.npz").numpy()[:16], -2.0)
    assert table.cache_stats()["hits"] == 16


def test_model_empty_batch_is_no_cache_pass():
    """The device runs no cache pass (no tick) for an empty batch, so lookup(a),
    lookup(empty), prefetch(b) still protects a's rows; the model ticked and let b evict
    them."""
    model = CacheModel(2, num_rows=100, admission="always")
    model.access([1, 2])
    assert model.access([]).size == 0
    assert model.access([3], protect_prev=True)[0] == -1
    assert model.cached_rows().tolist() == [1, 2]


def test_model_caps_the_cache_at_the_table_like_host_table():
    """HostTable builds its device cache of min(cache_rows, num_rows) rows (its sets follow
    from that); the model of the same arguments must have the same sets."""
    table = xferlib.HostTable(40, 4, cache_rows=100)
    model = CacheModel(100, num_rows=40, admission="always")
    assert model.n_sets == CacheModel(table.cache_rows, num_rows=40).n_sets == 2
    assert (model.tags >= -1).sum() == table.cache_rows
