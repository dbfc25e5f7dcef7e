"""Host-table GPU cache kernels: a 32-way set-associative cache of full rows (weights and
optimizer state) in HBM, looked up, filled and evicted on the device.

A row's set is a hash of its id (``set_of``; a collection's host rows: their set-ordered
keys, ``SET_ORDER``); one warp owns one set at a time, lane ``l`` holding way ``l``'s tag
(the cached row or -1), score (LRU: the tick of its last use; LFU: its use count) and
last-use tick in registers. A batch's distinct rows are grouped by set (a sort of their set
ids, or the collection's own sorted keys), so every row of a set is handled by the same
warp, one after the other, in ascending key order: hits, admission, victim choice,
write-back of a dirty victim and the fill of the new row happen in one pass with no atomics
on the cache (FBGEMM's find/miss/insert, fused). ``slots[run]`` receives each distinct
row's cache slot, or -1 for a row served from host RAM.

Admission: a missed row takes an empty way of its set if there is one (it evicts nothing);
past that, ``doorkeeper`` admits it the second time it misses (a bit per hashed row id, set
on the first miss; TinyLFU's doorkeeper); otherwise every miss is admitted. A
victim is an empty way, else the way of lowest score not used by this batch, and (for a
prefetch, ``protect_prev``) not used by the cache pass before, the batch whose update may run
beside the prefetch (the host makes any other batch's update wait for the prefetch).
When every way is taken the row is served from the host and not admitted.

A cache of K rows has ceil(K / 32) sets; ways past the K-th are disabled (tag -2).

Every kernel does nothing when the batch's verdict is set (a bad index): a rejected batch
leaves tags, scores, admission bits, statistics and rows as they were.
"""

from xferlib._kernels._declare import KernelDecl, defines
from xferlib._kernels._registry import KernelModule

WAYS = 32  # ways per set: a warp's lanes

# Arguments several kernels of the cache and table families share, in the order the host
# sides give them: ``host_args()`` (the host weights and state, their strides, the row
# count) and ``TableCache._layout_args()`` (the cache, its row width, the row's width and
# where its state starts in a cached row).
HOST_ARGS = ("host_w", "w_stride", "host_s", "s_stride", "n_rows")
LAYOUT_ARGS = ("cache", "cache_width", "dim", "s_off")

# A cached collection's host rows keyed in the order of their cache sets (``SetOrder`` in
# ``xferlib/table/cache.py`` is the NumPy twin and says why); shared with the collection's
# kernels, which make and read such keys. `set_size` 0: rows keyed as themselves.
SET_ORDER = r"""
// splitmix64's finalizer: neighbouring row ids land in unrelated sets.
__device__ __forceinline__ unsigned long long mix64(unsigned long long x) {
    x ^= x >> 30; x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27; x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// h(b): a hash of b below n_sets (splitmix64's finalizer after its golden-ratio step)
__device__ __forceinline__ long long set_order_shift(long long b, long long n_sets) {
    return (long long)(mix64((unsigned long long)b + 0x9E3779B97F4A7C15ull)
                       % (unsigned long long)n_sets);
}

// row x (0 <= x < 2^31): set (x % n_sets + h(x / n_sets)) % n_sets, key set * set_size + b
__device__ __forceinline__ long long set_order_key(long long x, long long n_sets,
                                                   long long set_size) {
    const long long b = x / n_sets;
    long long set = x - b * n_sets + set_order_shift(b, n_sets);
    if (set >= n_sets) set -= n_sets;
    return set * set_size + b;
}

// the row of a set-ordered key (key < n_sets * set_size; a key no row has gives a row
// past the table's, which callers refuse)
__device__ __forceinline__ long long set_order_row(long long key, long long n_sets,
                                                   long long set_size) {
    const long long b = key % set_size;
    long long a = key / set_size - set_order_shift(b, n_sets);
    if (a < 0) a += n_sets;
    return b * n_sets + a;
}
"""

