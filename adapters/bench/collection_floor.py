"""The floor under ``xferlib bench collection``'s all-in-HBM step: the plainest kernels that
do its memory traffic and nothing else.

One kernel reads every lookup's row and writes each bag's pooled sum (a warp per bag, the
rows summed in registers); a second reads every distinct row of the batch and writes it back
(a warp per row). Together they move the bytes a pooled lookup with a fused row update must
move (the touched rows read, the pooled outputs written, the rows written back), with no
sort, no gradient sums and no optimizer. The batch's distinct rows are found before timing
(a floor, not a rival engine), and the two launches are replayed from a CUDA graph, as the
collection's replayed step is. Float32 rows, ``dim`` and the stored width multiples of 4.
"""

from __future__ import annotations

import numpy as np

__all__ = ["floor_step"]

_SOURCE = r"""
extern "C" __global__ void floor_pool(const float* __restrict__ rows, long long num_rows,
                                      int width, const long long* __restrict__ idx,
                                      const long long* __restrict__ off, long long bags,
                                      int dim, float* __restrict__ out) {
    const int lane = threadIdx.x & 31;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long b = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; b < bags;
         b += warps) {
        for (int e = 4 * lane; e < dim; e += 128) {
            float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
            for (long long l = off[b]; l < off[b + 1]; ++l) {
                const long long k = idx[l];
                if (k < 0 || k >= num_rows) continue;  // never out of bounds
                const float4 v = *reinterpret_cast<const float4*>(rows + k * width + e);
                acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
            }
            *reinterpret_cast<float4*>(out + b * dim + e) = acc;
        }
    }
}

// Entries of -1 pad the distinct rows to a fixed length (the graph's static buffer).
extern "C" __global__ void floor_rows(float* rows, long long num_rows, int width,
                                      const long long* __restrict__ distinct, long long n,
                                      float scale) {
    const int lane = threadIdx.x & 31;
    const long long warps = ((long long)gridDim.x * blockDim.x) >> 5;
    for (long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < n;
         r += warps) {
        const long long row = distinct[r];
        if (row < 0 || row >= num_rows) continue;
        for (int e = 4 * lane; e < width; e += 128) {
            float4 v = *reinterpret_cast<const float4*>(rows + row * width + e);
            v.x *= scale; v.y *= scale; v.z *= scale; v.w *= scale;
            *reinterpret_cast<float4*>(rows + row * width + e) = v;
        }
    }
}
"""


def floor_step(num_rows: int, dim: int, width: int, idx: list, off):
    """``step(i)``: the two kernels on batch ``i`` (``idx``: CUDA int64 index tensors,
    ``off``: the shared CUDA int64 offsets), replayed from a CUDA graph on torch's current
    stream. ``width``: a stored row's floats (the weights, then the optimizer's state: what
    the update reads and writes back)."""
    import cupy
    import torch

    if dim % 4 or width % 4 or width < dim:
        raise ValueError(f"the floor kernels read float4s of rows holding their weights: "
                         f"dim {dim}, width {width}")
    module = cupy.RawModule(code=_SOURCE)
    pool, write = module.get_function("floor_pool"), module.get_function("floor_rows")
    idx = [i.to(torch.int64) for i in idx]
    off = off.to(torch.int64)
    rows = torch.zeros((num_rows, width), dtype=torch.float32, device="cuda")
    bags = off.shape[0] - 1
    out = torch.empty((bags, dim), dtype=torch.float32, device="cuda")
    distinct = [torch.unique(i) for i in idx]
    longest = max(d.shape[0] for d in distinct)
    padded = [torch.cat([d, d.new_full((longest - d.shape[0],), -1)]) for d in distinct]
    static_idx, static_rows = idx[0].clone(), padded[0].clone()
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    pool_grid = min(-(-bags * 32 // 256), 32 * sms)
    rows_grid = min(-(-longest * 32 // 256), 32 * sms)
    ptr = lambda t: np.uint64(t.data_ptr())  # noqa: E731

    def launch():
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        pool((pool_grid,), (256,), (ptr(rows), np.int64(num_rows), np.int32(width),
                                    ptr(static_idx), ptr(off), np.int64(bags), np.int32(dim),
                                    ptr(out)), stream=stream)
        write((rows_grid,), (256,), (ptr(rows), np.int64(num_rows), np.int32(width),
                                     ptr(static_rows), np.int64(longest), np.float32(1.0)),
              stream=stream)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launch()  # compiled and run once outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()

    def step(i):
        static_idx.copy_(idx[i % len(idx)])
        static_rows.copy_(padded[i % len(padded)])
        graph.replay()

    step.keep = (graph, rows, out, module)  # alive as long as the step
    return step
