"""Eager training steps of an :class:`EmbeddingBagCollection` replayed from CUDA graphs.

Called eagerly, a collection's training step costs about a millisecond of Python a step
(a dozen launches, their allocations, torch's autograd thread) where its kernels take 0.1-0.7
ms: the GPU waits for the host. With ``cuda_graphs=True`` the module captures, per batch
shape, its training forward and its backward (with the fused update) into two CUDA graphs at
the shape's second call (the first runs as usual and warms everything up), and replays them
from then on: a step's host work is two input copies, two replays and a copy of the pooled
output. What a replayed step computes is what the eager one computes, bit for bit.

A shape is the batch size B (the offsets' length), the dtypes and the number of lookups
rounded up to a bucket (:func:`capacity`: eight sizes per power of two), so batches whose
bags hold a varying number of lookups share graphs: the graph's static indices hold
``capacity(n)`` entries, a batch's ``n`` lookups are copied to their front and the rest is
padding the kernels ignore (the core's ``padded=True``), with ``n`` itself on the device
(``total=``), so the last bag must end at it as in the eager step.

A replay is used only where it is exact; the eager step runs instead when:

- the step is inside a CUDA graph the caller captures (the caller's graph holds it),
- the collection has tt tables (the dict form is replayed too: its packed arrays are copied
  in like flat ones),
- the shape's previous forward still waits for its backward (two forwards, then their
  backwards: the graphs' buffers hold one batch),
- more shapes than ``limit`` are in use (the least recently used one's graphs are dropped).

A backward whose forward was replayed, but after which another update or cache pass of the
collection ran (an eager step of another shape, a lookup through the cache), runs eagerly
on the replayed plan, with the forward's staged rows and cache slots treated as stale.
Bad input raises as in the eager step, from a later call or ``check()``: each replay's
verdict is queued like an eager forward's.
"""

from __future__ import annotations

import collections
import weakref

import torch

from xferlib.adapters.torch._convert import as_core_array, stream_capturing
from xferlib.batch import Verdict
from xferlib.collection.device import CollectionReport

__all__ = ["StepGraphs", "GraphedLookup", "capacity"]

_SMALLEST = 64  # the smallest bucket (lookups)


