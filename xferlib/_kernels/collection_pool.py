"""The embedding collection's pooled lookup: each bag's rows summed in registers (no buffer of
one row per lookup), read from its table in HBM or from the host rows the forward staged,
written once to the bag's columns of the pooled output. Part of the collection's kernel module
(``collection.py``), launched by ``xferlib/collection/device.py`` after the batch's plan.

Two kernels, by the batch's shape (:func:`pool_kernel`): ``coll_pool`` gives a bag of several
lookups a lane group that first finds up to a group's worth of its lookups' rows at once (one
load a lane) and then keeps four row loads in flight; ``coll_pool_pairs`` gives a lane group
two neighbouring bags of about one lookup each (DLRM's features), one row of each in flight.
A lane group is a power of two up to 32 lanes, as many as the widest row needs vectors (a
64-wide float row fills 16, so a warp takes two groups instead of leaving half its lanes
idle). Rows are added in bag order whatever the kernel.

A refused batch's bags are written as zeros (no row read): a caller that learns of the
refusal later (a sharded step, a CUDA graph) passes on zeros, not whatever the buffer held.
No grid-stride loop (the launch covers every bag): fewer live registers, more warps resident.
`verdict_host` (when given): the verdict's pinned host slot, written by the first block (the
verdict is final: no kernel after this one writes it), in place of a launch of its own
(``xferlib/checks.py``).
"""

from __future__ import annotations

from xferlib._kernels._declare import KernelDecl

__all__ = ["POOL", "POOL_PAIRS", "POOL_HELPERS", "pool_kernel"]

_ARGS = (("const T*", "hbm"), ("const i64*", "meta"), ("const K*", "indices"),
         ("const i64*", "offsets"), ("const T*", "psw"), ("const i64*", "inv"),
         ("const T*", "staged"), ("i64", "stage_width"), ("i64", "n"), ("i64", "bags"),
         ("i64", "B"), ("int", "mean"), ("T*", "out"), ("i64", "total_dim"), ("int", "group"),
         ("const unsigned long long*", "verdict"), ("unsigned long long*", "verdict_host"))

# What both kernels know of a bag, and where one of its lookups' row starts.
POOL_HELPERS = r"""
template <typename T> struct PoolBag {
    i64 lo, len, dim, row_width, rows;
    bool host;
    const T* table;
    T* dst;
};

// Bag `bag` (or, for `real` false, a bag of no lookups and no columns: the odd one out of a
// pair); `refused`: the batch's verdict refused it (nothing read).
template <typename T>
__device__ __forceinline__ PoolBag<T> pool_bag(const T* hbm, const i64* meta,
                                               const i64* offsets, i64 bag, bool real,
                                               bool refused, i64 n, i64 bags, i64 B, T* out,
                                               i64 total_dim) {
    // the table of a bag: a 32-bit division where the sizes allow (the common case)
    const i64 t = bags <= 0x7fffffffLL ? (i64)((unsigned)bag / (unsigned)B) : bag / B;
    const i64* m = meta + t * COLL_META;
    PoolBag<T> b;
    i64 hi;
    bag_range(offsets, bag, n, b.lo, hi);
    b.len = refused || !real ? 0 : hi - b.lo;
    b.dim = real ? m[M_DIM] : 0;
    b.row_width = m[M_ROW_WIDTH];
    b.rows = m[M_NUM_ROWS];
    b.host = m[M_HOST] != 0;
    b.table = hbm + m[M_BASE];
    b.dst = out + (bag - t * B) * total_dim + m[M_D_OFF];
    return b;
}

// The first element of lookup l's row: its staged copy (a host table's; `inv`: the lookup's
// distinct row) or its table's row in HBM, either clamped into its array.
template <typename T, typename K>
__device__ __forceinline__ const T* pool_row(const PoolBag<T>& b, i64 l, const K* indices,
                                             const i64* inv, const T* staged, i64 stage_width,
                                             i64 n) {
    if (b.host) {
        i64 r = inv[l];
        r = r < 0 ? 0 : (r >= n ? n - 1 : r);
        return staged + r * stage_width;
    }
    i64 k = (i64)indices[l];
    k = k < 0 ? 0 : (k >= b.rows ? b.rows - 1 : k);
    return b.table + k * b.row_width;
}

// A lookup's row added to a bag's sum (times its factor `s` where lookups are weighted or
// the bags averaged).
template <int V, typename T>
__device__ __forceinline__ void pool_add(T (&acc)[V], const vec<T, V>& row, T s, const T* psw,
                                         int mean) {
    #pragma unroll
    for (int q = 0; q < V; ++q) acc[q] += psw != nullptr || mean ? row.v[q] * s : row.v[q];
}

// The verdict's two words written to its pinned host slot (when given) by the first block.
__device__ __forceinline__ void pool_copy_verdict(const unsigned long long* verdict,
                                                  unsigned long long* verdict_host) {
    if (verdict_host != nullptr && blockIdx.x == 0 && threadIdx.x < 2)
        verdict_host[threadIdx.x] = verdict[threadIdx.x];
}

template <int V, typename T>
__device__ __forceinline__ void pool_store(T* dst, const T (&acc)[V]) {
    vec<T, V> o;
    #pragma unroll
    for (int q = 0; q < V; ++q) o.v[q] = acc[q];
    *reinterpret_cast<vec<T, V>*>(dst) = o;
}
"""

