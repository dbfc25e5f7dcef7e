"""The GPU form of a capturable ``ShardedEmbeddingBagCollection``'s lookup exchange: the
core's exchange kernels (:mod:`xferlib.collection.exchange`) on torch's current stream,
writing into tensors torch allocates (inside a CUDA-graph capture, from the graph's pool).

It builds the same messages and the same padded owner batches as the tensor arithmetic of
``collection_dist`` / ``collection_layout`` (which the CPU runs), in a handful of launches
instead of dozens of small torch kernels a step.
"""

from __future__ import annotations

import contextlib

import torch

from xferlib.adapters.torch._convert import as_core_array, cupy_stream
from xferlib.collection.exchange import (ExchangeRoutes, check_lookups, count_lookups,
                                         exchange_routes, pack_lookups, unpack_lookups)

__all__ = ["KernelExchange"]


def _view(t):
    """The core's view of ``t`` (None stays None: an absent weight array)."""
    return None if t is None else as_core_array(t)


class KernelExchange:
    """A plan's exchange kernels on one CUDA ``device`` (tables of ``dtype``); on the CPU
    the same steps run the core's NumPy reference (slow: for tests)."""

    def __init__(self, plan, device: torch.device, dtype):
        self.device, self.dtype = device, dtype
        keep = []  # the routes' tensors, which the CuPy views below point into

        def as_long(values):
            keep.append(torch.tensor(values, dtype=torch.int64, device=device))
            return as_core_array(keep[-1])

        with self._cupy_device():
            self.routes: ExchangeRoutes = exchange_routes(plan, asarray=as_long)
        self._keep = keep
        self.slots, self.world = self.routes.slots, self.routes.world

    def _cupy_device(self):
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        import cupy

        return cupy.cuda.Device(self.device.index)

    def _stream(self):
        return cupy_stream(self.device) if self.device.type == "cuda" else None

    def check(self, indices, offsets, B: int, max_bag_size: int) -> torch.Tensor:
        """``[bad offsets, an index out of range]`` (int64 0/1) of this rank's batch."""
        flags = torch.zeros(2, dtype=torch.int64, device=self.device)
        with self._cupy_device():
            check_lookups(as_core_array(indices), as_core_array(offsets), B, self.routes,
                          max_bag_size, as_core_array(flags), stream=self._stream())
        return flags

    def pack(self, indices, offsets, weights, B: int, flags, any_bad, layout, mean: bool,
             weighted: bool):
        """This rank's messages to every owner: ``(lookups (int64: each owner's bag lengths
        then its room), weights (or None))``. ``layout``: ``(rooms, message starts, room
        starts)`` as device tensors and ``sum`` sizes (``_rooms``)."""
        caps_t, msg_base_t, w_base_t, msg_size, w_size = layout
        counts = torch.zeros(self.world * self.slots * B, dtype=torch.int64,
                             device=self.device)
        message = torch.zeros(msg_size, dtype=torch.int64, device=self.device)
        w_message = (torch.zeros(w_size, dtype=self.dtype, device=self.device)
                     if weighted else None)
        with self._cupy_device():
            stream = self._stream()
            idx, off = _view(indices), _view(offsets)
            count_lookups(idx, off, B, self.routes, _view(flags), _view(any_bad), _view(counts),
                          stream=stream)
            scan = torch.cumsum(counts, 0)
            pack_lookups(idx, off, B, self.routes, _view(flags), _view(any_bad), _view(counts),
                         _view(scan), _view(msg_base_t), _view(caps_t), _view(message),
                         weights=_view(weights), mean=mean, w_base=_view(w_base_t),
                         w_msg=_view(w_message), stream=stream)
        return message, w_message

    def unpack(self, received, w_received, B: int, room: int, T_me: int):
        """The messages an owner received (``(world, slots x B + room)``) as one padded
        batch ``(indices, offsets, weights)``, as ``owner_batch_padded`` lays it out."""
        world = received.shape[0]
        lengths = received[:, :T_me * B]
        # one flat scan (a device-wide scan), not one per rank (a row scan runs a block a row)
        scan = torch.cumsum(lengths.reshape(-1), 0)
        offsets = torch.empty(T_me * world * B + 1, dtype=torch.int64, device=self.device)
        offsets[:1].zero_()
        torch.cumsum(lengths.reshape(world, T_me, B).transpose(0, 1).reshape(-1), 0,
                     out=offsets[1:])
        idx = torch.zeros(world * room, dtype=torch.int64, device=self.device)
        w = (torch.zeros(world * room, dtype=w_received.dtype, device=self.device)
             if w_received is not None else None)
        with self._cupy_device():
            unpack_lookups(_view(received), B, self.slots, room, T_me, _view(scan),
                           _view(offsets), _view(idx), w_received=_view(w_received),
                           w_out=_view(w), stream=self._stream())
        return idx, offsets, w
