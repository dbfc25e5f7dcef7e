"""TT embedding bags under data parallelism: replicated cores, all-reduced core-row gradients.

``TableBatchedTTEmbeddingBag(..., process_group=group)`` (and ``TTEmbeddingBag``): every rank
holds the same cores (the ranks agree on the initialization seed at construction) and trains
on its own share of the global batch. In a fused (``sparse=True``) backward each rank

1. computes the core gradients of ITS batch (``xferlib.tt.tt_core_grads``: one flat,
   core-sized buffer, zeros in untouched rows, and one touched flag per core row; with an
   active row cache also the cache rows' gradients and flags);
2. adds one slot per rank for a rejected batch (on the GPU the kernels' device verdict, read
   without a host sync) and sums the whole buffer over the group with ONE ``all_reduce``;
3. applies the fused optimizer to the rows touched on any rank from the summed gradient
   (``xferlib.tt.tt_apply_core_grads``), the same update on every rank, or, when some
   rank's batch was rejected, to none (the step changes nothing anywhere).

So N ranks equal one process on the concatenated global batch (each bag's gradient is its
own: the gradients of the ranks are SUMMED, as one process sums them over its batch; a loss
averaged over the global batch is each rank's summed loss divided by the global batch size).
The cache's contents are chosen from the access counts of every rank (``populate_across``).
Every rank must run each module's forward and backward every step, as DDP requires.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from xferlib import tt as core
from xferlib.adapters.torch._convert import array_of
from xferlib.batch import Verdict
from xferlib.handoff import to_torch

__all__ = ["agree_seed", "agree_forward", "fused_step", "populate_across",
           "broadcast_state"]

# Error types a rejected batch raises, coded in the all-reduced buffer (0: accepted).
_ERRORS = (None, IndexError, ValueError, TypeError, RuntimeError)


def agree_seed(group, seed):
    """``seed``, or (None) one drawn by the group's rank 0 and broadcast: every rank then
    draws the same cores."""
    if seed is not None:
        return seed
    box = [int(np.random.SeedSequence().entropy % (1 << 63))
           if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def _code(error) -> float:
    for code, kind in enumerate(_ERRORS[1:], 1):
        if isinstance(error, kind):
            return float(code)
    return float(len(_ERRORS) - 1)


def _raise_for_others(codes, rank: int, what: str = "a TT embedding bag") -> None:
    """Raise for the first other rank whose batch was rejected (``codes``: one per rank)."""
    codes = np.asarray(codes).reshape(-1)
    for r, code in enumerate(codes):
        if code and r != rank:
            kind = _ERRORS[min(int(code), len(_ERRORS) - 1)]
            raise kind(f"rank {r} of the process group had a bad batch ({kind.__name__}) for "
                       f"{what}: this step changed nothing on any rank")


def agree_forward(group, device, error, what: str = "a TT embedding bag") -> None:
    """A training forward whose batch is checked on the host: every rank learns whether some
    rank's batch was rejected, and raises (its own error, or one naming the rank and
    ``what`` it fed), so no rank waits for the others in the backward's collective."""
    codes = torch.zeros(dist.get_world_size(group), dtype=torch.float32, device=device)
    rank = dist.get_rank(group)
    if error is not None:
        codes[rank] = _code(error)
    dist.all_reduce(codes, group=group)
    if error is not None:
        raise error
    if bool(codes.any()):
        _raise_for_others(codes.cpu().numpy(), rank, what)


class _GroupReport:
    """Words the group verdict of a GPU step (word 0: the first rank whose batch was
    rejected, word 1: its error code): this rank's own error first (read from its own
    verdict), else one naming the other rank."""

    __slots__ = ("rank", "own")

    def __init__(self, rank: int, own: Verdict):
        self.rank, self.own = rank, own

    def __call__(self, first: int, code: int) -> None:
        self.own.raise_now()  # this rank's error first
        codes = np.zeros(first + 1)
        codes[first] = code
        _raise_for_others(codes, self.rank)


def _group_verdict(codes: torch.Tensor, rank: int, own: Verdict, to_array) -> Verdict:
    """The group's verdict as two device words (no host sync): the first rank with a
    nonzero code and that code, all ones when every batch was accepted."""
    bad = codes != 0
    none = torch.full((), -1, dtype=torch.int64, device=codes.device)
    first = torch.where(bad.any(), bad.to(torch.int64).argmax(), none)
    code = torch.where(bad.any(), codes[first.clamp(min=0)].to(torch.int64), none)
    return Verdict(to_array(torch.stack([first, code])).view(np.uint64), _GroupReport(rank, own))


