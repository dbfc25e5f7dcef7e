"""TT embedding kernels: rows from cores, pooling, backward grouped by index prefix, update.

The table's factorization (``p``, ``q``, ranks) is compiled in (one module per shape, built
on first use), so every product's loops have constant bounds. Core ``k`` holds ``P(k)`` slices
of ``W(k) = R(k) * Q(k) * R(k+1)`` floats; the *prefix* of a row is its first ``D - 1``
digits, whose slices multiply to a ``(A_LAST x R_LAST)`` matrix that the last core's slice
finishes into the row.

The pipeline over a batch sorted by row (rows sharing a prefix sit side by side):

* ``tt_prepare``: resets the verdict, validates offsets and computes the sort keys; the tile
  sort adds bad indices to the verdict and ``tt_merge_all`` finishes the sort in one launch. A
  rejected batch makes every later kernel a no-op, so nothing is written.
* ``tt_rows``: each block walks ``CHUNK`` sorted positions, recomputes the prefix product only
  when the prefix changes, and finishes each row with one small product.
* ``tt_pool``: sums (or averages) each bag's rows in bag order (deterministic).
* ``tt_bwd_pieces``: per *piece* (a run of one prefix inside a chunk) accumulates ``U = sum
  g_n G_last[i_d]^T`` (the upstream of the prefix product) and per lookup the last core's
  slice gradient ``Left^T g_n``; writes the keys that group them by core row.
* ``tt_reduce``: one block per core row sums its contributions in sorted order (no atomics)
  into a gradient row (at large batches a long list is split over several blocks, whose
  partials ``tt_reduce_join`` adds in order); prefix cores are differentiated through the
  prefix chain per piece.
* ``tt_update``: the fused optimizer on every touched core row (FBGEMM's rules: the row
  reductions here, the per-element steps from ``xferlib/_kernels/rules.py``).
* row cache, no launch of its own: ``tt_prepare`` finds each lookup's cache slot (binary
  search of the sorted cached rows); ``tt_rows`` counts each run of one row once in the
  frequency table and skips the lookups the cache serves; ``tt_pool`` reads their dense rows; ``tt_bwd_pieces``
  leaves each cached run's per-block gradient sums; the blocks of ``tt_update`` past the core
  rows sum them per cached row (``tt_cache_update``, deterministic) and step the dense rows.
  The cache's device functions live in ``xferlib/_kernels/tt_cache.py`` and are spliced into
  ``TT_KERNEL`` at their place.

Every kernel bounds every index by the compiled shape, so no input reaches outside an array.
"""

from __future__ import annotations

import functools
import math

from xferlib._kernels._registry import KernelModule
from xferlib._kernels.rules import RULES_KERNEL
from xferlib._kernels.tt_cache import TT_CACHE_LOOKUP_KERNEL, TT_CACHE_UPDATE_KERNEL

CHUNK = 16  # sorted positions per block in tt_rows / tt_bwd_pieces
THREADS = 128
REDUCE_THREADS = 256
REDUCE_SPLITS = 8  # blocks per core row in tt_reduce at large batches (see reduce_splits)
PIECE_BATCH = 8  # PB in the kernel source
UPDATE_THREADS = 256  # tt_update's block size (its cache blocks are written for it)
CACHE_CHUNK = 64  # sorted positions per chunk of the cache update (CACHE_CHUNK in tt_cache.py)

