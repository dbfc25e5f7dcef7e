"""DLRM's dot interaction (``xferlib/interaction.py`` launches these).

A sample's ``n = 1 + T`` vectors of ``d`` values are ``x[b]`` (vector 0) and ``pooled[b, t]``
(vector ``t + 1``). One warp per sample: its lanes split each vector's ``d`` values (lane
``l`` takes ``l, l + 32, ...``), so every load is coalesced and the sample's vectors stay in
L1 while the warp works on them.

``DOTI_FWD`` writes ``out[b] = [x[b], v_i . v_j for i < j]`` (``numpy.triu_indices(n, 1)``
order: pair ``p(i, j) = i n - i (i + 1) / 2 + j - i - 1``); each dot is a lane's partial sum
reduced across the warp by a fixed butterfly, so the order of every sum is fixed.
``DOTI_BWD`` writes ``dx[b] = g[b, :d] + sum_s g(0, s) v_s`` and ``dpooled[b, t] = sum_s
g(t + 1, s) v_s`` (``s`` ascending, ``s != r``; ``g(r, s)`` the output gradient of the pair
``(min, max)``): bitwise the same on every run. Both index only inside their arrays: ``B``,
``T`` and ``d`` are the arrays' own shapes.
"""

from __future__ import annotations

from xferlib._kernels._declare import KernelDecl
from xferlib._kernels._registry import KernelModule

__all__ = ["DOTI_FWD", "DOTI_BWD", "INTERACTION_KERNEL", "INTERACTION_MODULE",
           "interaction_module"]

_HEAD = r"""
typedef long long i64;

template <typename F>
__device__ __forceinline__ const F* vector_of(const F* x, const F* pooled, i64 b, i64 r,
                                              i64 T, i64 d) {
    return r == 0 ? x + b * d : pooled + (b * T + r - 1) * d;
}

template <typename F>
__device__ __forceinline__ F warp_sum(F v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ i64 pair_index(i64 i, i64 j, i64 n) {  // i < j
    return i * n - i * (i + 1) / 2 + j - i - 1;
}
"""

DOTI_FWD = KernelDecl(
    "doti_fwd", "template <typename F>",
    (("const F*", "x"), ("const F*", "pooled"), ("i64", "B"), ("i64", "T"), ("i64", "d"),
     ("F*", "out")),
    r"""
    const i64 n = T + 1, width = d + n * (n - 1) / 2;
    const int lane = threadIdx.x & 31;
    const i64 warps = ((i64)gridDim.x * blockDim.x) >> 5;
    for (i64 b = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; b < B; b += warps) {
        F* row = out + b * width;
        for (i64 k = lane; k < d; k += 32) row[k] = x[b * d + k];
        i64 p = d;
        for (i64 i = 0; i < n; ++i) {
            const F* vi = vector_of(x, pooled, b, i, T, d);
            for (i64 j = i + 1; j < n; ++j, ++p) {
                const F* vj = vector_of(x, pooled, b, j, T, d);
                F acc = 0;
                for (i64 k = lane; k < d; k += 32) acc += vi[k] * vj[k];
                acc = warp_sum(acc);
                if (lane == 0) row[p] = acc;
            }
        }
    }
""")

DOTI_BWD = KernelDecl(
    "doti_bwd", "template <typename F>",
    (("const F*", "x"), ("const F*", "pooled"), ("const F*", "g"), ("i64", "B"), ("i64", "T"),
     ("i64", "d"), ("F*", "dx"), ("F*", "dpooled")),
    r"""
    const i64 n = T + 1, width = d + n * (n - 1) / 2;
    const int lane = threadIdx.x & 31;
    const i64 warps = ((i64)gridDim.x * blockDim.x) >> 5;
    for (i64 b = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; b < B; b += warps) {
        const F* gb = g + b * width;
        for (i64 r = 0; r < n; ++r) {
            F* dst = r == 0 ? dx + b * d : dpooled + (b * T + r - 1) * d;
            for (i64 k = lane; k < d; k += 32) {
                F acc = r == 0 ? gb[k] : (F)0;
                for (i64 s = 0; s < n; ++s) {
                    if (s == r) continue;
                    const F gp = gb[d + (r < s ? pair_index(r, s, n) : pair_index(s, r, n))];
                    acc += gp * vector_of(x, pooled, b, s, T, d)[k];
                }
                dst[k] = acc;
            }
        }
    }
""")

_TYPES = ("float", "double")

INTERACTION_KERNEL = _HEAD + DOTI_FWD.source() + DOTI_BWD.source()
INTERACTION_MODULE = KernelModule(
    "interaction", INTERACTION_KERNEL,
    (*(DOTI_FWD.instance(t) for t in _TYPES), *(DOTI_BWD.instance(t) for t in _TYPES)))


def interaction_module() -> KernelModule:
    return INTERACTION_MODULE
