"""One host table shared by the ranks of a torch.distributed group on one host.

``HostEmbeddingBag(..., process_group=group)`` (and ``HostEmbedding``) builds its table in
host memory shared by the ranks (``xferlib/table/shared.py``): group rank 0 creates and
initializes it, the others open it by name, and rank 0 unlinks the name once all have it
(the memory then lives while some rank maps it). Each rank's forward gathers its own batch's
rows from the one table, on its own GPU (the single-process lookup path).

The update (run in each module's backward, in the same order on every rank as autograd's):

1. each rank sums the gradients of its repeated rows (a stable sort, then segment sums:
   deterministic), and checks its indices, without a host sync;
2. one ``all_gather`` of ``(distinct rows, any bad index, rows per owner)`` (the one host
   sync of the step: these sizes decide the shapes), one ``all_gather`` of the
   ``(row, summed gradient)`` pairs padded to the largest rank's count (both work on gloo and
   NCCL); a bad index on any rank raises on every rank before anything changes;
3. each rank keeps the pairs of the rows it owns (``row % world_size``, ``owner_of``),
   concatenated in rank order, and applies the table's fused optimizer to them (the
   single-process kernel, which sums a row's contributions in that order), so every row is
   written by exactly one rank and N ranks equal one process on the concatenated batch up to
   float summation order;
4. a fence (a one-element ``all_reduce`` on NCCL, ordered on the streams after the update
   kernels; a barrier on gloo) so the next lookup on every rank sees every rank's update.

Every rank must run each module's forward and backward every step (as DDP requires).
"""

from __future__ import annotations

import json
import socket

import numpy as np
import torch
import torch.distributed as dist

from xferlib.adapters.torch._convert import as_core_array, current_stream
from xferlib.table import HostTable

__all__ = ["build_shared_table", "SharedTableGroup"]


def _agree(group, fn):
    """Run ``fn()`` on every rank; if it raised anywhere, raise on every rank (the rank's own
    exception, or RuntimeError naming the rank that failed), so no rank waits forever in a
    later collective. Returns ``(value, [what every rank's fn shared])``: ``fn`` returns
    ``(value, shared)``."""
    try:
        value, shared = fn()
        note = None
    except Exception as err:  # reported to every rank, then re-raised here
        value, shared, note, error = None, None, f"{type(err).__name__}: {err}", err
    notes = [None] * dist.get_world_size(group)
    dist.all_gather_object(notes, (note, shared), group=group)
    if note is not None:
        raise error
    for rank, (other, _) in enumerate(notes):
        if other is not None:
            raise RuntimeError(f"rank {rank} of the process group failed to build its shared "
                               f"host table: {other}")
    return value, [s for _, s in notes]


_CHECKED = ("num_rows", "dim", "dtype", "optimizer", "hyper", "padding_idx")


def build_shared_table(group, num_rows, dim, dtype, optimizer, optimizer_kwargs, *, init,
                       seed, padding_idx=None, prepare=None) -> HostTable:
    """A HostTable shared by the ranks of ``group`` (all on this host): rank 0 creates and
    initializes it (then calls ``prepare(table)``), the others open it. Ranks that disagree
    on the configuration, or sit on different hosts, get ValueError on every rank."""
    from xferlib.table.rules import resolve_hyper

    rank = dist.get_rank(group)

    def config():
        if optimizer is None:
            raise ValueError("a host table shared by a process group needs a fused optimizer "
                             "(optimizer=None trains rows with a torch.optim optimizer in "
                             "each process); pass process_group=None for a private table")
        hyper = json.loads(json.dumps(resolve_hyper(optimizer, optimizer_kwargs)))
        mine = dict(num_rows=int(num_rows), dim=int(dim), dtype=np.dtype(dtype).name,
                    optimizer=optimizer, hyper=hyper, padding_idx=padding_idx,
                    host=socket.gethostname())
        return mine, mine

    _, configs = _agree(group, config)
    for key in _CHECKED:
        values = [c[key] for c in configs]
        if any(v != values[0] for v in values):
            raise ValueError(f"the ranks of the process group disagree on the shared host "
                             f"table's {key}: " + ", ".join(f"rank {k}: {v!r}"
                                                            for k, v in enumerate(values)))
    hosts = [c["host"] for c in configs]
    if len(set(hosts)) > 1:
        raise ValueError(f"a shared host table needs every rank of its process group on one "
                         f"host, got {hosts}; give it a group of one host's ranks")

    def create():
        table = HostTable(num_rows, dim, dtype, optimizer, optimizer_kwargs, init=init,
                          seed=seed, shared=True)
        try:
            if prepare is not None:
                prepare(table)
        except BaseException:
            table.close()
            raise
        return table, table.shared_name

    table, names = _agree(group, create if rank == 0 else lambda: (None, None))

    def open_():
        if rank == 0:
            return table, None
        return HostTable(num_rows, dim, dtype, optimizer, optimizer_kwargs,
                         shared=names[0]), None

    try:
        opened, _ = _agree(group, open_)
    finally:
        if table is not None:  # every rank has it mapped (or failed): the name can go
            table.unlink_shared()
    return opened


