"""``ContiguousParams``: contiguous_params' API, correct under torch 2.x, at its host cost.

contiguous_params copies a model's parameters into one flat buffer, makes every parameter (and
its ``.grad``) a view into it, and hands the flat buffer to a stock torch optimizer, which then
steps all parameters in a few kernels. The names, call forms and attributes are the original's:
``contiguous()`` (a list holding the flat buffer, a tensor that is not a Parameter and does not
require grad), ``original()`` (the parameter list given, the same list each call),
``buffer_is_valid()``, ``assert_buffer_is_valid()``, and the ``data_pointers`` /
``grad_pointers`` lists of each parameter's place in the buffers.

Where the original is wrong and this class is right: on torch 2.x ``optimizer.zero_grad()``
defaults to ``set_to_none=True``, which sets the flat buffer's ``.grad`` to None; with the
original the optimizer then skips the buffer on every later step (nothing trains) while the
parameters' gradient views keep accumulating and ``buffer_is_valid()`` still says yes. Here
the flat buffer is a tensor of a small subclass whose only difference is its ``grad`` setter:
setting the gradient to None zeroes the gradient buffer in place (one kernel, what
``set_to_none=False`` does) and keeps it attached. ``model.zero_grad()``, or one layer's
(which set parameters' ``.grad`` to None), is repaired the next time the flat gradient is
read: the parameters' fresh gradients are copied into the buffer and the views re-attached
(an identity test per parameter per read; no autograd hook is registered). With the
original, one layer's ``zero_grad()`` silently left that layer's slice of the buffer stale.

One more difference: gradients the parameters already hold when they are wrapped are kept
(copied into the gradient buffer); the original starts from a zero gradient buffer.

>>> import torch
>>> from xferlib.adapters.torch import ContiguousParams
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
>>> params = ContiguousParams(model.parameters())
>>> opt = torch.optim.Adam(params.contiguous(), lr=1e-3)
>>> model(torch.randn(5, 4)).sum().backward()
>>> norm = torch.nn.utils.clip_grad_norm_(params.contiguous(), 0.1)
>>> opt.step(); opt.zero_grad()
>>> params.assert_buffer_is_valid()
>>> float(params.contiguous()[0].grad.abs().sum())
0.0
"""

from __future__ import annotations

import torch
from torch._C import _disabled_torch_function_impl

__all__ = ["ContiguousParams"]

_grad_get = torch._C.TensorBase.grad.__get__
_grad_set = torch._C.TensorBase.grad.__set__


class _FlatBuffer(torch.Tensor):
    """The flat parameter buffer: a plain tensor (ops on it return plain tensors, no
    ``__torch_function__`` overhead) whose ``grad`` stays the gradient buffer.

    Setting ``.grad`` to None zeroes the gradient buffer instead of detaching it; setting it
    to another tensor copies the values in. Reading ``.grad`` first re-attaches parameter
    gradients that ``model.zero_grad()`` or other code replaced (see ``ContiguousParams``).
    """

    __torch_function__ = _disabled_torch_function_impl
    _owner = None  # the ContiguousParams, set once at construction

    @property
    def grad(self):
        owner = self._owner
        # Every parameter's gradient checked at each read (one identity test each, a few
        # reads a step): a replaced gradient anywhere, from model.zero_grad() or one layer's,
        # is copied in before an optimizer reads the buffer. No hook on every parameter.
        if owner is not None:
            owner._reattach_grads()
        return _grad_get(self)

    @grad.setter
    def grad(self, value):
        owner = self._owner
        if owner is None:
            _grad_set(self, value)
            return
        buffer = owner._grad_buffer  # never requires grad: in-place ops record nothing
        if value is None:
            buffer.zero_()
        elif value is not buffer:
            if value.shape != buffer.shape:
                raise ValueError(f"grad: expected a gradient of shape {tuple(buffer.shape)}, "
                                 f"got {tuple(value.shape)}")
            buffer.copy_(value.detach())
        if _grad_get(self) is not buffer:
            _grad_set(self, buffer)

    @grad.deleter
    def grad(self):
        self.grad = None

    def __repr__(self, *, tensor_contents=None):
        return repr(self.as_subclass(torch.Tensor))

    # Saved and copied as the plain tensor it stands for (the owner is not part of its value,
    # and torch.load's weights_only mode only rebuilds plain tensors).
    def __reduce_ex__(self, protocol):
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        if id(self) in memo:
            return memo[id(self)]
        new = self.as_subclass(torch.Tensor).detach().clone()
        grad = _grad_get(self)
        if grad is not None:
            new.grad = grad.clone()
        memo[id(self)] = new
        return new


