"""TT embedding kernels' CUDA source, second half: the backward (``tt_bwd_pieces``, ``tt_reduce``,
``tt_reduce_join``), followed by the fused update (``tt_update``, whose source is in
:mod:`xferlib._kernels.tt_update`).

Spliced after the forward's source by :mod:`xferlib._kernels.tt`, whose constants, device helpers
and compiled shape it uses; the pipeline is described there.
"""

from xferlib._kernels._declare import KernelDecl
from xferlib._kernels.tt_update import TT_UPDATE_KERNEL

__all__ = ["CORE_ARGS", "CORE_PARAMS", "TT_BWD_PIECES", "TT_REDUCE", "TT_REDUCE_JOIN",
           "TT_BACKWARD_KERNEL"]

# Argument group several TT kernels declare: the four core pointers (NULL past the table's
# cores).
CORE_ARGS = ("c0", "c1", "c2", "c3")
CORE_PARAMS = tuple(("const float*", name) for name in CORE_ARGS)

_PIECE_HELPERS = r"""
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

"""

# Per piece (a run of one prefix within the block's CHUNK sorted positions, slot = its first
# position): U = sum_n g_n G_last[i_d]^T, then flush_piece. Per position j: C[j] = Left^T g_n,
# and the sort keys of its items in region REGION(k) of keys for every keyed core k: the
# last core's for every position, the others' at piece starts (SENTINEL elsewhere).
# Row cache (cseg != NULL): at the last position j of each run of a cached row within the
# block (slot[m] in [0, capacity)), the run's gradients summed in position order go to
# cseg[j * DIM ...], which tt_update's cache blocks add up per cached row.
TT_BWD_PIECES = KernelDecl(
    "tt_bwd_pieces", "template <typename K>",
    (*CORE_PARAMS, ("const K*", "rows"), ("const i64*", "perm"), ("i64", "n"),
     ("const i64*", "bag_of"), ("const i64*", "offsets"), ("i64", "n_off"),
     ("int", "include_last"), ("const float*", "psw"), ("int", "mean"),
     ("const float*", "grad_out"), ("float*", "ubuf"), ("float*", "cbuf"), ("float*", "c0buf"),
     ("int*", "keys"), ("const i64*", "slot"), ("i64", "capacity"), ("float*", "cseg"),
     ("const u64*", "verdict")),
    r"""
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
    }""")

_REDUCE_HELPERS = r"""
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

"""

# One block per core row (all cores): its gradient row, summed in sorted order, and its flag
# (1: touched, 0: not; every flag is written). dense: untouched rows get zeros, else they are
# left unwritten. counter (may be NULL): the step counter, incremented once by block 0 (the
# update kernels that follow read it) unless the verdict rejects the batch, which changes
# nothing, its count included.
# splits > 1 (large batches): the grid has splits blocks per core row (block b + s * rows
# takes part s); a row whose list is long is summed by up to splits blocks into partials
# (part: splits floats per gradient float) that tt_reduce_join adds in order.
TT_REDUCE = KernelDecl(
    "tt_reduce", "template <typename K>",
    (*CORE_PARAMS, ("const K*", "rows"), ("i64", "n"), ("const int*", "skeys"),
     ("const i64*", "items"), ("i64", "n_items"), ("const float*", "ubuf"),
     ("const float*", "cbuf"), ("const float*", "c0buf"), ("float*", "grad"),
     ("int*", "touched"), ("int", "dense"), ("i64*", "counter"), ("float*", "part"),
     ("int", "splits"), ("const u64*", "verdict")),
    r"""
    if (counter != nullptr && blockIdx.x == 0 && threadIdx.x == 0 && !rejected(verdict))
        counter[0] += 1;
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
    }""")

_JOIN_HELPERS = r"""
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

"""

# After tt_reduce with splits > 1: one block per core row.
TT_REDUCE_JOIN = KernelDecl(
    "tt_reduce_join", "template <typename K>",
    (("const K*", "rows"), ("i64", "n"), ("const int*", "skeys"), ("i64", "n_items"),
     ("float*", "grad"), ("int*", "touched"), ("const float*", "part"), ("int", "splits"),
     ("const u64*", "verdict")),
    r"""
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
    }""")

TT_BACKWARD_KERNEL = (_PIECE_HELPERS + TT_BWD_PIECES.source() + _REDUCE_HELPERS
                      + TT_REDUCE.source() + _JOIN_HELPERS + TT_REDUCE_JOIN.source()
                      + TT_UPDATE_KERNEL)
