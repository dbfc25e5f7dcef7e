"""Sharded flat optimizers (ZeRO stage 1): ``ShardedFlatAdamW`` and friends.

Every rank of a process group holds the whole flat parameter buffer, as under DDP, but the
optimizer state only for its contiguous slice of it: the buffer is padded to a multiple of the
group size N and rank r owns elements ``[r * S, (r + 1) * S)``, ``S = padded / N``. A step:

1. gradients: with ``reduce_grads=True`` (the default, right with or without DDP) the flat
   gradients are reduce-scattered, so each rank gets the mean of its slice over the ranks;
   under DDP, which has already averaged them, ``reduce_grads=False`` skips that;
2. the slice is updated by the same one-kernel flat update as ``FlatAdamW`` (the core's
   rule, run over a layout of the tensors' pieces that fall inside the slice);
3. the slices are all-gathered back into every rank's parameter buffer
   (``all_gather_into_tensor`` in place on NCCL).

So optimizer state (and the float32 master weights of 16-bit parameters) costs 1/N of the
memory per rank, and N ranks train exactly as one process on the global batch would with the
unsharded optimizer (up to float summation order). ``step()`` and ``clip_grad_norm_()`` are
collectives: every rank of the group calls them, in the same order.

Why separate classes rather than ``FlatAdamW(..., shard=True)``: ``FlatAdamW`` is a drop-in
for ``torch.optim.AdamW`` (a local step, torch's checkpoint format both ways); the sharded
step needs a process group, is a collective, and its natural checkpoint is per rank. Those
are different contracts, so they get different names, as torch has ``ZeroRedundancyOptimizer``
beside ``Adam``. Hyperparameters, defaults and ``param_groups`` are the flat optimizer's.

Checkpoints: ``state_dict()`` is this rank's shard (each rank saves its own file, restored on
the same rank of a group of the same size); ``consolidated_state_dict(to=0)`` gathers the
whole state in torch.optim's per-parameter format on rank ``to`` (it loads into
``FlatAdamW``, ``torch.optim.AdamW`` or a sharded optimizer of any group size);
``load_state_dict`` takes either.

>>> # torchrun --nproc_per_node=2 train.py
>>> # model = DistributedDataParallel(model.cuda())
>>> # opt = ShardedFlatAdamW(model.parameters(), lr=1e-3, reduce_grads=False)  # DDP averaged
>>> # loss.backward(); opt.clip_grad_norm_(1.0); opt.step()
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from xferlib import optim as core
from xferlib.adapters.torch import optim as flat
from xferlib.backend import stream_scope
from xferlib.handoff import to_torch

__all__ = ["ShardedFlatSGD", "ShardedFlatAdam", "ShardedFlatAdamW", "ShardedFlatAdagrad",
           "ShardedFlatRMSprop", "ShardedFlatAdamax", "ShardedFlatNAdam", "ShardedFlatRAdam",
           "ShardedFlatLion"]

# Slice boundaries fall on multiples of 16 elements (64 bytes in float32): every piece then
# starts on a 16-byte boundary, so the kernel's whole-vector accesses stay aligned, for 16-bit
# parameters too.
_QUANTUM = 16


def _shard_layout(layout: core.FlatLayout, start: int, end: int):
    """The pieces of ``layout``'s segments inside ``[start, end)``, as a layout of
    ``end - start`` elements, with each piece's segment index and its element range inside
    its tensor (flattened).

    A segment's region runs to the next segment's offset (its padding rides along, as in the
    one-buffer step). A piece that holds only padding keeps its segment's scalars and stays
    zero; a zero-size tensor belongs to the rank whose slice holds its offset."""
    segments = layout.segments
    pieces, index, ranges = [], [], []
    for i, seg in enumerate(segments):
        stop = segments[i + 1].offset if i + 1 < len(segments) else layout.total
        lo, hi = max(seg.offset, start), min(stop, end)
        if hi <= lo and not (seg.size == 0 and start <= seg.offset < end):
            continue
        first = min(lo - seg.offset, seg.size)
        count = max(0, min(seg.offset + seg.size, end) - lo)
        pieces.append(core.Segment(lo - start, count, (count,), seg.group))
        index.append(i)
        ranges.append((first, first + count))
    local = core.FlatLayout(tuple(pieces), end - start, layout.dtype)
    return local, np.array(index, dtype=np.int64), ranges


def _collective(new_name, old_name):
    """torch renamed the tensor collectives (all_gather_into_tensor -> all_gather_single);
    use the name this torch has."""
    return getattr(dist, new_name, None) or getattr(dist, old_name)


class _ShardBucket(flat.Bucket):
    """One (device, dtype) of parameters: the whole flat buffers, the state of one slice."""

    def __init__(self, entries, rule, hypers, group, reduce_grads: bool):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.reduce_grads = reduce_grads
        self._attach(entries, multiple=self.world * _QUANTUM)
        size = self.layout.total // self.world
        self.start, self.end = self.rank * size, (self.rank + 1) * size
        self.local, self.index, self.ranges = _shard_layout(self.layout, self.start, self.end)
        self.shard_params = self.flat_params[self.start:self.end]
        # Under DDP the slice of the (already averaged) flat gradients is read in place;
        # otherwise the reduce-scatter writes this rank's mean slice into a buffer of its own.
        self.shard_grads = (torch.empty_like(self.shard_params) if reduce_grads
                            else self.flat_grads[self.start:self.end])
        self.reduced = False
        xp = flat.array_module(self.device)
        self.state = rule.init(self.local, hypers, xp=xp)
        self.state_tensors = {name: torch.from_dlpack(b) if self.device.type == "cuda"
                              else torch.from_numpy(b) for name, b in self.state.buffers.items()}
        self.master = None if self.dtype == torch.float32 else self.shard_params.float()
        self.core_params = flat.core_view(self.shard_params if self.master is None
                                          else self.master)
        self.core_grads = flat.core_view(self.shard_grads)
        self.core_lowp = None if self.master is None else flat.core_view(self.shard_params)
        self.capturable = False
        self.cuda_step = None
        if self.device.type == "cuda":
            self.cuda_step = core.CudaStep(rule.name, self.local, self.core_params,
                                           self.core_grads, self.state.buffers, self.core_lowp)
        nccl = dist.get_backend(group) == "nccl"
        self._gather_in_place = nccl  # NCCL reads its input from inside the output buffer
        # last: every view above counts
        self.storage_uses = flat.storage_use_count(self.flat_params)

    @property
    def state_layout(self):
        return self.local

    def zero_grad(self, set_to_none: bool):
        super().zero_grad(set_to_none)
        self.reduced = False  # a clip without a step (a skipped step) reduced old gradients

    def _marker(self, i):
        mark = super()._marker(i)

        def mark_and_forget(param):  # new gradients: the next clip or step reduces again
            mark(param)
            self.reduced = False
        return mark_and_forget

    def set_step(self, i: int, step: int) -> None:  # i: a piece of this shard
        self.state.steps[i] = step

    def reduce(self) -> None:
        """This rank's slice of the gradients, averaged over the group (once per step)."""
        if self.reduced:
            return
        self.reduced = True
        if not self.reduce_grads or self.world == 1:
            if self.reduce_grads:
                self.shard_grads.copy_(self.flat_grads[self.start:self.end])
            return
        _collective("reduce_scatter_single", "reduce_scatter_tensor")(
            self.shard_grads, self.flat_grads, group=self.group)
        self.shard_grads.div_(self.world)

    def step(self, rule, hypers, grad_mul=None, grad_scale=None, found_inf=None):
        self.check_params()
        active = self.collect_grads()[self.index]
        self.reduce()
        self.reduced = False
        if len(self.local.segments):
            if self.cuda_step is not None:
                self.cuda_step(self.state, hypers, active, flat.current_cupy_stream(self.device))
            else:
                rule.update(self.local, self.core_params, self.core_grads, self.state, hypers,
                            active=active, params_lowp=self.core_lowp)
        self.all_gather()

    def all_gather(self) -> None:
        """Every rank's updated slice into every rank's parameter buffer."""
        if self.world == 1:
            return
        gather = _collective("all_gather_single", "all_gather_into_tensor")
        if self._gather_in_place:
            gather(self.flat_params, self.shard_params, group=self.group)
            return
        # gloo: hand it a copy (its input must not alias the output), as one tensor when the
        # backend takes that, else as the list of slices.
        mine = self.shard_params.clone()
        try:
            gather(self.flat_params, mine, group=self.group)
        except (RuntimeError, NotImplementedError):
            dist.all_gather(list(self.flat_params.chunk(self.world)), mine, group=self.group)


