"""DLRM's dot interaction (``xferlib/interaction.py`` launches these).

A sample's ``n = 1 + T`` vectors of ``d`` values are ``x[b]`` (vector 0) and ``pooled[b, t]``
(vector ``t + 1``). A warp per sample: it copies the sample's vectors into shared memory
(rows ``d + 1`` apart, so that lanes reading one column of different rows hit different
banks; rows past ``n`` up to a multiple of 4 stay zero), then each lane computes a register
tile of outputs from there. The warps of a block work on their own samples (no block-wide
barrier).

``DOTI_FWD`` writes ``out[b] = [x[b], v_i . v_j for i < j]`` (``numpy.triu_indices(n, 1)``
order: pair ``p(i, j) = i n - i (i + 1) / 2 + j - i - 1``): a lane takes a 4 x 4 tile of the
Gram matrix ``V V^T`` on or above its diagonal, sums over ``k`` ascending, and leaves its
pairs in shared memory, which the warp then writes out in order (coalesced).

``DOTI_BWD`` writes ``dx[b] = g[b, :d] + sum_s G(0, s) v_s`` and ``dpooled[b, t] = sum_s
G(t + 1, s) v_s``, ``G`` the symmetric matrix of the pairs' output gradients (zero
diagonal), put in shared memory by the warp: a lane takes 4 rows by ``CG`` columns of the
result (columns ``c, c + d / CG, ...``: adjacent lanes read adjacent words) and sums over
``s`` ascending. Every sum has a fixed order: two runs give the same bits. Both index only
inside their arrays: ``B``, ``T`` and ``d`` are the arrays' own shapes.
"""

from __future__ import annotations

from xferlib._kernels._declare import KernelDecl
from xferlib._kernels._registry import KernelModule

__all__ = ["DOTI_FWD", "DOTI_BWD", "COLUMN_GROUPS", "INTERACTION_KERNEL",
           "INTERACTION_MODULE", "interaction_module", "load_width", "rows_padded"]

COLUMN_GROUPS = (8, 4, 2, 1)  # columns per lane in the backward, the widest dividing d


def load_width(d: int, itemsize: int, *arrays) -> int:
    """Values a load of ``load_vectors`` takes: 16 bytes where ``d`` is a multiple of that
    and every array starts on a 16-byte boundary, else one."""
    vec = 16 // itemsize
    aligned = all(a.data.ptr % 16 == 0 for a in arrays)
    return vec if d % vec == 0 and aligned else 1


def rows_padded(n: int) -> int:
    """The vectors a sample's shared rows hold: ``n`` up to a multiple of 4 (the tiles')."""
    return (int(n) + 3) // 4 * 4


_HEAD = r"""
typedef long long i64;

__device__ __forceinline__ int pair_index(int i, int j, int n) {  // i < j
    return i * n - i * (i + 1) / 2 + j - i - 1;
}

// A sample's n = T + 1 vectors into shared rows ld apart: VEC values a load (VEC divides d
// and both arrays are aligned to it, so a load never straddles two vectors), eight loads
// in flight per lane.
template <typename F, int VEC>
struct alignas(sizeof(F) * VEC) Pack { F v[VEC]; };

template <typename F, int VEC>
__device__ __forceinline__ void load_vectors(F* v, const F* x, const F* pooled, i64 b,
                                             int T, int d, int ld, int lane) {
    const int total = (T + 1) * d / VEC, dv = d / VEC;
    const Pack<F, VEC>* xb = reinterpret_cast<const Pack<F, VEC>*>(x + b * d);
    const Pack<F, VEC>* pb = reinterpret_cast<const Pack<F, VEC>*>(pooled + b * (i64)T * d);
    for (int e0 = lane; e0 < total; e0 += 32 * 8) {
        Pack<F, VEC> buf[8];
        #pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int e = e0 + 32 * u;
            if (e < total) buf[u] = e < dv ? xb[e] : pb[e - dv];
        }
        #pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int e = e0 + 32 * u;
            if (e < total) {
                const int r = e / dv, k = (e - r * dv) * VEC;
                #pragma unroll
                for (int i = 0; i < VEC; ++i) v[r * ld + k + i] = buf[u].v[i];
            }
        }
    }
}
"""

