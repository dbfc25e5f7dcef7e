"""torch.optim optimizers over one flat buffer per (device, dtype): ``FlatAdam`` and friends.

Each optimizer copies its parameters into a flat buffer and points every ``param.data`` at
its slice, and points every ``param.grad`` at a slice of a flat gradient buffer, so a step
is one update over the whole buffer (one CUDA launch on the GPU). The update rule, the
hyperparameter names and defaults, ``param_groups`` (learning-rate schedulers work) and the
``state_dict`` format are torch.optim's: a checkpoint moves between ``FlatAdam`` and
``torch.optim.Adam`` both ways.

Gradients: ``optimizer.zero_grad()`` zeroes the flat gradient buffer in one call and keeps
the slices attached. ``model.zero_grad()`` (which sets ``.grad`` to None) and gradients the
user assigns are fine too: before the next step they are copied back into the buffer. As in
torch, a parameter that received no gradient since ``zero_grad()`` is skipped by the step.
"""

from __future__ import annotations

import operator

import numpy as np
import torch

from xferlib import optim as core
from xferlib.handoff import to_cupy, to_numpy, to_torch

__all__ = ["FlatSGD", "FlatAdam", "FlatAdamW", "FlatAdagrad", "FlatRMSprop", "FlatAdamax",
           "FlatNAdam", "FlatRAdam", "FlatLion"]

_TORCH_ONLY_KEYS = ("foreach", "fused", "capturable", "differentiable")


def core_view(t: torch.Tensor):
    """A zero-copy core array (NumPy on CPU, CuPy on CUDA) over ``t``'s memory."""
    return to_cupy(t) if t.is_cuda else to_numpy(t)