class _ShardedFlatOptimizer(flat.FlatOptimizerBase):
    """Base of the ``ShardedFlat*`` classes: ``FlatOptimizerBase`` with sharded buckets."""

    def __init__(self, params, *, process_group=None, reduce_grads: bool = True, **hyper):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__} needs torch.distributed initialized "
                               "(dist.init_process_group) before it is built")
        if hyper.get("capturable"):
            raise ValueError(f"capturable=True is not supported by {type(self).__name__} "
                             "(the step is a collective)")
        self._group = dist.group.WORLD if process_group is None else process_group
        self._reduce_grads = bool(reduce_grads)
        super().__init__(params, **hyper)

    def _build_buckets(self):
        hypers = self.hypers()
        # Every rank builds the same buckets in the same order: their collectives pair up.
        return [_ShardBucket(entries, self._rule, hypers, self._group, self._reduce_grads)
                for entries in self.bucket_entries()]

    @property
    def process_group(self):
        return self._group

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, eps: float = 1e-6,
                        fused: bool = False):
        """``torch.nn.utils.clip_grad_norm_`` with the norm of ALL gradients: each rank's
        share over its slice (``xferlib.optim.partial_norm``), summed (max for ``inf``) over
        the group by one all-reduce. Returns the total norm, the same on every rank.

        Only this rank's slice of the gradients is scaled (the step reads nothing else), so
        ``.grad`` outside it keeps its unclipped values. A collective: call it on every rank."""
        if fused:
            raise ValueError(f"clip_grad_norm_(fused=True) is not supported by "
                             f"{type(self).__name__}")
        norm_type = float(norm_type)
        inf = norm_type == float("inf")
        shares = []
        for bucket in self._buckets:
            bucket.collect_grads()
            bucket.reduce()
            stream = (flat.current_cupy_stream(bucket.device) if bucket.device.type == "cuda"
                      else None)
            # 16-bit gradients: their float32 copy (1/N of the buffer), so the norm is
            # summed in float32 whatever the array library does with 16-bit types.
            grads = bucket.core_grads if bucket.dtype == torch.float32 else \
                flat.core_view(bucket.shard_grads.float())
            with stream_scope(stream, bucket.device.type == "cuda"):
                share = core.partial_norm(grads, norm_type)
            shares.append(to_torch(flat.as_array(share)).to(self._buckets[0].device,
                                                             torch.float32).reshape(1))
        share = torch.stack(shares).max(0)[0] if inf else torch.stack(shares).sum(0)
        dist.all_reduce(share, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM,
                        group=self._group)
        total = share[0] if inf else share[0] ** (1.0 / norm_type)
        factor = torch.clamp(max_norm / (total + eps), max=1.0)
        for bucket in self._buckets:
            bucket.shard_grads.mul_(factor.to(bucket.device))
        return total

    # -- checkpoints -------------------------------------------------------------------------

    def state_dict(self):
        """This rank's shard: torch.optim's per-parameter entries, each holding the piece of
        the parameter's state inside this rank's slice (flattened), and ``"shard"``: the
        rank, the group size and each piece's element range. Restore it with
        ``load_state_dict`` on the same rank of a group of the same size."""
        for bucket in self._buckets:
            bucket.check_params(shapes=True)
        index = self._param_index()
        state, ranges = {}, {}
        for bucket in self._buckets:
            for k, (i, (lo, hi)) in enumerate(zip(bucket.index, bucket.ranges)):
                p, seg = bucket.params[i], bucket.local.segments[k]
                key = index[id(p)]
                ranges[key] = (lo, hi)
                entry = {"step": torch.tensor(float(bucket.state.steps[k]))}
                hyper = self._hyper(self.param_groups[seg.group])
                for name in self._rule.state_names(hyper):
                    entry[name] = bucket.state_tensors[name][
                        seg.offset:seg.offset + seg.size].clone()
                if self._rule_name == "nadam":
                    entry["mu_product"] = torch.tensor(float(
                        bucket.state.scalars["mu_product"][k]))
                if bucket.master is not None:
                    entry["master_param"] = bucket.master[
                        seg.offset:seg.offset + seg.size].clone()
                state[key] = entry
        groups = []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = [index[id(p)] for p in group["params"]]
            groups.append(packed)
        shard = {"rank": self._buckets[0].rank, "world_size": self._buckets[0].world,
                 "ranges": ranges}
        return {"state": state, "param_groups": groups, "shard": shard}

    def consolidated_state_dict(self, to: int = 0):
        """The whole optimizer state in torch.optim's per-parameter format (``FlatAdamW``'s),
        gathered on rank ``to`` of the group (other ranks get None). A collective: call it
        on every rank. It moves every rank's state through rank ``to``'s host memory (a
        pickled gather), so it is for checkpoints, not for every step."""
        bucket0 = self._buckets[0]
        if not 0 <= to < bucket0.world:
            raise ValueError(f"to={to} is not a rank of a group of {bucket0.world}")
        mine = _to_cpu(self.state_dict())
        gathered = [None] * bucket0.world if bucket0.rank == to else None
        dst = to if self._group is dist.group.WORLD else dist.get_global_rank(self._group, to)
        if dist.get_backend(self._group) == "nccl":
            torch.cuda.set_device(bucket0.device)  # gather_object stages through the GPU
        dist.gather_object(mine, gathered, dst=dst, group=self._group)
        if bucket0.rank != to:
            return None
        return self._merge(gathered)

    def _merge(self, shards):
        params = [p for group in self.param_groups for p in group["params"]]
        state = {}
        for key, p in enumerate(params):
            pieces = sorted(((s["shard"]["ranges"][key], s["state"][key]) for s in shards
                             if key in s["state"]), key=lambda piece: piece[0])
            if not pieces or all(float(e["step"]) == 0 for _, e in pieces):
                continue
            (_, first), covered = pieces[0], 0
            for (lo, hi), _ in pieces:
                if lo != covered:
                    raise ValueError(f"the shards do not cover parameter {key}: a gap at "
                                     f"element {covered}")
                covered = hi
            if covered != p.numel():
                raise ValueError(f"the shards cover {covered} of parameter {key}'s "
                                 f"{p.numel()} elements")
            entry = {}
            if self._rule_name != "sgd":
                entry["step"] = first["step"].clone()
            for name, value in first.items():
                if name in ("step", "mu_product"):
                    continue
                entry[name] = torch.cat([e[name] for _, e in pieces]).view(p.shape)
            if "mu_product" in first:
                entry["mu_product"] = first["mu_product"].clone()
            state[key] = entry
        groups = shards[0]["param_groups"]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        """Restore this rank's shard (from ``state_dict()``, same rank and group size), or
        take this rank's slice of a whole per-parameter state dict (``FlatAdamW``'s,
        ``torch.optim.AdamW``'s or ``consolidated_state_dict()``'s). Everything is checked
        before anything changes: a rejected checkpoint (``ValueError``) leaves the optimizer
        as it was."""
        for bucket in self._buckets:
            bucket.check_params(shapes=True)
        shard = state_dict.get("shard")
        if shard is not None:
            bucket0 = self._buckets[0]
            if (shard["world_size"], shard["rank"]) != (bucket0.world, bucket0.rank):
                raise ValueError(
                    f"state_dict: a shard of rank {shard['rank']} of {shard['world_size']} "
                    f"cannot be loaded by rank {bucket0.rank} of {bucket0.world}; load a "
                    "consolidated_state_dict() instead")
        saved = state_dict["state"]
        plan = self._load_plan(saved, shard)
        torch.optim.Optimizer.load_state_dict(self, {k: v for k, v in state_dict.items()
                                                     if k != "shard"})
        for bucket in self._buckets:  # the checkpoint's hyperparameters may need more state
            bucket.ensure_buffers(self._rule, self.hypers())
        for bucket, k, p, entry, piece, lo, hi in plan:
            seg = bucket.local.segments[k]
            where = slice(seg.offset, seg.offset + seg.size)
            if bucket.master is not None:
                master = entry.get("master_param")
                source = p.detach().reshape(-1)[lo:hi] if master is None else \
                    master.reshape(-1)[piece]
                bucket.master[where].copy_(source.to(bucket.device, torch.float32))
            for name, tensor in bucket.state_tensors.items():
                if entry.get(name) is not None:
                    tensor[where].copy_(entry[name].reshape(-1)[piece].to(
                        tensor.device, tensor.dtype))
                else:  # no state saved for it: it starts afresh, as in torch
                    tensor[where].fill_(core.fresh_value(self._rule_name, name,
                                                         self.param_groups[seg.group]))
            bucket.restore_counters(k, entry, self._rule_name)
        self.state.clear()

    def _load_plan(self, saved, shard):
        """Each piece of this rank's slice with its checkpoint entry and the part of that
        entry's tensors it takes, every tensor's size checked."""
        index = self._param_index()
        plan = []
        for bucket in self._buckets:
            for k, (i, (lo, hi)) in enumerate(zip(bucket.index, bucket.ranges)):
                p = bucket.params[i]
                key = index[id(p)]
                entry = saved.get(key, {})
                if shard is None:
                    piece, want = slice(lo, hi), p.numel()
                else:
                    if key in saved and tuple(shard["ranges"].get(key, ())) != (lo, hi):
                        raise ValueError(f"state_dict: parameter {key}'s piece "
                                         f"{tuple(shard['ranges'].get(key, ()))} is not this "
                                         f"rank's {(lo, hi)} (a different model or layout)")
                    piece, want = slice(None), hi - lo
                for name, value in entry.items():
                    if (name not in ("step", "mu_product") and isinstance(value, torch.Tensor)
                            and value.numel() != want):
                        raise ValueError(f"state_dict: parameter {key}'s {name!r} has "
                                         f"{value.numel()} elements, expected {want}")
                plan.append((bucket, k, p, entry, piece, lo, hi))
        return plan


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value


