"""Data-parallel gradients: summed over the ranks in buckets while the backward still runs.

A model's dense part trains data-parallel beside a sharded embedding collection (each rank
its own samples, the same weights everywhere): its gradients must be summed over the ranks
before the optimizer steps. :class:`GradAllReduce` does it as ``DistributedDataParallel``
does, without wrapping the model: each parameter's post-accumulate hook marks it ready, and a
bucket (parameters in reverse order, about ``bucket_mb`` each, the order a backward produces
them) starts its ``all_reduce`` as soon as its last gradient lands, so the collectives of the
late layers run under the backward of the early ones. :meth:`GradAllReduce.wait` starts what
is left, waits for every bucket and leaves the summed gradients in ``.grad``.

With a ``Flat*`` optimizer the buckets are slices of its flat gradient buffer: no copy at
all. Plain parameters are packed into one buffer per bucket and copied back. Everything is
asynchronous on the GPU (the waits are stream waits), so a training step with it is
capturable in a CUDA graph on NCCL.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.distributed as dist

from xferlib.adapters.torch import optim as flat
from xferlib.adapters.torch.groups import resolve_group

__all__ = ["GradAllReduce"]

_OPS = ("sum", "mean")


class _CommBucket:
    """Parameters whose gradients travel in one ``all_reduce``."""

    def __init__(self, params, flat_slice=None, owner=None, index=None, trainable=None):
        self.params = params            # in the order their gradients arrive (no frozen one)
        self.flat_slice = flat_slice    # a view of a flat optimizer's gradients, or None
        self.owner, self.index = owner, index  # that optimizer's bucket, its parameters
        self.trainable = trainable      # which of the owner's parameters there can step
        self.ready = set()
        self.packed = None              # plain parameters: the buffer that travelled
        self.work = None


class GradAllReduce:
    """Sum (or average) the gradients of ``params`` over ``process_group`` in buckets that
    start during the backward.

    Args:
        params: a ``Flat*`` optimizer (its flat gradient buffers are all-reduced in place,
            slice by slice) or an iterable of parameters.
        process_group: ``"default"`` (torch.distributed's default group), a group, or None
            (one process: :meth:`wait` does nothing).
        bucket_mb: about how many megabytes of gradients one ``all_reduce`` carries.
        op: ``"sum"`` (the gradients of a loss already divided by the global batch) or
            ``"mean"`` (DDP's convention: each rank's loss is its own batch's mean).

    Use::

        sync = GradAllReduce(optimizer)
        loss.backward()     # buckets start as their gradients land
        sync.wait()         # the rest started, every bucket waited for
        optimizer.step()

    Gradient accumulation: run the accumulating backwards under ``with sync.no_sync():``
    and the last one outside it. Buckets start strictly in their order (collectives pair up
    by call order across ranks): a bucket waits for the ones before it. A parameter that got
    no gradient on a rank is summed as zeros there (its ``.grad`` zeros, and a ``Flat*``
    optimizer steps it like the others), so every rank runs the same collectives and keeps
    the same weights. After a failed backward (an exception, a failed CUDA-graph capture)
    call :meth:`reset` on every rank before the next step.
    """

    def __init__(self, params, process_group="default", bucket_mb: float = 4.0,
                 op: str = "sum"):
        if op not in _OPS:
            raise ValueError(f"op must be one of {_OPS}, got {op!r}")
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb!r}")
        self.group = resolve_group(process_group)
        self.op = op
        self.world = 1 if self.group is None else dist.get_world_size(self.group)
        self._limit = int(bucket_mb * 2**20)
        self._syncing = True
        self._error = None
        if isinstance(params, flat.FlatOptimizerBase):
            if getattr(params, "process_group", None) is not None:
                raise ValueError(f"{type(params).__name__} sums its gradients itself "
                                 "(reduce-scatter); GradAllReduce would sum them twice")
            self.buckets = [b for fb in params.buckets for b in self._flat_buckets(fb)]
        else:
            params = [p for p in params if p.requires_grad]
            if len({(p.device, p.dtype) for p in params}) > 1:
                raise ValueError("GradAllReduce packs plain parameters of one device and "
                                 "dtype; pass a Flat* optimizer or one call per kind")
            self.buckets = self._plain_buckets(params)
        self._bucket_of = {}
        for bucket in self.buckets:
            for p in bucket.params:
                self._bucket_of[p] = bucket
        self._next = 0  # the next bucket to start: they start in order
        self._hooks = [p.register_post_accumulate_grad_hook(self._ready)
                       for p in self._bucket_of] if self.group is not None else []

    # ------------------------------------------------------------------ buckets
    def _cut(self, sizes):
        """Index ranges ``[(lo, hi), ...]`` from the last parameter to the first, each at
        most about ``bucket_mb`` (one parameter larger than that is a bucket alone)."""
        ranges, hi, used = [], len(sizes), 0
        for i in range(len(sizes) - 1, -1, -1):
            if used and used + sizes[i] > self._limit:
                ranges.append((i + 1, hi))
                hi, used = i + 1, 0
            used += sizes[i]
        if hi > 0:
            ranges.append((0, hi))
        return ranges

    def _flat_buckets(self, fb):
        segments, item = fb.layout.segments, fb.flat_grads.element_size()
        out = []
        for lo, hi in self._cut([s.size * item for s in segments]):
            start, end = segments[lo].offset, segments[hi - 1].offset + segments[hi - 1].size
            # The alignment gaps inside the slice hold zeros on every rank: summed, still 0
            # (frozen parameters' gradients too: they get no hook and never step).
            trainable = np.array([p.requires_grad for p in fb.params[lo:hi]])
            out.append(_CommBucket([p for p in fb.params[lo:hi][::-1] if p.requires_grad],
                                   fb.flat_grads[start:end], fb, slice(lo, hi), trainable))
        return out

    def _plain_buckets(self, params):
        sizes = [p.numel() * p.element_size() for p in params]
        return [_CommBucket(params[lo:hi][::-1]) for lo, hi in self._cut(sizes)]

    # ------------------------------------------------------------------ the step
    def _ready(self, param) -> None:
        bucket = self._bucket_of[param]
        if bucket.work is not None:  # also under no_sync: it adds into a bucket in flight
            # Raised at wait(): an exception inside autograd's hook would hide the cause.
            self._error = RuntimeError(
                "a gradient landed after its bucket was summed: a second backward before "
                "wait(); accumulate gradients under `with sync.no_sync():`, before the "
                "backward that syncs")
            return
        if not self._syncing:
            return
        bucket.ready.add(param)
        while (self._next < len(self.buckets) and len(self.buckets[self._next].ready)
               == len(self.buckets[self._next].params)):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, bucket) -> None:
        if bucket.flat_slice is not None:
            # A gradient autograd made anew (after model.zero_grad(): .grad was None) or
            # one assigned lives outside the flat buffer: bring it in first; a parameter
            # without one is summed as zeros.
            owner = bucket.owner
            for i in range(bucket.index.start, bucket.index.stop):
                p, view = owner.params[i], owner.grad_views[i]
                g = p.grad
                if g is not view:
                    if g is None:
                        view.zero_()
                    else:
                        view.copy_(g)
                    p.grad = view
            tensor = bucket.flat_slice
        else:
            for p in bucket.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            tensor = torch.cat([p.grad.reshape(-1) for p in bucket.params])
            bucket.packed = tensor
        if self.op == "mean":
            tensor.div_(self.world)
        bucket.work = dist.all_reduce(tensor, group=self.group, async_op=True)

    def wait(self) -> None:
        """Start the buckets whose gradients did not all land, wait for every bucket (a
        stream wait on the GPU), and leave the sums in the parameters' ``.grad``."""
        if self.group is None:
            return
        error, self._error = self._error, None
        for bucket in self.buckets[self._next:]:
            self._launch(bucket)
        self._next = 0
        for bucket in self.buckets:
            bucket.work.wait()
            if bucket.owner is not None:  # a Flat* optimizer: every trainable one steps
                bucket.owner.has_grad[bucket.index] |= bucket.trainable
            if bucket.packed is not None:
                at = 0
                for p in bucket.params:
                    n = p.numel()
                    p.grad.copy_(bucket.packed[at:at + n].view_as(p.grad))
                    at += n
            bucket.work, bucket.packed = None, None
            bucket.ready.clear()
        if error is not None:
            raise error

    def reset(self) -> None:
        """Forget a backward that did not reach :meth:`wait` (an exception, a failed
        capture): no bucket pending, none started. Call it on every rank alike."""
        self._error, self._next = None, 0
        for bucket in self.buckets:
            bucket.work, bucket.packed = None, None
            bucket.ready.clear()

    @contextlib.contextmanager
    def no_sync(self):
        """Backwards inside accumulate gradients without starting any bucket."""
        before, self._syncing = self._syncing, False
        try:
            yield
        finally:
            self._syncing = before

    def remove(self) -> None:
        """Take the hooks off the parameters."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def __repr__(self) -> str:
        return (f"GradAllReduce({len(self.buckets)} buckets, op={self.op!r}, "
                f"world={self.world})")