POOL = KernelDecl(
    "coll_pool", "template <int V, typename T, typename K>", _ARGS,
    r"""
    // A group of `group` lanes per bag, its lookups taken `group` at a time: lane j first
    // finds lookup j's row and factor, then the group walks them with each at hand from a
    // shuffle, U row loads in flight. A bag of 16 lookups so waits on five loads in turn,
    // not on an index and then a row for every two lookups (one H200, 8M x 128, 4,096 bags
    // of 16: 10.8 us against 11.8).
    pool_copy_verdict(verdict, verdict_host);
    constexpr int U = 4;
    const int lane = threadIdx.x & (group - 1);
    // the group's lanes in the warp (the same trips for all: shuffles among them)
    const unsigned mine = group == 32 ? 0xffffffffu
        : ((1u << group) - 1u) << ((threadIdx.x & 31) & ~(group - 1));
    const i64 bag = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / group;
    if (bag >= bags) return;
    const PoolBag<T> b = pool_bag(hbm, meta, offsets, bag, true, rejected(verdict), n, bags, B,
                                  out, total_dim);
    for (i64 e0 = 0; e0 < b.dim; e0 += (i64)group * V) {
        const i64 e = e0 + (i64)V * lane;
        T acc[V];
        #pragma unroll
        for (int q = 0; q < V; ++q) acc[q] = (T)0;
        for (i64 c0 = 0; c0 < b.len; c0 += group) {
            const int count = b.len - c0 < group ? (int)(b.len - c0) : group;
            unsigned long long my_src = 0;  // lane j: lookup c0 + j's row and factor
            T my_s = (T)0;
            if (lane < count) {
                const i64 l = b.lo + c0 + lane;
                my_src = reinterpret_cast<unsigned long long>(
                    pool_row(b, l, indices, inv, staged, stage_width, n));
                my_s = lookup_scale<T>(psw, l, mean, b.len);
            }
            for (int k0 = 0; k0 < count; k0 += U) {
                vec<T, V> row[U];
                T s[U];
                #pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int k = k0 + u < count ? k0 + u : count - 1;
                    const T* src = reinterpret_cast<const T*>(__shfl_sync(mine, my_src, k, group));
                    s[u] = __shfl_sync(mine, my_s, k, group);
                    if (k0 + u < count && e < b.dim)
                        row[u] = *reinterpret_cast<const vec<T, V>*>(src + e);
                }
                #pragma unroll
                for (int u = 0; u < U; ++u)
                    if (k0 + u < count && e < b.dim)
                        pool_add<V, T>(acc, row[u], s[u], psw, mean);
            }
        }
        if (e < b.dim) pool_store<V, T>(b.dst + e, acc);
    }""", launch_bounds="__launch_bounds__(256, 4)")  # 64 registers

POOL_PAIRS = KernelDecl(
    "coll_pool_pairs", "template <int V, typename T, typename K>", _ARGS,
    r"""
    // A group of `group` lanes per two neighbouring bags, a row of each in flight (bags of
    // about one lookup: DLRM's features; an H200, 26 tables x 64, 425,984 bags of one: 83
    // us against 96 with one bag a group). No lane waits on another (no shuffles), so the
    // groups of a warp may part ways.
    pool_copy_verdict(verdict, verdict_host);
    const bool refused = rejected(verdict);
    const int lane = threadIdx.x & (group - 1);
    const i64 bag0 = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / group * 2;
    if (bag0 >= bags) return;
    PoolBag<T> b[2];
    #pragma unroll
    for (int x = 0; x < 2; ++x) {  // the last group of an odd count has one bag
        const bool real = bag0 + x < bags;
        b[x] = pool_bag(hbm, meta, offsets, real ? bag0 + x : bag0, real, refused, n, bags, B,
                        out, total_dim);
    }
    const i64 dmax = b[0].dim > b[1].dim ? b[0].dim : b[1].dim;
    const i64 most = b[0].len > b[1].len ? b[0].len : b[1].len;
    for (i64 e = (i64)V * lane; e < dmax; e += (i64)group * V) {
        T acc[2][V];
        #pragma unroll
        for (int x = 0; x < 2; ++x)
            #pragma unroll
            for (int q = 0; q < V; ++q) acc[x][q] = (T)0;
        for (i64 k = 0; k < most; ++k) {
            vec<T, V> row[2];
            T s[2];
            #pragma unroll
            for (int x = 0; x < 2; ++x) {
                const i64 l = b[x].lo + k;
                s[x] = (T)0;
                if (k < b[x].len && e < b[x].dim) {
                    row[x] = *reinterpret_cast<const vec<T, V>*>(
                        pool_row(b[x], l, indices, inv, staged, stage_width, n) + e);
                    s[x] = lookup_scale<T>(psw, l, mean, b[x].len);
                }
            }
            #pragma unroll
            for (int x = 0; x < 2; ++x)
                if (k < b[x].len && e < b[x].dim)
                    pool_add<V, T>(acc[x], row[x], s[x], psw, mean);
        }
        #pragma unroll
        for (int x = 0; x < 2; ++x)
            if (e < b[x].dim) pool_store<V, T>(b[x].dst + e, acc[x]);
    }""", launch_bounds="__launch_bounds__(256, 4)")  # 64 registers


def pool_kernel(n: int, bags: int) -> tuple:
    """The pooled lookup's kernel for ``n`` lookups in ``bags`` bags and the bags each lane
    group takes: ``coll_pool_pairs`` and two where bags average under two lookups, else
    ``coll_pool`` and one.

    >>> [(k.name, nb) for k, nb in (pool_kernel(425_984, 425_984), pool_kernel(65_536, 4_096))]
    [('coll_pool_pairs', 2), ('coll_pool', 1)]
    """
    return (POOL_PAIRS, 2) if n < 2 * bags else (POOL, 1)
