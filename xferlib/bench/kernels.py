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
    from xferlib._kernels.optim import OPTIM_MODULE, update_name

    table = core.step_scalars(core.FLAT_RULES["adam"], layout, state, hypers,
                              np.ones(len(layout.segments), dtype=bool))
    device_table = cupy.asarray(table.astype(np.float32))
    chunks = core.chunk_table(layout)
    kernel = OPTIM_MODULE.get_function(update_name(rule.kind))
    s = state.buffers
    args = (params, grads, s["exp_avg"], s["exp_avg_sq"], np.uint64(0),
            device_table, *chunks, np.int32(table.shape[1]), np.uint64(0), np.uint64(0))

    def launch():
        kernel((len(chunks[0]),), (256,), args)

    return launch
