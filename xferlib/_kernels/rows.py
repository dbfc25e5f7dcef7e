"""Row transfer kernels: gather, scatter and scatter-add of table rows.

The fused kernels (gather_fused, scatter_fused; batches up to a few tens of thousands of
positions) take the indices as given, check them themselves and need no sort (see their
comment). The others take the batch's rows sorted (``rows``, ascending; ``perm`` maps a sorted
position back to its batch position; a stable sort) and give one group of lanes to each run
of equal rows: the run's row is read or written once (repeated rows cost one read; sorted
rows also found the GPU's address translations warm in an earlier measurement). Lanes move
16-byte words when the row width and the base addresses allow it.

Every kernel checks each row against ``n_rows`` and skips rows outside the table, so no
input can make it touch memory outside its arrays (the host validates first and raises).
"""

from xferlib._kernels._declare import KernelDecl, defines
from xferlib._kernels._registry import KernelModule

# One-block sort: items per thread of each instantiation; the tile is 1024 times that. Past
# one tile of 2,048 positions the batch sort is the radix sort (``radix.py``); one block
# sorting 16,384 took 64 us on an H100 where tiles of 2,048 and merges took 24.
SMALL_SORT_ITEMS = (2,)
SMALL_SORT_THREADS = 1024
SMALL_SORT_TILE = SMALL_SORT_THREADS * max(SMALL_SORT_ITEMS)
# The fused kernels' block, and the most positions one block of scatter_fused owns (its
# shared hash has twice as many slots).
FUSED_THREADS = 1024
FUSED_CHUNK_MAX = 1024
FUSED_HASH_MAX = 2 * FUSED_CHUNK_MAX

_HEAD = defines(SMALL_SORT_THREADS=SMALL_SORT_THREADS, FUSED_THREADS=FUSED_THREADS,
                FUSED_HASH_MAX=FUSED_HASH_MAX) + r"""
typedef long long i64;

// Half-precision types as raw bits: conversions go through PTX, so no CUDA header is needed
// at NVRTC compile time.
struct f16 { unsigned short bits; };
struct bf16 { unsigned short bits; };

__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(f16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}
__device__ __forceinline__ float to_acc(bf16 x) {
    return __uint_as_float(((unsigned int)x.bits) << 16);
}
__device__ __forceinline__ void from_acc(float a, float& out) { out = a; }
__device__ __forceinline__ void from_acc(double a, double& out) { out = a; }
__device__ __forceinline__ void from_acc(float a, f16& out) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(a));
    out.bits = h;
}
__device__ __forceinline__ void from_acc(float a, bf16& out) {
    unsigned int u = __float_as_uint(a);
    if ((u & 0x7fffffffu) > 0x7f800000u) {          // NaN stays a quiet NaN
        out.bits = (unsigned short)((u >> 16) | 0x40u);
    } else {                                         // round to nearest even
        u += 0x7fffu + ((u >> 16) & 1u);
        out.bits = (unsigned short)(u >> 16);
    }
}

template <typename T> struct acc_type { typedef float type; };
template <> struct acc_type<double> { typedef double type; };

template <typename T, int N> struct alignas(sizeof(T) * N) pack { T v[N]; };

"""

# verdict[0]: first position i with idx[i] outside [0, n_rows); verdict[1] (check_order
# only): first position with idx[i] < idx[i-1]. Both atomic minimums, all ones when clean.
# Also writes the 32-bit keys when they fit (a narrower radix sort is cheaper). The kernels
# below read the verdict and do nothing at all when it is set, so a rejected batch changes
# no memory even though the host learns of it only after they were queued.
CHECK_AND_NARROW = KernelDecl(
    "check_and_narrow", "template <typename I>",
    (("const I* __restrict__", "idx"), ("i64", "n"), ("i64", "n_rows"),
     ("unsigned long long* __restrict__", "verdict"), ("int* __restrict__", "keys32"),
     ("int", "check_order")),
    r"""
    i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        i64 v = (i64)idx[i];
        const bool bad = v < 0 || v >= n_rows;
        if (bad) atomicMin(&verdict[0], (unsigned long long)i);
        if (check_order && i > 0 && (i64)idx[i - 1] > v)
            atomicMin(&verdict[1], (unsigned long long)i);
        if (keys32 != nullptr) keys32[i] = bad ? 0 : (int)v;
    }""")