_HEAD = defines(WAYS=WAYS) + SET_ORDER + r"""
typedef long long i64;
typedef unsigned long long u64;
#define FULL 0xffffffffu
#define NO_WAY 0x7fffffffffffffffll
#define EMPTY_WAY (-NO_WAY - 1)

__device__ __forceinline__ bool rejected(const u64* verdict) {
    return (verdict[0] & verdict[1]) != ~0ull;
}

__device__ __forceinline__ i64 set_of(i64 row, i64 n_sets) {
    return (i64)(mix64((u64)row) % (u64)n_sets);
}

template <typename T, int V> struct alignas(sizeof(T) * V) words { T v[V]; };

template <int V, typename T>
__device__ __forceinline__ void copy_words(T* __restrict__ dst, const T* __restrict__ src,
                                           i64 len, int lane) {
    typedef words<T, V> W;
    for (i64 e = (i64)V * lane; e < len; e += 32 * V)
        *reinterpret_cast<W*>(dst + e) = *reinterpret_cast<const W*>(src + e);
}

// A cache slot's new row: the victim's weights and state written back to host RAM (``old_w``
// non-null: a dirty victim) and the new row's read from it, a warp's share of both in flight
// together (every load issued before any store: host reads cost a round trip over the link).
template <int V, typename T>
__device__ __forceinline__ void evict_and_fill(T* c, i64 dim, i64 s_off, i64 s_width,
                                               T* old_w, T* old_s, const T* new_w,
                                               const T* new_s, int lane) {
    typedef words<T, V> W;
    const i64 len = dim > s_width ? dim : s_width;
    for (i64 e = (i64)V * lane; e < len; e += 32 * V) {
        const bool w = e < dim, s = e < s_width;
        W vw, vs, nw, ns;
        if (old_w != nullptr) {
            if (w) vw = *reinterpret_cast<const W*>(c + e);
            if (s) vs = *reinterpret_cast<const W*>(c + s_off + e);
        }
        if (w) nw = *reinterpret_cast<const W*>(new_w + e);
        if (s) ns = *reinterpret_cast<const W*>(new_s + e);
        if (old_w != nullptr) {
            if (w) *reinterpret_cast<W*>(old_w + e) = vw;
            if (s) *reinterpret_cast<W*>(old_s + e) = vs;
        }
        if (w) *reinterpret_cast<W*>(c + e) = nw;
        if (s) *reinterpret_cast<W*>(c + s_off + e) = ns;
    }
}

"""

# For each distinct row of a sorted batch (run r starting at sorted position j):
# set_key[r] = its set and run_row[r] = the row; set_key is n_sets (sorts last: no pass
# looks at it) past the last run and for keys the cache never holds (>= n_rows: a
# collection's HBM tables' rows; with set-ordered keys, those at or past n_sets * set_size).
# Set-ordered keys (set_size > 0, a collection's: set = key / set_size) make set_key
# ascending as it is, no sort needed. Thread 0 advances the cache's tick (even for a
# rejected batch, so the host can count ticks; nothing else changes then).
CACHE_SETS = KernelDecl(
    "cache_sets", "template <typename K>",
    (("const K* __restrict__", "keys"), ("const i64* __restrict__", "run"), ("i64", "n"),
     ("i64", "n_sets"), ("i64", "n_rows"), ("i64", "set_size"),
     ("int* __restrict__", "set_key"), ("i64* __restrict__", "run_row"),
     ("i64* __restrict__", "tick"), ("const u64* __restrict__", "verdict")),
    r"""
    const bool bad = rejected(verdict);
    const i64 last_run = n > 0 ? run[n - 1] : -1;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    const i64 first = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (first == 0) tick[0] += 1;
    for (i64 j = first; j < n; j += stride) {
        if (bad || j > last_run) set_key[j] = (int)n_sets;
        if (!bad && (j == 0 || keys[j] != keys[j - 1])) {
            const i64 r = run[j], key = (i64)keys[j];
            if (set_size > 0) {  // set-ordered: a host row's key, below n_sets * set_size
                const i64 row = key >= 0 && key < n_sets * set_size
                                ? set_order_row(key, n_sets, set_size) : -1;
                const bool host = row >= 0 && row < n_rows;
                set_key[r] = host ? (int)(key / set_size) : (int)n_sets;
                run_row[r] = host ? row : -1;
            } else {
                set_key[r] = key >= 0 && key < n_rows ? (int)set_of(key, n_sets) : (int)n_sets;
                run_row[r] = key;
            }
        }
    }""")

