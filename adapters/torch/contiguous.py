"""``ContiguousParams``: contiguous_params' API, correct under torch 2.x.

contiguous_params copies a model's parameters into one flat parameter so a stock torch
optimizer steps it in a few kernels. On torch 2.x it breaks silently: ``optimizer.zero_grad()``
now sets the flat parameter's ``.grad`` to None, after which the optimizer skips it forever
while ``buffer_is_valid()`` still says yes; ``model.zero_grad()`` detaches the per-parameter
gradient views the same way. Here a gradient hook on every parameter re-attaches (and zeroes)
the flat gradient before each accumulation, so both ``zero_grad`` calls work, and
``buffer_is_valid()`` still detects a parameter whose ``.data`` was replaced.

>>> import torch
>>> from xferlib.adapters.torch import ContiguousParams
>>> model = torch.nn.Linear(4, 2)
>>> params = ContiguousParams(model.parameters())
>>> opt = torch.optim.Adam(params.contiguous(), lr=1e-3)
"""

from __future__ import annotations

import torch

__all__ = ["ContiguousParams"]


class ContiguousParams:
    """Parameters of one device and dtype, backed by one flat parameter and one flat grad."""

    def __init__(self, parameters):
        self._params = [p for p in parameters]
        if not self._params:
            raise ValueError("ContiguousParams needs at least one parameter")
        devices = {(p.device, p.dtype) for p in self._params}
        if len(devices) != 1:
            raise ValueError(f"all parameters must share one device and dtype, got {devices}")
        p0 = self._params[0]
        total = sum(p.numel() for p in self._params)
        self._flat = torch.nn.Parameter(torch.empty(total, dtype=p0.dtype, device=p0.device))
        self._flat.grad = torch.zeros_like(self._flat)
        self._grad_buffer = self._flat.grad
        self._param_views, self._grad_views = [], []
        offset = 0
        for p in self._params:
            n = p.numel()
            view = self._flat.data[offset:offset + n].view_as(p)
            view.copy_(p.detach())
            p.data = view
            grad_view = self._grad_buffer[offset:offset + n].view_as(p)
            p.grad = grad_view
            self._param_views.append(view)
            self._grad_views.append(grad_view)
            offset += n
        self._hooks = [p.register_hook(self._reattach_hook(i)) for i, p in enumerate(self._params)]

    def _reattach_hook(self, i):
        def hook(grad):
            self._reattach(i)
            return grad
        return hook

    def _reattach(self, i):
        """Before parameter i accumulates: make sure its gradient lands in the flat buffer."""
        if self._flat.grad is not self._grad_buffer:
            # optimizer.zero_grad() set the flat grad to None: start every gradient at zero.
            self._grad_buffer.zero_()
            self._flat.grad = self._grad_buffer
            for p, view in zip(self._params, self._grad_views):
                p.grad = view
            return
        p = self._params[i]
        if p.grad is self._grad_views[i]:
            return
        # model.zero_grad() set per-parameter grads to None: zero those slices, re-attach all.
        for q, view in zip(self._params, self._grad_views):
            if q.grad is None:
                view.zero_()
            elif q.grad is not view:
                view.copy_(q.grad)
            q.grad = view

    def contiguous(self):
        """The flat parameters to hand to an optimizer (a list, as contiguous_params gives)."""
        return [self._flat]

    def original(self):
        """The original parameters, now views into the flat buffer."""
        return list(self._params)

    def buffer_is_valid(self) -> bool:
        """False when a parameter's ``.data`` no longer lives in the flat buffer."""
        return all(p.data_ptr() == v.data_ptr() and p.shape == v.shape
                   for p, v in zip(self._params, self._param_views))

    def assert_buffer_is_valid(self) -> None:
        if not self.buffer_is_valid():
            raise ValueError("a parameter's .data was replaced after ContiguousParams was built; "
                             "its updates no longer reach the flat buffer (rebuild it)")
