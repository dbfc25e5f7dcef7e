"""``ContiguousParams``: contiguous_params' API, correct under torch 2.x, at its host cost.

contiguous_params copies a model's parameters into one flat buffer, makes every parameter (and
its ``.grad``) a view into it, and hands the flat buffer to a stock torch optimizer, which then
steps all parameters in a few kernels. The names, call forms and attributes are the original's:
``contiguous()`` (a list holding the flat buffer: a plain ``torch.Tensor``, not a Parameter,
not requiring grad), ``original()`` (the parameter list given, the same list each call),
``buffer_is_valid()``, ``assert_buffer_is_valid()``, and the ``data_pointers`` /
``grad_pointers`` lists of each parameter's place in the buffers.

The flat buffer is of the exact type torch's optimizers and ``clip_grad_norm_`` look for, so
they take their foreach (or, asked for, fused) paths over it, as they do for the original.

Where the original is wrong and this class is right: on torch 2.x ``optimizer.zero_grad()``
defaults to ``set_to_none=True``, which sets the flat buffer's ``.grad`` to None; with the
original the optimizer then skips the buffer on every later step (nothing trains) while the
parameters' gradient views keep accumulating and ``buffer_is_valid()`` still says yes. Here a
hook on each parameter runs before autograd accumulates into it and, only when something set
a gradient to None or replaced it, repairs the buffers first: the flat gradient is zeroed
(copied in, if a tensor was assigned) and re-attached, and parameter gradients that
``model.zero_grad()`` or an assignment replaced are zeroed (or copied) back into their views.
So between ``zero_grad()`` and the next backward ``.grad`` of the flat buffer is None, as
torch says (a ``step()`` then skips it, as for any parameter without a gradient), and after
the backward it is the gradient buffer holding only the new gradients. In a training step the
hooks cost one Python call per parameter and backward with no work on the device.

>>> import torch
>>> from xferlib.adapters.torch import ContiguousParams
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
>>> params = ContiguousParams(model.parameters())
>>> opt = torch.optim.Adam(params.contiguous(), lr=1e-3)
>>> for _ in range(2):
...     model(torch.randn(5, 4)).sum().backward()
...     norm = torch.nn.utils.clip_grad_norm_(params.contiguous(), 0.1)
...     opt.step(); opt.zero_grad()
>>> params.assert_buffer_is_valid()
>>> params.contiguous()[0].grad is None, model[0].bias.grad.data_ptr() == params.grad_pointers[1]
(True, True)
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["ContiguousParams"]


class _Link:
    """The buffers and views the parameter hooks repair.

    Holds parameters only through weak references and never the ``ContiguousParams``: an
    optimizer built from ``ContiguousParams(...).contiguous()`` keeps training after the
    wrapper is dropped, and nothing forms a reference cycle (GPU memory is freed as soon as the
    model is, not at the next garbage collection).
    """

    __slots__ = ("flat", "grad", "views", "params")

    def __init__(self, flat, grad, views, params):
        self.flat, self.grad, self.views = flat, grad, views
        self.params = [weakref.ref(p) for p in params]

    def repair(self) -> None:
        """Attach the gradient buffer to the flat buffer (zeroed if its gradient was set to
        None, holding the assigned values if another tensor was assigned), then the views."""
        current = self.flat.grad
        if current is not self.grad:
            with torch.no_grad():
                if current is None:
                    self.grad.zero_()
                else:
                    self.grad.copy_(current)
            self.flat.grad = self.grad
        self.repair_params()

    def repair_params(self) -> None:
        """Make every parameter's ``.grad`` its view again: zero the views of gradients set to
        None, copy replaced gradients in (a launch or two for all of them)."""
        zero, dst, src = [], [], []
        for ref, view in zip(self.params, self.views):
            p = ref()
            if p is None:
                continue
            grad = p.grad
            if grad is view:
                continue
            if grad is None:
                zero.append(view)
            else:
                dst.append(view)
                src.append(grad.detach())
            p.grad = view
        with torch.no_grad():
            if zero:
                torch._foreach_zero_(zero)
            if dst:
                torch._foreach_copy_(dst, src)


def _before_accumulate(link: _Link, ref, view):
    """The pre-accumulation hook of one parameter: two identity checks when nothing changed.

    Autograd runs a parameter's hooks just before adding into its ``.grad``, and every
    parameter that can receive a gradient has one, so the first hook of a backward repairs the
    buffers before any accumulation of that backward.
    """
    flat, grad = link.flat, link.grad

    def hook(_incoming):
        if flat.grad is not grad or ref().grad is not view:
            link.repair()

    return hook


class ContiguousParams:
    """Parameters of one device and dtype backed by one flat buffer and one flat gradient.

    ``ContiguousParams(parameters)``: ``parameters`` is any iterable of tensors (usually
    ``model.parameters()``); each parameter's ``.data`` and ``.grad`` become views into the
    buffers. Hand ``contiguous()`` to the optimizer (and to ``clip_grad_norm_``); keep using
    ``original()`` for anything that needs per-parameter shapes. Any ``zero_grad`` works:
    the optimizer's or the model's, ``set_to_none`` True or False.

    Raises ``ValueError`` for an empty iterable, a parameter given twice, or parameters of
    several devices or dtypes; ``TypeError`` for an entry that is not a tensor.

    >>> import torch
    >>> from xferlib.adapters.torch import ContiguousParams
    >>> model = torch.nn.Linear(3, 2)
    >>> params = ContiguousParams(model.parameters())
    >>> (flat,) = params.contiguous()
    >>> flat.shape, type(flat) is torch.Tensor, flat.requires_grad
    (torch.Size([8]), True, False)
    >>> params.original()[0] is model.weight
    True
    """

    def __init__(self, parameters):
        self._parameters = list(parameters)
        if not self._parameters:
            raise ValueError("parameters: ContiguousParams needs at least one parameter, got "
                             "an empty iterable")
        for i, p in enumerate(self._parameters):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"parameters[{i}]: expected a tensor, got {type(p).__name__}")
        dtype, device = self._parameters[0].dtype, self._parameters[0].device
        seen = {}
        for i, p in enumerate(self._parameters):
            if p.dtype != dtype:
                raise ValueError(f"parameters: all parameters must share one dtype: "
                                 f"parameters[0] is {dtype}, parameters[{i}] is {p.dtype}")
            if p.device != device:
                raise ValueError(f"parameters: all parameters must share one device: "
                                 f"parameters[0] is on {device}, parameters[{i}] on {p.device}")
            if id(p) in seen:
                raise ValueError(f"parameters: parameters[{i}] is parameters[{seen[id(p)]}]; "
                                 f"each parameter can live in the buffer only once")
            seen[id(p)] = i
        size = sum(p.numel() for p in self._parameters)
        # Plain tensors, as the original's: torch's optimizers take their foreach and fused
        # paths only for exact torch.Tensor / Parameter types.
        self._param_buffer = torch.zeros(size, dtype=dtype, device=device)
        self._grad_buffer = torch.zeros(size, dtype=dtype, device=device)
        self._param_views, self._grad_views = [], []
        self.data_pointers, self.grad_pointers = [], []
        offset = 0
        with torch.no_grad():
            for p in self._parameters:
                n = p.numel()
                view = self._param_buffer[offset:offset + n].view(p.shape)
                view.copy_(p.detach())
                p.data = view
                grad_view = self._grad_buffer[offset:offset + n].view(p.shape)
                if p.grad is not None:
                    grad_view.copy_(p.grad)
                p.grad = grad_view
                self._param_views.append(view)
                self._grad_views.append(grad_view)
                self.data_pointers.append(view.data_ptr())
                self.grad_pointers.append(grad_view.data_ptr())
                offset += n
        self._param_buffer.grad = self._grad_buffer
        self._link = _Link(self._param_buffer, self._grad_buffer, self._grad_views,
                           self._parameters)
        # A parameter that needs no gradient gets none from autograd: no hook.
        self._hooks = [p.register_hook(_before_accumulate(self._link, ref, view))
                       for p, ref, view in zip(self._parameters, self._link.params,
                                               self._grad_views) if p.requires_grad]

    def contiguous(self):
        """The flat buffer in a list, to hand to an optimizer or ``clip_grad_norm_``."""
        return [self._param_buffer]

    def original(self):
        """The parameters as given (now views into the flat buffer); the same list each call."""
        return self._parameters

    def buffer_is_valid(self) -> bool:
        """True while every parameter's ``.data`` is still its view into the flat buffer.

        Parameter gradients that were set to None or replaced (``model.zero_grad()``, an
        assignment) are first zeroed or copied back into the gradient buffer and re-attached,
        so they never make the buffer invalid (the original raises AttributeError for a
        gradient set to None); a replaced ``.data`` does (its updates would no longer reach
        the buffer).
        """
        self._link.repair_params()
        return all(p.data_ptr() == ptr and p.shape == v.shape
                   for p, ptr, v in zip(self._parameters, self.data_pointers, self._param_views))

    def assert_buffer_is_valid(self) -> None:
        """Raise ``ValueError`` if a parameter's ``.data`` no longer lives in the flat buffer."""
        if not self.buffer_is_valid():
            bad = next(i for i, (p, ptr) in enumerate(zip(self._parameters, self.data_pointers))
                       if p.data_ptr() != ptr or p.shape != self._param_views[i].shape)
            raise ValueError(f"The data buffer has been invalidated: parameter {bad}'s .data was "
                             f"replaced after ContiguousParams was built, so its updates no "
                             f"longer reach the flat buffer. Update parameters in place only.")
