"""Embedding-collection kernels: one pooled lookup and one fused backward + update over
every table of a collection (``xferlib/collection/device.py`` launches them).

A step's lookups arrive in FBGEMM's layout (``indices``; ``offsets``, ``T * B + 1`` bag
boundaries; optional per-sample weights). Each table's place is one row of ``meta``
(``COLL_META`` int64 fields, below). ``coll_plan`` checks every bag and index and gives each
lookup a key unique over the collection (the table's ``key_base`` plus its row; with a GPU
cache, a host row's set-ordered key, ``SET_ORDER``) and its bag; the batch sort
(``xferlib/batch.py``) orders the keys and ``coll_runs`` numbers their runs (one run per
distinct row of any table, one launch). Rows of host tables are staged into HBM once per
distinct row in key order (``coll_stage``: ascending rows, the link's fast access pattern,
where no cache asks for its set order), and the pooled lookup (``collection_pool.py``)
gives each bag a group of lanes (sized to the widest row's vectors: a warp, or part of one)
that sums its rows in registers, read from the table in HBM or from the staged copy: no
buffer of one row per lookup. The backward sums each run's gradients from the pooled
gradient in sorted order in two passes (``collection_sums.py``: deterministic, no atomics,
no warp stuck on a hot row), and ``coll_update`` (``collection_update.py``, one module per
rule) gives each distinct row a group of lanes that runs the table's update rule where the
row lives.

Every kernel bounds every position and row it touches, and writes nothing once the plan's
verdict (two uint64 words) reports a bad bag or index.
"""

from __future__ import annotations

from xferlib._kernels._declare import KernelDecl, defines
from xferlib._kernels._registry import KernelModule
from xferlib._kernels.cache import SET_ORDER
from xferlib._kernels.collection_pool import POOL, POOL_HELPERS, POOL_PAIRS, pool_kernel
from xferlib._kernels.collection_sums import (ADD_HEADS, LONG_SPAN, SUM_CHUNK, SUM_CHUNKS,
                                              SUM_SPANS)
from xferlib._kernels.rows import BLOCK_SCAN
from xferlib._kernels.table import RULE_IDS, TABLE_KERNEL

__all__ = ["COLL_META", "META_FIELDS", "SUM_CHUNK", "PLAN", "STAGE", "POOL", "POOL_PAIRS",
           "SUM_CHUNKS", "SUM_SPANS", "LONG_SPAN", "INIT", "RUNS", "RUN_THREADS", "pool_kernel",
           "run_status_words", "collection_module", "KEY_TYPES", "RULE_IDS", "DTYPE_NAMES",
           "COLLECTION_HEAD", "STAGING_HELPERS", "vector_widths", "c_type"]

# The per-table fields of ``meta`` (int64 each), in order.
META_FIELDS = ("num_rows", "dim", "d_off", "host", "base", "row_width", "state_offset",
               "step_off", "key_base")
COLL_META = len(META_FIELDS)
RUN_THREADS = 256  # threads of a coll_runs block, 4 sorted positions each
RUN_TILE = 4 * RUN_THREADS
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

