"""A sharded collection's lookup exchange with fixed-size messages (``xferlib/collection/
exchange.py`` launches these; ``adapters/torch/collection_dist.py`` is the caller).

A rank's batch is in FBGEMM's layout (``T * B`` bags, table by table). Each lookup goes to the
shard holding its row: ``table_shard0[t] .. table_shard0[t + 1]`` are table ``t``'s shards
(the plan's order, rows ascending), ``shard_row0`` their first rows and ``shard_slot`` their
``owner * S + place`` (``S`` slots per owner). Owner ``o``'s message starts at
``msg_base[o]``: ``S x B`` bag lengths (slot-major), then ``caps[o]`` lookup slots holding its
lookups in (slot, bag) order, the rest zero.

``XCH_CHECK`` flags bad offsets (not starting at 0, decreasing, not ending at ``n``, a bag
longer than ``max_bag``) and indices out of their table's range; ``XCH_COUNT`` counts the
lookups sent to each (slot, sample); the caller scans the counts; ``XCH_PACK`` writes the
headers and each sent lookup (its index local to its shard, and its weight) at its place (a
thread a lookup for tables held whole, a thread a bag for tables split by rows).
What is sent: nothing when this rank's offsets are bad, else every lookup, or only the bad
ones when any rank's batch was bad (``any_bad``, summed over the ranks), so an owner refuses
them and no table changes. ``XCH_UNPACK`` lays an owner's received messages out as one
padded batch, table by table, each table's bags rank after rank.

A lookup's bag is found by binary search over the offsets (as ``searchsorted``), clamped, so
garbage offsets route harmlessly; every position written is bounded by its array.
"""

from __future__ import annotations

from xferlib._kernels._declare import KernelDecl
from xferlib._kernels._registry import KernelModule
from xferlib._kernels.collection import BAG_RANGE

__all__ = ["XCH_CHECK", "XCH_COUNT", "XCH_PACK", "XCH_UNPACK", "EXCHANGE_KERNEL",
           "EXCHANGE_MODULE", "exchange_module"]

_HEAD = r"""
typedef long long i64;
typedef unsigned long long u64;

// The bag of lookup l: the number of bag ends (offsets[1..nb]) at or before l, clamped to
// the last bag (searchsorted(offsets[1:], l, right=True)).
__device__ __forceinline__ i64 bag_of(const i64* off, i64 nb, i64 l) {
    i64 lo = 0, hi = nb;
    while (lo < hi) {
        const i64 mid = (lo + hi) >> 1;
        if (off[mid + 1] <= l) lo = mid + 1; else hi = mid;
    }
    return lo < nb ? lo : nb - 1;
}

// Where lookup l goes: its shard (the table's last shard starting at or below its row,
// the row clamped into the table) and its index local to that shard (an index out of range
// stays out of the shard's range, so the owner refuses it).
struct Route { i64 shard; i64 local; int bad; };

__device__ __forceinline__ Route route_of(const i64* idx, i64 l, i64 t, const i64* table_rows,
                                          const i64* table_shard0, const i64* shard_row0) {
    Route r;
    const i64 v = idx[l], rows = table_rows[t];
    r.bad = v < 0 || v >= rows;
    const i64 row = v < 0 ? 0 : (v >= rows ? rows - 1 : v);
    i64 s = table_shard0[t];
    const i64 end = table_shard0[t + 1];
    while (s + 1 < end && shard_row0[s + 1] <= row) ++s;
    r.shard = s;
    r.local = v - shard_row0[s];
    return r;
}

// Whether lookup l travels: not when this rank's offsets are bad; only a bad lookup when
// any rank's batch was bad.
__device__ __forceinline__ bool sent(int bad, u64 bad_offsets, i64 any_bad) {
    return bad_offsets == 0 && (any_bad == 0 || bad);
}

// Lookup l (bag g, routed r), the rank-th of its bag sent to its shard: its local index (and
// weight) at its place in its owner's room, after the (slot, sample)s before it there.
template <typename W>
__device__ __forceinline__ void place_lookup(
        const Route& r, i64 l, i64 g, i64 rank, i64 B, i64 S, i64 head, const i64* shard_slot,
        const i64* counts, const i64* scan, const i64* msg_base, const i64* caps, i64* msg,
        const i64* off, const W* psw, int mean, const i64* w_base, W* w_msg) {
    const i64 slot = shard_slot[r.shard], o = slot / S;
    const i64 e = slot * B + g % B;
    const i64 owner_first = o == 0 ? 0 : scan[o * head - 1];
    const i64 place = scan[e] - counts[e] - owner_first + rank;
    if (place < 0 || place >= caps[o]) return;
    msg[msg_base[o] + head + place] = r.local;
    if (w_msg != nullptr) {
        const i64 len = off[g + 1] - off[g];
        W w = psw != nullptr ? psw[l] : (W)1;
        if (mean) {
            const W inv = (W)1 / (W)(len < 1 ? 1 : len);
            w = psw != nullptr ? w * inv : inv;
        }
        w_msg[w_base[o] + place] = w;
    }
}
"""