class Bucket:
    """The parameters of one (device, dtype): their flat buffers, layout and state (the
    sharded optimizers' buckets extend it)."""

    def __init__(self, entries, rule: core.FlatOptimizer, hypers, capturable: bool = False):
        self._attach(entries)
        self._init_state(rule, hypers, capturable, entries)
        self.storage_uses = storage_use_count(self.flat_params)  # last: every view above counts

    def _attach(self, entries, multiple: int = 1):
        """Move the parameters into one flat buffer (its length padded to a multiple of
        ``multiple`` elements) and their gradients into another."""
        # entries: [(param, group index)] in param_groups order
        self.params = [p for p, _ in entries]
        p0 = self.params[0]
        self.device, self.dtype = p0.device, p0.dtype  # checked by bucket_entries
        # The layout is the float32 master's; 16-bit parameters and gradients share its
        # offsets (16-byte aligned for float32, so 8-byte aligned for them).
        layout = core.FlatLayout.from_shapes([tuple(p.shape) for p in self.params],
                                             [g for _, g in entries], dtype=np.float32)
        if multiple > 1:  # a sharded buffer: also past the last tensor's offset (a
            # zero-size last tensor then still lies inside some rank's slice)
            need = max(layout.total, layout.segments[-1].offset + 1)
            layout = core.FlatLayout(layout.segments, -(-need // multiple) * multiple,
                                     layout.dtype)
        self.layout = layout
        self.flat_params = torch.zeros(self.layout.total, dtype=self.dtype, device=self.device)
        self.flat_grads = torch.zeros_like(self.flat_params)
        self.param_views = self._views(self.flat_params)
        self.grad_views = self._views(self.flat_grads)
        self.has_grad = np.zeros(len(self.params), dtype=bool)
        for i, (p, view, grad) in enumerate(zip(self.params, self.param_views,
                                                self.grad_views)):
            view.copy_(p.detach())
            p.data = view
            if p.grad is not None:  # a gradient computed before the optimizer was built
                grad.copy_(p.grad)
                self.has_grad[i] = True
            p.grad = grad  # backward accumulates into the flat buffer in place
        self.expected_ptrs = [v.data_ptr() for v in self.param_views]
        self.expected_shapes = [v.shape for v in self.param_views]
        self.steps_since_full_check = 0
        # a frozen parameter gets no gradient (and no hook: torch refuses one); it never steps
        self.hooks = [p.register_post_accumulate_grad_hook(self._marker(i))
                      for i, p in enumerate(self.params) if p.requires_grad]

    def _init_state(self, rule, hypers, capturable, entries):
        xp = array_module(self.device)
        self.state = rule.init(self.layout, hypers, xp=xp)
        self.state_tensors = {}
        for name, buffer in self.state.buffers.items():
            tensor = torch.from_dlpack(buffer) if self.device.type == "cuda" else \
                torch.from_numpy(buffer)
            self.state_tensors[name] = tensor
        # Mixed precision: float32 master weights updated by the kernel, which also writes
        # them back rounded into the model's 16-bit parameters.
        self.master = None if self.dtype == torch.float32 else self.flat_params.float()
        self.core_params = core_view(self.flat_params if self.master is None else self.master)
        self.core_grads = core_view(self.flat_grads)
        self.core_lowp = None if self.master is None else core_view(self.flat_params)
        self.capturable = capturable
        self.cuda_step = None
        if capturable:
            self._init_device_scalars(entries)
        elif self.device.type == "cuda":
            # Eager steps on the GPU: the launch is prepared once (kernel, pointers, pinned
            # staging for the scalar table), so a step's host work is a few microseconds of
            # table arithmetic, one small async copy and one launch.
            self.cuda_step = core.CudaStep(rule.name, self.layout, self.core_params,
                                           self.core_grads, self.state.buffers, self.core_lowp)

    def _init_device_scalars(self, entries):
        """Capturable mode: step counts, the active mask and hyperparameters on the GPU
        (CUDA parameters: bucket_entries refused others)."""
        n, groups = len(self.params), max(g for _, g in entries) + 1
        self.dev_steps = torch.zeros(n, dtype=torch.float32, device=self.device)
        self.dev_active = torch.zeros(n, dtype=torch.uint8, device=self.device)
        self.dev_groups = torch.tensor([g for _, g in entries], dtype=torch.int32,
                                       device=self.device)
        self.dev_hyper = torch.zeros((groups, 8), dtype=torch.float32, device=self.device)
        self.core_device = [core_view(t) for t in (self.dev_hyper, self.dev_groups,
                                                    self.dev_steps, self.dev_active)]
        self.uploaded_active = None
        self.uploaded_hyper = None

    def steps(self) -> np.ndarray:
        """Step count per parameter (read from the GPU in capturable mode)."""
        if self.capturable:
            return self.dev_steps.cpu().numpy().astype(np.int64)
        return self.state.steps

    def set_step(self, i: int, step: int) -> None:
        self.state.steps[i] = step
        if self.capturable:
            self.dev_steps[i] = float(step)

    def restore_counters(self, i: int, entry: dict, rule_name: str) -> None:
        """Parameter ``i``'s step count (and NAdam's momentum product) from its torch-format
        checkpoint entry; SGD keeps no step: one has been taken once a momentum buffer
        exists."""
        if "step" in entry:
            self.set_step(i, int(float(entry["step"])))
        elif rule_name == "sgd":
            self.set_step(i, 1 if entry.get("momentum_buffer") is not None else 0)
        else:
            self.set_step(i, 0)
        if "mu_product" in self.state.scalars:  # none saved: it starts afresh, as in torch
            self.state.scalars["mu_product"][i] = float(entry.get("mu_product", 1.0))

    def _views(self, flat):
        return [flat[s.offset:s.offset + s.size].view(s.shape) for s in self.layout.segments]

    def _marker(self, i):
        def mark(param):
            self.has_grad[i] = True
        return mark

    def check_params(self, shapes: bool = False):
        # A parameter re-pointed elsewhere (``p.data = ...``) would silently stop training.
        # Every step costs O(1): re-pointing a parameter drops a reference to the flat
        # buffer's storage, so an unchanged use count skips the per-parameter address check
        # (which still runs every 64 steps, and whenever the count moves). Shapes are
        # checked when checkpoints are written or read: a view reshaped in place still covers
        # the same bytes, so the update itself stays correct and in bounds.
        uses = storage_use_count(self.flat_params)
        self.steps_since_full_check += 1
        if (not shapes and uses == self.storage_uses and self.steps_since_full_check < 64):
            return
        if list(map(torch.Tensor.data_ptr, self.params)) == self.expected_ptrs and (
                not shapes or list(map(_shape, self.params)) == self.expected_shapes):
            self.storage_uses = uses  # other views come and go: the addresses are right
            self.steps_since_full_check = 0
            return
        for i, (p, view) in enumerate(zip(self.params, self.param_views)):
            if p.data_ptr() != view.data_ptr() or p.shape != view.shape:
                raise RuntimeError(
                    f"parameter {i} of shape {tuple(view.shape)} was replaced or reshaped "
                    f"after the flat optimizer was built (now shape {tuple(p.shape)}); build "
                    "the optimizer again after changing parameters")

    def collect_grads(self):
        """Bring every gradient into the flat buffer; the mask of parameters that have one."""
        grads = list(map(_grad, self.params))
        if all(map(operator.is_, grads, self.grad_views)):
            return self.has_grad  # the common case: gradients accumulated in place
        for i, (p, g, view) in enumerate(zip(self.params, grads, self.grad_views)):
            if g is None:
                view.zero_()  # so a later in-place accumulation starts from zero
                self.has_grad[i] = False
            elif g is not view:  # model.zero_grad() then backward, or an assigned gradient
                view.copy_(g)
                p.grad = view
                self.has_grad[i] = True
        return self.has_grad

    def zero_grad(self, set_to_none: bool):
        if not set_to_none:  # torch zeroes the gradients there are: those steps still
            # take; a parameter whose .grad is None (model.zero_grad()) stays without one
            for i, (p, view) in enumerate(zip(self.params, self.grad_views)):
                g = p.grad
                if g is not view:
                    self.has_grad[i] = g is not None
        self.flat_grads.zero_()
        for p, view in zip(self.params, self.grad_views):
            p.grad = view
        if set_to_none:  # torch semantics: no gradient until the next backward
            self.has_grad[:] = False

    @property
    def state_layout(self):
        """The layout the state buffers follow (the whole buffer here; a shard's slice in
        sharded optimizers)."""
        return self.layout

    def missing_buffers(self, rule, hypers) -> list:
        """State buffers ``hypers`` need that this bucket was built without."""
        names = dict.fromkeys(n for h in hypers for n in rule.state_names(h))
        return [n for n in names if n not in self.state.buffers]

    def refuse_new_buffers(self, rule, hypers) -> None:
        """``capturable``: a captured step holds the buffers' addresses, so state it was
        built without cannot be added (RuntimeError, before anything changes)."""
        missing = self.missing_buffers(rule, hypers)
        if missing and self.capturable:
            raise RuntimeError(f"capturable=True: the hyperparameters need optimizer state "
                               f"{missing} the optimizer was built without; build it with them")

    def ensure_buffers(self, rule, hypers) -> None:
        """Zeroed state buffers the hyperparameters now need and the build did not make (a
        scheduler turning SGD's momentum on, a checkpoint of an amsgrad run): torch makes
        such state at first use, from zero, as here."""
        missing = self.missing_buffers(rule, hypers)
        if not missing:
            return
        self.refuse_new_buffers(rule, hypers)
        cuda = self.device.type == "cuda"
        if cuda:  # the prepared step's staging memory may still be read by queued work
            torch.cuda.synchronize(self.device)
        xp = array_module(self.device)
        for name in missing:
            buffer = self.state_layout.zeros(xp)
            self.state.buffers[name] = buffer
            self.state_tensors[name] = torch.from_dlpack(buffer) if cuda else \
                torch.from_numpy(buffer)
        if rule.name == "sgd":  # torch's first step with a momentum buffer copies the
            self.state.steps[...] = 0  # gradient into it (dampening not applied): SGD's
            # step count only tells that first step
        if cuda:  # the zeros written (CuPy's stream) before torch's stream reads them
            torch.cuda.synchronize(self.device)
        if self.cuda_step is not None:  # its launch was prepared with the old buffers
            self.cuda_step = core.CudaStep(rule.name, self.state_layout, self.core_params,
                                           self.core_grads, self.state.buffers, self.core_lowp)

    def step(self, rule, hypers, grad_mul=None, grad_scale=None, found_inf=None):
        self.check_params()
        active = self.collect_grads()
        if self.cuda_step is not None:
            self.cuda_step(self.state, hypers, active, current_cupy_stream(self.device))
            return
        stream = current_cupy_stream(self.device) if self.device.type == "cuda" else None
        if self.capturable:
            scaling = {name: None if t is None else to_cupy(
                t.to(self.device, torch.float32).reshape(1))
                for name, t in (("grad_mul", grad_mul), ("grad_scale", grad_scale),
                                ("found_inf", found_inf))}
            self._step_device_scalars(rule, hypers, active, stream, scaling)
            return
        rule.update(self.layout, self.core_params, self.core_grads, self.state, hypers,
                    active=active, stream=stream, params_lowp=self.core_lowp)

    def _step_device_scalars(self, rule, hypers, active, stream, scaling):
        # Host-to-device copies happen only when the mask or a hyperparameter changed, so a
        # step taken after them (warm-up) is pure device work and can be graph-captured.
        if self.uploaded_active is None or not np.array_equal(active, self.uploaded_active):
            self.dev_active.copy_(torch.from_numpy(active.astype(np.uint8)))
            self.uploaded_active = active.copy()
        rows = [core.adam_device_hyper(rule.name, h) for h in hypers]
        if rows != self.uploaded_hyper:
            self.dev_hyper.copy_(torch.tensor(rows, dtype=torch.float32))
            self.uploaded_hyper = rows
        core.apply_adam_device_scalars(self.layout, self.core_params, self.core_grads,
                                       self.state.buffers, *self.core_device, stream=stream,
                                       params_lowp=self.core_lowp, **scaling)


_grad = operator.attrgetter("grad")


def current_cupy_stream(device):
    """torch's current stream on ``device`` as a (cached) CuPy stream, without building a
    torch Stream object per call."""
    from xferlib.backend import as_cupy_stream

    try:
        handle = torch._C._cuda_getCurrentRawStream(device.index)
    except (AttributeError, TypeError):  # a torch without the raw query
        handle = torch.cuda.current_stream(device).cuda_stream
    return as_cupy_stream(handle)


def as_array(value):
    """NumPy reductions return scalars; the handoff takes arrays."""
    return np.asarray(value) if isinstance(value, np.generic) else value


def storage_use_count(tensor) -> int:
    """How many tensors share ``tensor``'s storage (an O(1) query)."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)
_shape = operator.attrgetter("shape")


def array_module(device):
    """The core's array module for a torch device: CuPy for CUDA, else NumPy."""
    if device.type == "cuda":
        import cupy

        return cupy
    import numpy

    return numpy


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class FlatOptimizerBase(torch.optim.Optimizer):
    """Base of the ``Flat*`` optimizers (and of the sharded ones): a torch.optim optimizer
    stepping one core rule over a flat buffer per (device, dtype)."""

    _rule_name = ""
    _renamed = {}  # core name -> torch-side name (Lion's learning_rate is torch's lr)

    def __init__(self, params, **hyper):
        self._capturable = bool(hyper.pop("capturable", False))
        if self._capturable and self._rule_name not in ("adam", "adamw"):
            raise ValueError(f"capturable=True is supported by FlatAdam and FlatAdamW, not "
                             f"{type(self).__name__}")
        for key in _TORCH_ONLY_KEYS:
            hyper.pop(key, None)
        to_core = {v: k for k, v in self._renamed.items()}
        known = {self._renamed.get(k, k) for k in getattr(core, self._rule_name)().defaults}
        for key in hyper:
            if key not in known:  # torch.optim's own error for a keyword it does not take
                raise TypeError(f"{type(self).__name__}.__init__() got an unexpected keyword "
                                f"argument {key!r}")
        self._rule = getattr(core, self._rule_name)(
            **{to_core.get(k, k): v for k, v in hyper.items()})
        defaults = {self._renamed.get(k, k): v for k, v in self._rule.defaults.items()}
        self._buckets = None
        self._checked_hypers = None
        self._grad_mul = None  # a clipping factor waiting for the next step (fused clipping)
        super().__init__(params, defaults)
        self._buckets = self._build_buckets()
        # With device-side scalars, GradScaler hands the step its scale and found_inf tensors
        # (torch's protocol for fused optimizers): the kernel unscales, and skips on inf/NaN.
        self._step_supports_amp_scaling = self._capturable

    def add_param_group(self, param_group):
        if self._buckets is not None:  # refused before anything is added
            raise RuntimeError("a flat optimizer lays out its buffers when it is built: give "
                               "every parameter group to its constructor (add_param_group "
                               "afterwards is not supported; build a new optimizer instead)")
        super().add_param_group(param_group)
        core.resolve_hyper(self._rule_name, self._hyper(self.param_groups[-1]))

    def _hyper(self, group):
        return {k: group[self._renamed.get(k, k)] for k in self._rule.defaults}

    def hypers(self) -> list:
        """Each parameter group's hyperparameters, under the core rule's names."""
        return [self._hyper(g) for g in self.param_groups]

    @property
    def rule(self) -> core.FlatOptimizer:
        """The core rule this optimizer steps with (``xferlib.optim``)."""
        return self._rule

    @property
    def buckets(self) -> list:
        """The flat buffers, one per (device, dtype) of the parameters: each with its
        ``layout``, optimizer ``state`` and the core views ``core_params``/``core_grads``."""
        return self._buckets

    def bucket_entries(self) -> list:
        """``[(param, group index), ...]`` per (device, dtype), in parameter order: what each
        bucket holds (every rank of a group lists them in the same order)."""
        by_key = {}
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                by_key.setdefault((p.device, p.dtype), []).append((p, gi))
        for device, dtype in by_key:  # before any bucket takes its parameters over
            if dtype not in _DTYPES:
                raise TypeError(f"flat optimizers take float32, bfloat16 or float16 "
                                f"parameters, got {dtype}")
            if self._capturable and device.type != "cuda":
                raise ValueError("capturable=True needs CUDA parameters")
        return list(by_key.values())

    def _build_buckets(self):
        hypers = self.hypers()
        return [Bucket(entries, self._rule, hypers, self._capturable)
                for entries in self.bucket_entries()]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        hypers = self.hypers()
        if hypers != self._checked_hypers:  # schedulers change lr: check what changed
            for h in hypers:
                core.resolve_hyper(self._rule_name, h)
            for bucket in self._buckets:
                bucket.ensure_buffers(self._rule, hypers)
            self._checked_hypers = [dict(h) for h in hypers]
        scaling = dict(grad_mul=self._grad_mul, grad_scale=getattr(self, "grad_scale", None),
                       found_inf=getattr(self, "found_inf", None))
        self._grad_mul = None
        for bucket in self._buckets:
            bucket.step(self._rule, hypers, **scaling)
        return loss

    def zero_grad(self, set_to_none: bool = True):
        for bucket in self._buckets:
            bucket.zero_grad(set_to_none)

    def state_nbytes(self) -> int:
        """Bytes of optimizer state this process holds: the flat state buffers, plus the
        float32 master weights of 16-bit parameters (not the parameters or gradients)."""
        total = 0
        for bucket in self._buckets:
            tensors = list(bucket.state_tensors.values())
            if bucket.master is not None:
                tensors.append(bucket.master)
            total += sum(t.numel() * t.element_size() for t in tensors)
        return total

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, eps: float = 1e-6,
                        fused: bool = False):
        """``torch.nn.utils.clip_grad_norm_`` over every gradient of this optimizer, as one
        reduction over each flat gradient buffer and one in-place scale (no per-tensor
        kernels, no host sync). Returns the total norm (a tensor), as torch does.

        ``fused=True`` (``capturable=True`` optimizers): the gradients are left as they are and
        the factor is applied inside the next ``step()``'s update kernel, saving the pass
        that scales the gradient buffer."""
        for bucket in self._buckets:
            bucket.collect_grads()
        device = self._buckets[0].device
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        grads = [b.core_grads for b in self._buckets]
        if fused:
            if not self._capturable:
                raise ValueError("clip_grad_norm_(fused=True) needs capturable=True (the "
                                 "clipping factor is read by the update kernel on the GPU)")
            total, factor = core.global_norm_clip_factor(grads, max_norm, norm_type, eps,
                                                         stream=stream)
            self._grad_mul = to_torch(factor.reshape(1))
            return to_torch(as_array(total))
        total = core.clip_by_global_norm(grads, max_norm, norm_type, eps, stream=stream)
        return to_torch(as_array(total))

    # -- checkpoints in torch.optim's per-parameter format ---------------------------------

    def _param_index(self):
        index, i = {}, 0
        for group in self.param_groups:
            for p in group["params"]:
                index[id(p)] = i
                i += 1
        return index

    def state_dict(self):
        for bucket in self._buckets:
            bucket.check_params(shapes=True)
        index = self._param_index()
        state = {}
        for bucket in self._buckets:
            steps = bucket.steps()
            for i, p in enumerate(bucket.params):
                step = int(steps[i])
                if step == 0:
                    continue
                entry = {}
                if self._rule_name != "sgd":
                    entry["step"] = torch.tensor(float(step))
                seg = bucket.layout.segments[i]
                hyper = self._hyper(self.param_groups[seg.group])
                for name in self._rule.state_names(hyper):
                    flat = bucket.state_tensors[name]
                    entry[name] = flat[seg.offset:seg.offset + seg.size].view(seg.shape).clone()
                if self._rule_name == "nadam":
                    entry["mu_product"] = torch.tensor(float(bucket.state.scalars["mu_product"][i]))
                if bucket.master is not None:  # float32 master weights of 16-bit parameters
                    entry["master_param"] = bucket.master[
                        seg.offset:seg.offset + seg.size].view(seg.shape).clone()
                state[index[id(p)]] = entry
        groups = []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = [index[id(p)] for p in group["params"]]
            groups.append(packed)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        for bucket in self._buckets:
            bucket.check_params(shapes=True)
            bucket.refuse_new_buffers(self._rule, [self._hyper(g)
                                                   for g in state_dict["param_groups"]])
        saved = state_dict["state"]
        index = self._param_index()
        for bucket in self._buckets:  # every tensor's size, before anything changes
            for p in bucket.params:
                key = index[id(p)]
                for name, value in saved.get(key, {}).items():
                    if (name not in ("step", "mu_product") and isinstance(value, torch.Tensor)
                            and value.numel() != p.numel()):
                        raise ValueError(f"state_dict: parameter {key}'s {name!r} has "
                                         f"{value.numel()} elements, expected {p.numel()}")
        super().load_state_dict(state_dict)  # torch's checks and param_groups update
        self.state.clear()
        for bucket in self._buckets:  # the checkpoint's hyperparameters may need more state
            bucket.ensure_buffers(self._rule, self.hypers())
        # Read the tensors from the checkpoint itself: torch casts loaded state to each
        # parameter's dtype, which would round the float32 state of 16-bit parameters.
        for bucket in self._buckets:
            for i, p in enumerate(bucket.params):
                entry = saved.get(index[id(p)], {})
                seg = bucket.layout.segments[i]
                if bucket.master is not None:
                    master = entry.get("master_param")
                    source = p.detach() if master is None else master
                    bucket.master[seg.offset:seg.offset + seg.size].copy_(
                        source.reshape(-1).to(bucket.master.device, torch.float32))
                for name, flat in bucket.state_tensors.items():
                    region = flat[seg.offset:seg.offset + seg.size]
                    if entry.get(name) is not None:
                        region.copy_(entry[name].reshape(-1).to(flat.device, flat.dtype))
                    else:  # no state saved for it: it starts afresh, as in torch
                        region.fill_(core.fresh_value(self._rule_name, name,
                                                      self.param_groups[seg.group]))
                bucket.restore_counters(i, entry, self._rule_name)
        self.state.clear()