def capacity(n: int) -> int:
    """The bucket of a batch of ``n`` lookups: the smallest of eight sizes per power of two
    (``k * 2**(e - 3)``, ``k`` in 8..16) that holds it, at least 64, so that a bucket's
    padding is under an eighth of its size.

    >>> [capacity(n) for n in (0, 64, 65, 1000, 65536, 65537)]
    [64, 64, 72, 1024, 65536, 73728]
    """
    if n <= _SMALLEST:
        return _SMALLEST
    step = 1 << (n.bit_length() - 4)
    return -(-n // step) * step


class GraphedLookup:
    """What a replayed forward leaves for its backward (autograd's context holds it: while
    it lives, the backward is pending)."""

    __slots__ = ("shape", "marks", "__weakref__")

    def __init__(self, shape, marks):
        self.shape, self.marks = shape, marks


class _Shape:
    """One batch shape's static inputs and outputs, its graphs and their memory pool."""

    def __init__(self, key):
        self.key = key
        self.calls = 0
        self.forward = self.backward = None  # torch.cuda.CUDAGraph, once captured
        self.pool = None
        self.inputs = None  # static core arrays the forward graph reads: indices, offsets, psw
        self.total = None  # the batch's number of lookups, on the device (a torch tensor)
        self.out = None  # the forward graph's pooled output (a torch tensor)
        self.ctx = None  # the forward graph's LookupContext (its plan: static arrays)
        self.grad = None  # the backward graph's pooled gradient (a torch tensor)
        self.pending = None  # weakref to the GraphedLookup whose backward has not run

    def busy(self) -> bool:
        return self.pending is not None and self.pending() is not None


class StepGraphs:
    """Per-shape CUDA graphs of one module's training step (see the module docstring)."""

    def __init__(self, limit: int = 4):
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise ValueError(f"limit must be an int >= 1, got {limit!r}")
        self.limit = limit
        self.shapes = collections.OrderedDict()

    def clear(self) -> None:
        """Drop every graph (the collection they were captured on is gone)."""
        self.shapes.clear()

    # ------------------------------------------------------------------ forward

    def forward(self, module, indices, offsets, psw):
        """``(out, GraphedLookup)`` from a replay (captured first where this is the shape's
        second call), or None: the caller runs the eager forward."""
        coll = module.collection
        if coll.tt_tables or stream_capturing():
            return None
        n = int(indices.shape[0])
        key = (capacity(n), indices.dtype.str, offsets.shape[0], offsets.dtype.str,
               None if psw is None else psw.dtype.str)
        shape = self.shapes.get(key)
        if shape is None:
            shape = self.shapes[key] = _Shape(key)
            while len(self.shapes) > self.limit:
                self.shapes.popitem(last=False)
        self.shapes.move_to_end(key)
        shape.calls += 1
        if shape.calls < 2 or shape.busy():
            return None
        side = coll._gpu_side()
        with module._on_device(), module._on_stream() as stream:
            side.checks.poll(hold=not coll.raise_in_calls)  # as the eager forward does
            if shape.forward is None:
                self._capture_forward(module, shape, indices, offsets, psw)
            else:
                _copy_into(shape.inputs, (indices, offsets, psw), stream)
                shape.total.fill_(n)
            shape.forward.replay()
            side.replayed_lookup(shape.ctx.plan, stream)
            # the replay's verdict read as an eager forward's is: a bad batch raises from a
            # later call (the graph's own copy of it is not queued)
            Verdict(shape.ctx.plan.words, CollectionReport(coll, indices, offsets)).defer(
                side.checks, stream)
            out = shape.out.clone()
        lookup = GraphedLookup(shape, (side.writes, side.cache_passes))
        shape.pending = weakref.ref(lookup)
        return out, lookup

    def _capture_forward(self, module, shape, indices, offsets, psw) -> None:
        import cupy

        side = module.collection._gpu_side()
        room = shape.key[0]
        # zeros: the padding is never read as indices, but no byte of it is left undefined
        shape.inputs = (cupy.zeros(room, dtype=indices.dtype), cupy.empty_like(offsets),
                        None if psw is None else cupy.zeros(room, dtype=psw.dtype))
        _copy_into(shape.inputs, (indices, offsets, psw), cupy.cuda.get_current_stream())
        shape.total = torch.full((1,), int(indices.shape[0]), dtype=torch.int64,
                                 device=module.device)
        total = as_core_array(shape.total)
        shape.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        before = set(side.checks.graph)
        with torch.cuda.graph(graph, pool=shape.pool, capture_error_mode="thread_local"):
            shape.out, shape.ctx = module._lookup(*shape.inputs, train=True, padded=True,
                                                  total=total)
        # the captured verdict copy: replays are read through the eager pushes instead (its
        # device words are the plan's, which this shape keeps while the graph lives)
        with side.checks.lock:
            for slot in set(side.checks.graph) - before:
                side.checks.graph.pop(slot)
        shape.forward = graph

    # ------------------------------------------------------------------ backward

    def backward(self, module, lookup: GraphedLookup, grad: torch.Tensor) -> None:
        """The update of a replayed forward: replayed (captured at the first), or run
        eagerly on its plan where the graph's choices may be stale."""
        shape = lookup.shape
        shape.pending = None
        side = module.collection._gpu_side()
        grad = grad.to(device=module.device, dtype=module.dtype)
        if (side.writes, side.cache_passes) != lookup.marks:
            self._eager_backward(module, shape, grad)
            return
        with module._on_device(), module._on_stream() as stream:
            side.checks.poll(hold=not module.collection.raise_in_calls)
            if shape.backward is None:
                shape.grad = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
                shape.grad.copy_(grad)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=shape.pool,
                                      capture_error_mode="thread_local"):
                    module._update(shape.ctx, shape.grad)
                shape.backward = graph
            else:
                shape.grad.copy_(grad)
            shape.backward.replay()
            side.replayed_update(stream)

    @staticmethod
    def _eager_backward(module, shape, grad) -> None:
        """The update on the replayed plan, its staged rows and cache slots treated as
        stale (an update or cache pass came between): the rows read where they live, the
        slots looked up again."""
        plan = shape.ctx.plan
        kept = plan.writes, plan.cache_pass
        plan.writes, plan.cache_pass = -1, -1
        try:
            module._update(shape.ctx, grad)
        finally:
            plan.writes, plan.cache_pass = kept


def _copy_into(static, arrays, stream) -> None:
    """Device-to-device copies of ``arrays`` into the front of the graph's static arrays
    (one launch each, no kernel)."""
    import cupy

    for dst, src in zip(static, arrays):
        if dst is not None and src.nbytes:
            cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes,
                                          cupy.cuda.runtime.memcpyDeviceToDevice, stream.ptr)