# Exclusive prefix of x over a block's threads (thread order; any whole number of warps up
# to 32): warp shuffles and one shared array of warp totals. The tile sort's and the radix
# sort's (radix.py).
BLOCK_SCAN = r"""
__device__ __forceinline__ unsigned int block_exclusive_scan(unsigned int x,
                                                             unsigned int* warp_sums) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = (int)(blockDim.x >> 5);
    unsigned int inclusive = x;
    #pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        unsigned int y = __shfl_up_sync(0xffffffffu, inclusive, d);
        if (lane >= d) inclusive += y;
    }
    if (lane == 31) warp_sums[warp] = inclusive;
    __syncthreads();
    if (warp == 0) {
        unsigned int w = lane < warps ? warp_sums[lane] : 0u;
        unsigned int wi = w;
        #pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            unsigned int y = __shfl_up_sync(0xffffffffu, wi, d);
            if (lane >= d) wi += y;
        }
        if (lane < warps) warp_sums[lane] = wi - w;  // exclusive prefix of the warp totals
    }
    __syncthreads();
    const unsigned int out = warp_sums[warp] + inclusive - x;
    __syncthreads();  // warp_sums is reused by the next call
    return out;
}
"""

_SORT_HELPERS = r"""
__device__ __forceinline__ bool rejected(const unsigned long long* verdict) {
    return (verdict[0] & verdict[1]) != ~0ull;
}

// Small batches (n <= 1024 * ITEMS): check, narrow and stably sort (row, position) pairs in
// ONE block, in shared memory: one launch instead of a check kernel, a device-wide radix sort
// and a gather of the sorted keys. LSD radix sort, 4 bits a pass over the `bits` low bits.
// Thread t owns positions t*ITEMS .. t*ITEMS+ITEMS-1 (blocked order), so a digit-major
// exclusive scan of per-thread digit counts gives every item its stable destination.
// Shared arrays are padded by one word every 32 (SPAD) so that blocked accesses, which stride
// by ITEMS words, fall in distinct banks.
#define SPAD(i) ((i) + ((i) >> 5))
""" + BLOCK_SCAN

CHECK_AND_SORT_SMALL = KernelDecl(
    "check_and_sort_small", "template <typename I, int ITEMS>",
    (("const I* __restrict__", "idx"), ("i64", "n_total"), ("i64", "n_rows"), ("int", "bits"),
     ("int* __restrict__", "rows_out"), ("i64* __restrict__", "perm_out"),
     ("unsigned long long* __restrict__", "first_bad")),
    r"""
    const int TILE = SMALL_SORT_THREADS * ITEMS;
    // Block b sorts positions [b * TILE, b * TILE + n): one tile (the batch sort launches
    // one block). first_bad was set to all ones by the caller; blocks report by atomicMin.
    const i64 base = (i64)blockIdx.x * TILE;
    const int n = (int)(n_total - base < TILE ? n_total - base : TILE);
    idx += base;
    rows_out += base;
    perm_out += base;
    const int COUNTS = 16 * SMALL_SORT_THREADS;  // [16 digits][THREADS]
    extern __shared__ unsigned int smem[];
    unsigned int* counts = smem;
    unsigned int* keys = smem + SPAD(COUNTS);
    unsigned int* vals = keys + SPAD(TILE);
    __shared__ unsigned int warp_sums[32];
    __shared__ unsigned long long bad;
    const int t = threadIdx.x;
    if (t == 0) bad = ~0ull;
    __syncthreads();
    const unsigned int pad = bits >= 32 ? 0xffffffffu : ((1u << bits) - 1u);
    unsigned int k[ITEMS], v[ITEMS];
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int p = t * ITEMS + i;
        v[i] = (unsigned int)p;
        k[i] = pad;  // padding sorts last: it ties only with valid keys, and comes after them
        if (p < n) {
            const i64 x = (i64)idx[p];
            if (x < 0 || x >= n_rows) atomicMin(&bad, (unsigned long long)p);
            else k[i] = (unsigned int)x;
        }
    }
    for (int shift = 0; shift < bits; shift += 4) {
        #pragma unroll
        for (int d = 0; d < 16; ++d) counts[SPAD(d * SMALL_SORT_THREADS + t)] = 0;
        #pragma unroll
        for (int i = 0; i < ITEMS; ++i)
            counts[SPAD(((k[i] >> shift) & 15u) * SMALL_SORT_THREADS + t)] += 1;
        __syncthreads();
        unsigned int local[16], sum = 0;
        #pragma unroll
        for (int j = 0; j < 16; ++j) { local[j] = counts[SPAD(t * 16 + j)]; sum += local[j]; }
        unsigned int prefix = block_exclusive_scan(sum, warp_sums);
        #pragma unroll
        for (int j = 0; j < 16; ++j) { counts[SPAD(t * 16 + j)] = prefix; prefix += local[j]; }
        __syncthreads();
        #pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
            const unsigned int slot =
                counts[SPAD(((k[i] >> shift) & 15u) * SMALL_SORT_THREADS + t)]++;
            keys[SPAD(slot)] = k[i];
            vals[SPAD(slot)] = v[i];
        }
        __syncthreads();
        #pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
            k[i] = keys[SPAD(t * ITEMS + i)];
            v[i] = vals[SPAD(t * ITEMS + i)];
        }
        __syncthreads();
    }
    #pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int p = t * ITEMS + i;
        if (p < n) {
            rows_out[p] = (int)k[i];
            perm_out[p] = base + (i64)v[i];
        }
    }
    if (t == 0 && bad != ~0ull) atomicMin(&first_bad[0], (unsigned long long)(base + bad));""",
    launch_bounds="__launch_bounds__(SMALL_SORT_THREADS)")

