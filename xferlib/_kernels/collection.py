"""Embedding-collection kernels: one pooled lookup and one fused backward + update over
every table of a collection (``xferlib/collection/device.py`` launches them).

A step's lookups arrive in FBGEMM's layout (``indices``; ``offsets``, ``T * B + 1`` bag
boundaries; optional per-sample weights). Each table's place is one row of ``meta``
(``COLL_META`` int64 fields, below). ``coll_plan`` checks every bag and index and gives each
lookup a key unique over the collection (the table's ``key_base`` plus its row) and its bag;
the batch sort (``xferlib/batch.py``) orders the keys and numbers their runs (one run per
distinct row of any table). Rows of host tables are staged into HBM once per distinct row in
sorted order (``coll_stage``: the link's fast access pattern), and ``coll_pool`` gives each
bag a group of lanes (sized to the widest row's vectors: a warp, or part of one) that sums its
rows in registers, read from the table in HBM or from the staged copy: no buffer of one row
per lookup. The backward sums each run's gradients from the pooled gradient in sorted order
in two passes (``coll_sum_chunks`` / ``coll_sum_spans``: deterministic, no atomics, no warp
stuck on a hot row), and ``coll_update`` (``collection_update.py``, one module per rule)
gives each distinct row a group of lanes that runs the table's update rule where the row
lives.

Every kernel bounds every position and row it touches, and writes nothing once the plan's
verdict (two uint64 words) reports a bad bag or index.
"""

from __future__ import annotations

from xferlib._kernels._declare import KernelDecl, defines
from xferlib._kernels._registry import KernelModule
from xferlib._kernels.table import RULE_IDS, TABLE_KERNEL

__all__ = ["COLL_META", "META_FIELDS", "SUM_CHUNK", "PLAN", "STAGE", "POOL", "SUM_CHUNKS",
           "SUM_SPANS", "INIT", "RUNS", "pool_bags", "collection_module",
           "KEY_TYPES", "RULE_IDS", "DTYPE_NAMES", "COLLECTION_HEAD", "vector_widths",
           "c_type"]

# The per-table fields of ``meta`` (int64 each), in order.
META_FIELDS = ("num_rows", "dim", "d_off", "host", "base", "row_width", "state_offset",
               "step_off", "key_base")
COLL_META = len(META_FIELDS)
SUM_CHUNK = 32  # sorted positions per thread in the gradient sums' first pass
KEY_TYPES = {4: "int", 8: "long long"}
_TYPES = {"float32": "float", "float64": "double"}
DTYPE_NAMES = tuple(_TYPES)  # the row dtypes a collection's kernels are built for

# Shared with the exchange kernels (xferlib/_kernels/exchange.py).
BAG_RANGE = r"""
// Bag b's lookups are [offsets[b], offsets[b + 1]), clamped to [0, n] so that even a bag of a
// rejected batch reads inside its arrays.
__device__ __forceinline__ void bag_range(const i64* offsets, i64 b, i64 n, i64& lo, i64& hi) {
    lo = offsets[b]; hi = offsets[b + 1];
    lo = lo < 0 ? 0 : (lo > n ? n : lo);
    hi = hi < lo ? lo : (hi > n ? n : hi);
}
"""

COLLECTION_HEAD = TABLE_KERNEL + defines(
    COLL_META=COLL_META, COLL_SUM_CHUNK=SUM_CHUNK,
    **{f"M_{f.upper()}": k for k, f in enumerate(META_FIELDS)}) + BAG_RANGE + r"""

// A lookup's factor in its bag's sum: its sample weight, over the bag's length for mean.
template <typename T>
__device__ __forceinline__ T lookup_scale(const T* psw, i64 l, int mean, i64 len) {
    T s = psw != nullptr ? psw[l] : (T)1;
    if (mean && len > 0) s /= (T)len;
    return s;
}
"""