def _sharded_class(cls):
    sharded = type(f"Sharded{cls.__name__}", (_ShardedFlatOptimizer,),
                   {"_rule_name": cls._rule_name, "_renamed": dict(cls._renamed)})
    sharded.__doc__ = (
        f"``{cls.__name__}`` sharded over a process group (ZeRO-1): each rank keeps the state "
        f"of its 1/N slice of the flat buffer, updates it and all-gathers the parameters.\n\n"
        f"``{sharded.__name__}(params, *, process_group=None, reduce_grads=True, **hyper)``: "
        f"``hyper`` as ``{cls.__name__}``; ``process_group`` defaults to the default group; "
        f"``reduce_grads=False`` under DDP (the gradients are already averaged). See "
        f"``xferlib.adapters.torch.optim_sharded``.")
    return sharded


ShardedFlatSGD = _sharded_class(flat.FlatSGD)
ShardedFlatAdam = _sharded_class(flat.FlatAdam)
ShardedFlatAdamW = _sharded_class(flat.FlatAdamW)
ShardedFlatAdagrad = _sharded_class(flat.FlatAdagrad)
ShardedFlatRMSprop = _sharded_class(flat.FlatRMSprop)
ShardedFlatAdamax = _sharded_class(flat.FlatAdamax)
ShardedFlatNAdam = _sharded_class(flat.FlatNAdam)
ShardedFlatRAdam = _sharded_class(flat.FlatRAdam)
ShardedFlatLion = _sharded_class(flat.FlatLion)
