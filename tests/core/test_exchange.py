"""The sharded collection's fixed-size lookup exchange (xferlib.collection.exchange): the NumPy
reference against what each owner must receive, written out plainly; the CUDA kernels against
the reference, bit for bit, on random batches with awkward sizes, row-wise shards, bags of
any length, bad indices and bad offsets."""

import dataclasses

import numpy as np
import pytest

import xferlib
from xferlib.collection import TableConfig, plan_sharding
from xferlib.collection.exchange import (check_lookups, count_lookups, exchange_routes,
                                         pack_lookups, unpack_lookups)
from xferlib.testing import GPU_SKIP_REASON

TABLES = [TableConfig(9, 4, name="a"), TableConfig(30, 4, name="b"),
          TableConfig(5, 4, name="c"), TableConfig(17, 4, name="d")]


def _plan(world, row_wise=()):
    return plan_sharding(TABLES, world, row_wise=row_wise)


def _batch(rng, B, max_len, bad_index=False):
    lengths = rng.integers(0, max_len + 1, len(TABLES) * B)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    rows = np.repeat([c.num_rows for c in TABLES], B)
    idx = np.concatenate([rng.integers(0, r, n) for r, n in zip(rows, lengths)]
                         ).astype(np.int64)
    if bad_index and idx.size:
        idx[rng.integers(idx.size)] = 10_000
    weights = rng.standard_normal(idx.size).astype(np.float32)
    return idx, offsets, weights


def _rooms(plan, B, n, max_bag):
    S = max(1, max(len(plan.shards_of(r)) for r in range(plan.world_size)))
    tables = [plan.tables_of(r) for r in range(plan.world_size)]
    caps = [min(n, B * max_bag * t) if max_bag else (n if t else 0) for t in tables]
    starts = np.cumsum(caps) - caps
    return S, np.array(caps), np.array([o * S * B + s for o, s in enumerate(starts)]), starts


def _send(xp, plan, idx, off, w, B, max_bag, any_bad_of_others=0, mean=False, n=64):
    """One rank's messages, through the four steps (the collective summed in by hand);
    ``n``: the lookups every rank's messages have room for (ranks pass equal sizes)."""
    routes = exchange_routes(plan, xp)
    S, caps, msg_base, w_base = _rooms(plan, B, max(n, idx.size), max_bag)
    a = lambda v, dt=np.int64: xp.asarray(np.asarray(v, dtype=dt))  # noqa: E731
    flags = xp.zeros(2, dtype=np.uint64)
    check_lookups(a(idx), a(off), B, routes, max_bag, flags)
    any_bad = a([int(flags.sum()) + any_bad_of_others])
    counts = xp.zeros(plan.world_size * S * B, dtype=np.int64)
    count_lookups(a(idx), a(off), B, routes, flags, any_bad, counts)
    msg = xp.zeros(plan.world_size * S * B + int(caps.sum()), dtype=np.int64)
    w_msg = xp.zeros(int(caps.sum()), dtype=np.float32)
    pack_lookups(a(idx), a(off), B, routes, flags, any_bad, counts, xp.cumsum(counts),
                 a(msg_base), a(caps), msg, weights=a(w, np.float32), mean=mean,
                 w_base=a(w_base), w_msg=w_msg)
    host = lambda v: v.get() if hasattr(v, "get") else np.asarray(v)  # noqa: E731
    return host(flags), host(counts), host(msg), host(w_msg), (S, caps, msg_base, w_base)


def _expected(plan, batches, B, owner):
    """What ``owner`` must get, written out: for each of its shards, each rank's bags of the
    shard's table, each bag's lookups inside the shard's rows (local), in order."""
    lengths, idx = [], []
    for s in plan.shards_of(owner):
        for idx_r, off_r in batches:
            for b in range(B):
                g = s.table_index * B + b
                bag = idx_r[off_r[g]:off_r[g + 1]]
                inside = bag[(bag >= s.row_start) & (bag < s.row_stop)] - s.row_start
                lengths.append(inside.size)
                idx.extend(inside.tolist())
    return np.array(lengths, dtype=np.int64), np.array(idx, dtype=np.int64)