PLAN = KernelDecl(
    "coll_plan", "template <typename K, typename O>",
    (("const K*", "indices"), ("const O*", "offsets"), ("i64", "n"), ("i64", "bags"),
     ("i64", "B"), ("const i64*", "meta"), ("int", "padded"), ("const i64*", "total"),
     ("i64", "pad_key"), ("i64*", "keys"), ("i64*", "bag_of"), ("i64*", "offsets64"),
     ("unsigned long long*", "words"), ("int", "group")),
    r"""
    // A group of `group` lanes per bag (a power of two, about the bags' mean length, so
    // that a bag's lookups are read side by side, not one after another by one thread): its
    // bounds (the first bag starts at 0, the last ends at n, or at most n when `padded`,
    // at *total when `padded` gives `total`; none goes back), each index against its own
    // table; every lookup gets its
    // collection-wide key and its bag. A padded batch's tail (from the last bag's end) gets
    // `pad_key` (past every table's keys) and bag -1. words[0]: first bad lookup; words[1]:
    // first bad bag. `offsets64` (int32 offsets): their int64 copy, which the later kernels
    // read (no separate widening launch).
    const i64 stride = (i64)gridDim.x * blockDim.x;
    const i64 thread = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (offsets64 != nullptr && thread == 0) offsets64[bags] = (i64)offsets[bags];
    if (padded) {
        i64 end = (i64)offsets[bags];
        end = end < 0 ? 0 : (end > n ? n : end);
        for (i64 l = end + thread; l < n; l += stride) {
            keys[l] = pad_key;
            bag_of[l] = -1;
        }
    }
    const int lane = threadIdx.x & (group - 1);
    for (i64 b = thread / group; b < bags; b += stride / group) {
        const i64 lo = (i64)offsets[b], hi = (i64)offsets[b + 1];
        if (offsets64 != nullptr && lane == 0) offsets64[b] = lo;
        const bool ok = lo >= 0 && hi >= lo && hi <= n && (b > 0 || lo == 0)
                        && (b < bags - 1 || hi == n
                            || (padded && (total == nullptr || hi == *total)));
        if (!ok) {
            if (lane == 0) atomicMin(&words[1], (unsigned long long)b);
            continue;
        }
        const i64* m = meta + (b / B) * COLL_META;
        const i64 rows = m[M_NUM_ROWS], base = m[M_KEY_BASE];
        for (i64 l = lo + lane; l < hi; l += group) {
            const i64 row = (i64)indices[l];
            const bool good = row >= 0 && row < rows;
            if (!good) atomicMin(&words[0], (unsigned long long)l);
            keys[l] = good ? base + row : base;
            bag_of[l] = b;
        }
    }""")

RUNS = KernelDecl(
    "coll_runs", "template <typename K>",
    (("const i64*", "meta"), ("const K*", "keys"), ("const i64*", "run"),
     ("const i64*", "starts"), ("const i64*", "perm"), ("const i64*", "bag_of"), ("i64", "n"),
     ("i64", "B"), ("i64*", "run_off"), ("int*", "run_tab"), ("i64*", "inv"),
     ("const unsigned long long*", "verdict")),
    r"""
    // A thread per run: where its row lives (elements from its placement's buffer start;
    // -1 when out of range) and its table, so that the row kernels start from one load
    // instead of a chain of four (start, position, bag, table). `inv` (host tables' staged
    // rows): then a thread per sorted position, inv[lookup] = its run (its staged row).
    if (rejected(verdict)) return;
    const i64 runs = n > 0 ? min(run[n - 1] + 1, n) : 0;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 r = (i64)blockIdx.x * blockDim.x + threadIdx.x; r < runs; r += stride) {
        i64 off = -1;
        int tab = 0;
        const i64 j = starts[r];
        const i64 l = j >= 0 && j < n ? perm[j] : -1;
        if (l >= 0 && l < n && bag_of[l] >= 0) {  // bag -1: a padded batch's tail
            tab = (int)(bag_of[l] / B);
            const i64* m = meta + (i64)tab * COLL_META;
            const i64 row = (i64)keys[j] - m[M_KEY_BASE];
            if (row >= 0 && row < m[M_NUM_ROWS]) off = m[M_BASE] + row * m[M_ROW_WIDTH];
        }
        run_off[r] = off;
        run_tab[r] = tab;
    }
    if (inv == nullptr) return;
    for (i64 j = (i64)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride) {
        const i64 l = perm[j];
        if (l >= 0 && l < n) inv[l] = run[j];
    }""")

