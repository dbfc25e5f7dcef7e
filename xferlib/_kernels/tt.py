"""TT embedding kernels: rows from cores, pooling, backward grouped by index prefix, update.

The table's factorization (``p``, ``q``, ranks) is compiled in (one module per shape, built
on first use), so every product's loops have constant bounds. Core ``k`` holds ``P(k)`` slices
of ``W(k) = R(k) * Q(k) * R(k+1)`` floats; the *prefix* of a row is its first ``D - 1``
digits, whose slices multiply to a ``(A_LAST x R_LAST)`` matrix that the last core's slice
finishes into the row.

The pipeline over a batch sorted by row (rows sharing a prefix sit side by side):

* ``tt_prepare``: resets the verdict, validates offsets and computes the sort keys; the batch
  sort (``xferlib.batch.sort_on_device``) adds bad indices to the verdict. A rejected batch
  makes every later kernel a no-op, so nothing is written.
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

This file holds the forward's source and the module's build; the backward's source (one
compiled module with it) is in ``xferlib/_kernels/tt_backward.py``, the update's in
``xferlib/_kernels/tt_update.py``.

Every kernel bounds every index by the compiled shape, so no input reaches outside an array.
"""

from __future__ import annotations

import functools
import math

from xferlib._kernels._declare import KernelDecl
from xferlib._kernels._declare import defines as defines_of
from xferlib._kernels._registry import KernelModule
from xferlib._kernels.rules import RULES_KERNEL
from xferlib._kernels.tt_backward import (CORE_ARGS, CORE_PARAMS,  # noqa: F401
                                          TT_BACKWARD_KERNEL, TT_BWD_PIECES, TT_REDUCE,
                                          TT_REDUCE_JOIN)
from xferlib._kernels.tt_update import HYPER_ARGS, TT_UPDATE  # noqa: F401
from xferlib._kernels.tt_cache import CACHE_CHUNK, TT_CACHE_LOOKUP_KERNEL, TT_COUNT

CHUNK = 16  # sorted positions per block in tt_rows / tt_bwd_pieces
THREADS = 128
REDUCE_THREADS = 256
REDUCE_SPLITS = 8  # blocks per core row in tt_reduce at large batches (see reduce_splits)
PIECE_BATCH = 8  # pieces staged at once by the 3-core reduction (PB in the kernel source)
UPDATE_THREADS = 256  # tt_update's block size (its cache blocks are written for it)
# CACHE_CHUNK: sorted positions per chunk of the cache update (xferlib/_kernels/tt_cache.py)


def lead_core_of(num_cores: int) -> int:
    """The core whose digit leads the sort key (LEAD in the kernel source): with three cores
    the middle one, whose slices are the largest, so rows side by side share them; else 0."""
    return 1 if num_cores == 3 else 0


_SHAPE_HEAD = r"""
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
constexpr int LEAD = TT_LEAD;
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
constexpr int PB = TT_PB;                     // pieces staged at once by the 3-core reduction
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
"""

_BLOCK_HELPERS = r"""

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

#define CORES const float* cores[4] = {c0, c1, c2, c3}

"""

# The batch's first kernel. Block 0 sets the verdict clean, then checks the offsets
# (verdict[1] <- first bad offset position); the batch sort that follows reports the first
# bad index position into verdict[0]. No memset precedes it, and only block 0 writes the
# verdict, so its reset cannot race with the offset check. keys[t] = key_of(idx[t]), or
# NUM_ROWS (which the sort rejects) where idx[t] is outside [0, bound); keys == nullptr:
# the indices are the sort keys. slot (NULL without an active row cache): each lookup's slot
# among the capacity sorted cached rows crow, -1 where it is not cached or out of range (a
# binary search per lookup, every thread of the grid at once; tt_rows, tt_pool and the
# backward read the slots). idx is read only where keys or slot are given.
TT_PREPARE = KernelDecl(
    "tt_prepare", "",
    (("const i64*", "idx"), ("i64", "n"), ("i64", "bound"), ("i64*", "keys"),
     ("const i64*", "offsets"), ("i64", "n_off"), ("int", "include_last"),
     ("const i64*", "crow"), ("i64", "capacity"), ("i64*", "slot"), ("u64*", "verdict")),
    r"""
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
    }""", extern_c=True)

