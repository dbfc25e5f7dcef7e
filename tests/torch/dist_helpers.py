"""What every multi-process test of the torch adapters does: a free port for the rendezvous,
and a worker joining its group on the CPU (gloo) or on its own GPU (NCCL, CuPy's current
device made the same)."""

import datetime
import faulthandler
import os

import pytest
import torch
import torch.distributed as dist

from xferlib.testing import free_port

__all__ = ["free_port", "join", "require_two_gpus"]


# A worker still running after this long prints every thread's stack and exits: a rank
# stuck in a collective fails its test with where it stood instead of hanging the run.
WORKER_LIMIT_S = int(os.environ.get("XFERLIB_TEST_WORKER_LIMIT_S", "300"))


def join(rank: int, world: int, port: int, backend: str) -> torch.device:
    """Join the ``backend`` group of ``world`` processes as ``rank``; returns this rank's
    device (``cuda:<rank>`` on NCCL, the CPU on gloo)."""
    faulthandler.dump_traceback_later(WORKER_LIMIT_S, exit=True)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    device = torch.device("cpu")
    if backend == "nccl":
        import cupy

        torch.cuda.set_device(rank)
        cupy.cuda.Device(rank).use()
        device = torch.device("cuda", rank)
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    return device


def require_two_gpus() -> None:
    """Skip, saying why, unless two CUDA GPUs, CuPy and NCCL are here."""
    import xferlib
    from xferlib.testing import GPU_SKIP_REASON

    if not (torch.cuda.is_available() and xferlib.cupy_available()):
        pytest.skip(GPU_SKIP_REASON)
    if torch.cuda.device_count() < 2 or not dist.is_nccl_available():
        pytest.skip("needs two CUDA GPUs and NCCL")