STAGE = KernelDecl(
    "coll_stage", "template <int V, typename T>",
    (("const T*", "host"), ("const i64*", "meta"), ("const i64*", "run"),
     ("const i64*", "run_off"), ("const int*", "run_tab"), ("i64", "n"), ("const T*", "cache"),
     ("i64", "cache_width"), ("const int*", "slots"), ("T*", "staged"), ("i64", "stage_width"),
     ("int", "full"), ("const unsigned long long*", "verdict")),
    r"""
    // A warp per distinct row: a host table's row copied to staged[r], from its GPU cache
    // slot (slots[r] >= 0) or from host RAM (sorted keys: the link's fast pattern); rows of
    // HBM tables are read in place and skipped. `full`: the whole stored row (weights, state,
    // step count, padding: whole host cache lines), so that the update reads it from HBM and
    // only writes over the link (rows whose state is a few scalars); else the weights (the
    // update then reads full-width state over the link as its writes go the other way).
    if (rejected(verdict)) return;
    const int lane = threadIdx.x & 31;
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    const i64 runs = n > 0 ? min(run[n - 1] + 1, n) : 0;
    for (i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < runs; r += warps) {
        const i64 off = run_off[r];
        const i64* m = meta + (i64)run_tab[r] * COLL_META;
        if (off < 0 || !m[M_HOST]) continue;
        const i64 len = full ? m[M_ROW_WIDTH] : m[M_DIM];
        const int slot = slots != nullptr ? slots[r] : -1;
        const T* src = slot >= 0 ? cache + (i64)slot * cache_width : host + off;
        T* dst = staged + r * stage_width;
        // every load of the row (up to 4 x 32 vectors) in flight before the first store:
        // one trip over the link per row instead of one per 32 vectors
        for (i64 e0 = (i64)V * lane; e0 < len; e0 += 4 * 32 * V) {
            vec<T, V> part[4];
            #pragma unroll
            for (int u = 0; u < 4; ++u)
                if (e0 + u * 32 * V < len)
                    part[u] = *reinterpret_cast<const vec<T, V>*>(src + e0 + u * 32 * V);
            #pragma unroll
            for (int u = 0; u < 4; ++u)
                if (e0 + u * 32 * V < len)
                    *reinterpret_cast<vec<T, V>*>(dst + e0 + u * 32 * V) = part[u];
        }
    }""")