# The fused find / miss / admit / evict / fill pass. `sets` are the set ids in ascending
# order and `order[p]` the run at sorted position p (null: run p, for set-ordered keys);
# one warp per set present in the batch.
# stats: lookups, hits, misses, admitted, evicted (unique rows).
CACHE_INSERT = KernelDecl(
    "cache_insert", "template <int V, typename T>",
    (("T*", "host_w"), ("i64", "w_stride"), ("T*", "host_s"), ("i64", "s_stride"),
     ("i64", "n_rows"), ("T*", "cache"), ("i64", "cache_width"), ("i64", "dim"),
     ("i64", "s_off"), ("i64* __restrict__", "tags"), ("i64* __restrict__", "score"),
     ("i64* __restrict__", "last"), ("unsigned char* __restrict__", "dirty"),
     ("unsigned* __restrict__", "door"), ("i64", "door_bits"),
     ("const int* __restrict__", "sets"), ("const i64* __restrict__", "order"),
     ("const i64* __restrict__", "run_row"), ("i64", "n"), ("i64", "n_sets"),
     ("int* __restrict__", "slots"), ("const i64* __restrict__", "tick"), ("int", "lfu"),
     ("int", "doorkeeper"), ("int", "protect_prev"), ("u64* __restrict__", "stats"),
     ("const u64* __restrict__", "verdict")),
    r"""
    if (rejected(verdict)) return;
    __shared__ u64 block_stats[5];
    if (threadIdx.x < 5) block_stats[threadIdx.x] = 0;
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    const i64 now = tick[0];
    const i64 s_width = cache_width - s_off;
    // Counted per warp and summed per block: one global atomic per block and counter (not
    // five per set, contended on five words).
    u64 hits = 0, misses = 0, admitted = 0, evicted = 0;
    for (i64 p = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; p < n; p += warps) {
        const int set = sets[p];
        // ascending: past the batch's last set only non-rows follow (no trips over them)
        if (set >= n_sets) break;
        if (set < 0 || (p > 0 && sets[p - 1] == set)) continue;
        const i64 base = (i64)set * WAYS;
        i64 tag = tags[base + lane], sc = score[base + lane], ls = last[base + lane];
        unsigned used = 0;
        bool filled = false;
        for (i64 q = p; q < n && sets[q] == set; ++q) {
            const i64 r = order != nullptr ? order[q] : q;
            const i64 row = run_row[r];
            const unsigned hit = __ballot_sync(FULL, tag == row);
            int way = -1;
            if (hit) {
                way = __ffs(hit) - 1;
                if (lane == way) { sc = lfu ? sc + 1 : now; ls = now; }
                ++hits;
            } else {
                ++misses;
                bool admit = row >= 0 && row < n_rows;
                // An empty way takes any miss (it evicts nothing); the doorkeeper decides
                // only when admitting means evicting.
                if (admit && doorkeeper && !__ballot_sync(FULL, tag == -1)) {
                    // Bits of earlier batches only (cache_mark sets this batch's afterwards),
                    // so the decision does not depend on the order the warps run in.
                    const u64 h = mix64((u64)row ^ 0x9e3779b97f4a7c15ull) % (u64)door_bits;
                    admit = (door[h >> 5] >> (h & 31)) & 1u;
                }
                if (admit) {
                    // Candidates: empty ways first, then the lowest score; never a way this
                    // batch uses, nor (prefetch) one the batch before used.
                    i64 key;
                    if (((used >> lane) & 1u) || tag < -1) key = NO_WAY;  // -2: no such way
                    else if (tag == -1) key = EMPTY_WAY;
                    else if (ls >= now - protect_prev) key = NO_WAY;
                    else key = lfu ? sc : ls;
                    i64 best = key;
                    int best_lane = lane;
                    #pragma unroll
                    for (int d = 16; d > 0; d >>= 1) {
                        const i64 o = __shfl_xor_sync(FULL, best, d);
                        const int ol = __shfl_xor_sync(FULL, best_lane, d);
                        if (o < best || (o == best && ol < best_lane)) { best = o; best_lane = ol; }
                    }
                    if (best != NO_WAY) {
                        way = best_lane;
                        const i64 slot = base + way;
                        const i64 old = __shfl_sync(FULL, tag, way);
                        T* c = cache + slot * cache_width;
                        const bool write_back = old >= 0 && old < n_rows && dirty[slot];
                        if (old >= 0) ++evicted;
                        __syncwarp();
                        evict_and_fill<V>(c, dim, s_off, s_width,
                                          write_back ? host_w + old * w_stride : nullptr,
                                          write_back ? host_s + old * s_stride : nullptr,
                                          host_w + row * w_stride, host_s + row * s_stride,
                                          lane);
                        __syncwarp();
                        filled = true;
                        if (lane == way) { tag = row; sc = lfu ? 1 : now; ls = now; }
                        if (lane == 0) dirty[slot] = 0;
                        ++admitted;
                    }
                }
            }
            if (way >= 0) used |= 1u << way;
            if (lane == 0) slots[r] = way >= 0 ? (int)(base + way) : -1;
        }
        // Every lane's fill and dirty flag above are visible (device-wide) before any tag:
        // a probe on another stream that sees a tag finds its row in place.
        // (A set with hits only moved no row: nothing to order.)
        __syncwarp();
        if (filled) __threadfence();
        tags[base + lane] = tag;
        score[base + lane] = sc;
        last[base + lane] = ls;
    }
    if (lane == 0 && hits + misses) {
        atomicAdd(block_stats + 0, hits + misses);
        atomicAdd(block_stats + 1, hits);
        atomicAdd(block_stats + 2, misses);
        atomicAdd(block_stats + 3, admitted);
        atomicAdd(block_stats + 4, evicted);
    }
    __syncthreads();
    if (threadIdx.x < 5 && block_stats[threadIdx.x])
        atomicAdd(stats + threadIdx.x, block_stats[threadIdx.x]);""")

