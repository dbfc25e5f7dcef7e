"""A sharded collection's lookup exchange with fixed-size messages, on the GPU in a few
kernels (``xferlib/_kernels/exchange.py``) and in NumPy as their reference.

A rank routes its batch (FBGEMM's layout, ``T * B`` bags) to the owners of the shards of a
:class:`~xferlib.collection.ShardingPlan`: :func:`check_lookups` flags bad offsets and
indices, the ranks sum the flags (the caller's collective), :func:`count_lookups` counts the
lookups each (owner slot, sample) receives, the caller scans the counts (an inclusive
cumulative sum), and :func:`pack_lookups` writes each owner's message: ``S x B`` bag lengths,
then its room of lookups (indices local to their shard) in (slot, bag) order. An owner lays
the messages it received out as one padded batch with :func:`unpack_lookups` (the caller
scans the lengths first). Nothing is read back on the host: a step with its collectives can
be captured in a CUDA graph. Every output is written into arrays the caller allocated
(zeroed where a function says so), so a capture allocates nothing here.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from xferlib._backend import array_module, as_cupy_stream

__all__ = ["ExchangeRoutes", "exchange_routes", "check_lookups", "count_lookups",
           "pack_lookups", "unpack_lookups"]

_THREADS, _MAX_BLOCKS = 256, 4096


@dataclasses.dataclass(frozen=True)
class ExchangeRoutes:
    """Where a plan's lookups go (int64 arrays, NumPy or CuPy): ``table_rows[T]``,
    ``table_shard0[T + 1]`` (table ``t``'s shards are ``table_shard0[t]`` up to
    ``table_shard0[t + 1]``, rows ascending), ``shard_row0`` (each shard's first row of its
    table), ``shard_slot`` (``owner * slots + the shard's place there``); ``slots`` per
    owner, ``world`` ranks."""

    table_rows: object
    table_shard0: object
    shard_row0: object
    shard_slot: object
    slots: int
    world: int


def exchange_routes(plan, xp=np, asarray=None) -> ExchangeRoutes:
    """The :class:`ExchangeRoutes` of ``plan`` (its shards are sorted by table, then row), as
    arrays of ``xp`` (or made by ``asarray(list)``)."""
    make = asarray or (lambda v: xp.asarray(np.asarray(v, dtype=np.int64)))
    world = plan.world_size
    _check_plan(plan)
    place = {s: k for r in range(world) for k, s in enumerate(plan.shards_of(r))}
    slots = max(1, max(len(plan.shards_of(r)) for r in range(world)))
    first = np.zeros(len(plan.tables) + 1, dtype=np.int64)
    for s in plan.shards:
        first[s.table_index + 1] += 1
    return ExchangeRoutes(
        make([c.num_rows for c in plan.tables]), make(np.cumsum(first).tolist()),
        make([s.row_start for s in plan.shards]),
        make([s.rank * slots + place[s] for s in plan.shards]), slots, world)


def _check_plan(plan) -> None:
    """The kernels index by the plan: every table's shards in order, covering its rows from
    0 without a gap, each on a rank of the group (a hand-made plan is checked here)."""
    at = [0] * len(plan.tables)
    last = (-1, -1)
    for s in plan.shards:
        if not 0 <= s.table_index < len(plan.tables) or not 0 <= s.rank < plan.world_size:
            raise ValueError(f"shard {s.local_name}: table {s.table_index} or rank {s.rank} "
                             f"outside the plan's {len(plan.tables)} tables and "
                             f"{plan.world_size} ranks")
        if (s.table_index, s.row_start) <= last or s.row_start != at[s.table_index] \
                or s.row_stop <= s.row_start:
            raise ValueError(f"shard {s.local_name}: the plan's shards must be in table and "
                             f"row order, each table's rows covered from 0 without a gap")
        last, at[s.table_index] = (s.table_index, s.row_start), s.row_stop
    uncovered = [c.name for c, stop in zip(plan.tables, at) if stop != c.num_rows]
    if uncovered:
        raise ValueError(f"the plan's shards do not cover every row of {uncovered}")


def _require(name, a, dtypes, size=None) -> None:
    """What the kernels read as dense arrays of one type, checked before a launch."""
    if a is None:
        return
    if a.dtype not in dtypes or not a.flags.c_contiguous or (size is not None and
                                                             a.size < size):
        raise ValueError(f"{name}: needs a C-contiguous array of {[str(d) for d in dtypes]}"
                         + (f" with at least {size} values" if size is not None else "")
                         + f", got {a.dtype} {a.shape}")


_I64, _U64, _FLOATS = (np.dtype(np.int64),), (np.dtype(np.int64), np.dtype(np.uint64)), \
    (np.dtype(np.float32), np.dtype(np.float64))


def _route_args(indices, offsets, B, routes):
    _require("indices", indices, _I64)
    _require("offsets", offsets, _I64, 1)
    return dict(idx=indices, n=indices.size, off=offsets, B=B,
                T=(offsets.size - 1) // B if B else 0, table_rows=routes.table_rows,
                table_shard0=routes.table_shard0, shard_row0=routes.shard_row0)


def _grid(n):
    from xferlib._kernels._registry import grid_1d

    return grid_1d(max(int(n), 1), _THREADS, _MAX_BLOCKS)


def _module():
    from xferlib._kernels.exchange import exchange_module

    return exchange_module()


# ---------------------------------------------------------------------- NumPy reference

def _bags(offsets, n, nb):
    """Each lookup's bag, as ``searchsorted(offsets[1:], l, right=True)`` clamped."""
    return np.minimum(np.searchsorted(offsets[1:], np.arange(n), side="right"),
                      max(nb - 1, 0))


def _routes_np(indices, t, routes):
    rows = np.asarray(routes.table_rows)[t]
    bad = (indices < 0) | (indices >= rows)
    row = np.clip(indices, 0, rows - 1)
    first, row0 = np.asarray(routes.table_shard0), np.asarray(routes.shard_row0)
    shard = first[t].copy()
    for k in range(len(shard)):  # the table's last shard starting at or below the row
        while shard[k] + 1 < first[t[k] + 1] and row0[shard[k] + 1] <= row[k]:
            shard[k] += 1
    return shard, indices - row0[shard], bad


def _sent_lookups(indices, offsets, B, routes, flags, any_bad):
    """Each lookup's ``(bag, shard, local index, sent?)``; None when nothing is sent (no bags,
    or this rank's offsets are bad). Only bad lookups are sent when any rank had some."""
    nb = offsets.size - 1
    if not nb or int(flags[0]):
        return None
    bag = _bags(offsets, indices.size, nb)
    shard, local, bad = _routes_np(indices, bag // B, routes)
    return bag, shard, local, (int(any_bad[0]) == 0) | bad


# ---------------------------------------------------------------------- the steps

def check_lookups(indices, offsets, B: int, routes: ExchangeRoutes, max_bag_size: int,
                  flags, *, stream=None) -> None:
    """Set ``flags[0]`` (uint64, zeroed by the caller) for bad offsets (not from 0 to ``n``,
    decreasing, a bag longer than ``max_bag_size`` when it is > 0) and ``flags[1]`` for an
    index outside its table."""
    xp = array_module(indices)
    if xp is not np:
        args = _route_args(indices, offsets, B, routes)
        _require("flags", flags, _U64, 2)
        from xferlib._kernels.exchange import XCH_CHECK

        XCH_CHECK.launch(_module(), (), *_grid(max(indices.size, offsets.size)),
                         stream=as_cupy_stream(stream), max_bag=max_bag_size, flags=flags,
                         **args)
        return
    n, nb = indices.size, offsets.size - 1
    # compared, not subtracted first: the difference of garbage offsets can wrap
    if offsets[0] != 0 or offsets[-1] != n or (offsets[1:] < offsets[:-1]).any() or \
            (max_bag_size > 0 and (np.diff(offsets) > max_bag_size).any()):
        flags[0] = 1
    if nb and n:
        t = _bags(offsets, n, nb) // B
        if ((indices < 0) | (indices >= np.asarray(routes.table_rows)[t])).any():
            flags[1] = 1


def count_lookups(indices, offsets, B: int, routes: ExchangeRoutes, flags, any_bad, counts, *,
                  stream=None) -> None:
    """Add to ``counts`` (int64, ``world x slots x B``, zeroed by the caller) each sent
    lookup at its (owner slot, sample). ``any_bad``: the ranks' summed flags (one int64)."""
    xp = array_module(indices)
    if xp is not np:
        _require("counts", counts, _I64, routes.world * routes.slots * B)
        from xferlib._kernels.exchange import XCH_COUNT

        XCH_COUNT.launch(_module(), (), *_grid(indices.size), stream=as_cupy_stream(stream),
                         shard_slot=routes.shard_slot, flags=flags, any_bad=any_bad,
                         counts=counts, **_route_args(indices, offsets, B, routes))
        return
    sent = _sent_lookups(indices, offsets, B, routes, flags, any_bad)
    if sent is not None:
        bag, shard, _, go = sent
        np.add.at(counts, np.asarray(routes.shard_slot)[shard[go]] * B + bag[go] % B, 1)


def pack_lookups(indices, offsets, B: int, routes: ExchangeRoutes, flags, any_bad, counts,
                 scan, msg_base, caps, msg, *, weights=None, mean: bool = False,
                 w_base=None, w_msg=None, stream=None) -> None:
    """Write each owner's message into ``msg`` (int64, zeroed by the caller): at
    ``msg_base[o]`` the ``slots x B`` counts of owner ``o``, then its ``caps[o]`` lookup
    places, each sent lookup's index local to its shard at its place in (slot, bag) order
    (``scan``: the inclusive cumulative sum of ``counts``). With ``w_msg`` (zeroed, rooms
    at ``w_base[o]``), each lookup's weight too: ``weights[l]`` (ones without), over its
    bag's length when ``mean``."""
    xp = array_module(indices)
    S, world = routes.slots, routes.world
    if xp is not np:
        from xferlib._kernels.exchange import XCH_PACK

        for name, a in (("counts", counts), ("scan", scan)):
            _require(name, a, _I64, world * S * B)
        # the rooms (caps) are on the device: reading them here would sync (and break a
        # capture), so msg and w_msg must be sized by them, as the caller allocates them
        _require("msg", msg, _I64, world * S * B)
        _require("w_msg", w_msg, _FLOATS)
        if weights is not None and (w_msg is None or weights.dtype != w_msg.dtype):
            raise ValueError("weights need a w_msg of their dtype")
        _require("weights", weights, _FLOATS, indices.size)
        kind = "double" if (w_msg is not None and w_msg.dtype == np.float64) else "float"
        XCH_PACK.launch(_module(), (kind,), *_grid(max(indices.size, counts.size)),
                        stream=as_cupy_stream(stream), shard_slot=routes.shard_slot,
                        flags=flags, any_bad=any_bad, counts=counts, scan=scan, S=S,
                        world=world, msg_base=msg_base, caps=caps, msg=msg, psw=weights,
                        mean=int(mean), w_base=w_base, w_msg=w_msg,
                        **_route_args(indices, offsets, B, routes))
        return
    head = S * B
    for e in range(world * head):
        msg[msg_base[e // head] + e % head] = counts[e]
    sent = _sent_lookups(indices, offsets, B, routes, flags, any_bad)
    if sent is None:
        return
    bag, shard, local, go = sent
    slot = np.asarray(routes.shard_slot)[shard]
    taken = {}  # (shard, bag) -> lookups placed so far
    for l in np.flatnonzero(go):
        g, s = int(bag[l]), int(shard[l])
        rank = taken.get((s, g), 0)
        taken[(s, g)] = rank + 1
        o, e = int(slot[l]) // S, int(slot[l]) * B + g % B
        place = int(scan[e] - counts[e]) - (int(scan[o * head - 1]) if o else 0) + rank
        if not 0 <= place < int(caps[o]):
            continue
        msg[int(msg_base[o]) + head + place] = local[l]
        if w_msg is not None:
            w = w_msg.dtype.type(1) if weights is None else weights[l]
            if mean:
                cast = w_msg.dtype.type
                inv = cast(1) / cast(max(int(offsets[g + 1] - offsets[g]), 1))
                w = inv if weights is None else w * inv
            w_msg[int(w_base[o]) + place] = w


def unpack_lookups(received, B: int, slots: int, room: int, T_me: int, scan, offsets, idx_out,
                   *, w_received=None, w_out=None, stream=None) -> None:
    """An owner's received messages (``received``: ``world`` rows of ``slots x B`` lengths
    then ``room`` lookups) as one padded batch: ``idx_out`` (``world x room``, zeroed by the
    caller) gets table ``k``'s bag ``b`` of rank ``r`` at ``offsets[(k * world + r) * B +
    b]`` (the exclusive scan of the lengths in that order, computed by the caller), the
    rest of it padding; ``scan``: the inclusive cumulative sum of every rank's first ``T_me
    x B`` lengths, rank after rank (one flat scan of ``world x T_me x B``). ``w_out``
    likewise from ``w_received``."""
    xp = array_module(received)
    world = received.shape[0]
    head = slots * B
    if xp is not np:
        from xferlib._kernels.exchange import XCH_UNPACK

        _require("received", received, _I64, world * (head + room))
        _require("scan", scan, _I64, world * T_me * B)
        _require("offsets", offsets, _I64, T_me * world * B + 1)
        _require("idx_out", idx_out, _I64, world * room)
        _require("w_out", w_out, _FLOATS, world * room)
        _require("w_received", w_received, _FLOATS, world * room)
        if (w_out is None) != (w_received is None) or (
                w_out is not None and w_out.dtype != w_received.dtype):
            raise ValueError("w_received and w_out go together, of one dtype")
        kind = "double" if (w_out is not None and w_out.dtype == np.float64) else "float"
        XCH_UNPACK.launch(_module(), (kind,), *_grid(T_me * world * B),
                          stream=as_cupy_stream(stream), received=received, world=world,
                          row=received.shape[1], head=head, room=room, T_me=T_me, B=B,
                          scan=scan, offsets=offsets, idx_out=idx_out,
                          w_received=w_received, w_out=w_out)
        return
    total = world * room
    for e in range(T_me * world * B):
        k, r, b = e // (world * B), (e // B) % world, e % B
        h = k * B + b
        n = int(received[r, h])
        rank_first = int(scan[r * T_me * B - 1]) if r else 0
        src, dst = int(scan[r * T_me * B + h]) - n - rank_first, int(offsets[e])
        if n < 0 or src < 0 or dst < 0:
            continue
        n = min(n, room - src, total - dst)
        idx_out[dst:dst + n] = received[r, head + src:head + src + n]
        if w_out is not None:
            w_out[dst:dst + n] = w_received[r, src:src + n]