class ContiguousParams:
    """Parameters of one device and dtype backed by one flat buffer and one flat gradient.

    ``ContiguousParams(parameters)``: ``parameters`` is any iterable of tensors (usually
    ``model.parameters()``); each parameter's ``.data`` and ``.grad`` become views into the
    buffers. Hand ``contiguous()`` to the optimizer (and to ``clip_grad_norm_``); keep using
    ``original()`` for anything that needs per-parameter shapes.

    Raises ``ValueError`` for an empty iterable or parameters of several devices or dtypes.

    >>> import torch
    >>> from xferlib.adapters.torch import ContiguousParams
    >>> model = torch.nn.Linear(3, 2)
    >>> params = ContiguousParams(model.parameters())
    >>> (flat,) = params.contiguous()
    >>> flat.shape, isinstance(flat, torch.nn.Parameter), flat.requires_grad
    (torch.Size([8]), False, False)
    >>> params.original()[0] is model.weight
    True
    """

    def __init__(self, parameters):
        self._parameters = list(parameters)
        if not self._parameters:
            raise ValueError("parameters: ContiguousParams needs at least one parameter, got "
                             "an empty iterable")
        dtype, device = self._parameters[0].dtype, self._parameters[0].device
        for i, p in enumerate(self._parameters):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"parameters[{i}]: expected a tensor, got {type(p).__name__}")
            if p.dtype != dtype:
                raise ValueError(f"parameters: all parameters must share one dtype: "
                                 f"parameters[0] is {dtype}, parameters[{i}] is {p.dtype}")
            if p.device != device:
                raise ValueError(f"parameters: all parameters must share one device: "
                                 f"parameters[0] is on {device}, parameters[{i}] on {p.device}")
        size = sum(p.numel() for p in self._parameters)
        self._param_buffer = torch.zeros(size, dtype=dtype, device=device).as_subclass(_FlatBuffer)
        self._grad_buffer = torch.zeros(size, dtype=dtype, device=device)
        self._param_views, self._grad_views = [], []
        self.data_pointers, self.grad_pointers = [], []
        offset = 0
        flat = self._param_buffer.as_subclass(torch.Tensor)
        with torch.no_grad():
            for p in self._parameters:
                n = p.numel()
                view = flat[offset:offset + n].view(p.shape)
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
        _grad_set(self._param_buffer, self._grad_buffer)
        self._param_buffer._owner = self

    def contiguous(self):
        """The flat buffer in a list, to hand to an optimizer or ``clip_grad_norm_``."""
        return [self._param_buffer]

    def original(self):
        """The parameters as given (now views into the flat buffer); the same list each call."""
        return self._parameters

    def buffer_is_valid(self) -> bool:
        """True while every parameter's ``.data`` is still its view into the flat buffer.

        Gradients that were set to None or replaced (``model.zero_grad()``, a manual
        assignment) are first copied back into the gradient buffer and re-attached, so they
        never make the buffer invalid; a replaced ``.data`` does (its updates would no longer
        reach the buffer).
        """
        self._reattach_grads()
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

    def _reattach_grads(self) -> None:
        """Copy parameter gradients that were replaced (or zero those set to None) into the
        buffer and make every parameter's ``.grad`` its view again."""
        moved = [(p, view) for p, view in zip(self._parameters, self._grad_views)
                 if p.grad is not view]
        if moved:
            with torch.no_grad():
                for p, view in moved:
                    if p.grad is None:
                        view.zero_()
                    else:
                        view.copy_(p.grad)
                    p.grad = view
        if _grad_get(self._param_buffer) is not self._grad_buffer:
            _grad_set(self._param_buffer, self._grad_buffer)
