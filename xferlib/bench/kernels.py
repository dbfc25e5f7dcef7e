"""xferlib's kernels launched alone, without the host work of a step, for timing.

Framework-free (NumPy and CuPy): a suite beside an adapter gets a launch function here and
times it, so it needs no private module of the core.
"""

from __future__ import annotations

import numpy as np


def flat_adam_kernel_launch(rule, layout, state, hypers, params, grads):
    """A function of no arguments that launches the flat update kernel of ``rule`` once over
    ``params`` and ``grads`` (CuPy arrays laid out by ``layout``) with Adam's state buffers.

    The per-segment scalar table is computed and copied to the GPU once, here; a launch is
    the kernel alone (no table, no upload, no argument checks), on the current stream. Each
    launch updates ``params`` and the state in place.

    >>> # launch = flat_adam_kernel_launch(opt.rule, bucket.layout, bucket.state,
    >>> #                                  opt.hypers(), bucket.core_params, bucket.core_grads)
    >>> # gpu_time_ms(lambda i: launch())
    """
    import cupy

    from xferlib import optim as core
    from xferlib._kernels.optim import FLAT_UPDATE, OPTIM_MODULE

    table = core.step_scalars(core.FLAT_RULES["adam"], layout, state, hypers,
                              np.ones(len(layout.segments), dtype=bool))
    device_table = cupy.asarray(table.astype(np.float32))
    chunks = core.chunk_table(layout)
    kernel = FLAT_UPDATE.function(OPTIM_MODULE, int(rule.kind), "float")
    s = state.buffers
    args = core.flat_update_arguments(params, grads, (s["exp_avg"], s["exp_avg_sq"], None),
                                      device_table, chunks, table.shape[1])

    def launch():
        kernel((len(chunks[0]),), (256,), args)

    return launch


def scattered_rows_launches(table, rows):
    """``(read, write, buffer)``: functions of no arguments that move the distinct rows
    ``rows`` (a CuPy int64 array) of the GPU-ready ``HostTable`` ``table`` between its pinned
    host RAM and ``buffer`` in HBM (uint8, a row's ``layout.used_width`` elements, weights
    and optimizer state, per line), with the plain kernels of ``xferlib/_kernels/scattered.py``,
    launched as the table's own row kernels are (its block cap). ``write`` puts back what
    ``read`` fetched, so a read followed by a write leaves the table as it was.

    >>> # read, write, _ = scattered_rows_launches(table, cupy.unique(idx))
    >>> # gpu_time_ms(lambda i: (read(), write()))
    """
    side = table.device_side
    if side is None:
        raise ValueError("the table has no GPU side yet: run a GPU lookup on it first")
    import cupy

    from xferlib._kernels import SCATTERED_MODULE, launch_config
    from xferlib._kernels.scattered import SCATTERED_MOVE

    itemsize = table.dtype.itemsize
    layout = table.layout
    if side.s_ptr - side.w_ptr != layout.state_offset * itemsize \
            or side.s_stride != side.w_stride:
        raise ValueError("scattered_rows_launches needs a table whose storage rows hold the "
                         "weights and the state together (HostTable's own layout)")
    width_bytes = layout.used_width * itemsize
    stride_bytes = side.w_stride * itemsize
    if width_bytes % 16 or stride_bytes % 16 or side.w_ptr % 16:
        raise ValueError(f"scattered_rows_launches needs 16-byte aligned rows (row of "
                         f"{width_bytes} bytes, stride {stride_bytes}, address {side.w_ptr})")
    rows = cupy.ascontiguousarray(rows, dtype=cupy.int64)
    n, width, stride = rows.size, width_bytes // 16, stride_bytes // 16
    buffer = cupy.empty((max(n, 1), width * 16), dtype=cupy.uint8)
    grid, block = launch_config(max(1, n), max_blocks=side.max_blocks)
    args = SCATTERED_MOVE.arguments(host=side.w_ptr, stride=stride, n_rows=table.num_rows,
                                    rows=rows, n=n, width=width, hbm=buffer)

    def read():
        SCATTERED_MOVE.function(SCATTERED_MODULE, "false")(grid, block, args)

    def write():
        SCATTERED_MOVE.function(SCATTERED_MODULE, "true")(grid, block, args)

    return read, write, buffer