def fused_step(table, residuals, grad_bags, *, group):
    """One fused training step across the group (see the module docstring): the data-parallel
    hook of :meth:`xferlib.tt.TTTable.apply_gradients` (``reduce=``), which has counted the
    step. ``residuals``: the table's lookup residuals. Returns the group's
    :class:`xferlib.batch.Verdict` for the table to defer (GPU, ``defer_checks``; it must be
    read at the same call on every rank, so never early) or None; raises at once for a
    rejected batch otherwise."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    shape, arrays, cache, bag = table.joint_shape, residuals.cores, residuals.cache, \
        residuals.bag
    plan = isinstance(bag, core.TTBagPlan)
    cached = cache is not None and cache.active
    own_error = None
    # The input check read here, on the host: a rejected batch's cache gradient would index
    # the gradients with positions its kernels never wrote. (One sync per data-parallel cached
    # step; the single-GPU step has none.)
    if plan and cached:
        try:
            bag.verdict.raise_now()
        except (IndexError, ValueError) as err:
            own_error = err
    grad, touched = core.tt_core_grads(arrays, shape, bag, grad_bags)
    pieces = [to_torch(grad), to_torch(touched.astype(np.float32))]
    if cached:
        if own_error is None:
            cgrad, ctouched = core.tt_cache_grad(cache, table.shape, bag, grad_bags)
            pieces += [to_torch(cgrad).reshape(-1), to_torch(ctouched.astype(np.float32))]
        else:  # a rejected batch contributes nothing
            pieces.append(torch.zeros(cache.capacity * (table.dim + 1),
                                      device=pieces[0].device))
    codes = torch.zeros(world, dtype=torch.float32, device=pieces[0].device)
    if own_error is not None:
        codes[rank] = _code(own_error)
    elif plan:  # the device verdict: 1 for a bad index, 2 for bad offsets (no host sync)
        v = (to_torch(bag.verdict.words.view(np.int64)) != -1).float()
        codes[rank] = v[0] + 2.0 * v[1] * (1.0 - v[0])
    buf = torch.cat(pieces + [codes])
    dist.all_reduce(buf, group=group)
    codes = buf[-world:].clone()
    buf = buf * (codes.sum() == 0)  # a rejected batch anywhere: no row is touched anywhere
    sizes = [p.numel() for p in pieces]
    parts = torch.split(buf[:-world], sizes)
    hyper = table.rule_hyper()
    core.tt_apply_core_grads(arrays, shape, array_of(parts[0]),
                             array_of((parts[1] > 0).to(torch.int32)), table.states,
                             table.optimizer, **hyper)
    if cached:
        width = cache.capacity * (table.dim + 1)
        flat = buf[sum(sizes[:2]):sum(sizes[:2]) + width]
        cgrad = flat[:cache.capacity * table.dim].view(cache.capacity, -1)
        ctouched = flat[cache.capacity * table.dim:] > 0
        core.tt_cache_apply(cache, array_of(cgrad), array_of(ctouched), table.optimizer,
                            **hyper)
    # A batch rejected on any rank takes no step anywhere, its count included (as one
    # process's GPU step leaves it): taken back on the device, no host sync.
    table.uncount(array_of((codes.sum() != 0).to(torch.int64).reshape(1)))
    if own_error is not None:
        raise own_error
    if not plan:  # the host checked every batch in the forward (agree_forward)
        return None
    verdict = _group_verdict(codes, rank, bag.verdict, array_of)
    if table.defer_checks and not bag.checked:
        return verdict
    verdict.raise_now()  # this rank's error first
    return None


def _gather(t: torch.Tensor, group) -> np.ndarray:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts).cpu().numpy()


def populate_across(module, group, table, on_stream) -> None:
    """``cache_populate()`` of a module with a group: the rows are chosen from the access
    counts of every rank summed (the same rows on every rank, those one process on the global
    batches would choose unless its 32-way table dropped some), new rows from the (same)
    cores of the module's core ``table``."""
    keys, counts = _gather(module.hashtbl, group), _gather(module.cache_freq, group)
    seen = keys >= 0
    rows, inverse = np.unique(keys[seen], return_inverse=True)
    summed = np.zeros(rows.size, dtype=np.int64)
    np.add.at(summed, inverse, counts[seen])
    with on_stream(module.cache_rows):
        table.populate_cache_from(rows, summed)


@torch.no_grad()
def broadcast_state(module, group, src: int = 0) -> None:
    """Copy every parameter and buffer (cores, optimizer state, step count, cache) from
    ``group``'s rank ``src`` to the other ranks: e.g. after loading a checkpoint on one rank
    (pending input checks resolved first)."""
    root = dist.get_global_rank(group, src)
    for t in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(t.data, src=root, group=group)
    if module.use_cache:
        module.warmup = not bool((module.cache_rows != core.NO_ROW).any())