def _receive(xp, plan, messages, w_messages, B, owner, layout):
    S, caps, msg_base, w_base = layout
    world, head, room = plan.world_size, S * B, int(caps[owner])
    received = np.stack([m[msg_base[owner]:msg_base[owner] + head + room] for m in messages])
    w_received = np.stack([w[w_base[owner]:w_base[owner] + room] for w in w_messages])
    T_me = len(plan.shards_of(owner))
    lengths = received[:, :T_me * B]
    scan = np.cumsum(lengths.reshape(-1))
    offsets = np.concatenate([[0], np.cumsum(lengths.reshape(world, T_me, B)
                                             .transpose(1, 0, 2).reshape(-1))])
    idx = xp.zeros(world * room, dtype=np.int64)
    w = xp.zeros(world * room, dtype=np.float32)
    unpack_lookups(xp.asarray(received), B, S, room, T_me, xp.asarray(scan),
                   xp.asarray(offsets), idx, w_received=xp.asarray(w_received), w_out=w)
    host = lambda v: v.get() if hasattr(v, "get") else np.asarray(v)  # noqa: E731
    return offsets, host(idx), host(w)


CASES = [(2, (), 3, 1, 1), (2, ("b",), 5, 3, 3), (3, ("b", "d"), 7, 4, 0), (3, (), 1, 2, 2),
         (2, ("a", "b", "c", "d"), 4, 0, 2)]


@pytest.mark.parametrize("world,row_wise,B,max_len,max_bag", CASES)
def test_owners_receive_their_shards_lookups_in_order(world, row_wise, B, max_len, max_bag):
    plan = _plan(world, row_wise)
    rng = np.random.default_rng(world * 100 + B)
    batches = [_batch(rng, B, max_len) for _ in range(world)]
    n = max(i.size for i, _, _ in batches)
    sent = [_send(np, plan, i, o, w, B, max_bag, n=n) for i, o, w in batches]
    assert all(not f.any() for f, *_ in sent)
    layout = sent[0][4]
    for owner in range(world):
        if not plan.shards_of(owner):
            continue
        offsets, idx, w = _receive(np, plan, [s[2] for s in sent], [s[3] for s in sent], B,
                                   owner, layout)
        lengths, want = _expected(plan, [(i, o) for i, o, _ in batches], B, owner)
        np.testing.assert_array_equal(np.diff(offsets), lengths)
        np.testing.assert_array_equal(idx[:want.size], want)
        assert not idx[want.size:].any() and not w[want.size:].any()  # padding


def test_mean_pooling_weights_divide_by_the_whole_bag():
    plan = _plan(2, ("b",))
    rng = np.random.default_rng(5)
    idx, off, w = _batch(rng, 3, 4)
    *_, w_msg, layout = _send(np, plan, idx, off, w, 3, 0, mean=True)
    flags, counts, msg, w_plain, _ = _send(np, plan, idx, off, w, 3, 0)
    lengths = np.maximum(np.diff(off), 1)
    bag = np.searchsorted(off[1:], np.arange(idx.size), side="right")
    want = (w * (np.float32(1) / lengths[bag].astype(np.float32))).astype(np.float32)
    assert sorted(w_msg[w_msg != 0].tolist()) == sorted(want[want != 0].tolist())
    assert sorted(w_plain[w_plain != 0].tolist()) == sorted(w[w != 0].tolist())