TT_KERNEL = r"""
typedef long long i64;
typedef unsigned long long u64;

constexpr int D = TT_D;
__host__ __device__ constexpr i64 P(int k) {
    return k == 0 ? TT_P0 : k == 1 ? TT_P1 : k == 2 ? TT_P2 : k == 3 ? TT_P3 : 1;
}
__host__ __device__ constexpr int Q(int k) {
    return k == 0 ? TT_Q0 : k == 1 ? TT_Q1 : k == 2 ? TT_Q2 : k == 3 ? TT_Q3 : 1;
}
// Ranks padded with 1 at both ends: R(0) = R(D) = 1.
__host__ __device__ constexpr int R(int k) {
    return (k <= 0 || k >= D) ? 1 : k == 1 ? TT_R1 : k == 2 ? TT_R2 : TT_R3;
}
__host__ __device__ constexpr int W(int k) { return R(k) * Q(k) * R(k + 1); }
__host__ __device__ constexpr i64 STRIDE(int k) { return k >= D - 1 ? 1 : P(k + 1) * STRIDE(k + 1); }
// prod Q(f .. l-1)
__host__ __device__ constexpr int QPROD(int f, int l) { return f >= l ? 1 : Q(f) * QPROD(f + 1, l); }
// Core k's first slice in the flat gradient buffer / touched flags / grid of row blocks.
__host__ __device__ constexpr i64 GOFF(int k) { return k <= 0 ? 0 : GOFF(k - 1) + P(k - 1) * W(k - 1); }
__host__ __device__ constexpr i64 ROFF(int k) { return k <= 0 ? 0 : ROFF(k - 1) + P(k - 1); }
// The batch is sorted by a key that puts core LEAD's digit first, then the others in order:
// with three cores LEAD is the middle core, whose slices are the largest (R x q x R), so rows
// side by side share them and a block stages each once; otherwise the key is the row itself.
// Pieces (runs of one prefix, digits 0..D-2) stay contiguous either way.
constexpr int LEAD = TT_D == 3 ? 1 : 0;
// Every core but LEAD is "keyed": its items (pieces, or lookups for the last core) are sorted
// by (core, digit) into region REGION(k) of the item keys: key = KOFF(k) + digit.
__host__ __device__ constexpr int REGION(int k) { return k < LEAD ? k : k - 1; }
__host__ __device__ constexpr int KOFF(int k) {
    return k <= 0 ? 0 : KOFF(k - 1) + (k - 1 == LEAD ? 0 : (int)P(k - 1));
}

constexpr int DIM = QPROD(0, D);
constexpr int A_LAST = QPROD(0, D - 1);
constexpr int R_LAST = R(D - 1);
constexpr int QL = Q(D - 1);
constexpr int UW = A_LAST * R_LAST;           // a piece's upstream U
constexpr int CW = R_LAST * QL;               // a lookup's last-core slice gradient
constexpr i64 NUM_ROWS = P(0) * STRIDE(0);
constexpr int SENTINEL = KOFF(D);             // key of an item that is not a piece start
constexpr int CHUNK = TT_CHUNK;
constexpr int MAXBUF = TT_MAXBUF;             // largest chain product (floats)
constexpr int MAXW = TT_MAXW;                 // largest slice
constexpr int MAXV = TT_MAXV;                 // largest L^T U intermediate
constexpr int MAXS = TT_MAXS;                 // largest staged right-hand slice (padded)
constexpr int PB = 8;                         // pieces staged at once by the 3-core reduction
constexpr int REDUCE_THREADS = TT_REDUCE_THREADS;
constexpr int BWD_THREADS = TT_THREADS;  // tt_bwd_pieces' block size

__device__ __forceinline__ bool rejected(const u64* v) { return v[0] != ~0ull || v[1] != ~0ull; }

__device__ __forceinline__ i64 bound_at(const i64* off, i64 n_off, i64 n, i64 t) {
    return t < n_off ? off[t] : n;
}

__device__ __forceinline__ void digits_of(i64 row, i64* dig) {
#pragma unroll
    for (int k = 0; k < D; ++k) dig[k] = (row / STRIDE(k)) % P(k);
}

// Rows per value of the lead digit, and the sort key of a row (see LEAD) and back.
constexpr i64 SPAN = NUM_ROWS / P(LEAD);
__device__ __forceinline__ i64 key_of(i64 row) {
    if constexpr (LEAD == 0) {
        return row;
    } else {  // three cores: (i1, i0, i2)
        return ((row / STRIDE(1)) % P(1)) * SPAN + (row / STRIDE(0)) * P(2) + row % P(2);
    }
}
__device__ __forceinline__ void digits_of_key(i64 key, i64* dig) {
    if constexpr (LEAD == 0) {
        digits_of(key, dig);
    } else {
        dig[1] = key / SPAN;
        dig[0] = (key / P(2)) % P(0);
        dig[2] = key % P(2);
    }
}
__device__ __forceinline__ i64 row_of_key(i64 key) {
    if constexpr (LEAD == 0) {
        return key;
    } else {
        return (key / P(2)) % P(0) * STRIDE(0) + (key / SPAN) * STRIDE(1) + key % P(2);
    }
}
""" + TT_CACHE_LOOKUP_KERNEL + r"""

// out (M x N) (+)= op(a) (M x K) op(b) (K x N), row-major; TA: a is stored (K x M); TB: b is
// stored (N x K); LDB: b's row stride (a padded staging). Where there are outputs enough, a
// thread computes a TM x TN tile (rows m0..m0+TM-1, columns cb + j * N / TN, so lanes read
// neighbouring columns), reusing each loaded value TM or TN times: these products are bound
// by shared-memory loads, not arithmetic. Each output is owned by one thread, the same on
// every call of one instantiation: accumulating calls need no barrier between them.
template <int M, int K, int N, bool TA, bool TB, bool ACC, int LDB = (TB ? K : N)>
__device__ __forceinline__ void block_matmul(const float* a, const float* b, float* out) {
    constexpr int TM = (M % 4 == 0 && (M / 4) * N >= 128) ? 4 : 1;
    constexpr int TN = (N % 4 == 0 && (M / TM) * (N / 4) >= 128) ? 4 : 1;
    constexpr int NT = N / TN, TILES = (M / TM) * NT;
    for (int tile = threadIdx.x; tile < TILES; tile += blockDim.x) {
        const int m0 = (tile / NT) * TM, cb = tile % NT;
        float s[TM][TN];
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int j = 0; j < TN; ++j) s[i][j] = ACC ? out[(m0 + i) * N + cb + j * NT] : 0.f;
#pragma unroll 4
        for (int k = 0; k < K; ++k) {
            float av[TM], bv[TN];
#pragma unroll
            for (int i = 0; i < TM; ++i) av[i] = TA ? a[k * M + m0 + i] : a[(m0 + i) * K + k];
#pragma unroll
            for (int j = 0; j < TN; ++j) {
                const int c = cb + j * NT;
                bv[j] = TB ? b[c * LDB + k] : b[k * LDB + c];
            }
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) s[i][j] += av[i] * bv[j];
        }
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int j = 0; j < TN; ++j) out[(m0 + i) * N + cb + j * NT] = s[i][j];
    }
}

// out (M x N) (+)= a (M x K) b^T, b stored (N x K), for long K: one warp per output, lanes
// split K, so both operands are read along contiguous rows (coalesced from global memory).
// Warp w owns outputs w, w + warps, ...
template <int M, int K, int N, bool ACC>
__device__ __forceinline__ void warp_matmul_nt(const float* a, const float* b, float* out) {
    const int lanes = blockDim.x < 32 ? blockDim.x : 32;
    const int lane = threadIdx.x % lanes, warp = threadIdx.x / lanes, warps = blockDim.x / lanes;
    for (int o = warp; o < M * N; o += warps) {
        const int m = o / N, c = o - m * N;
        float s = 0.f;
        for (int k = lane; k < K; k += lanes) s += a[m * K + k] * b[c * K + k];
        for (int off = 16; off > 0; off >>= 1) s += __shfl_down_sync(0xffffffffu, s, off);
        if (lane == 0) out[o] = ACC ? out[o] + s : s;
    }
}

__device__ __forceinline__ const float* slice_of(const float* const* cores, int k, const i64* dig) {
    return cores[k] + dig[k] * W(k);
}

// store(o, load(o)) for o in [0, count), block-wide; each thread issues its BATCH loads before
// any store, so staging a block of values costs one memory latency, not one per value.
template <typename Load, typename Store>
__device__ __forceinline__ void batched_copy(int count, Load load, Store store) {
    constexpr int BATCH = 8;
    for (int base = threadIdx.x; base < count; base += blockDim.x * BATCH) {
        float r[BATCH];
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            const int o = base + u * blockDim.x;
            r[u] = o < count ? load(o) : 0.f;
        }
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            const int o = base + u * blockDim.x;
            if (o < count) store(o, r[u]);
        }
    }
}

// A slice staged as ROWS rows of COLS floats at a row stride of COLS + 1 (shared), so that
// reading down a column across lanes hits distinct banks.
template <int ROWS, int COLS>
__device__ __forceinline__ void stage_padded(float* dst, const float* src) {
    batched_copy(ROWS * COLS, [&](int o) { return src[o]; },
                 [&](int o, float v) { dst[o + o / COLS] = v; });
    __syncthreads();
}

// Row stride of a staged right-hand slice L (see chain).
__host__ __device__ constexpr int LDS(int l) { return Q(l) * R(l + 1) + 1; }

// The product of the slices of cores F..L of the row with digits dig, a row-major
// (R(F) * QPROD(F, L + 1)) x R(L + 1) matrix: the core's slice itself (in global memory) when
// F == L, else computed into out (tmp: scratch; each right-hand slice is first staged in sb,
// padded, where it stays until the next chain), synchronized.
template <int F, int L>
__device__ const float* chain(const float* const* cores, const i64* dig, float* out, float* tmp,
                              float* sb, i64* sb_tag = nullptr) {
    if constexpr (F >= L) {
        return slice_of(cores, F, dig);
    } else {
        const float* prev = chain<F, L - 1>(cores, dig, tmp, out, sb, sb_tag);
        __syncthreads();
        // sb_tag: which slice sb holds (uniform over the block), so a run of rows with the same
        // slice stages it once
        const i64 tag = (i64)L * NUM_ROWS + dig[L];
        if (sb_tag == nullptr || *sb_tag != tag) {
            stage_padded<R(L), Q(L) * R(L + 1)>(sb, slice_of(cores, L, dig));
            if (sb_tag != nullptr) *sb_tag = tag;
        }
        block_matmul<R(F) * QPROD(F, L), R(L), Q(L) * R(L + 1), false, false, false, LDS(L)>(
            prev, sb, out);
        __syncthreads();
        return out;
    }
}

#define CORE_ARGS const float* c0, const float* c1, const float* c2, const float* c3
#define CORES const float* cores[4] = {c0, c1, c2, c3}

// The batch's first kernel. Block 0 sets the verdict clean, then checks the offsets
// (verdict[1] <- first bad offset position); the tile sort that follows reports the first
// bad index position into verdict[0]. No memset precedes it, and only block 0 writes the
// verdict, so its reset cannot race with the offset check. keys[t] = key_of(idx[t]), or
// NUM_ROWS (which the sort rejects) where idx[t] is outside [0, bound); keys == nullptr:
// the indices are the sort keys. slot (NULL without an active row cache): each lookup's slot
// among the capacity sorted cached rows crow, -1 where it is not cached or out of range (a
// binary search per lookup, every thread of the grid at once; tt_rows, tt_pool and the
// backward read the slots). idx is read only where keys or slot are given.
extern "C" __global__ void tt_prepare(const i64* idx, i64 n, i64 bound, i64* keys,
                                      const i64* offsets, i64 n_off, int include_last,
                                      const i64* crow, i64 capacity, i64* slot,
                                      u64* verdict) {
    if (blockIdx.x == 0) {
        if (threadIdx.x == 0) verdict[0] = verdict[1] = ~0ull;
        __syncthreads();
        const i64 nb = include_last ? n_off : n_off + 1;
        for (i64 t = threadIdx.x; t < nb; t += blockDim.x) {
            const i64 v = bound_at(offsets, n_off, n, t);
            const bool bad = (t == 0 && v != 0) || (t == nb - 1 && v != n) ||
                             (t > 0 && v < bound_at(offsets, n_off, n, t - 1));
            if (bad) atomicMin(verdict + 1, (u64)t);
        }
    }
    if (keys == nullptr && slot == nullptr) return;
    for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t < n;
         t += (i64)gridDim.x * blockDim.x) {
        const i64 row = idx[t];
        const bool valid = row >= 0 && row < bound && row < NUM_ROWS;
        if (keys != nullptr) keys[t] = valid ? key_of(row) : NUM_ROWS;
        if (slot != nullptr)
            slot[t] = (valid && crow != nullptr) ? cache_slot_of(row, crow, capacity) : -1;
    }
}

// The last round of the small sort (xferlib/tt/plan.py): runs of `width` sorted positions
// (the last may be shorter), each sorted stably, joined in ONE launch, where pairwise merges
// take one launch per doubling. A position's place is its rank in its own run plus, in every
// other run, the keys that go before it: those <= its key in an earlier run, < in a later
// one, so equal keys keep batch order (the result equals the pairwise merges').
extern "C" __global__ void tt_merge_all(const int* __restrict__ keys,
                                        const i64* __restrict__ perm, i64 n, i64 width,
                                        int* __restrict__ keys_out, i64* __restrict__ perm_out) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const i64 run = i / width;
        const int key = keys[i];
        i64 dest = i - run * width;
        for (i64 start = 0, r = 0; start < n; start += width, ++r) {
            if (r == run) continue;
            const bool earlier = r < run;
            i64 lo = start, hi = start + width < n ? start + width : n;
            while (lo < hi) {
                const i64 mid = (lo + hi) >> 1;
                const bool before = earlier ? keys[mid] <= key : keys[mid] < key;
                if (before) lo = mid + 1; else hi = mid;
            }
            dest += lo - start;
        }
        keys_out[dest] = key;
        perm_out[dest] = perm[i];
    }
}

// The block's CHUNK sorted positions: rows and batch positions, then every position's
// last-core slice (ls[t * CW ...]), loaded once with independent loads, so the per-row loop
// never waits on global memory for them.
template <typename K>
__device__ __forceinline__ i64 load_chunk(const float* last_core, const K* rows, const i64* perm,
                                          i64 n, i64* srow, i64* sperm, float* ls) {
    const i64 start = (i64)blockIdx.x * CHUNK;
    for (int t = threadIdx.x; t < CHUNK; t += blockDim.x) {
        const i64 j = start + t;
        const i64 row = j < n ? (i64)rows[j] : -1;
        srow[t] = row >= 0 && row < NUM_ROWS ? row : -1;
        sperm[t] = j < n ? perm[j] : -1;
    }
    __syncthreads();
    batched_copy(
        CHUNK * CW,
        [&](int o) {
            const int t = o / CW;
            return srow[t] >= 0 ? last_core[(srow[t] % P(D - 1)) * CW + (o - t * CW)] : 0.f;
        },
        [&](int o, float v) { ls[o] = v; });
    __syncthreads();
    return start;
}

// y[perm[j]] = row rows[j] of the table, for the CHUNK sorted positions of this block.
// Lookups the row cache serves (slot[m] in [0, capacity), as tt_prepare found them and
// tt_pool tests them; slot may be NULL) are skipped: tt_pool reads their dense rows, so their
// y rows are never read. A prefix product is computed only when a lookup that is not skipped
// needs it, so a piece whose lookups are all cached costs nothing. keys (NULL: no counting):
// each run of one row within the block is added once to the cache's frequency table (keys,
// counts, size). A rejected batch writes nothing (its lookups are not counted).
template <typename K>
__global__ void tt_rows(CORE_ARGS, const K* rows, const i64* perm, i64 n, float* y,
                        const i64* slot, i64 capacity, i64* keys, long long* counts, i64 size,
                        const u64* verdict) {
    if (rejected(verdict)) return;
    __shared__ __align__(16) float left[MAXBUF], tmp[MAXBUF], sb[MAXS], ls[CHUNK * CW];
    __shared__ i64 srow[CHUNK], sperm[CHUNK];
    __shared__ int sskip[CHUNK];
    CORES;
    const i64 start = load_chunk(cores[D - 1], rows, perm, n, srow, sperm, ls);
    for (int t = threadIdx.x; t < CHUNK; t += blockDim.x) {
        const i64 m = sperm[t], key = srow[t];
        const i64 c = (slot != nullptr && m >= 0 && m < n) ? slot[m] : -1;
        sskip[t] = (m < 0 || m >= n || (c >= 0 && c < capacity)) ? 1 : 0;
        if (keys != nullptr && key >= 0 && (t == 0 || srow[t - 1] != key)) {
            int len = 1;  // the run's positions in this block
            while (t + len < CHUNK && srow[t + len] == key) ++len;
            count_row(row_of_key(key), keys, counts, size, len);
        }
    }
    __syncthreads();
    i64 dig[4] = {0, 0, 0, 0};
    i64 prefix = -1, sb_tag = -1;
    const float* lp = left;
    for (int t = 0; t < CHUNK && start + t < n; ++t) {
        const i64 row = srow[t];
        if (row < 0) continue;  // unreachable: the verdict rejects such a batch
        if (sskip[t]) continue;  // served by the cache (block-uniform: shared flag)
        digits_of_key(row, dig);
        const i64 pre = row / P(D - 1);
        if (pre != prefix) {
            __syncthreads();
            lp = chain<0, D - 2>(cores, dig, left, tmp, sb, &sb_tag);
            prefix = pre;
        }
        block_matmul<A_LAST, R_LAST, QL, false, false, false>(lp, ls + t * CW, y + sperm[t] * DIM);
    }
}

// out[b] = sum over bag b of w * y[m]; bag_of[m] = b. A rejected batch gives zeros. With
// y == nullptr only bag_of is written (a backward that rebuilds its plan).
// Lookups with slot[m] >= 0 read row slot[m] of the dense row cache cache_w instead.
extern "C" __global__ void tt_pool(const float* y, const i64* offsets, i64 n_off,
                                   int include_last, i64 n, const float* psw, int mean,
                                   const i64* slot, const float* cache_w, i64 cache_rows,
                                   float* out, i64* bag_of, const u64* verdict) {
    const i64 bags = (include_last ? n_off : n_off + 1) - 1;
    const bool bad = rejected(verdict);
    for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t < bags * DIM;
         t += (i64)gridDim.x * blockDim.x) {
        const i64 b = t / DIM;
        const int e = (int)(t - b * DIM);
        float s = 0.f;
        if (!bad) {
            const i64 lo = max((i64)0, bound_at(offsets, n_off, n, b));
            const i64 hi = min(n, bound_at(offsets, n_off, n, b + 1));
            for (i64 m = lo; m < hi; ++m) {
                if (e == 0) bag_of[m] = b;
                if (y == nullptr) continue;
                float w = psw != nullptr ? psw[m] : 1.f;
                if (mean) w /= (float)(hi - lo);
                const i64 c = slot != nullptr ? slot[m] : -1;
                s += w * (c >= 0 && c < cache_rows ? cache_w[c * DIM + e] : y[m * DIM + e]);
            }
        }
        if (out != nullptr) out[t] = s;
    }
}

// A finished piece (its upstream U in u): U goes to ubuf[piece] (middle cores read it), and
// core 0's slice gradient U S^T (S: the slices of cores 1..D-2) to c0buf[piece]. With three
// cores S is slice 1, still staged (padded) in sb by the piece's prefix product.
__device__ __forceinline__ void flush_piece(const float* const* cores, const i64* dig,
                                            const float* u, i64 piece, float* ubuf,
                                            float* c0buf, float* left, float* tmp, float* sb,
                                            float* part) {
    for (int o = threadIdx.x; o < UW; o += blockDim.x) ubuf[piece * UW + o] = u[o];
    if constexpr (D == 3) {
        // c0[m][r] = sum_b U[m][b] S[r][b] over a long b: thread (r, slice) sums every
        // slices-th b for all m (each S value loaded once), then the slices' partials are
        // added in order (deterministic).
        constexpr int M = Q(0), RK = R(1), K = UW / Q(0);
        const int slices = (int)blockDim.x / RK;
        if (slices == 0) {
            block_matmul<M, K, RK, false, true, false, LDS(1)>(u, sb, c0buf + piece * W(0));
            return;
        }
        if ((int)threadIdx.x < slices * RK) {
            const int r = threadIdx.x % RK, slice = threadIdx.x / RK;
            float acc[M];
#pragma unroll
            for (int m = 0; m < M; ++m) acc[m] = 0.f;
            for (int k = slice; k < K; k += slices) {
                const float sv = sb[r * LDS(1) + k];
#pragma unroll
                for (int m = 0; m < M; ++m) acc[m] += u[m * K + k] * sv;
            }
#pragma unroll
            for (int m = 0; m < M; ++m) part[(slice * M + m) * RK + r] = acc[m];
        }
        __syncthreads();
        for (int o = threadIdx.x; o < M * RK; o += blockDim.x) {
            float total = 0.f;
            for (int slice = 0; slice < slices; ++slice) total += part[slice * M * RK + o];
            c0buf[piece * W(0) + o] = total;
        }
    } else if constexpr (D > 3) {
        const float* s = chain<1, D - 2>(cores, dig, left, tmp, sb);  // restages sb (no tag)
        warp_matmul_nt<Q(0), UW / Q(0), R(1), false>(u, s, c0buf + piece * W(0));
    }
}

// Per piece (a run of one prefix within the block's CHUNK sorted positions, slot = its first
// position): U = sum_n g_n G_last[i_d]^T, then flush_piece. Per position j: C[j] = Left^T g_n,
// and the sort keys of its items in region REGION(k) of keys for every keyed core k: the
// last core's for every position, the others' at piece starts (SENTINEL elsewhere).
// Row cache (cseg != NULL): at the last position j of each run of a cached row within the
// block (slot[m] in [0, capacity)), the run's gradients summed in position order go to
// cseg[j * DIM ...], which tt_update's cache blocks add up per cached row.
template <typename K>
__global__ void tt_bwd_pieces(CORE_ARGS, const K* rows, const i64* perm, i64 n,
                              const i64* bag_of, const i64* offsets, i64 n_off,
                              int include_last, const float* psw, int mean,
                              const float* grad_out, float* ubuf, float* cbuf, float* c0buf,
                              int* keys, const i64* slot, i64 capacity, float* cseg,
                              const u64* verdict) {
    if (rejected(verdict)) return;
    __shared__ __align__(16) float left[MAXBUF], tmp[MAXBUF], sb[MAXS], ls[CHUNK * CW], u[UW],
        g[CHUNK * DIM], part[D == 3 ? BWD_THREADS * Q(0) : 1];
    __shared__ i64 sbag[CHUNK];
    __shared__ float sw[CHUNK];
    __shared__ i64 srow[CHUNK], sperm[CHUNK];
    __shared__ int scached[CHUNK];
    CORES;
    const i64 start = load_chunk(cores[D - 1], rows, perm, n, srow, sperm, ls);
    // every position's bag and weight, then its scaled bag gradient, staged at once
    for (int t = threadIdx.x; t < CHUNK; t += blockDim.x) {
        const i64 m = sperm[t];
        i64 b = -1;
        float w = 0.f;
        int cached = 0;
        if (m >= 0 && m < n) {
            b = bag_of[m];
            w = psw != nullptr ? psw[m] : 1.f;
            if (mean) w /= (float)(bound_at(offsets, n_off, n, b + 1) - bound_at(offsets, n_off, n, b));
            if (cseg != nullptr && slot != nullptr) cached = slot[m] >= 0 && slot[m] < capacity;
        }
        sbag[t] = b;
        sw[t] = w;
        scached[t] = cached;
    }
    __syncthreads();
    batched_copy(
        CHUNK * DIM,
        [&](int o) {
            const int t = o / DIM;
            return sbag[t] >= 0 ? grad_out[sbag[t] * DIM + (o - t * DIM)] : 0.f;
        },
        [&](int o, float v) { g[o] = sw[o / DIM] * v; });
    __syncthreads();
    i64 dig[4] = {0, 0, 0, 0}, pdig[4] = {0, 0, 0, 0};
    i64 prefix = -1, piece = -1, sb_tag = -1;
    const float* lp = left;
    for (int t = 0; t < CHUNK && start + t < n; ++t) {
        const i64 j = start + t;
        const i64 row = srow[t];
        if (row < 0) continue;  // unreachable: the verdict rejects such a batch
        digits_of_key(row, dig);
        const i64 pre = row / P(D - 1);
        const bool starts = pre != prefix;
        if (starts) {
            __syncthreads();
            if (piece >= 0) {
                flush_piece(cores, pdig, u, piece, ubuf, c0buf, left, tmp, sb, part);
                __syncthreads();
                if constexpr (D > 3) sb_tag = -1;  // the flush restaged sb
            }
            lp = chain<0, D - 2>(cores, dig, left, tmp, sb, &sb_tag);
            for (int o = threadIdx.x; o < UW; o += blockDim.x) u[o] = 0.f;
            __syncthreads();  // u is zeroed by stride and accumulated by tiles
            prefix = pre;
            piece = j;
#pragma unroll
            for (int k = 0; k < 4; ++k) pdig[k] = dig[k];
        }
        // A repeat of the same row at the next position takes this one's gradient along (the
        // sorted batch keeps repeats together): a hot row yields one item per chunk, not one
        // per lookup.
        const bool folds = t + 1 < CHUNK && start + t + 1 < n && srow[t + 1] == row;
        if (threadIdx.x == 0) {
            keys[(i64)REGION(D - 1) * n + j] = folds ? SENTINEL : KOFF(D - 1) + (int)dig[D - 1];
#pragma unroll
            for (int k = 0; k <= D - 2; ++k)
                if (k != LEAD)
                    keys[(i64)REGION(k) * n + j] = starts ? KOFF(k) + (int)dig[k] : SENTINEL;
        }
        const float* gj = g + t * DIM;
        if (folds) {
            for (int o = threadIdx.x; o < DIM; o += blockDim.x) g[(t + 1) * DIM + o] += gj[o];
            __syncthreads();
            continue;
        }
        if (scached[t])  // the row's run in this block ends here: gj holds its sum
            for (int o = threadIdx.x; o < DIM; o += blockDim.x) cseg[j * DIM + o] = gj[o];
        block_matmul<R_LAST, A_LAST, QL, true, false, false>(lp, gj, cbuf + j * CW);
        block_matmul<A_LAST, QL, R_LAST, false, true, true>(gj, ls + t * CW, u);
    }
    if (piece >= 0) {
        __syncthreads();
        flush_piece(cores, pdig, u, piece, ubuf, c0buf, left, tmp, sb, part);
    }
}

// Slice gradient of middle core KC (four cores: KC = 1, 2; with three the middle core leads the
// sort and reduce_lead_middle handles it) from one piece's upstream U (global,
// A_LAST x R_LAST): acc += (L^T U) S^T, L the product of the slices before KC and S of those
// after it up to core D-2 (absent for KC == D-2).
template <int KC>
__device__ void middle_slice_grad(const float* const* cores, const i64* dig, const float* U,
                                  float* acc, float* bl, float* bs, float* tmp, float* sb,
                                  float* v) {
    constexpr int BR = QPROD(KC + 1, D - 1) * R_LAST;  // columns of U per (r_k, j_k)
    __syncthreads();
    const float* l = chain<0, KC - 1>(cores, dig, bl, tmp, sb);
    if constexpr (KC == D - 2) {
        block_matmul<R(KC), QPROD(0, KC), Q(KC) * BR, true, false, true>(l, U, acc);
    } else {
        const float* s = chain<KC + 1, D - 2>(cores, dig, bs, tmp, sb);
        block_matmul<R(KC), QPROD(0, KC), Q(KC) * BR, true, false, false>(l, U, v);
        __syncthreads();
        warp_matmul_nt<R(KC) * Q(KC), BR, R(KC + 1), true>(v, s, acc);
    }
}

__device__ __forceinline__ i64 lower_bound_int(const int* a, i64 n, int key) {
    i64 lo = 0, hi = n;
    while (lo < hi) { const i64 mid = (lo + hi) >> 1; if (a[mid] < key) lo = mid + 1; else hi = mid; }
    return lo;
}

template <typename K>
__device__ __forceinline__ i64 lower_bound_rows(const K* a, i64 n, i64 key) {
    i64 lo = 0, hi = n;
    while (lo < hi) { const i64 mid = (lo + hi) >> 1; if ((i64)a[mid] < key) lo = mid + 1; else hi = mid; }
    return lo;
}

template <typename K>
__device__ __forceinline__ bool piece_starts(const K* rows, i64 j) {
    return j % CHUNK == 0 || (i64)rows[j] / P(D - 1) != (i64)rows[j - 1] / P(D - 1);
}

// Three cores, middle (lead) core: acc += G0[i0]^T U for the pieces starting at the sorted
// positions of [lo, hi) whose lead digit is this row's. Tiles of blockDim positions are
// compacted to their piece starts (in order), then PB pieces at a time have their U and
// core-0 slice staged (independent loads) and are accumulated in order.
template <typename K>
__device__ void reduce_lead_middle(const float* const* cores, const K* rows, i64 lo, i64 hi,
                                   const float* ubuf, float* acc, float* mb, i64* mj,
                                   int* flags) {
    constexpr int ITEM = UW + W(0);
    for (i64 tile = lo; tile < hi; tile += blockDim.x) {
        __syncthreads();
        const i64 j = tile + threadIdx.x;
        flags[threadIdx.x] = (j < hi && piece_starts(rows, j)) ? 1 : 0;
        __syncthreads();
        // inclusive scan of the flags (Hillis-Steele; blockDim is a power of two <= 1024)
        for (int off = 1; off < (int)blockDim.x; off <<= 1) {
            const int add = threadIdx.x >= off ? flags[threadIdx.x - off] : 0;
            __syncthreads();
            flags[threadIdx.x] += add;
            __syncthreads();
        }
        const int count = flags[blockDim.x - 1];
        const bool mine = j < hi && piece_starts(rows, j);
        const int at = flags[threadIdx.x] - 1;
        __syncthreads();
        if (mine) mj[PB + at] = j;  // the tile's piece starts, in order, after the batch slots
        __syncthreads();
        for (int first = 0; first < count; first += PB) {
            const int batch = count - first < PB ? count - first : PB;
            batched_copy(
                PB * ITEM,
                [&](int o) {
                    const int p = o / ITEM, e = o - p * ITEM;
                    if (p >= batch) return 0.f;
                    const i64 jj = mj[PB + first + p];
                    return e < UW ? ubuf[jj * UW + e]
                                  : cores[0][(((i64)rows[jj] / P(2)) % P(0)) * W(0) + (e - UW)];
                },
                [&](int o, float v) { mb[o] = v; });
            __syncthreads();
            for (int p = 0; p < batch; ++p)
                block_matmul<R(1), Q(0), Q(1) * R(2), true, false, true>(mb + p * ITEM + UW,
                                                                        mb + p * ITEM, acc);
            __syncthreads();
        }
    }
}

// Core row i's items: a range of sorted positions for the lead core, else a run of the sorted
// item keys.
template <int KC, typename K>
__device__ __forceinline__ void row_range(const K* rows, i64 n, const int* skeys, i64 n_items,
                                          i64 i, i64& lo, i64& hi) {
    if constexpr (KC == LEAD) {
        lo = lower_bound_rows(rows, n, i * SPAN);
        hi = lower_bound_rows(rows, n, (i + 1) * SPAN);
    } else {
        const int key = KOFF(KC) + (int)i;
        lo = lower_bound_int(skeys, n_items, key);
        hi = lower_bound_int(skeys, n_items, key + 1);
    }
}

// How many blocks sum a core row's list of len items (at most splits, each at least
// SPLIT_MIN items): fixed by the batch, so the partials and their in-order join are too.
constexpr i64 SPLIT_MIN = 128;
__device__ __forceinline__ int split_count(i64 len, int splits) {
    const i64 ns = (len + SPLIT_MIN - 1) / SPLIT_MIN;
    return ns < 1 ? 1 : ns > splits ? splits : (int)ns;
}

// Partial s of core KC's row i: rows of core KC keep their splits side by side, core after
// core (the gradient's layout, each row widened splits times).
template <int KC>
__device__ __forceinline__ i64 partial_at(i64 i, int s, int splits) {
    return (GOFF(KC) + i * W(KC)) * splits + (i64)s * W(KC);
}

template <int KC, typename K>
__device__ void reduce_row(const float* const* cores, const K* rows, i64 n, const int* skeys,
                           const i64* items, i64 n_items, const float* ubuf, const float* cbuf,
                           const float* c0buf, i64 i, float* grad, int* touched, int dense,
                           int s, int splits, float* part, float* acc,
                           float* bl, float* bs, float* tmp, float* sb, float* v, float* mb,
                           i64* mj, int* flags) {
    i64 lo, hi;
    row_range<KC>(rows, n, skeys, n_items, i, lo, hi);
    const bool any = hi > lo;
    // a long list is split: this block sums part s of it into its partial (tt_reduce_join)
    const int ns = split_count(hi - lo, splits);
    if (s >= ns) return;  // block-uniform
    if (ns > 1) {
        const i64 len = hi - lo, first = lo;
        lo = first + len * s / ns;
        hi = first + len * (s + 1) / ns;
    }
    if constexpr (KC == D - 1 || KC == 0) {
        // sums of per-item slice gradients: the last core's per lookup (cbuf), core 0's per
        // piece (c0buf, or U itself when the prefix is core 0 alone); eight loads in flight
        const float* src = KC == D - 1 ? cbuf : (D == 2 ? ubuf : c0buf);
        for (int o = threadIdx.x; o < W(KC); o += blockDim.x) {
            float s = 0.f;
            for (i64 t0 = lo; t0 < hi; t0 += 8) {
                float x[8];
#pragma unroll
                for (int u = 0; u < 8; ++u) {
                    const i64 t = t0 + u;
                    float value = 0.f;
                    if (t < hi) {
                        if constexpr (KC == LEAD) {
                            if (piece_starts(rows, t)) value = src[t * W(KC) + o];
                        } else {
                            const i64 j = items[t] - (i64)REGION(KC) * n;
                            if (j >= 0 && j < n) value = src[j * W(KC) + o];
                        }
                    }
                    x[u] = value;
                }
#pragma unroll
                for (int u = 0; u < 8; ++u) s += x[u];
            }
            acc[o] = s;
        }
    } else if constexpr (KC == LEAD) {  // three cores: the middle core leads the sort
        for (int o = threadIdx.x; o < W(KC); o += blockDim.x) acc[o] = 0.f;
        reduce_lead_middle(cores, rows, lo, hi, ubuf, acc, mb, mj, flags);
    } else {  // four cores: a middle core, item by item through the prefix chain
        for (int o = threadIdx.x; o < W(KC); o += blockDim.x) acc[o] = 0.f;
        __syncthreads();
        i64 dig[4] = {0, 0, 0, 0};
        for (i64 t = lo; t < hi; ++t) {
            const i64 j = items[t] - (i64)REGION(KC) * n;
            if (j < 0 || j >= n) continue;
            digits_of_key((i64)rows[j], dig);
            middle_slice_grad<KC>(cores, dig, ubuf + j * UW, acc, bl, bs, tmp, sb, v);
        }
    }
    __syncthreads();
    if (ns > 1) {  // the join writes the row and its flag
        float* dst = part + partial_at<KC>(i, s, splits);
        for (int o = threadIdx.x; o < W(KC); o += blockDim.x) dst[o] = acc[o];
        return;
    }
    if (!any) {  // every flag is written (no memset before), zeros in a dense gradient
        if (dense)
            for (int o = threadIdx.x; o < W(KC); o += blockDim.x) grad[GOFF(KC) + i * W(KC) + o] = 0.f;
        if (threadIdx.x == 0) touched[ROFF(KC) + i] = 0;
        return;
    }
    for (int o = threadIdx.x; o < W(KC); o += blockDim.x) grad[GOFF(KC) + i * W(KC) + o] = acc[o];
    if (threadIdx.x == 0) touched[ROFF(KC) + i] = 1;
}

// A rejected batch's block: the row untouched (and zero in a dense gradient).
__device__ __forceinline__ void clear_row(i64 b, float* grad, int* touched, int dense) {
    int k = 0;
    while (k < D - 1 && b >= ROFF(k + 1)) ++k;
    const i64 i = b - ROFF(k);
    if (dense)
        for (int o = threadIdx.x; o < W(k); o += blockDim.x) grad[GOFF(k) + i * W(k) + o] = 0.f;
    if (threadIdx.x == 0) touched[b] = 0;
}

// One block per core row (all cores): its gradient row, summed in sorted order, and its flag
// (1: touched, 0: not; every flag is written). dense: untouched rows get zeros, else they are
// left unwritten. counter (may be NULL): the step counter, incremented once by block 0 (the
// update kernels that follow read it), whatever the verdict, as a step counts every call.
// splits > 1 (large batches): the grid has splits blocks per core row (block b + s * rows
// takes part s); a row whose list is long is summed by up to splits blocks into partials
// (part: splits floats per gradient float) that tt_reduce_join adds in order.
template <typename K>
__global__ void tt_reduce(CORE_ARGS, const K* rows, i64 n, const int* skeys, const i64* items,
                          i64 n_items, const float* ubuf, const float* cbuf, const float* c0buf,
                          float* grad, int* touched, int dense, i64* counter, float* part,
                          int splits, const u64* verdict) {
    if (counter != nullptr && blockIdx.x == 0 && threadIdx.x == 0) counter[0] += 1;
    const i64 b = blockIdx.x % ROFF(D);
    const int s = (int)(blockIdx.x / ROFF(D));
    if (s >= splits || (s > 0 && part == nullptr)) return;
    if (rejected(verdict)) {
        if (s == 0) clear_row(b, grad, touched, dense);
        return;
    }
    // Three cores need no chain products here, only the batch of pieces (mb).
    constexpr int CH = D == 3 ? 1 : MAXBUF, CS = D == 3 ? 1 : MAXS;
    __shared__ __align__(16) float acc[MAXW], bl[CH], bs[CH], tmp[CH], sb[CS], v[MAXV],
        mb[D == 3 ? PB * (UW + W(0)) : 1];
    __shared__ i64 mj[D == 3 ? PB + REDUCE_THREADS : 1];
    __shared__ int flags[D == 3 ? REDUCE_THREADS : 1];
    CORES;
    const int ways = part != nullptr ? splits : 1;
#define REDUCE_ARGS cores, rows, n, skeys, items, n_items, ubuf, cbuf, c0buf
#define REDUCE_BUFS grad, touched, dense, s, ways, part, acc, bl, bs, tmp, sb, v, mb, mj, flags
    if (b < ROFF(1)) {
        reduce_row<0>(REDUCE_ARGS, b, REDUCE_BUFS);
    } else if (b < ROFF(2)) {
        reduce_row<1>(REDUCE_ARGS, b - ROFF(1), REDUCE_BUFS);
    } else if constexpr (D > 2) {
        if (b < ROFF(3)) {
            reduce_row<(D > 2 ? 2 : 1)>(REDUCE_ARGS, b - ROFF(2), REDUCE_BUFS);
        } else if constexpr (D > 3) {
            if (b < ROFF(4)) reduce_row<(D > 3 ? 3 : 1)>(REDUCE_ARGS, b - ROFF(3), REDUCE_BUFS);
        }
    }
}

// A split row's gradient: its partials added in split order (deterministic), and its flag.
template <int KC, typename K>
__device__ void join_row(const K* rows, i64 n, const int* skeys, i64 n_items, i64 i,
                         float* grad, int* touched, const float* part, int splits) {
    i64 lo, hi;
    row_range<KC>(rows, n, skeys, n_items, i, lo, hi);
    const int ns = split_count(hi - lo, splits);
    if (ns <= 1) return;  // tt_reduce wrote it
    const float* src = part + partial_at<KC>(i, 0, splits);
    for (int o = threadIdx.x; o < W(KC); o += blockDim.x) {
        float total = 0.f;
        for (int t = 0; t < ns; ++t) total += src[(i64)t * W(KC) + o];
        grad[GOFF(KC) + i * W(KC) + o] = total;
    }
    if (threadIdx.x == 0) touched[ROFF(KC) + i] = 1;
}

// After tt_reduce with splits > 1: one block per core row.
template <typename K>
__global__ void tt_reduce_join(const K* rows, i64 n, const int* skeys, i64 n_items,
                               float* grad, int* touched, const float* part, int splits,
                               const u64* verdict) {
    if (rejected(verdict) || part == nullptr) return;
    const i64 b = blockIdx.x;
#define JOIN_ARGS rows, n, skeys, n_items
#define JOIN_BUFS grad, touched, part, splits
    if (b < ROFF(1)) {
        join_row<0>(JOIN_ARGS, b, JOIN_BUFS);
    } else if (b < ROFF(2)) {
        join_row<1>(JOIN_ARGS, b - ROFF(1), JOIN_BUFS);
    } else if constexpr (D > 2) {
        if (b < ROFF(3)) {
            join_row<(D > 2 ? 2 : 1)>(JOIN_ARGS, b - ROFF(2), JOIN_BUFS);
        } else if constexpr (D > 3) {
            if (b < ROFF(4)) join_row<(D > 3 ? 3 : 1)>(JOIN_ARGS, b - ROFF(3), JOIN_BUFS);
        }
    }
}
// A block-wide sum, returned to every thread (blockDim a multiple of 32; red: 33 floats).
__device__ float block_sum(float v, float* red) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
    __syncthreads();  // red may still be read from the previous call
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.f;
        for (int t = 0; t < (int)((blockDim.x + 31) >> 5); ++t) total += red[t];
        red[32] = total;
    }
    __syncthreads();
    return red[32];
}

struct Hyper {
    int opt;
    float lr, eps;
    double beta1, beta2;
    float wd, eta, mom;
    i64 iter;
};

// The fused optimizer on one parameter row w (width floats) from its gradient g, by the whole
// block (block-uniform call). opt: an XF_OPT_* id (xferlib.optim.rules.OptId): sgd,
// adagrad, rowwise_adagrad, rowwise_adam (elementwise first moment, one second moment and
// step per row), lamb, lars_sgd, partial_rowwise_adam, partial_rowwise_lamb (FBGEMM's rules;
// global step h.iter).
// e1/e2: elementwise state, rs: the row's state, st: its step count (NULL where unused).
// g is overwritten by the LAMB rules (their update direction). Each thread reads and writes
// the same elements of g and w throughout. The row reductions (norms, mean squared gradient)
// and the row scalars they give are computed here; every per-element step is the shared rule
// of xferlib/_kernels/rules.py.
__device__ void update_row(float* w, float* g, int width, float* e1, float* e2, float* rs,
                           i64* st, const Hyper& h, float* red) {
    const int opt = h.opt;
    XfScalars<float> s = xf_neutral<float>();
    s.lr = h.lr;
    s.eps = h.eps;
    s.b1 = (float)h.beta1; s.omb1 = (float)(1.0 - h.beta1);
    s.b2 = (float)h.beta2; s.omb2 = (float)(1.0 - h.beta2);
    s.wd = h.wd;
    s.mom = h.mom;
    if (opt == XF_OPT_SGD) {
        float none = 0.f;  // no momentum buffer
        for (int o = threadIdx.x; o < width; o += blockDim.x) xf_sgd(w[o], g[o], none, s);
        return;
    }
    if (opt == XF_OPT_ADAGRAD) {
        for (int o = threadIdx.x; o < width; o += blockDim.x) xf_adagrad(w[o], g[o], e1[o], s);
        return;
    }
    if (opt == XF_OPT_LARS_SGD) {
        float ww = 0.f, gg = 0.f;
        for (int o = threadIdx.x; o < width; o += blockDim.x) {
            ww += w[o] * w[o];
            gg += g[o] * g[o];
        }
        const float w_norm = sqrtf(block_sum(ww, red)), g_norm = sqrtf(block_sum(gg, red));
        const float den = g_norm + h.wd * w_norm;
        const float scale = den > 0.f ? h.lr * h.eta * w_norm / den : 0.f;
        for (int o = threadIdx.x; o < width; o += blockDim.x) xf_lars(w[o], g[o], e1[o], scale, s);
        return;
    }
    float part = 0.f;
    if (opt != XF_OPT_LAMB)
        for (int o = threadIdx.x; o < width; o += blockDim.x) part += g[o] * g[o];
    const float mean_sq = opt != XF_OPT_LAMB ? block_sum(part, red) / (float)width : 0.f;
    if (opt == XF_OPT_ROWWISE_ADAGRAD) {
        const float sum = rs[0] + mean_sq;
        __syncthreads();  // every thread has read rs[0]
        if (threadIdx.x == 0) rs[0] = sum;
        const float scale = h.lr / (sqrtf(sum) + h.eps);
        for (int o = threadIdx.x; o < width; o += blockDim.x) xf_descend(w[o], g[o], scale);
        return;
    }
    if (opt == XF_OPT_ROWWISE_ADAM) {
        const i64 t = st[0] + 1;
        const float vv = s.b2 * rs[0] + s.omb2 * mean_sq;
        __syncthreads();
        if (threadIdx.x == 0) {
            st[0] = t;
            rs[0] = vv;
        }
        const float den = sqrtf((float)(vv / (1.0 - pow(h.beta2, (double)t)))) + h.eps;
        s.bc1 = (float)(1.0 - pow(h.beta1, (double)t));
        for (int o = threadIdx.x; o < width; o += blockDim.x)
            xf_rowwise_adam(w[o], g[o], e1[o], den, s);
        return;
    }
    // lamb, partial_rowwise_adam, partial_rowwise_lamb: bias corrections from the global step
    s.bc1 = (float)(1.0 - pow(h.beta1, (double)h.iter));
    s.bc2 = (float)(1.0 - pow(h.beta2, (double)h.iter));
    float row_den = 0.f;
    if (opt != XF_OPT_LAMB) {
        const float vv = s.b2 * rs[0] + s.omb2 * mean_sq;
        __syncthreads();
        if (threadIdx.x == 0) rs[0] = vv;
        row_den = sqrtf(vv / s.bc2) + h.eps;
    }
    float ww = 0.f, uu = 0.f;
    for (int o = threadIdx.x; o < width; o += blockDim.x) {
        const float den = opt == XF_OPT_LAMB ? xf_lamb_den(g[o], e2[o], s) : row_den;
        const float u = xf_lamb_direction(w[o], g[o], e1[o], den, s);
        if (opt == XF_OPT_PARTIAL_ROWWISE_ADAM) {
            xf_descend(w[o], u, h.lr);
        } else {
            g[o] = u;
            ww += w[o] * w[o];
            uu += u * u;
        }
    }
    if (opt == XF_OPT_PARTIAL_ROWWISE_ADAM) return;
    const float w_norm = sqrtf(block_sum(ww, red)), u_norm = sqrtf(block_sum(uu, red));
    const float ratio = u_norm > 0.f ? w_norm / u_norm : 0.f;
    for (int o = threadIdx.x; o < width; o += blockDim.x) xf_descend(w[o], g[o], h.lr * ratio);
}

#define STATE_ARGS(name) float* name##0, float* name##1, float* name##2, float* name##3
// iter: the global step on the device (read when the kernel runs, so a captured CUDA graph's
// replays see the current step), NULL for 1.
#define HYPER_ARGS int opt, float lr, float eps, double beta1, double beta2, float wd, \
    float eta, float mom, const i64* iter
#define HYPER {opt, lr, eps, beta1, beta2, wd, eta, mom, iter != nullptr ? *iter : 1}
""" + TT_CACHE_UPDATE_KERNEL + r"""
// The fused optimizer on every touched core row (one block per core row) and, in the blocks
// past them, on the row cache's hit rows (tt_cache_update; cseg == NULL: no cache). The cache
// arguments: the sorted batch (rows, perm, n), each lookup's slot among capacity cached rows,
// tt_bwd_pieces' segment sums, the dense rows cw and their state, the batch's verdict.
template <typename K>
__global__ void __launch_bounds__(UPDATE_THREADS)
tt_update(float* c0, float* c1, float* c2, float* c3, STATE_ARGS(e), STATE_ARGS(f),
          STATE_ARGS(r), i64* s0, i64* s1, i64* s2, i64* s3, float* grad, const int* touched,
          HYPER_ARGS, const K* rows, const i64* perm, i64 n, const i64* slot, i64 capacity,
          const float* cseg, float* cw, float* ce1, float* ce2, float* crs, i64* cst,
          const u64* verdict) {
    __shared__ float red[33];
    const i64 b = blockIdx.x;
    if (b >= ROFF(D)) {  // a cache block (block-uniform)
        if (cseg == nullptr || cw == nullptr || slot == nullptr || rows == nullptr ||
            perm == nullptr || verdict == nullptr || rejected(verdict) ||
            blockDim.x != UPDATE_THREADS)
            return;
        const Hyper hc = HYPER;
        tt_cache_update<K>(rows, perm, n, slot, capacity, cseg, cw, ce1, ce2, crs, cst, hc, red,
                           b - ROFF(D), (i64)gridDim.x - ROFF(D));
        return;
    }
    int k = 0;
    while (k < D - 1 && b >= ROFF(k + 1)) ++k;
    const i64 i = b - ROFF(k);
    if (i < 0 || i >= P(k) || !touched[b]) return;
    const int width = W(k);
    float* cores[4] = {c0, c1, c2, c3};
    float* elem[4] = {e0, e1, e2, e3};
    float* elem2[4] = {f0, f1, f2, f3};
    float* rowst[4] = {r0, r1, r2, r3};
    i64* steps[4] = {s0, s1, s2, s3};
    const Hyper h = HYPER;
    update_row(cores[k] + i * width, grad + GOFF(k) + i * width, width,
               elem[k] ? elem[k] + i * width : nullptr, elem2[k] ? elem2[k] + i * width : nullptr,
               rowst[k] ? rowst[k] + i : nullptr, steps[k] ? steps[k] + i : nullptr, h, red);
}
"""