_RUN_HELPERS = r"""
// Each sorted position k is looked at by one group of `group` lanes (a power of two <= 32,
// about the row width in words, so narrow rows still keep every lane busy). The group that
// sees the first position of a run of equal rows handles the whole run; the other groups of
// that run move on. `rows[k]` is the row of sorted position k, `perm[k]` its batch position.
#define FOR_EACH_RUN_HEAD(n, group)                                                         \
    const int lane = threadIdx.x & (group - 1);                                             \
    const i64 num_groups = ((i64)gridDim.x * blockDim.x) / group;                           \
    for (i64 k = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / group; k < n;              \
         k += num_groups)

template <typename K>
__device__ __forceinline__ i64 run_end(const K* rows, i64 k, i64 n, K row) {
    i64 end = k + 1;
    while (end < n && rows[end] == row) ++end;
    return end;
}

"""

# out[perm[j], :] = table[rows[j], :] for every sorted position j; W is the word a lane moves.
GATHER_SORTED = KernelDecl(
    "gather_sorted", "template <typename W, typename K>",
    (("const W* __restrict__", "table"), ("i64", "n_rows"), ("i64", "table_stride"),
     ("i64", "width"), ("const K* __restrict__", "rows"), ("const i64* __restrict__", "perm"),
     ("i64", "n"), ("W* __restrict__", "out"), ("i64", "out_stride"),
     ("const unsigned long long* __restrict__", "first_bad"), ("int", "group")),
    r"""
    if (rejected(first_bad)) return;
    FOR_EACH_RUN_HEAD(n, group) {
        const K row = rows[k];
        if ((k > 0 && rows[k - 1] == row) || row < 0 || (i64)row >= n_rows) continue;
        const i64 end = run_end(rows, k, n, row);
        const W* src = table + (i64)row * table_stride;
        for (i64 c = lane; c < width; c += group) {
            const W v = src[c];
            for (i64 j = k; j < end; ++j) out[perm[j] * out_stride + c] = v;
        }
    }""")

# table[rows[j], :] = src[perm[j], :]; of several positions with one row, the last one wins.
SCATTER_SORTED = KernelDecl(
    "scatter_sorted", "template <typename W, typename K>",
    (("W* __restrict__", "table"), ("i64", "n_rows"), ("i64", "table_stride"),
     ("i64", "width"), ("const K* __restrict__", "rows"), ("const i64* __restrict__", "perm"),
     ("i64", "n"), ("const W* __restrict__", "src"), ("i64", "src_stride"),
     ("const unsigned long long* __restrict__", "first_bad"), ("int", "group")),
    r"""
    if (rejected(first_bad)) return;
    FOR_EACH_RUN_HEAD(n, group) {
        const K row = rows[k];
        if ((k > 0 && rows[k - 1] == row) || row < 0 || (i64)row >= n_rows) continue;
        const i64 last = run_end(rows, k, n, row) - 1;
        const W* s = src + perm[last] * src_stride;
        W* dst = table + (i64)row * table_stride;
        for (i64 c = lane; c < width; c += group) dst[c] = s[c];
    }""")