DOTI_FWD = KernelDecl(
    "doti_fwd", "template <typename F, int VEC>",
    (("const F* __restrict__", "x"), ("const F* __restrict__", "pooled"), ("i64", "B"),
     ("int", "T"), ("int", "d"), ("int", "per_block"), ("F* __restrict__", "out")),
    r"""
    extern __shared__ __align__(16) unsigned char raw[];
    const int n = T + 1, np = (n + 3) & ~3, ld = d + 1, P = n * (n - 1) / 2;
    const int nt = np / 4, tiles = nt * (nt + 1) / 2;
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    F* v = reinterpret_cast<F*>(raw) + (i64)w * (np * ld + P);
    F* pairs = v + np * ld;
    for (int e = n * ld + lane; e < np * ld; e += 32) v[e] = F(0);
    const i64 width = d + P;
    for (i64 b = (i64)blockIdx.x * per_block + w; b < B; b += (i64)gridDim.x * per_block) {
        __syncwarp();  // the last sample's reads of v and pairs are done
        load_vectors<F, VEC>(v, x, pooled, b, T, d, ld, lane);
        __syncwarp();
        F* row = out + b * width;
        for (int k = lane; k < d; k += 32) row[k] = v[k];
        for (int t = lane; t < tiles; t += 32) {
            int ti = 0, left = t;  // tile t of the upper triangle, row after row
            while (left >= nt - ti) { left -= nt - ti; ++ti; }
            const int tj = ti + left;
            F acc[4][4];
            #pragma unroll
            for (int p = 0; p < 4; ++p)
                #pragma unroll
                for (int q = 0; q < 4; ++q) acc[p][q] = F(0);
            const F* a = v + ti * 4 * ld;
            const F* c = v + tj * 4 * ld;
            for (int k = 0; k < d; ++k) {
                F ai[4], cj[4];
                #pragma unroll
                for (int q = 0; q < 4; ++q) { ai[q] = a[q * ld + k]; cj[q] = c[q * ld + k]; }
                #pragma unroll
                for (int p = 0; p < 4; ++p)
                    #pragma unroll
                    for (int q = 0; q < 4; ++q) acc[p][q] += ai[p] * cj[q];
            }
            #pragma unroll
            for (int p = 0; p < 4; ++p)
                #pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const int i = ti * 4 + p, j = tj * 4 + q;
                    if (i < j && j < n) pairs[pair_index(i, j, n)] = acc[p][q];
                }
        }
        __syncwarp();
        for (int p = lane; p < P; p += 32) row[d + p] = pairs[p];
    }
""")

DOTI_BWD = KernelDecl(
    "doti_bwd", "template <typename F, int VEC, int CG>",
    (("const F* __restrict__", "x"), ("const F* __restrict__", "pooled"),
     ("const F* __restrict__", "g"), ("i64", "B"), ("int", "T"), ("int", "d"),
     ("int", "per_block"), ("F* __restrict__", "dx"), ("F* __restrict__", "dpooled")),
    r"""
    extern __shared__ __align__(16) unsigned char raw[];
    const int n = T + 1, np = (n + 3) & ~3, ld = d + 1, ls = np + 1, P = n * (n - 1) / 2;
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    F* v = reinterpret_cast<F*>(raw) + (i64)w * (np * ld + np * ls);
    F* G = v + np * ld;  // rows ls apart: lanes of different row groups, different banks
    for (int e = n * ld + lane; e < np * ld; e += 32) v[e] = F(0);
    for (int e = lane; e < np * ls; e += 32) G[e] = F(0);  // only i < j < n written below
    const i64 width = d + P;
    const int groups = d / CG, items = (np / 4) * groups;
    for (i64 b = (i64)blockIdx.x * per_block + w; b < B; b += (i64)gridDim.x * per_block) {
        __syncwarp();
        load_vectors<F, VEC>(v, x, pooled, b, T, d, ld, lane);
        const F* gb = g + b * width;
        int i = 0, j = lane;  // pair `lane`'s (i, j), then 32 pairs on at each turn
        if (lane < P) {
            while (j >= n - 1 - i) { j -= n - 1 - i; ++i; }
            j += i + 1;
        }
        for (int p = lane; p < P; p += 32) {
            const F value = gb[d + p];
            G[i * ls + j] = value;
            G[j * ls + i] = value;
            j += 32;
            while (j >= n && i < n - 2) { j -= n - i - 2; ++i; }  // row i + 1 starts at i + 2
        }
        __syncwarp();
        for (int it = lane; it < items; it += 32) {
            const int rg = it / groups, cg = it - rg * groups;
            F acc[4][CG];
            #pragma unroll
            for (int q = 0; q < 4; ++q)
                #pragma unroll
                for (int c = 0; c < CG; ++c) acc[q][c] = F(0);
            const F* grow = G + rg * 4 * ls;
            for (int s = 0; s < n; ++s) {
                F gr[4], vs[CG];
                #pragma unroll
                for (int q = 0; q < 4; ++q) gr[q] = grow[q * ls + s];
                #pragma unroll
                for (int c = 0; c < CG; ++c) vs[c] = v[s * ld + cg + groups * c];
                #pragma unroll
                for (int q = 0; q < 4; ++q)
                    #pragma unroll
                    for (int c = 0; c < CG; ++c) acc[q][c] += gr[q] * vs[c];
            }
            #pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int r = rg * 4 + q;
                if (r >= n) break;
                #pragma unroll
                for (int c = 0; c < CG; ++c) {
                    const int col = cg + groups * c;
                    if (r == 0) dx[b * d + col] = gb[col] + acc[q][c];
                    else dpooled[(b * T + r - 1) * (i64)d + col] = acc[q][c];
                }
            }
        }
    }
""")

# per type: 16-byte loads, or one value at a time
_TYPES = {"float": (4, 1), "double": (2, 1)}

INTERACTION_KERNEL = _HEAD + DOTI_FWD.source() + DOTI_BWD.source()
INTERACTION_MODULE = KernelModule(
    "interaction", INTERACTION_KERNEL,
    (*(DOTI_FWD.instance(t, v) for t, vecs in _TYPES.items() for v in vecs),
     *(DOTI_BWD.instance(t, v, c) for t, vecs in _TYPES.items() for v in vecs
       for c in COLUMN_GROUPS)))


def interaction_module() -> KernelModule:
    return INTERACTION_MODULE