_ROUTE_ARGS = (("const i64*", "idx"), ("i64", "n"), ("const i64*", "off"), ("i64", "B"),
               ("i64", "T"), ("const i64*", "table_rows"), ("const i64*", "table_shard0"),
               ("const i64*", "shard_row0"))

XCH_CHECK = KernelDecl(
    "xch_check", "",
    _ROUTE_ARGS + (("i64", "max_bag"), ("u64*", "flags")),
    r"""
    const i64 nb = T * B;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    const i64 first = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (first == 0 && (off[0] != 0 || off[nb] != n)) atomicOr(flags, 1ull);
    for (i64 g = first; g < nb; g += stride) {
        // compared, not subtracted first: the difference of garbage offsets can wrap
        if (off[g + 1] < off[g] || (max_bag > 0 && off[g + 1] - off[g] > max_bag))
            atomicOr(flags, 1ull);
    }
    if (nb == 0) return;
    for (i64 l = first; l < n; l += stride) {
        const i64 t = bag_of(off, nb, l) / B;
        const i64 v = idx[l];
        if (v < 0 || v >= table_rows[t]) atomicOr(flags + 1, 1ull);
    }
""")

XCH_COUNT = KernelDecl(
    "xch_count", "",
    _ROUTE_ARGS + (("const i64*", "shard_slot"), ("const unsigned long long*", "flags"),
                   ("const i64*", "any_bad"), ("long long*", "counts")),
    r"""
    const i64 nb = T * B;
    if (nb == 0 || flags[0] != 0) return;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 l = (i64)blockIdx.x * blockDim.x + threadIdx.x; l < n; l += stride) {
        const i64 g = bag_of(off, nb, l);
        const Route r = route_of(idx, l, g / B, table_rows, table_shard0, shard_row0);
        if (sent(r.bad, flags[0], any_bad[0]))
            atomicAdd(reinterpret_cast<unsigned long long*>(counts + shard_slot[r.shard] * B
                                                            + g % B), 1ull);
    }
""")

