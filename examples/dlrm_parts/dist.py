"""Several GPUs for the torch runner: one process per GPU under ``torchrun``.

Every rank trains on its share of the global batch (``ClickLog.batch(..., part=(rank,
world))``) and the ranks stay equal to one process on the whole batch:

* each rank's loss is its samples' summed BCE divided by the GLOBAL batch size, so the
  gradients of the ranks add up to the gradient of the global mean loss;
* host tables and TT tables take ``process_group=``: one shared table per host, gradients
  summed across ranks inside their fused updates;
* the MLPs' gradients are summed with one ``all_reduce`` over a flat copy before the
  (replicated) flat Adam step;
* the small tables kept in HBM (``nn.EmbeddingBag(sparse=True)``) are replicated: their
  sparse gradients are all-gathered, so each rank's Adagrad step sees every rank's rows.

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


def init(device: str) -> tuple[Ranks, str]:
    """Join the process group ``torchrun`` describes; returns ``(ranks, device)`` with this
    rank's GPU (``cuda:<local rank>``) made current for torch and CuPy."""
    if not launched():
        return Ranks(), device
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if device == "cuda":
        if local >= torch.cuda.device_count():
            raise ValueError(f"local rank {local} has no GPU: this host has "
                             f"{torch.cuda.device_count()}")
        torch.cuda.set_device(local)
        import cupy

        cupy.cuda.Device(local).use()
        device = f"cuda:{local}"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo",
                                **({"device_id": torch.device(device)}
                                   if device.startswith("cuda") else {}))
    return Ranks(rank, world, local, dist.group.WORLD), device


def finish(ranks: Ranks) -> None:
    if ranks.world > 1:
        import torch.distributed as dist

        dist.barrier()  # every rank done with the shared tables before any tears down
        dist.destroy_process_group()


def sum_dense_grads(params, ranks: Ranks) -> None:
    """Sum the gradients of ``params`` over the ranks: one all_reduce of a flat copy."""
    import torch
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=ranks.group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def gather_sparse_grads(params, ranks: Ranks) -> None:
    """Replace each sparse gradient of ``params`` by the concatenation of every rank's (in
    rank order): a replicated table then takes the step of the whole batch on every rank.

    ``nn.EmbeddingBag(sparse=True)`` gives one uncoalesced gradient row per looked-up index,
    and every rank looks up as many indices (equal shares of the batch), so the pieces have
    the same size on every rank: two ``all_gather`` calls for all tables together, no
    size exchange and no host sync."""
    import torch
    import torch.distributed as dist

    sparse = [p for p in params if p.grad is not None and p.grad.is_sparse]
    if not sparse:
        return
    idx = [p.grad._indices()[0] for p in sparse]
    val = [p.grad._values() for p in sparse]
    sizes = [i.numel() for i in idx]
    flat_idx, flat_val = torch.cat(idx), torch.cat(val)
    all_idx = [torch.empty_like(flat_idx) for _ in range(ranks.world)]
    all_val = [torch.empty_like(flat_val) for _ in range(ranks.world)]
    dist.all_gather(all_idx, flat_idx, group=ranks.group)
    dist.all_gather(all_val, flat_val, group=ranks.group)
    pieces_idx = [torch.split(t, sizes) for t in all_idx]
    pieces_val = [torch.split(t, sizes) for t in all_val]
    for k, p in enumerate(sparse):
        i = torch.cat([pieces[k] for pieces in pieces_idx])
        v = torch.cat([pieces[k] for pieces in pieces_val])
        p.grad = torch.sparse_coo_tensor(i[None], v, p.grad.shape)