def _flat_class(name, torch_name, doc_rule):
    cls = type(f"Flat{torch_name}", (FlatOptimizerBase,), {"_rule_name": name})
    cls.__doc__ = (f"``torch.optim.{torch_name}`` over a flat buffer: {doc_rule}\n\n"
                   f"Hyperparameters and defaults: {getattr(core, name)().defaults}.")
    return cls


FlatSGD = _flat_class("sgd", "SGD", "momentum, dampening, nesterov, weight decay, maximize.")
FlatAdam = _flat_class("adam", "Adam", "amsgrad, maximize, L2 weight decay.")
FlatAdamW = _flat_class("adamw", "AdamW", "amsgrad, maximize, decoupled weight decay.")
FlatAdagrad = _flat_class("adagrad", "Adagrad", "lr_decay, initial accumulator, weight decay.")
FlatRMSprop = _flat_class("rmsprop", "RMSprop", "centered, momentum, weight decay.")
FlatAdamax = _flat_class("adamax", "Adamax", "infinity-norm Adam.")
FlatNAdam = _flat_class("nadam", "NAdam", "momentum decay, decoupled weight decay.")
FlatRAdam = _flat_class("radam", "RAdam", "rectified Adam, decoupled weight decay.")
FlatLion = _flat_class("lion", "Lion", "optax.lion's rule.")
FlatLion._renamed = {"learning_rate": "lr"}
FlatLion.__doc__ = ("Lion over a flat buffer, with optax.lion's rule and defaults (lr=1e-4, "
                    "b1=0.9, b2=0.99, weight_decay=1e-3); the learning rate is called ``lr`` as "
                    "torch's schedulers expect.")