_CHUNK_HELPERS = r"""
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

"""

# y[perm[j]] = row rows[j] of the table, for the CHUNK sorted positions of this block.
# Lookups the row cache serves (slot[m] in [0, capacity), as tt_prepare found them and
# tt_pool tests them; slot may be NULL) are skipped: tt_pool reads their dense rows, so their
# y rows are never read. A prefix product is computed only when a lookup that is not skipped
# needs it, so a piece whose lookups are all cached costs nothing. keys (NULL: no counting):
# each run of one row within the block is added once to the cache's frequency table (keys,
# counts, size). A rejected batch writes nothing (its lookups are not counted).
TT_ROWS = KernelDecl(
    "tt_rows", "template <typename K>",
    (*CORE_PARAMS, ("const K*", "rows"), ("const i64*", "perm"), ("i64", "n"), ("float*", "y"),
     ("const i64*", "slot"), ("i64", "capacity"), ("i64*", "keys"), ("long long*", "counts"),
     ("i64", "size"), ("const u64*", "verdict")),
    r"""
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
    }""")

# out[b] = sum over bag b of w * y[m]; bag_of[m] = b. A rejected batch gives zeros. With
# y == nullptr only bag_of is written (a backward that rebuilds its plan).
# Lookups with slot[m] >= 0 read row slot[m] of the dense row cache cache_w instead.
TT_POOL = KernelDecl(
    "tt_pool", "",
    (("const float*", "y"), ("const i64*", "offsets"), ("i64", "n_off"),
     ("int", "include_last"), ("i64", "n"), ("const float*", "psw"), ("int", "mean"),
     ("const i64*", "slot"), ("const float*", "cache_w"), ("i64", "cache_rows"),
     ("float*", "out"), ("i64*", "bag_of"), ("const u64*", "verdict")),
    r"""
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
    }""", extern_c=True)

TT_KERNEL = (_SHAPE_HEAD + TT_CACHE_LOOKUP_KERNEL + _BLOCK_HELPERS + TT_PREPARE.source()
             + _CHUNK_HELPERS + TT_ROWS.source() + TT_POOL.source()
             + TT_BACKWARD_KERNEL)

# Argument groups of tt_rows (its row cache: slots, cached rows, frequency table), of
# tt_bwd_pieces (its cache sums) and of tt_update (state pointers per core; its cache tail).
ROWS_CACHE_ARGS = ("slot", "capacity", "keys", "counts", "size")
BWD_CACHE_ARGS = ("slot", "capacity", "cseg")
UPDATE_POINTER_ARGS = TT_UPDATE.names[:20]
UPDATE_CACHE_ARGS = TT_UPDATE.names[TT_UPDATE.names.index("rows"):]
CACHE_STATE_ARGS = ("cw", "ce1", "ce2", "crs", "cst")

KEY_TYPES = ("int", "long long")
_TEMPLATED = (TT_ROWS, TT_BWD_PIECES, TT_REDUCE, TT_REDUCE_JOIN, TT_UPDATE)
_PLAIN = (TT_PREPARE, TT_POOL, TT_COUNT)


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
    defines += [defines_of(TT_PB=PIECE_BATCH, TT_LEAD=lead_core_of(len(p)),
                           TT_CACHE_CHUNK=CACHE_CHUNK).rstrip("\n")]
    names = ([d.instance(key) for d in _TEMPLATED for key in KEY_TYPES]
             + [d.instance() for d in _PLAIN])
    label = "x".join(map(str, p)) + "_" + "x".join(map(str, q)) + "_r" + "x".join(map(str, ranks))
    return KernelModule(f"tt_{label}", RULES_KERNEL + "\n".join(defines) + "\n" + TT_KERNEL,
                        names)


# FBTT-Embedding's benchmark shape, registered at import so the all-modules test compiles it.
TT_MODULE = tt_module((200, 220, 250), (4, 4, 4), (32, 32))