# The doorkeeper's first sight: set the bit of every distinct row this batch served from the
# host (after cache_insert, which only reads the bits).
CACHE_MARK = KernelDecl(
    "cache_mark", "",
    (("unsigned* __restrict__", "door"), ("i64", "door_bits"),
     ("const int* __restrict__", "set_key"), ("const i64* __restrict__", "run_row"),
     ("const int* __restrict__", "slots"), ("i64", "n"), ("i64", "n_sets"),
     ("const u64* __restrict__", "verdict")),
    r"""
    if (rejected(verdict)) return;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 r = (i64)blockIdx.x * blockDim.x + threadIdx.x; r < n; r += stride) {
        if (set_key[r] >= n_sets || slots[r] >= 0) continue;
        const u64 h = mix64((u64)run_row[r] ^ 0x9e3779b97f4a7c15ull) % (u64)door_bits;
        atomicOr(door + (h >> 5), 1u << (h & 31));
    }""")

# slots[run] = the cache slot holding each distinct row of a sorted batch, or -1: a lookup
# that changes nothing (the update of a batch looks its rows up again, so an eviction
# between its lookup and its update cannot send it to the wrong slot; the host orders it
# after any prefetch pass that could evict its rows while it runs: prefetch.must_wait).
CACHE_PROBE = KernelDecl(
    "cache_probe", "template <typename K>",
    (("const i64* __restrict__", "tags"), ("i64", "n_sets"), ("const K* __restrict__", "keys"),
     ("const i64* __restrict__", "run"), ("i64", "n"), ("i64", "n_rows"), ("i64", "set_size"),
     ("int* __restrict__", "slots"), ("const u64* __restrict__", "verdict")),
    r"""
    if (rejected(verdict)) return;
    const int lane = threadIdx.x & 31;
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    for (i64 j = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; j < n; j += warps) {
        if (j > 0 && keys[j] == keys[j - 1]) continue;
        const i64 key = (i64)keys[j];
        i64 row = key, set;
        if (set_size > 0) {  // set-ordered keys (a collection's)
            if (key < 0 || key >= n_sets * set_size) continue;
            row = set_order_row(key, n_sets, set_size);
            if (row >= n_rows) continue;
            set = key / set_size;
        } else {
            if (row < 0 || row >= n_rows) continue;
            set = set_of(row, n_sets);
        }
        const i64 base = set * WAYS;
        const unsigned hit = __ballot_sync(FULL, tags[base + lane] == row);
        if (lane == 0) slots[run[j]] = hit ? (int)(base + __ffs(hit) - 1) : -1;
    }""")

# Write every dirty cached row back to the host; `drop`: empty the cache as well.
CACHE_FLUSH = KernelDecl(
    "cache_flush", "template <int V, typename T>",
    (("T*", "host_w"), ("i64", "w_stride"), ("T*", "host_s"), ("i64", "s_stride"),
     ("i64", "n_rows"), ("T*", "cache"), ("i64", "cache_width"), ("i64", "dim"),
     ("i64", "s_off"), ("i64* __restrict__", "tags"), ("i64* __restrict__", "score"),
     ("i64* __restrict__", "last"), ("unsigned char* __restrict__", "dirty"),
     ("i64", "n_slots"), ("int", "drop")),
    r"""
    const int lane = threadIdx.x & 31;
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    const i64 s_width = cache_width - s_off;
    for (i64 slot = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; slot < n_slots;
         slot += warps) {
        const i64 row = tags[slot];
        if (row >= 0 && row < n_rows && dirty[slot]) {
            const T* c = cache + slot * cache_width;
            copy_words<V>(host_w + row * w_stride, c, dim, lane);
            copy_words<V>(host_s + row * s_stride, c + s_off, s_width, lane);
        }
        __syncwarp();
        if (lane == 0) {
            dirty[slot] = 0;
            if (drop) { tags[slot] = -1; score[slot] = 0; last[slot] = 0; }
        }
    }""")