POOL = KernelDecl(
    "coll_pool", "template <int V, int NB, typename T, typename K>",
    (("const T*", "hbm"), ("const i64*", "meta"), ("const K*", "indices"),
     ("const i64*", "offsets"), ("const T*", "psw"), ("const i64*", "inv"),
     ("const T*", "staged"), ("i64", "stage_width"), ("i64", "n"), ("i64", "bags"),
     ("i64", "B"), ("int", "mean"), ("T*", "out"), ("i64", "total_dim"), ("int", "group"),
     ("const unsigned long long*", "verdict")),
    r"""
    // A group of `group` lanes per NB bags (a power of two up to 32, as many as the widest
    // row needs vectors: a 64-wide float row fills 16 lanes, so a warp takes two groups
    // instead of leaving half its lanes idle): each bag's rows summed in registers, added in
    // bag order, written once to out[b, d_off:d_off + dim]. Two row loads in flight per
    // group: two lookups of one bag (NB = 1), or one of each of two neighbouring bags (NB =
    // 2, for bags of about one lookup: DLRM's features; an H200, 26 tables x 64, 425,984 bags
    // of one: 83 us against 96 with one bag a group). A refused batch's bags are written as
    // zeros (no row read): a caller that learns of the refusal later (a sharded step, a CUDA
    // graph) passes on zeros, not whatever the buffer held. No lane waits on another (no
    // shuffles), so groups of a warp may part ways. No grid-stride loop (the launch covers
    // every bag): fewer live registers, more warps resident.
    constexpr int U = 2 / NB;  // lookups of a bag loaded together
    const bool refused = rejected(verdict);
    const int lane = threadIdx.x & (group - 1);
    const i64 bag0 = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / group * NB;
    if (bag0 >= bags) return;
    i64 lo[NB], hi[NB], dim[NB], rw[NB], rows[NB];
    bool host[NB];
    const T* table[NB];
    T* dst[NB];
    #pragma unroll
    for (int x = 0; x < NB; ++x) {
        const bool real = bag0 + x < bags;  // the last group of an odd count has one bag
        const i64 bag = real ? bag0 + x : bag0;
        // the table of a bag: a 32-bit division where the sizes allow (the common case)
        const i64 t = bags <= 0x7fffffffLL ? (i64)((unsigned)bag / (unsigned)B) : bag / B;
        const i64* m = meta + t * COLL_META;
        bag_range(offsets, bag, n, lo[x], hi[x]);
        if (refused || !real) hi[x] = lo[x];
        dim[x] = real ? m[M_DIM] : 0;
        rw[x] = m[M_ROW_WIDTH];
        rows[x] = m[M_NUM_ROWS];
        host[x] = m[M_HOST] != 0;
        table[x] = hbm + m[M_BASE];
        dst[x] = out + (bag - t * B) * total_dim + m[M_D_OFF];
    }
    i64 dmax = dim[0], len = hi[0] - lo[0];
    #pragma unroll
    for (int x = 1; x < NB; ++x) {
        dmax = dim[x] > dmax ? dim[x] : dmax;
        len = hi[x] - lo[x] > len ? hi[x] - lo[x] : len;
    }
    for (i64 e = (i64)V * lane; e < dmax; e += (i64)group * V) {
        T acc[NB][V];
        #pragma unroll
        for (int x = 0; x < NB; ++x)
            #pragma unroll
            for (int q = 0; q < V; ++q) acc[x][q] = (T)0;
        for (i64 k0 = 0; k0 < len; k0 += U) {
            vec<T, V> row[NB][U];
            T s[NB][U];
            #pragma unroll
            for (int u = 0; u < U; ++u)
                #pragma unroll
                for (int x = 0; x < NB; ++x) {
                    const i64 l = lo[x] + k0 + u;
                    s[x][u] = (T)0;
                    if (l < hi[x] && e < dim[x]) {
                        const T* src;
                        if (host[x]) {
                            i64 r = inv[l];
                            r = r < 0 ? 0 : (r >= n ? n - 1 : r);
                            src = staged + r * stage_width;
                        } else {
                            i64 k = (i64)indices[l];
                            k = k < 0 ? 0 : (k >= rows[x] ? rows[x] - 1 : k);
                            src = table[x] + k * rw[x];
                        }
                        row[x][u] = *reinterpret_cast<const vec<T, V>*>(src + e);
                        s[x][u] = lookup_scale<T>(psw, l, mean, hi[x] - lo[x]);
                    }
                }
            #pragma unroll
            for (int u = 0; u < U; ++u)
                #pragma unroll
                for (int x = 0; x < NB; ++x)
                    if (lo[x] + k0 + u < hi[x] && e < dim[x]) {
                        #pragma unroll
                        for (int q = 0; q < V; ++q)
                            acc[x][q] += psw != nullptr || mean ? row[x][u].v[q] * s[x][u]
                                                                : row[x][u].v[q];
                    }
        }
        #pragma unroll
        for (int x = 0; x < NB; ++x)
            if (e < dim[x]) {
                vec<T, V> o;
                #pragma unroll
                for (int q = 0; q < V; ++q) o.v[q] = acc[x][q];
                *reinterpret_cast<vec<T, V>*>(dst[x] + e) = o;
            }
    }""", launch_bounds="__launch_bounds__(256, NB == 1 ? 5 : 4)")  # 48 or 64 registers

