"""Several GPUs for the torch runner: one process per GPU under ``torchrun``.

Every rank trains on its share of the global batch and the ranks stay equal to one process
on the whole batch (with the sharded collection each rank makes only its own samples:
``ClickLog.batches(..., part=(rank, world))``):

* each rank's loss is its samples' summed BCE divided by the GLOBAL batch size, so the
  gradients of the ranks add up to the gradient of the global mean loss;
* host tables and TT tables take ``process_group=``: one shared table per host, gradients
  summed across ranks inside their fused updates;
* the MLPs' gradients are summed over the ranks by ``GradAllReduce`` before the
  (replicated) flat Adam step: slices of FlatAdam's gradient buffer, each starting its
  ``all_reduce`` as soon as the backward has filled it;
* the embedding collection is sharded (``ShardedEmbeddingBagCollection``, table-wise by
  default): each rank holds only its shards and looks up only its own samples, each lookup
  sent to its table's owner and the pooled rows back by ``all_to_all`` (see
  ``torch_run.sharding_plan``). TT tables (``--placement tt``) keep the replicated design:
  every rank looks up the global batch, their gradients summed inside their fused updates.

Each rank sets and touches only its own GPU: :func:`local_gpu` picks ``LOCAL_RANK``'s GPU,
:func:`init` makes it current for torch and CuPy before anything allocates, and nothing
here calls a CUDA function without naming that device.

NCCL on GPUs, gloo on the CPU (``torchrun --nproc_per_node=2 examples/dlrm.py`` works on a
laptop).
"""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    group: object = None  # the torch.distributed group; None for one process

    @property
    def part(self):
        """``ClickLog.batch``'s ``part`` for this rank (None for one process)."""
        return None if self.world == 1 else (self.rank, self.world)

    @property
    def main(self) -> bool:
        return self.rank == 0


def launched() -> bool:
    """Whether ``torchrun`` (or the same environment) started this process among several."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def world_size(default: int = 1) -> int:
    """``WORLD_SIZE`` from the environment (torchrun's), else ``default``."""
    return int(os.environ.get("WORLD_SIZE", default))


def local_gpu(env, device_count: int) -> int:
    """The GPU index this rank may use: its ``LOCAL_RANK`` (``RANK`` where torchrun's
    ``LOCAL_RANK`` is missing), never a default of 0 for every rank. ValueError when the
    host has no such GPU (more ranks than GPUs: two ranks would share one)."""
    local = int(env.get("LOCAL_RANK", env.get("RANK", 0)))
    if not 0 <= local < device_count:
        raise ValueError(f"local rank {local} has no GPU of its own: this host shows "
                         f"{device_count} (run at most that many ranks per host)")
    return local


def init(device: str) -> tuple[Ranks, str]:
    """Join the process group ``torchrun`` describes; returns ``(ranks, device)`` with this
    rank's GPU (``cuda:<local rank>``) made current for torch and CuPy, before any CUDA
    context is created (``torch.cuda.is_available`` and CuPy's device count create none)."""
    if not launched():
        return Ranks(), device
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if device == "cuda":
        local = local_gpu(os.environ, torch.cuda.device_count())
        # JAX, should anything import it in this rank, would open every GPU it sees
        os.environ.setdefault("JAX_CUDA_VISIBLE_DEVICES", str(local))
        torch.cuda.set_device(local)
        import cupy

        cupy.cuda.Device(local).use()
        device = f"cuda:{local}"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo",
                                **({"device_id": torch.device(device)}
                                   if device.startswith("cuda") else {}))
    return Ranks(rank, world, local, dist.group.WORLD), device


def free_gpu_memory(ranks: Ranks, device: str) -> None:
    """Give cached GPU memory back between runs of one invocation, on this rank's GPU only.

    ``torch.cuda.empty_cache()`` walks the caching allocator of every GPU torch knows; under
    torchrun on GPUs in exclusive-process mode it raised "CUDA-capable device(s) is/are busy
    or unavailable" (issue 29). torchrun runs one job per invocation, so a rank among several
    frees nothing of torch's; one process frees its own device's cache, and CuPy's pool of
    the current (this rank's) device."""
    import sys

    if not device.startswith("cuda"):
        return
    if ranks.world == 1 and "torch" in sys.modules:
        torch = sys.modules["torch"]
        with torch.cuda.device(torch.device(device)):
            torch.cuda.empty_cache()
    if "cupy" in sys.modules:
        cupy = sys.modules["cupy"]
        with cupy.cuda.Device(ranks.local_rank if ranks.world > 1 else
                              cupy.cuda.runtime.getDevice()):
            cupy.get_default_memory_pool().free_all_blocks()


def init_jax(device: str) -> tuple[Ranks, str]:
    """JAX under ``torchrun`` (``--framework jax``): one process per GPU (per CPU device on
    the CPU) joined by ``jax.distributed``, before JAX starts a backend; returns ``(ranks,
    device)``. This rank's GPU is the only one JAX sees (``local_device_ids``) and CuPy's
    current. The coordinator's address is agreed through torchrun's own store:
    process 0 binds a free port and publishes it there."""
    import socket
    import sys

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if "jax" in sys.modules and sys.modules["jax"].distributed.is_initialized():
        raise RuntimeError("jax.distributed is initialized already")
    gpus = None
    if device == "cuda":
        import torch

        local = local_gpu(os.environ, torch.cuda.device_count())
        gpus = [local]  # JAX's only device (jax.distributed sets JAX's visible GPUs)
        import cupy

        cupy.cuda.Device(local).use()
        device = f"cuda:{local}"
    import torch.distributed as tdist

    host = os.environ.get("MASTER_ADDR", "127.0.0.1")  # one host: rank 0's too
    store = tdist.TCPStore(host, int(os.environ["MASTER_PORT"]), world, is_master=False)
    # a restarted job (torchrun --max-restarts) agrees afresh
    key = f"xferlib/jax_coordinator/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        store.set(key, f"{host}:{port}")
    address = store.get(key).decode()
    import jax

    if not device.startswith("cuda"):
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # no cluster detection: under SLURM or MPI it would pick the GPUs itself
    jax.distributed.initialize(address, num_processes=world, process_id=rank,
                               local_device_ids=gpus, cluster_detection_method="deactivate")
    return Ranks(rank, world, local, None), device


def finish(ranks: Ranks, ok: bool = True) -> None:
    """Leave the group: after a barrier (every rank done with the shared tables before any
    tears down) when this rank finished, without one when it failed (the others are not
    waited for). JAX's processes (``init_jax``) leave ``jax.distributed``."""
    import sys

    jax = sys.modules.get("jax")
    if ranks.world > 1 and jax is not None and jax.distributed.is_initialized():
        if ok:
            jax.distributed.shutdown()
            return
        # a failed process leaves at once: JAX's own shutdown at exit would wait minutes
        # at a barrier the other processes, stuck in the step's collectives, never reach
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    if ranks.world > 1:
        from xferlib.adapters.torch import leave_process_group

        leave_process_group(wait=ok)