XCH_PACK = KernelDecl(
    "xch_pack", "template <typename W>",
    _ROUTE_ARGS + (("const i64*", "shard_slot"), ("const unsigned long long*", "flags"),
                   ("const i64*", "any_bad"), ("const i64*", "counts"),
                   ("const i64*", "scan"), ("i64", "S"), ("i64", "world"),
                   ("const i64*", "msg_base"), ("const i64*", "caps"), ("i64*", "msg"),
                   ("const W*", "psw"), ("int", "mean"), ("const i64*", "w_base"),
                   ("W*", "w_msg")),
    r"""
    const i64 nb = T * B;
    const i64 head = S * B;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    const i64 first = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    // the headers: every owner's (slot, sample) lookup counts
    for (i64 e = first; e < world * head; e += stride)
        msg[msg_base[e / head] + e % head] = counts[e];
    if (nb == 0 || flags[0] != 0) return;
    const i64 any = any_bad[0];
    // Lookups of tables held whole, in a batch sent whole: a thread each, its rank in its
    // bag's lookups to that shard its place in the bag.
    if (any == 0) {
        for (i64 l = first; l < n; l += stride) {
            const i64 g = bag_of(off, nb, l);
            const i64 t = g / B;
            if (table_shard0[t + 1] - table_shard0[t] != 1) continue;
            const Route r = route_of(idx, l, t, table_rows, table_shard0, shard_row0);
            place_lookup(r, l, g, off[g] < 0 ? 0 : l - off[g], B, S, head, shard_slot,
                         counts, scan, msg_base, caps, msg, off, psw, mean, w_base, w_msg);
        }
    }
    // Bags of tables split by rows, or every bag of a bad batch (only its bad lookups
    // travel): a thread walks a bag once per shard of its table, numbering the bag's
    // lookups to that shard in order (shards x bag length, not bag length squared).
    for (i64 g = first; g < nb; g += stride) {
        const i64 t = g / B;
        const i64 s0 = table_shard0[t], s1 = table_shard0[t + 1];
        if (any == 0 && s1 - s0 == 1) continue;
        i64 lo, hi;
        bag_range(off, g, n, lo, hi);
        for (i64 s = s0; s < s1; ++s) {
            i64 rank = 0;
            for (i64 l = lo; l < hi; ++l) {
                const Route r = route_of(idx, l, t, table_rows, table_shard0, shard_row0);
                if (r.shard != s || !sent(r.bad, flags[0], any)) continue;
                place_lookup(r, l, g, rank++, B, S, head, shard_slot, counts, scan,
                             msg_base, caps, msg, off, psw, mean, w_base, w_msg);
            }
        }
    }
""")

XCH_UNPACK = KernelDecl(
    "xch_unpack", "template <typename W>",
    (("const i64*", "received"), ("i64", "world"), ("i64", "row"), ("i64", "head"),
     ("i64", "room"), ("i64", "T_me"), ("i64", "B"), ("const i64*", "scan"),
     ("const i64*", "offsets"), ("i64*", "idx_out"), ("const W*", "w_received"),
     ("W*", "w_out")),
    r"""
    // entry e = (k, r, b): table k's bag b from rank r, whose lookups sit in rank r's room at
    // its header's exclusive scan and go to offsets[e] of the owner's batch
    const i64 total = world * room;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < T_me * world * B;
         e += stride) {
        const i64 k = e / (world * B), r = (e / B) % world, b = e % B;
        const i64 h = k * B + b;
        i64 len = received[r * row + h];
        // scan: one inclusive sum over every rank's lengths, rank after rank
        const i64 rank_first = r == 0 ? 0 : scan[r * T_me * B - 1];
        const i64 src = scan[r * T_me * B + h] - len - rank_first;
        const i64 dst = offsets[e];
        if (len < 0 || src < 0 || dst < 0 || src >= room || dst >= total) continue;
        if (len > room - src) len = room - src;  // subtracted: a garbage len cannot wrap
        if (len > total - dst) len = total - dst;
        for (i64 j = 0; j < len; ++j) {
            idx_out[dst + j] = received[r * row + head + src + j];
            if (w_out != nullptr) w_out[dst + j] = w_received[r * room + src + j];
        }
    }
""")

_TYPES = ("float", "double")

EXCHANGE_KERNEL = _HEAD + BAG_RANGE + "".join(d.source() for d in (XCH_CHECK, XCH_COUNT, XCH_PACK,
                                                          XCH_UNPACK))
EXCHANGE_MODULE = KernelModule(
    "exchange", EXCHANGE_KERNEL,
    (XCH_CHECK.instance(), XCH_COUNT.instance(),
     *(XCH_PACK.instance(w) for w in _TYPES), *(XCH_UNPACK.instance(w) for w in _TYPES)))


def exchange_module() -> KernelModule:
    return EXCHANGE_MODULE