KEY_TYPES = ("int", "long long")
ROWS_NAMES = {key: f"tt_rows<{key}>" for key in KEY_TYPES}
BWD_NAMES = {key: f"tt_bwd_pieces<{key}>" for key in KEY_TYPES}
REDUCE_NAMES = {key: f"tt_reduce<{key}>" for key in KEY_TYPES}
JOIN_NAMES = {key: f"tt_reduce_join<{key}>" for key in KEY_TYPES}
UPDATE_NAMES = {key: f"tt_update<{key}>" for key in KEY_TYPES}
PLAIN_NAMES = ("tt_prepare", "tt_merge_all", "tt_pool", "tt_count")


def _chain_sizes(p, q, ranks):
    """Shared-memory needs (floats): the largest chain product over the prefix cores, the
    largest slice, the largest L^T U intermediate and the largest staged right-hand slice."""
    d = len(p)
    r = (1,) + tuple(ranks) + (1,)
    width = [r[k] * q[k] * r[k + 1] for k in range(d)]
    maxbuf = 1
    for first in range(d - 1):
        for last in range(first + 1, d - 1):  # a single slice is read in place
            maxbuf = max(maxbuf, r[first] * math.prod(q[first:last + 1]) * r[last + 1])
    maxv = 1
    for k in range(1, d - 2):  # middle prefix cores with both L and S present
        maxv = max(maxv, r[k] * math.prod(q[k:d - 1]) * r[d - 1])
    # right-hand slices of chain products, staged with one float of padding per row
    maxs = max([1] + [r[k] * (q[k] * r[k + 1] + 1) for k in range(1, d - 1)])
    return maxbuf, max(width), maxv, maxs