# table[r, :] += sum of src[p, :] over positions p with row r, summed in position order in
# float (double for double tables): deterministic, one read-modify-write per row.
SCATTER_ADD_SORTED = KernelDecl(
    "scatter_add_sorted", "template <typename T, int N, typename K>",
    (("T* __restrict__", "table"), ("i64", "n_rows"), ("i64", "table_stride"),
     ("i64", "width"), ("const K* __restrict__", "rows"), ("const i64* __restrict__", "perm"),
     ("i64", "n"), ("const T* __restrict__", "src"), ("i64", "src_stride"),
     ("const unsigned long long* __restrict__", "first_bad"), ("int", "group")),
    r"""
    if (rejected(first_bad)) return;
    typedef typename acc_type<T>::type A;
    typedef pack<T, N> P;
    // Strides and width count packs of N elements.
    P* packed_table = reinterpret_cast<P*>(table);
    const P* packed_src = reinterpret_cast<const P*>(src);
    FOR_EACH_RUN_HEAD(n, group) {
        const K row = rows[k];
        if ((k > 0 && rows[k - 1] == row) || row < 0 || (i64)row >= n_rows) continue;
        const i64 end = run_end(rows, k, n, row);
        P* dst = packed_table + (i64)row * table_stride;
        for (i64 c = lane; c < width; c += group) {
            P cur = dst[c];
            A acc[N];
            #pragma unroll
            for (int e = 0; e < N; ++e) acc[e] = to_acc(cur.v[e]);
            for (i64 j = k; j < end; ++j) {
                const P s = packed_src[perm[j] * src_stride + c];
                #pragma unroll
                for (int e = 0; e < N; ++e) acc[e] += to_acc(s.v[e]);
            }
            #pragma unroll
            for (int e = 0; e < N; ++e) from_acc(acc[e], cur.v[e]);
            dst[c] = cur;
        }
    }""")

_FUSED_HELPERS = r"""// ------------------------------------------------------------------------- fused kernels
// Batches up to a few tens of thousands of positions: ONE launch per call, no sort. Every
// block first checks EVERY index (an L2-resident scan, a few percent of the transfer), so all
// blocks agree on the verdict and a bad batch makes every block skip its writes: nothing is
// written, without a grid-wide barrier. The last block to finish (a ticket on `done`, one
// counter per verdict slot, rearmed by that block) writes the verdict straight into its
// pinned host slot: word 1, a system fence, word 0. The host reads word 0 to learn that the
// kernel has finished and whether the batch was clean; no copy, event or memset per call.
// Every argument is 8 bytes wide, so the host fills one cached argument buffer per table.

__device__ __forceinline__ unsigned long long warp_min(unsigned long long x) {
    #pragma unroll
    for (int d = 16; d > 0; d >>= 1) {
        const unsigned long long y = __shfl_xor_sync(0xffffffffu, x, d);
        x = y < x ? y : x;
    }
    return x;
}

// This block's scan of every index into s_bad (set to all ones and synchronized by the
// caller): the first position out of range, and (check_order) the first out of order.
template <typename I>
__device__ __forceinline__ void fused_check(const I* __restrict__ idx, i64 n, i64 n_rows,
                                            i64 check_order, unsigned long long* s_bad) {
    unsigned long long bad = ~0ull, desc = ~0ull;
    #pragma unroll 4
    for (i64 i = threadIdx.x; i < n; i += blockDim.x) {
        const i64 v = (i64)idx[i];
        if ((v < 0 || v >= n_rows) && bad == ~0ull) bad = (unsigned long long)i;
        if (check_order && i > 0 && desc == ~0ull && (i64)idx[i - 1] > v)
            desc = (unsigned long long)i;
    }
    bad = warp_min(bad);
    desc = warp_min(desc);
    if ((threadIdx.x & 31) == 0) {
        if (bad != ~0ull) atomicMin(&s_bad[0], bad);
        if (desc != ~0ull) atomicMin(&s_bad[1], desc);
    }
}

__device__ __forceinline__ void fused_finish(const unsigned long long* s_bad,
                                             unsigned long long* verdict,
                                             unsigned int* done) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();  // this block's reads and writes come before its ticket
        const unsigned int ticket = atomicAdd(done, 1u);
        if (ticket == gridDim.x - 1) {  // the last block: every block is done
            atomicExch(done, 0u);        // rearmed for the next kernel given this slot
            __threadfence_system();
            volatile unsigned long long* v = verdict;
            v[1] = s_bad[1];
            __threadfence_system();
            v[0] = s_bad[0];             // the host waits on word 0
        }
    }
}

"""