# Bags a group of the pooled lookup takes: two where bags average under two lookups.
POOL_BAGS = (1, 2)


def pool_bags(n: int, bags: int) -> int:
    """Bags per lane group of ``coll_pool`` for ``n`` lookups in ``bags`` bags.

    >>> pool_bags(425_984, 425_984), pool_bags(65_536, 4_096)
    (2, 1)
    """
    return 2 if n < 2 * bags else 1


_SUM_ARGS = (("const T*", "grad"), ("const K*", "keys"), ("const i64*", "run"),
             ("const i64*", "starts"), ("const i64*", "perm"), ("const i64*", "bag_of"),
             ("const i64*", "offsets"), ("const i64*", "meta"), ("const i64*", "run_off"),
             ("const int*", "run_tab"), ("const T*", "psw"), ("int", "mean"), ("i64", "B"),
             ("i64", "grad_stride"), ("i64", "n"), ("i64", "width"), ("T*", "summed"),
             ("T*", "head"), ("T*", "tail"), ("const unsigned long long*", "verdict"))

SUM_CHUNKS = KernelDecl(
    "coll_sum_chunks", "template <int V, typename T, typename K>", _SUM_ARGS,
    r"""
    // Pass 1 (as the host tables' sum_chunks): chunk c's COLL_SUM_CHUNK (= 32) sorted
    // positions, summed per column in position order; a run inside the chunk goes to
    // summed[run], the segment at the chunk's start to head[c], the one at its end to
    // tail[c]. A warp per (chunk, 32 x V columns), V adjacent columns a lane (one 16-byte
    // load where the gradient's rows allow): lane k first finds position k's records
    // (gradient source, factor, width, key, run), then the warp walks the positions with
    // every record at hand from a shuffle, so the gradient loads of the walk do not wait on
    // each other. Columns past a table's width are skipped (every width is a multiple of
    // V). `width`: the widest table (summed's row stride, a multiple of V).
    if (rejected(verdict)) return;
    const int lane = threadIdx.x & 31;
    const i64 chunks = (n + COLL_SUM_CHUNK - 1) / COLL_SUM_CHUNK;
    const i64 slices = (width + 32 * V - 1) / (32 * V);
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    for (i64 w = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; w < chunks * slices;
         w += warps) {
        const i64 c = w / slices, e = ((w - c * slices) * 32 + lane) * V;
        const i64 first = c * COLL_SUM_CHUNK;
        const int count = (int)(first + COLL_SUM_CHUNK < n ? COLL_SUM_CHUNK : n - first);
        const i64 mine_j = first + (lane < count ? lane : count - 1);
        // My position's record: where its lookup's gradient starts in the pooled gradient
        // (its bag's row, `grad_stride` elements apart, then its table's columns), its
        // factor and its table's width (0 for padding, bag -1: no gradient).
        i64 my_src = 0;
        T my_scale = (T)0;
        int my_dim = 0;
        {
            const i64 l = perm[mine_j];
            const i64 bag = l >= 0 && l < n ? bag_of[l] : -1;
            if (bag >= 0) {
                const i64 t = bag <= 0x7fffffffLL && B <= 0x7fffffffLL
                              ? (i64)((unsigned)bag / (unsigned)B) : bag / B;
                const i64* m = meta + t * COLL_META;
                my_src = (bag - t * B) * grad_stride + m[M_D_OFF];
                my_dim = (int)m[M_DIM];
                my_scale = (T)1;
                if (psw != nullptr || mean) {
                    i64 lo, hi;
                    bag_range(offsets, bag, n, lo, hi);
                    my_scale = lookup_scale<T>(psw, l, mean, hi - lo);
                }
            }
        }
        const i64 my_run = run[mine_j];
        // Does a segment end at my position (the next key differs, or the chunk ends)?
        const bool my_end = lane >= count - 1 || keys[mine_j + 1] != keys[mine_j];
        const bool head_open = first > 0 && keys[first] == keys[first - 1];
        const bool tail_open = first + count < n && keys[first + count] == keys[first + count - 1];
        const unsigned ends = __ballot_sync(0xffffffffu, my_end && lane < count);
        vec<T, V> acc;
        #pragma unroll
        for (int q = 0; q < V; ++q) acc.v[q] = (T)0;
        int begin = 0;
        // AHEAD positions' gradient loads issued before the first is added: the walk is
        // bound by load latency, not bandwidth (26 tables x 64, 425,984 lookups, an H200:
        // 63 us with one load at a time). AHEAD divides 32, so k stays a lane of the warp.
        constexpr int AHEAD = V >= 4 ? 4 : 8;
        for (int k0 = 0; k0 < count; k0 += AHEAD) {
            vec<T, V> g[AHEAD];
            T scale[AHEAD];
            int dim[AHEAD];
            #pragma unroll
            for (int u = 0; u < AHEAD; ++u) {
                const int k = k0 + u;
                const i64 src = __shfl_sync(0xffffffffu, my_src, k);
                scale[u] = __shfl_sync(0xffffffffu, my_scale, k);
                dim[u] = k < count ? __shfl_sync(0xffffffffu, my_dim, k) : 0;
                if (e < dim[u]) g[u] = *reinterpret_cast<const vec<T, V>*>(grad + src + e);
            }
            #pragma unroll
            for (int u = 0; u < AHEAD; ++u) {
                const int k = k0 + u;
                if (k >= count) break;  // the same for every lane
                if (e < dim[u]) {
                    #pragma unroll
                    for (int q = 0; q < V; ++q) acc.v[q] += g[u].v[q] * scale[u];
                }
                if ((ends >> k) & 1u) {  // the segment [begin, k] ends here
                    const i64 rk = __shfl_sync(0xffffffffu, my_run, k);
                    const bool is_head = begin == 0 && head_open;
                    const bool is_tail = k == count - 1 && tail_open;
                    if (e < dim[u]) {
                        if (is_head) *reinterpret_cast<vec<T, V>*>(head + c * width + e) = acc;
                        if (is_tail) *reinterpret_cast<vec<T, V>*>(tail + c * width + e) = acc;
                        if (!is_head && !is_tail && rk >= 0 && rk < n)
                            *reinterpret_cast<vec<T, V>*>(summed + rk * width + e) = acc;
                    }
                    #pragma unroll
                    for (int q = 0; q < V; ++q) acc.v[q] = (T)0;
                    begin = k + 1;
                }
            }
        }
    }""")