def shared_bytes(p, q, ranks) -> dict:
    """Static shared memory of each kernel, in bytes, for a shape."""
    maxbuf, maxw, maxv, maxs = _chain_sizes(p, q, ranks)
    d = len(p)
    r = (1,) + tuple(ranks) + (1,)
    dim, cw = math.prod(q), r[d - 1] * q[d - 1]
    uw = math.prod(q[:d - 1]) * r[d - 1]
    index = 16 * CHUNK
    if d == 3:
        reduce = (4 * (maxw + 4 + maxv + PIECE_BATCH * (uw + q[0] * r[1]))
                  + 8 * (PIECE_BATCH + REDUCE_THREADS) + 4 * REDUCE_THREADS)
    else:
        reduce = 4 * (maxw + 3 * maxbuf + maxs + maxv + 1) + 8 * PIECE_BATCH
    return {"rows": 4 * (2 * maxbuf + maxs + CHUNK * cw) + index,
            "bwd": (4 * (2 * maxbuf + maxs + CHUNK * cw + uw + CHUNK * dim
                         + (THREADS * q[0] if d == 3 else 1)) + 24 * CHUNK + index),
            "reduce": reduce}


@functools.lru_cache(maxsize=None)
def tt_module(p: tuple, q: tuple, ranks: tuple) -> KernelModule:
    """The compiled-in-shape module for one factorization (built once per shape)."""
    maxbuf, maxw, maxv, maxs = _chain_sizes(p, q, ranks)
    pad = lambda values, n, fill: list(values) + [fill] * (n - len(values))  # noqa: E731
    pp, qq, rr = pad(p, 4, 1), pad(q, 4, 1), pad(ranks, 3, 1)
    defines = [f"#define TT_D {len(p)}"]
    defines += [f"#define TT_P{k} {v}LL" for k, v in enumerate(pp)]
    defines += [f"#define TT_Q{k} {v}" for k, v in enumerate(qq)]
    defines += [f"#define TT_R{k + 1} {v}" for k, v in enumerate(rr)]
    defines += [f"#define TT_CHUNK {CHUNK}", f"#define TT_MAXBUF {maxbuf}",
                f"#define TT_MAXW {maxw}", f"#define TT_MAXV {maxv}", f"#define TT_MAXS {maxs}",
                f"#define TT_REDUCE_THREADS {REDUCE_THREADS}", f"#define TT_THREADS {THREADS}",
                f"#define TT_UPDATE_THREADS {UPDATE_THREADS}"]
    names = (list(ROWS_NAMES.values()) + list(BWD_NAMES.values())
             + list(REDUCE_NAMES.values()) + list(JOIN_NAMES.values())
             + list(UPDATE_NAMES.values()) + list(PLAIN_NAMES))
    label = "x".join(map(str, p)) + "_" + "x".join(map(str, q)) + "_r" + "x".join(map(str, ranks))
    return KernelModule(f"tt_{label}", RULES_KERNEL + "\n".join(defines) + "\n" + TT_KERNEL,
                        names)


# FBTT-Embedding's benchmark shape, registered at import so the all-modules test compiles it.
TT_MODULE = tt_module((200, 220, 250), (4, 4, 4), (32, 32))