# out[k, :] = table[idx[k], :]. Groups of `group` lanes take positions in turn. With
# `sorted` (the caller's promise, checked) the first position of a run of equal rows reads
# the row once and writes every position of the run.
GATHER_FUSED = KernelDecl(
    "gather_fused", "template <typename W, typename I>",
    (("const W* __restrict__", "table"), ("i64", "n_rows"), ("i64", "table_stride"),
     ("i64", "width"), ("const I* __restrict__", "idx"), ("i64", "n"),
     ("W* __restrict__", "out"), ("i64", "out_stride"), ("i64", "group"), ("i64", "sorted"),
     ("unsigned long long*", "verdict"), ("unsigned int*", "done")),
    r"""
    __shared__ unsigned long long s_bad[2];
    if (threadIdx.x == 0) { s_bad[0] = ~0ull; s_bad[1] = ~0ull; }
    __syncthreads();
    fused_check(idx, n, n_rows, sorted, s_bad);
    __syncthreads();
    if ((s_bad[0] & s_bad[1]) == ~0ull) {
        const int g = (int)group;
        const int lane = threadIdx.x & (g - 1);
        const i64 groups = ((i64)gridDim.x * blockDim.x) / g;
        for (i64 k = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / g; k < n; k += groups) {
            const i64 row = (i64)idx[k];
            if (row < 0 || row >= n_rows) continue;
            const W* s = table + row * table_stride;
            if (!sorted) {
                W* d = out + k * out_stride;
                for (i64 c = lane; c < width; c += g) d[c] = s[c];
                continue;
            }
            if (k > 0 && (i64)idx[k - 1] == row) continue;
            i64 end = k + 1;
            while (end < n && (i64)idx[end] == row) ++end;
            for (i64 c = lane; c < width; c += g) {
                const W v = s[c];
                for (i64 j = k; j < end; ++j) out[j * out_stride + c] = v;
            }
        }
    }
    fused_finish(s_bad, verdict, done);""", launch_bounds="__launch_bounds__(FUSED_THREADS)")

_HASH_SLOT = r"""
__device__ __forceinline__ int hash_slot(i64 key, int bits) {
    return (int)(((unsigned long long)key * 0x9E3779B97F4A7C15ull) >> (64 - bits));
}

"""

# table[idx[k], :] = src[k, :], the last position of a row winning. Block b owns positions
# [b * chunk, b * chunk + chunk): it puts their rows in a shared hash (row -> its last
# position in the chunk), then, while checking every index, marks a row superseded when a
# later chunk has it too. Each row is thus written once, by the block holding its last
# position, with no sort. `sorted`: the last position of each run writes, no hash.
SCATTER_FUSED = KernelDecl(
    "scatter_fused", "template <typename W, typename I>",
    (("W* __restrict__", "table"), ("i64", "n_rows"), ("i64", "table_stride"),
     ("i64", "width"), ("const I* __restrict__", "idx"), ("i64", "n"),
     ("const W* __restrict__", "src"), ("i64", "src_stride"), ("i64", "group"),
     ("i64", "sorted"), ("unsigned long long*", "verdict"), ("unsigned int*", "done"),
     ("i64", "chunk"), ("i64", "hash_bits")),
    r"""
    __shared__ long long keys[FUSED_HASH_MAX];
    __shared__ int last[FUSED_HASH_MAX];  // last position in the chunk; -1: none or superseded
    __shared__ unsigned long long s_bad[2];
    const int bits = (int)hash_bits, slots = 1 << bits;
    const i64 start = (i64)blockIdx.x * chunk;
    const i64 end = start + chunk < n ? start + chunk : n;
    for (int s = threadIdx.x; s < slots; s += blockDim.x) { keys[s] = -1; last[s] = -1; }
    if (threadIdx.x == 0) { s_bad[0] = ~0ull; s_bad[1] = ~0ull; }
    __syncthreads();
    if (!sorted) {
        for (i64 p = start + threadIdx.x; p < end; p += blockDim.x) {
            const i64 v = (i64)idx[p];
            if (v < 0 || v >= n_rows) continue;
            for (int s = hash_slot(v, bits);; s = (s + 1) & (slots - 1)) {
                const long long prev = (long long)atomicCAS(
                    (unsigned long long*)&keys[s], ~0ull, (unsigned long long)v);
                if (prev == -1 || prev == v) { atomicMax(&last[s], (int)(p - start)); break; }
            }
        }
        __syncthreads();
        for (i64 i = end + threadIdx.x; i < n; i += blockDim.x) {  // later chunks
            const i64 v = (i64)idx[i];
            if (v < 0 || v >= n_rows) continue;
            for (int s = hash_slot(v, bits);; s = (s + 1) & (slots - 1)) {
                const long long k = keys[s];
                if (k == v) { last[s] = -1; break; }
                if (k == -1) break;
            }
        }
    }
    fused_check(idx, n, n_rows, sorted, s_bad);
    __syncthreads();
    if ((s_bad[0] & s_bad[1]) == ~0ull) {
        const int g = (int)group;
        const int lane = threadIdx.x & (g - 1);
        const int groups = blockDim.x / g;
        const i64 count = sorted ? end - start : (i64)slots;
        for (i64 e = threadIdx.x / g; e < count; e += groups) {
            i64 row, p;
            if (sorted) {
                p = start + e;
                row = (i64)idx[p];
                if (p + 1 < n && (i64)idx[p + 1] == row) continue;
            } else {
                if (last[e] < 0) continue;
                row = keys[e];
                p = start + last[e];
            }
            if (row < 0 || row >= n_rows) continue;
            W* d = table + row * table_stride;
            const W* s = src + p * src_stride;
            for (i64 c = lane; c < width; c += g) d[c] = s[c];
        }
    }
    fused_finish(s_bad, verdict, done);""", launch_bounds="__launch_bounds__(FUSED_THREADS)")