# After an update that ran beside a prefetch: the update's rows that lived in host RAM
# (uslots < 0) may have been read by the prefetch before the update wrote them. Re-read each
# into the cache slot the prefetch gave it (full row) or into the prefetch's staging rows
# (weights). Nothing else changed, so nothing else is refreshed.
REFRESH_PREFETCHED = KernelDecl(
    "refresh_prefetched", "template <typename T, typename K>",
    (("T*", "host_w"), ("i64", "w_stride"), ("T*", "host_s"), ("i64", "s_stride"),
     ("i64", "n_rows"), ("T*", "cache"), ("i64", "cache_width"), ("i64", "dim"),
     ("i64", "s_off"), ("const i64* __restrict__", "tags"), ("i64", "n_sets"),
     ("const K* __restrict__", "ukeys"), ("const i64* __restrict__", "urun"), ("i64", "un"),
     ("const int* __restrict__", "uslots"), ("const K* __restrict__", "pkeys"),
     ("const i64* __restrict__", "prun"), ("i64", "pn"), ("const int* __restrict__", "pslots"),
     ("T* __restrict__", "staged"), ("const u64* __restrict__", "uverdict"),
     ("const u64* __restrict__", "pverdict")),
    r"""
    if (rejected(uverdict) || rejected(pverdict)) return;
    const int lane = threadIdx.x & 31;
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    const i64 s_width = cache_width - s_off;
    for (i64 j = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; j < un; j += warps) {
        if (j > 0 && ukeys[j] == ukeys[j - 1]) continue;
        const i64 row = (i64)ukeys[j];
        if (row < 0 || row >= n_rows) continue;
        if (uslots != nullptr && uslots[urun[j]] >= 0) continue;  // updated in the cache
        if (tags != nullptr) {
            const i64 base = set_of(row, n_sets) * WAYS;
            const unsigned hit = __ballot_sync(FULL, tags[base + lane] == row);
            if (hit) {
                T* c = cache + (base + __ffs(hit) - 1) * cache_width;
                for (i64 e = lane; e < dim; e += 32) c[e] = host_w[row * w_stride + e];
                for (i64 e = lane; e < s_width; e += 32) c[s_off + e] = host_s[row * s_stride + e];
                continue;
            }
        }
        i64 lo = 0, hi = pn;
        while (lo < hi) {
            const i64 mid = (lo + hi) >> 1;
            if ((i64)pkeys[mid] < row) lo = mid + 1; else hi = mid;
        }
        if (lo == pn || (i64)pkeys[lo] != row) continue;  // not prefetched
        const i64 r = prun[lo];
        if (pslots != nullptr && pslots[r] >= 0) continue;
        T* dst = staged + r * dim;
        for (i64 e = lane; e < dim; e += 32) dst[e] = host_w[row * w_stride + e];
    }""")

CACHE_KERNEL = _HEAD + "".join(d.source() for d in (
    CACHE_SETS, CACHE_INSERT, CACHE_MARK, CACHE_PROBE, CACHE_FLUSH, REFRESH_PREFETCHED))

_TYPES = {"float32": "float", "float64": "double"}
_KEYS = {4: "int", 8: "long long"}


def _vector_widths(dtype_name: str) -> tuple:
    return (1, 4) if dtype_name == "float32" else (1, 2)


def _all_names():
    yield CACHE_MARK.instance()
    for K in _KEYS.values():
        yield CACHE_SETS.instance(K)
        yield CACHE_PROBE.instance(K)
    for dtype_name, T in _TYPES.items():
        for vec in _vector_widths(dtype_name):
            yield CACHE_INSERT.instance(vec, T)
            yield CACHE_FLUSH.instance(vec, T)
        for K in _KEYS.values():
            yield REFRESH_PREFETCHED.instance(T, K)


CACHE_MODULE = KernelModule("table_cache", CACHE_KERNEL, tuple(_all_names()))