SUM_SPANS = KernelDecl(
    "coll_sum_spans", "template <typename T, typename K>", _SUM_ARGS,
    r"""
    // Pass 2: a run crossing chunk boundaries (found at its first chunk) adds its pieces in
    // order: that chunk's tail, the middle chunks' heads, the last chunk's head. The run's
    // last chunk is known from the next run's start, so 32 chunks' heads are loaded at once
    // without waiting on keys (a hot row's run crosses thousands of chunks).
    if (rejected(verdict)) return;
    const i64 chunks = (n + COLL_SUM_CHUNK - 1) / COLL_SUM_CHUNK;
    const i64 total = chunks * width;
    const i64 runs = n > 0 ? min(run[n - 1] + 1, n) : 0;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const i64 c = i / width, e = i - c * width;
        const i64 first = c * COLL_SUM_CHUNK;
        const i64 last = first + COLL_SUM_CHUNK - 1;
        if (last + 1 >= n || keys[last + 1] != keys[last]) continue;  // no run leaves c
        const K key = keys[last];
        if (keys[first] == key && first > 0 && keys[first - 1] == key) continue;  // began earlier
        const i64 rl = run[last];
        if (rl < 0 || rl >= n || run_off[rl] < 0) continue;  // a row nowhere: no gradient
        if (e >= meta[(i64)run_tab[rl] * COLL_META + M_DIM]) continue;
        i64 end = rl + 1 < runs ? starts[rl + 1] - 1 : n - 1;  // the run's last position
        end = end <= last ? last + 1 : (end >= n ? n - 1 : end);
        const i64 c_end = end / COLL_SUM_CHUNK;
        T acc = tail[c * width + e];
        for (i64 d0 = c + 1; d0 <= c_end; d0 += 32) {
            T h[32];
            #pragma unroll
            for (int u = 0; u < 32; ++u)
                h[u] = d0 + u <= c_end ? head[(d0 + u) * width + e] : (T)0;
            #pragma unroll
            for (int u = 0; u < 32; ++u)
                if (d0 + u <= c_end) acc += h[u];
        }
        summed[rl * width + e] = acc;
    }""")