ROWS_KERNEL = (_HEAD + CHECK_AND_NARROW.source() + _SORT_HELPERS
               + CHECK_AND_SORT_SMALL.source() + _RUN_HELPERS
               + "".join(d.source() for d in (GATHER_SORTED, SCATTER_SORTED, SCATTER_ADD_SORTED))
               + _FUSED_HELPERS + GATHER_FUSED.source() + _HASH_SLOT + SCATTER_FUSED.source())

# Words a lane moves in the copy kernels, by size in bytes.
WORD_TYPES = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}
# Element types of scatter-add, by NumPy dtype name, with the pack width of a 16-byte access.
ADD_TYPES = {"float32": ("float", 4), "float64": ("double", 2), "float16": ("f16", 8),
             "bfloat16": ("bf16", 8)}
KEY_TYPES = {4: "int", 8: "long long"}
INDEX_TYPES = {"int32": "int", "int64": "long long"}


def small_sort_name(index_dtype_name: str, items: int) -> str:
    return CHECK_AND_SORT_SMALL.instance(INDEX_TYPES[index_dtype_name], items)


def small_sort_shared_bytes(items: int) -> int:
    """Dynamic shared memory of one instantiation: padded counts, keys and positions."""

    def padded(count):
        return count + count // 32

    return 4 * (padded(16 * SMALL_SORT_THREADS) + 2 * padded(SMALL_SORT_THREADS * items))


def _all_names():
    for K in KEY_TYPES.values():
        for W in WORD_TYPES.values():
            yield GATHER_SORTED.instance(W, K)
            yield SCATTER_SORTED.instance(W, K)
            yield GATHER_FUSED.instance(W, K)
            yield SCATTER_FUSED.instance(W, K)
        for T, pack in ADD_TYPES.values():
            yield SCATTER_ADD_SORTED.instance(T, pack, K)
            yield SCATTER_ADD_SORTED.instance(T, 1, K)
    for I in INDEX_TYPES.values():
        yield CHECK_AND_NARROW.instance(I)
        for items in SMALL_SORT_ITEMS:
            yield CHECK_AND_SORT_SMALL.instance(I, items)


ROWS_MODULE = KernelModule("rows", ROWS_KERNEL, tuple(_all_names()))

_TILE_SORTS = {}  # (device, key dtype, items) -> (tile sort, its shared bytes)


def tile_sort_kernels(dtype_name: str, items: int):
    """``(tile sort, its dynamic shared bytes)``: the tile sort of ``items`` keys per thread
    for ``dtype_name`` keys, with its dynamic shared memory opted in once (the attribute is a
    driver call); looked up once per device. Used by the batch sort
    (``xferlib.batch.sort_on_device``) of the batch plans and the TT plans."""
    import cupy

    key = (cupy.cuda.runtime.getDevice(), dtype_name, items)
    found = _TILE_SORTS.get(key)
    if found is None:
        kernel = ROWS_MODULE.get_function(small_sort_name(dtype_name, items))
        shared = small_sort_shared_bytes(items)
        if kernel.max_dynamic_shared_size_bytes < shared:
            kernel.max_dynamic_shared_size_bytes = shared
        found = _TILE_SORTS[key] = (kernel, shared)
    return found