def test_bad_batches_send_only_bad_lookups_or_nothing():
    plan = _plan(2, ("b",))
    rng = np.random.default_rng(7)
    idx, off, w = _batch(rng, 4, 3, bad_index=True)
    flags, counts, msg, _, _ = _send(np, plan, idx, off, w, 4, 0)
    assert flags.tolist() == [0, 1]
    assert counts.sum() == 1  # the bad lookup alone travels, and its owner refuses it
    # local to the shard it was sent to (b's second half starts at row 15)
    assert (msg == 10_000).sum() + (msg == 10_000 - 15).sum() == 1
    good = _batch(rng, 4, 3)
    flags, counts, *_ = _send(np, plan, *good[:2], good[2], 4, 0, any_bad_of_others=1)
    assert flags.tolist() == [0, 0] and counts.sum() == 0  # another rank's bad batch
    off_bad = good[1].copy()
    off_bad[-1] += 1  # not ending at n
    flags, counts, msg, _, _ = _send(np, plan, good[0], off_bad, good[2], 4, 0)
    assert flags[0] == 1 and counts.sum() == 0 and not msg.any()
    long_bag = _batch(rng, 4, 3)
    flags, *_ = _send(np, plan, *long_bag[:2], long_bag[2], 4, 1)
    assert flags[0] == int((np.diff(long_bag[1]) > 1).any())


@pytest.mark.gpu
@pytest.mark.parametrize("world,row_wise,B,max_len,max_bag", CASES)
@pytest.mark.parametrize("case", ["good", "bad index", "other rank bad", "bad offsets",
                                  "mean"])
def test_kernels_match_the_reference(world, row_wise, B, max_len, max_bag, case):
    if not xferlib.cupy_available():
        pytest.skip(GPU_SKIP_REASON)
    import cupy

    plan = _plan(world, row_wise)
    rng = np.random.default_rng(world * 7 + B)
    batches = [_batch(rng, B, max_len, bad_index=case == "bad index") for _ in range(world)]
    if case == "bad offsets":
        i, o, w = batches[0]
        o = o.copy()
        o[-1] += 2
        batches[0] = (i, o, w)
    others = 1 if case == "other rank bad" else 0
    mean = case == "mean"
    n = max(i.size for i, _, _ in batches)
    sent = {xp: [_send(xp, plan, i, o, w, B, max_bag, others, mean, n=n)
                 for i, o, w in batches] for xp in (np, cupy)}
    for a, b in zip(sent[np], sent[cupy]):
        for x, y in zip(a[:4], b[:4]):
            np.testing.assert_array_equal(x, y)
    if case in ("bad index", "bad offsets") and n:
        assert any(s[0].any() for s in sent[np])  # the case is what it says
    layout = sent[np][0][4]
    for owner in range(world):
        if not plan.shards_of(owner):
            continue
        got = [_receive(xp, plan, [s[2] for s in sent[xp]], [s[3] for s in sent[xp]], B,
                        owner, layout) for xp in (np, cupy)]
        for x, y in zip(*got):
            np.testing.assert_array_equal(x, y)


def test_plans_the_kernels_cannot_index_by_are_refused():
    plan = _plan(2, ("b",))
    shards = list(plan.shards)
    gap = dataclasses.replace(shards[1], row_start=shards[1].row_start + 1)
    for bad, why in (([shards[1], shards[0], *shards[2:]], "order"),
                     ([shards[0], gap, *shards[2:]], "order"),
                     ([dataclasses.replace(shards[0], rank=5), *shards[1:]], "ranks"),
                     (shards[:-1], "cover")):
        with pytest.raises(ValueError, match=why):
            exchange_routes(dataclasses.replace(plan, shards=tuple(bad)))


def test_garbage_offsets_whose_differences_wrap_are_bad():
    plan = _plan(1)
    routes = exchange_routes(plan)
    off = np.array([0, 2 ** 62, -2 ** 63, -1, 0, 0, 0, 0, 0], dtype=np.int64)  # T=4, B=2
    flags = np.zeros(2, dtype=np.uint64)
    check_lookups(np.zeros(0, dtype=np.int64), off, 2, routes, 0, flags)
    assert flags[0] == 1