# The tables' counter-based initializer (``xferlib/collection/init.py`` has its NumPy twin):
# weight (row, col) of table stream `stream` is a function of (stream, row * dim + col) alone,
# so any chunk of rows, on either path, gets the same values. No FMA contraction in the
# uniform map (__dmul_rn, __dadd_rn): the NumPy twin rounds each operation the same way.
_INIT_HEAD = r"""
__device__ __forceinline__ unsigned long long xf_mix64(unsigned long long z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
"""

INIT = KernelDecl(
    "coll_init", "template <typename T>",
    (("T*", "rows"), ("i64", "first_row"), ("i64", "num_rows"), ("i64", "row_width"),
     ("i64", "dim"), ("i64", "state_offset"), ("i64", "state_used"),
     ("unsigned long long", "table_stream"), ("int", "kind"), ("double", "a"), ("double", "b"),
     ("double", "initial")),
    r"""
    // Rows [first_row, first_row + num_rows) of a table, written whole: the weights (kind 0
    // zeros, 1 uniform(a, b), 2 normal(a, b)), the state slots and row scalars (`initial`),
    // the int64 step count and the padding (zero bits).
    const i64 total = num_rows * row_width;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const i64 rr = i / row_width, col = i - rr * row_width;
        T v = (T)0;
        if (col < dim) {
            if (kind != 0) {
                const unsigned long long z1 = xf_mix64(
                    (unsigned long long)((first_row + rr) * dim + col) + table_stream);
                if (kind == 1) {
                    const double u = (double)(z1 >> 11) * 0x1.0p-53;
                    v = (T)__dadd_rn(a, __dmul_rn(b - a, u));
                } else {
                    const double u1 = (double)((z1 >> 11) + 1) * 0x1.0p-53;
                    const double u2 = (double)(xf_mix64(z1) >> 11) * 0x1.0p-53;
                    const double r = sqrt(-2.0 * log(u1)) * cospi(2.0 * u2);
                    v = (T)__dadd_rn(a, __dmul_rn(b, r));
                }
            }
        } else if (col >= state_offset && col < state_offset + state_used) {
            v = (T)initial;
        }
        rows[i] = v;
    }""")

COLLECTION_KERNEL = COLLECTION_HEAD + _INIT_HEAD + "".join(
    d.source() for d in (PLAN, RUNS, STAGE, POOL, SUM_CHUNKS, SUM_SPANS, INIT))


def vector_widths(dtype_name: str) -> tuple:
    """Elements per lane access: 16-byte words down to one element."""
    return (1, 2, 4) if dtype_name == "float32" else (1, 2)


def _collection_names():
    for dtype_name, T in _TYPES.items():
        yield INIT.instance(T)
        for V in vector_widths(dtype_name):
            yield STAGE.instance(V, T)
        for K in KEY_TYPES.values():
            if dtype_name == "float32":
                for O in KEY_TYPES.values():
                    yield PLAN.instance(K, O)
                yield RUNS.instance(K)
            for V in vector_widths(dtype_name):
                yield SUM_CHUNKS.instance(V, T, K)
            yield SUM_SPANS.instance(T, K)
            for V in vector_widths(dtype_name):
                for NB in POOL_BAGS:
                    yield POOL.instance(V, NB, T, K)


COLLECTION_MODULE = KernelModule("collection", COLLECTION_KERNEL,
                                 tuple(n for n in _collection_names() if n is not None))


def collection_module() -> KernelModule:
    return COLLECTION_MODULE


def c_type(dtype_name: str) -> str:
    return _TYPES[dtype_name]