class SharedTableGroup:
    """The collective update of a shared table (see the module docstring)."""

    def __init__(self, group, table: HostTable, device: torch.device):
        self.group, self.table, self.device = group, table, device
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        backend = str(dist.get_backend(group))
        # NCCL moves CUDA tensors; gloo (and a CPU module) moves host tensors.
        self.comm_device = device if device.type == "cuda" and "nccl" in backend \
            else torch.device("cpu")
        self.fence_flag = None

    # ------------------------------------------------------------------ update

    def _local_sums(self, idx: torch.Tensor, grads: torch.Tensor):
        """This rank's distinct rows (ascending, then -1 padding) and their summed gradients
        (then zero rows), both of the batch's length: fixed shapes, no host sync. Sums are
        deterministic: a stable sort by row, then one sequential sum per run. Also the
        number of distinct rows, whether an index is out of range, and how many of the
        distinct rows each rank owns (all on the device)."""
        n, dev = idx.numel(), idx.device
        keys, perm = torch.sort(idx, stable=True)
        starts = torch.ones(n, dtype=torch.bool, device=dev)
        starts[1:] = keys[1:] != keys[:-1]
        run = torch.cumsum(starts, 0) - 1  # the run (distinct row) of each sorted position
        counts = torch.zeros(n, dtype=torch.int64, device=dev).index_add_(
            0, run, torch.ones_like(run))
        sums = torch.segment_reduce(grads.index_select(0, perm), "sum", lengths=counts,
                                    axis=0)
        rows = torch.full((n,), -1, dtype=torch.int64, device=dev).scatter_(0, run, keys)
        distinct = run[-1:] + 1
        bad = ((keys[:1] < 0) | (keys[-1:] >= self.table.num_rows)).to(torch.int64)
        real = (torch.arange(n, device=dev) < distinct).to(torch.int64)
        per_owner = torch.zeros(self.world, dtype=torch.int64, device=dev).index_add_(
            0, torch.remainder(rows, self.world), real)  # owner_of
        return rows, sums, torch.cat([distinct, bad, per_owner])

    def apply(self, idx: torch.Tensor, grads: torch.Tensor) -> None:
        """Every rank's ``(idx, grads)`` summed per row, applied once by each row's owner.
        One host sync (the sizes of the exchange)."""
        table, dim, comm, world = self.table, self.table.dim, self.comm_device, self.world
        idx = idx.to(device=self.device, dtype=torch.int64).reshape(-1)
        grads = grads.to(device=self.device, dtype=torch.float32).reshape(-1, dim)
        if idx.numel():
            rows, sums, meta = self._local_sums(idx, grads)
        else:
            rows, sums = idx.new_empty(0), grads.new_empty((0, dim))
            meta = torch.zeros(2 + world, dtype=torch.int64, device=self.device)
        meta = meta.to(comm)
        metas = [torch.empty_like(meta) for _ in range(world)]
        dist.all_gather(metas, meta, group=self.group)
        metas = torch.stack(metas).cpu().tolist()  # the host sync: sizes decide shapes
        sizes = [m[0] for m in metas]
        if any(m[1] for m in metas):
            self._raise_bad(idx, [m[1] for m in metas])
        largest, owned = max(sizes), sum(m[2 + self.rank] for m in metas)
        if largest == 0:
            return  # no rank has a gradient: nothing changes, no fence needed
        # One message per rank: each row id's 8 bytes ride in the gradient's dtype.
        words, mine = 8 // sums.element_size(), sizes[self.rank]
        packed = torch.zeros((largest, words + dim), dtype=sums.dtype, device=comm)
        if mine:
            packed[:mine, :words] = rows[:mine].view(sums.dtype).view(-1, words).to(comm)
            packed[:mine, words:] = sums[:mine].to(comm)
        pieces = [torch.empty_like(packed) for _ in range(world)]
        dist.all_gather(pieces, packed, group=self.group)
        every = torch.cat([p[:n] for p, n in zip(pieces, sizes)])  # rank order
        all_rows = every[:, :words].contiguous().view(torch.int64).reshape(-1)
        # The pairs of the rows this rank owns, in rank order (a stable sort puts them first;
        # their number is known from the sizes: no sync).
        others = (torch.remainder(all_rows, world) != self.rank).to(torch.int32)
        order = torch.sort(others, stable=True)[1][:owned]
        own_rows = all_rows.index_select(0, order).to(self.device)
        own_grads = every.index_select(0, order)[:, words:].contiguous().to(self.device)
        table.apply_gradients(as_core_array(own_rows), as_core_array(own_grads),
                              **self._stream())
        self.fence()

    def _raise_bad(self, idx, bads) -> None:
        if bads[self.rank]:
            if self.device.type == "cuda":
                try:  # the forward lookup's deferred check reports the same batch: drop it
                    self.table.check()
                except IndexError:
                    pass
            keys = idx.cpu()
            wrong = ((keys < 0) | (keys >= self.table.num_rows)).nonzero()[0, 0]
            raise IndexError(f"index {int(keys[wrong])} at position {int(wrong)} is out of "
                             f"range for a table of {self.table.num_rows} rows; no rank "
                             f"updated the shared table")
        ranks = [k for k, b in enumerate(bads) if b]
        raise IndexError(f"rank(s) {ranks} of the process group had an index out of range "
                         f"for a table of {self.table.num_rows} rows; no rank updated the "
                         f"shared table")

    def _stream(self) -> dict:
        return {"stream": current_stream(self.device)} if self.device.type == "cuda" else {}

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on some rank of the group (a one-element all_reduce read
        on the host: for loading a checkpoint, not for a step)."""
        value = torch.tensor([float(bool(flag))], device=self.comm_device)
        dist.all_reduce(value, group=self.group)
        return bool(value.item())

    def fence(self) -> None:
        """Return (or, on NCCL, order the caller's stream) after every rank's queued table
        writes: the next lookup on any rank sees them."""
        if self.comm_device.type == "cuda":
            # NCCL starts the all_reduce after the work queued on this stream (the update
            # kernels) and the stream waits for its end, on every rank: no host sync.
            if self.fence_flag is None:
                self.fence_flag = torch.zeros(1, device=self.comm_device)
            dist.all_reduce(self.fence_flag, group=self.group)
            return
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        dist.barrier(group=self.group)