COLLECTION_HEAD = TABLE_KERNEL + BLOCK_SCAN + defines(
    COLL_META=COLL_META, COLL_SUM_CHUNK=SUM_CHUNK, COLL_LONG_SPAN=LONG_SPAN,
    COLL_RUN_THREADS=RUN_THREADS, COLL_RUN_TILE=RUN_TILE,
    **{f"M_{f.upper()}": k for k, f in enumerate(META_FIELDS)}) + BAG_RANGE + SET_ORDER + r"""

// The sorted key at position i, as the batch sort left it: int32 or int64 (`key_bytes`).
__device__ __forceinline__ i64 sorted_key(const void* keys, int key_bytes, i64 i) {
    return key_bytes == 4 ? (i64)static_cast<const int*>(keys)[i]
                          : (i64)static_cast<const long long*>(keys)[i];
}

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
     ("i64", "pad_key"), ("i64", "n_sets"), ("i64", "set_size"), ("i64*", "keys"),
     ("i64*", "bag_of"), ("i64*", "offsets64"),
     ("unsigned long long*", "words"), ("int", "group"), ("unsigned*", "zero"),
     ("i64", "zero_words")),
    r"""
    // A group of `group` lanes per bag (a power of two, about the bags' mean length, so
    // that a bag's lookups are read side by side, not one after another by one thread): its
    // bounds (the first bag starts at 0, the last ends at n, or at most n when `padded`,
    // at *total when `padded` gives `total`; none goes back), each index against its own
    // table; every lookup gets its
    // collection-wide key and its bag. A padded batch's tail (from the last bag's end) gets
    // `pad_key` (past every table's keys) and bag -1. words[0]: first bad lookup; words[1]:
    // first bad bag. `offsets64` (int32 offsets): their int64 copy, which the later kernels
    // read (no separate widening launch). `set_size` > 0 (host tables with a GPU cache):
    // host rows get set-ordered keys (SET_ORDER), so that the sort groups them by cache set.
    // `zero`: the later kernels' working words, zeroed here (a memset node before this
    // kernel would hold a graph's launches back).
    const i64 stride = (i64)gridDim.x * blockDim.x;
    const i64 thread = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    for (i64 i = thread; i < zero_words; i += stride) zero[i] = 0u;
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
        const bool ordered = set_size > 0 && m[M_HOST] != 0;
        for (i64 l = lo + lane; l < hi; l += group) {
            const i64 row = (i64)indices[l];
            const bool good = row >= 0 && row < rows;
            if (!good) atomicMin(&words[0], (unsigned long long)l);
            const i64 key = good ? base + row : base;
            keys[l] = ordered ? set_order_key(key, n_sets, set_size) : key;
            bag_of[l] = b;
        }
    }""")

# A tile's published count in the run numbering (`status`, 64-bit words): a flag in the top
# two bits (0 not yet, A its own count, P with every earlier tile's), the count below.
RUN_FLAGS = r"""
#define RUN_FLAG_A (1ull << 62)
#define RUN_FLAG_P (1ull << 63)
#define RUN_COUNT_MASK (RUN_FLAG_A - 1ull)
#define RUN_LOOK 4
"""

RUNS = KernelDecl(
    "coll_runs", "template <typename K>",
    (("const i64*", "meta"), ("const K*", "keys"), ("const i64*", "perm"),
     ("const i64*", "bag_of"), ("i64", "n"), ("i64", "B"), ("i64", "n_sets"),
     ("i64", "set_size"),
     ("unsigned long long*", "status"), ("i64*", "run"), ("i64*", "starts"),
     ("i64*", "run_off"), ("int*", "run_tab"), ("i64*", "inv"),
     ("const unsigned long long*", "verdict")),
    r"""
    // The sorted keys' runs numbered in one launch: a block of COLL_RUN_THREADS threads per
    // tile of COLL_RUN_TILE sorted positions (4 adjacent a thread), taken in the order
    // blocks start (status[0] counts them out): flags where a key differs from the one
    // before, a block scan, and the runs of earlier tiles by a decoupled look-back over
    // their published counts (status[1 + tile], zeroed by the caller; warp 0 reads 32 x
    // RUN_LOOK tiles a round trip). run[j]: position j's run (0 for the first); at each
    // run's first position: starts[r], and (unless the batch was rejected) where its row lives
    // (run_off: elements from its placement's buffer start, -1 when nowhere) and its table
    // (run_tab), so that the row kernels start from one load instead of a chain of four;
    // inv[lookup] = its run (its staged row) where host tables need it. A thread's loads
    // of each kind are issued together (four positions' chains side by side).
    __shared__ unsigned int warp_sums[32];
    __shared__ unsigned int tile_s, total_s;
    __shared__ unsigned long long carry_s;
    const int t = threadIdx.x;
    if (t == 0) tile_s = (unsigned int)atomicAdd(&status[0], 1ull);
    __syncthreads();
    const i64 tile = tile_s;
    const i64 j0 = tile * COLL_RUN_TILE + 4 * (i64)t;
    K key[5];  // positions j0 - 1 .. j0 + 3
    #pragma unroll
    for (int u = 0; u < 5; ++u) {
        const i64 j = j0 - 1 + u;
        key[u] = j >= 0 && j < n ? keys[j] : (K)0;
    }
    int flag[4];
    unsigned int count = 0;
    #pragma unroll
    for (int u = 0; u < 4; ++u) {
        const i64 j = j0 + u;
        flag[u] = (j < n && j > 0 && key[u + 1] != key[u]) ? 1 : 0;
        count += flag[u];
    }
    // the run heads' lookups (every lookup's where host tables need `inv`), loaded before
    // the scan and look-back so that their latency passes while warp 0 waits on earlier tiles
    i64 l[4];
    #pragma unroll
    for (int u = 0; u < 4; ++u) {
        const i64 j = j0 + u;
        l[u] = j < n && (inv != nullptr || flag[u] || j == 0) ? perm[j] : -1;
    }
    const unsigned int before_me = block_exclusive_scan(count, warp_sums);
    if (t == (int)blockDim.x - 1) total_s = before_me + count;
    __syncthreads();
    if (t < 32) {
        volatile unsigned long long* published = status + 1;
        const unsigned long long total = total_s;
        if (t == 0) published[tile] = (tile == 0 ? RUN_FLAG_P : RUN_FLAG_A) | total;
        unsigned long long before = 0;
        if (tile > 0) {
            i64 next = tile - 1;  // the nearest earlier tile not yet added
            bool done = false;
            while (!done) {
                // RUN_LOOK windows of 32 tiles read at once (lane t: tiles next - t - 32 w;
                // before tile 0, a P of nothing), then added window by window
                unsigned long long seen[RUN_LOOK];
                #pragma unroll
                for (int w = 0; w < RUN_LOOK; ++w) {
                    const i64 k = next - t - 32 * w;
                    seen[w] = k >= 0 ? published[k] : RUN_FLAG_P;
                }
                #pragma unroll
                for (int w = 0; w < RUN_LOOK; ++w) {
                    const unsigned long long s = seen[w];
                    const unsigned int ready = __ballot_sync(0xffffffffu, (s >> 62) != 0);
                    const unsigned int full = __ballot_sync(0xffffffffu, (s >> 63) != 0);
                    const int gap = __ffs(~ready) - 1;  // first lane not published (-1: none)
                    const int first_p = __ffs(full) - 1;  // first with every tile before it
                    done = first_p >= 0 && (gap < 0 || first_p < gap);
                    const int take = done ? first_p + 1 : (gap < 0 ? 32 : gap);
                    unsigned long long add = t < take ? (s & RUN_COUNT_MASK) : 0ull;
                    #pragma unroll
                    for (int d = 16; d > 0; d >>= 1) add += __shfl_xor_sync(0xffffffffu, add, d);
                    before += add;
                    next -= take;
                    if (done || take < 32) break;  // the same for every lane
                }
            }
            if (t == 0) published[tile] = RUN_FLAG_P | (before + total);
        }
        if (t == 0) carry_s = before;
    }
    const bool refused = rejected(verdict);
    i64 bag[4];
    #pragma unroll
    for (int u = 0; u < 4; ++u) l[u] = l[u] >= 0 && l[u] < n ? l[u] : -1;
    #pragma unroll
    for (int u = 0; u < 4; ++u)
        bag[u] = !refused && l[u] >= 0 && (flag[u] || j0 + u == 0) ? bag_of[l[u]] : -1;
    __syncthreads();
    i64 r = (i64)carry_s + before_me;
    #pragma unroll
    for (int u = 0; u < 4; ++u) {
        const i64 j = j0 + u;
        if (j >= n) break;
        r += flag[u];
        run[j] = r;
        if (inv != nullptr && !refused && l[u] >= 0) inv[l[u]] = r;
        if (!flag[u] && j != 0) continue;
        starts[r] = j;
        if (refused) continue;
        i64 off = -1;
        int tab = 0;
        if (bag[u] >= 0) {  // bag -1: a padded batch's tail
            tab = (int)(bag[u] / B);
            const i64* m = meta + (i64)tab * COLL_META;
            i64 x = (i64)key[u + 1];  // a host row's set-ordered key turned back (PLAN)
            if (set_size > 0 && m[M_HOST] != 0)
                x = set_order_row(x, n_sets, set_size);
            const i64 row = x - m[M_KEY_BASE];
            if (row >= 0 && row < m[M_NUM_ROWS]) off = m[M_BASE] + row * m[M_ROW_WIDTH];
        }
        run_off[r] = off;
        run_tab[r] = tab;
    }""", launch_bounds="__launch_bounds__(COLL_RUN_THREADS)")


def run_status_words(n: int) -> int:
    """64-bit words of ``coll_runs``' zeroed status for ``n`` sorted positions: its tile
    counter, then one word a tile (its blocks: one fewer)."""
    return 1 + -(-int(n) // RUN_TILE)


# The staging kernel's helpers: a row moved by a warp, V elements a lane (its two copies), and
# the warp's search of the pending rows' keys (a test builds its own kernel on it).
STAGING_HELPERS = r"""
// A warp copies `len` elements (whole V-element vectors) from src to dst: every load of up to
// 4 x 32 vectors in flight before the first store, one trip over the link per row instead of
// one per 32 vectors.
template <int V, typename T>
__device__ __forceinline__ void warp_copy_row(const T* src, T* dst, i64 len, int lane) {
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
}

