"""The plainest move of scattered rows between pinned host RAM and HBM, for the benchmark's
reference (``xferlib.bench.kernels.scattered_rows_launches``): one warp per row (a grid-stride
loop over the rows), 16-byte words, nothing else. A table step timed beside it says how much
of its time the host's handling of scattered accesses takes (on a machine whose IOMMU
translates the GPU's accesses, random rows over gigabytes move far slower than a large copy)
and how much is the step's own work. Rows outside the table are skipped.
"""

from xferlib._kernels._declare import KernelDecl
from xferlib._kernels._registry import KernelModule

_HEAD = r"""
typedef long long i64;

"""

# TO_HOST false: hbm[r] = host row rows[r]; true: the host row = hbm[r]. `width` and `stride`
# in 16-byte words.
SCATTERED_MOVE = KernelDecl(
    "scattered_move", "template <bool TO_HOST>",
    (("float4*", "host"), ("i64", "stride"), ("i64", "n_rows"),
     ("const i64* __restrict__", "rows"), ("i64", "n"), ("i64", "width"),
     ("float4* __restrict__", "hbm")),
    r"""
    const int lane = threadIdx.x & 31;
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    for (i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < n; r += warps) {
        const i64 row = rows[r];
        if (row < 0 || row >= n_rows) continue;
        for (i64 e = lane; e < width; e += 32) {
            if (TO_HOST) host[row * stride + e] = hbm[r * width + e];
            else hbm[r * width + e] = host[row * stride + e];
        }
    }""")

SCATTERED_KERNEL = _HEAD + SCATTERED_MOVE.source()

READ, WRITE = SCATTERED_MOVE.instance("false"), SCATTERED_MOVE.instance("true")
SCATTERED_MODULE = KernelModule("scattered_rows", SCATTERED_KERNEL, (READ, WRITE))