// Where `want` first sits in keys[0, count) (ascending; equal keys allowed), or -1: a warp's
// search, each lane probing one of 32 evenly spaced keys a round (three rounds for 25,000
// keys, not fifteen one after another). Every lane of the warp calls it with the same
// arguments.
template <typename K>
__device__ __forceinline__ i64 warp_find(const K* keys, i64 count, i64 want, int lane) {
    i64 lo = 0, hi = count;  // the first key >= want is at a position in [lo, hi]
    while (lo < hi) {
        const i64 step = (hi - lo + 31) / 32;
        const i64 p = lo + (i64)lane * step;
        const int below = __popc(__ballot_sync(0xffffffffu, p < hi && (i64)keys[p] < want));
        if (below == 0) break;  // keys[lo] >= want
        const i64 top = lo + (i64)below * step;
        lo += (i64)(below - 1) * step + 1;
        hi = top < hi ? top : hi;
    }
    return lo < count && (i64)keys[lo] == want ? lo : -1;
}

// Whether the batch's sorted keys (int32 or int64: `key_bytes`) hold `want`.
__device__ __forceinline__ bool warp_has_key(const void* keys, int key_bytes, i64 n, i64 want,
                                             int lane) {
    return key_bytes == 4 ? warp_find(static_cast<const int*>(keys), n, want, lane) >= 0
                          : warp_find(static_cast<const long long*>(keys), n, want, lane) >= 0;
}
"""

STAGE = KernelDecl(
    "coll_stage", "template <int V, typename T>",
    (("T*", "host"), ("const i64*", "meta"), ("const void*", "keys"), ("int", "key_bytes"),
     ("const i64*", "run"),
     ("const i64*", "starts"), ("const i64*", "run_off"), ("const int*", "run_tab"),
     ("i64", "n"), ("const T*", "cache"), ("i64", "cache_width"), ("const int*", "slots"),
     ("T*", "staged"), ("i64", "stage_width"), ("int", "full"), ("const T*", "pending"),
     ("const i64*", "pending_key"), ("const i64*", "pending_off"),
     ("const int*", "pending_tab"), ("const i64*", "pending_count"), ("i64", "pending_rows"),
     ("int", "keep_taken"), ("i64", "host_elems"), ("i64", "num_tables"),
     ("const unsigned long long*", "verdict")),
    r"""
    // A warp per distinct row: a host table's row copied to staged[r], from its GPU cache
    // slot (slots[r] >= 0) or from host RAM (in key order: ascending rows without a cache,
    // the link's fast pattern; with one, the cache's set order); rows of
    // HBM tables are read in place and skipped. `full`: the whole stored row (weights, state,
    // step count, padding: whole host cache lines), so that the update reads it from HBM and
    // only writes over the link (rows whose state is a few scalars); else the weights (the
    // update then reads full-width state over the link as its writes go the other way).
    // `pending` (no cache: the last update's runs, *pending_count, run p's sorted key
    // pending_key[p]; its host row held in HBM at pending[p] when pending_off[p], where it
    // goes, is >= 0): written back here, whatever this batch's verdict, while this batch's
    // rows come in over the link the other way (the link carries both at once). A row of
    // this batch found held there is taken from `pending`, not from host RAM that the
    // write-back may not have reached. `keep_taken` (this batch's update holds its rows in
    // `pending` again): a held row this batch takes is not written back (its update writes
    // it, whole, where it goes; until then the buffer and its count stand, and a staging
    // of any batch without the row writes it back): a fifth of a Zipf batch's rows, the
    // hot ones, cross the link no more.
    const int lane = threadIdx.x & 31;
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    const i64 runs = n > 0 && !rejected(verdict) ? min(run[n - 1] + 1, n) : 0;
    i64 held = pending != nullptr ? *pending_count : 0;
    // one value for every lane of a warp, whatever else writes the count meanwhile (its
    // ballots must agree)
    held = __shfl_sync(0xffffffffu, held, 0);
    held = held < 0 ? 0 : (held > pending_rows ? pending_rows : held);
    const i64 todo = runs > held ? runs : held;
    for (i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < todo; r += warps) {
        if (r < held) {
            const i64 off = pending_off[r];
            const int tab = pending_tab[r];
            if (off >= 0 && tab >= 0 && tab < num_tables) {
                const i64* m = meta + (i64)tab * COLL_META;
                const i64 len = m[M_ROW_WIDTH];
                const bool kept = keep_taken && runs > 0
                    && warp_has_key(keys, key_bytes, n, pending_key[r], lane);
                if (!kept && m[M_HOST] && len <= stage_width && off + len <= host_elems)
                    warp_copy_row<V, T>(pending + r * stage_width, host + off, len, lane);
            }
        }
        if (r >= runs) continue;
        const i64 off = run_off[r];
        const i64* m = meta + (i64)run_tab[r] * COLL_META;
        if (off < 0 || !m[M_HOST]) continue;
        const i64 len = full ? m[M_ROW_WIDTH] : m[M_DIM];
        const int slot = slots != nullptr ? slots[r] : -1;
        const T* src = slot >= 0 ? cache + (i64)slot * cache_width : host + off;
        if (held > 0) {
            const i64 start = starts[r];
            const i64 p = start >= 0 && start < n
                ? warp_find(pending_key, held, sorted_key(keys, key_bytes, start), lane) : -1;
            if (p >= 0 && pending_off[p] >= 0) src = pending + p * stage_width;
        }
        warp_copy_row<V, T>(src, staged + r * stage_width, len, lane);
    }""")

# The tables' counter-based initializer (``xferlib/collection/init.py`` has its NumPy twin):
# weight (row, col) of table stream `stream` is a function of (stream, row * dim + col) alone,
# so any chunk of rows, on either path, gets the same values. No FMA contraction in the
# uniform map (__dmul_rn, __dadd_rn): the NumPy twin rounds each operation the same way.
_INIT_HEAD = r"""
// splitmix64's step: the golden-ratio add, then the finalizer (SET_ORDER's mix64)
__device__ __forceinline__ unsigned long long xf_mix64(unsigned long long z) {
    return mix64(z + 0x9E3779B97F4A7C15ull);
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

COLLECTION_KERNEL = (COLLECTION_HEAD + RUN_FLAGS + _INIT_HEAD + ADD_HEADS + STAGING_HELPERS
                     + POOL_HELPERS
                     + "".join(d.source()
                               for d in (PLAN, RUNS, STAGE, POOL, POOL_PAIRS, SUM_CHUNKS,
                                         SUM_SPANS, INIT)))


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
            for V in vector_widths(dtype_name):
                yield POOL.instance(V, T, K)
                yield POOL_PAIRS.instance(V, T, K)
        for V in vector_widths(dtype_name):
            yield SUM_SPANS.instance(V, T)


COLLECTION_MODULE = KernelModule("collection", COLLECTION_KERNEL,
                                 tuple(n for n in _collection_names() if n is not None))


def collection_module() -> KernelModule:
    return COLLECTION_MODULE


def c_type(dtype_name: str) -> str:
    return _TYPES[dtype_name]
