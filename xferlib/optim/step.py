"""The flat optimizer step: every parameter in one buffer, one update over all of it.

A :class:`FlatLayout` places many tensors (*segments*) in one flat array, each starting on a
16-byte boundary, each tagged with its parameter group. An optimizer is a pair of functions,
optax style::

    layout = xferlib.optim.FlatLayout.from_shapes([(128, 64), (64,)])   # layout.py
    params, grads = layout.pack([w, b]), layout.zeros()
    opt = xferlib.optim.adam(lr=1e-3)
    state = opt.init(layout)                          # zeroed state buffers, step counters
    state = opt.update(layout, params, grads, state)  # params updated in place

``params`` and ``grads`` are flat arrays laid out by ``layout`` (NumPy on the CPU, CuPy on the
GPU); the state buffers are flat arrays of the same layout. The update rules, hyperparameter
names and defaults are torch.optim's (optax's for :func:`lion`), eps placement and bias
correction included, so a flat optimizer follows the torch optimizer it replaces step for
step.

Per-step scalars (bias corrections, step sizes, NAdam's momentum products) are computed on
the host per segment, from each segment's own step counter (a segment without a gradient in a
step is skipped, as torch skips a parameter whose ``.grad`` is None); the elementwise work then
runs in one pass: vectorized NumPy over runs of segments that share their scalars, or one CUDA
launch over the whole buffer (``xferlib/_kernels/optim.py``) with a per-segment scalar table.
The rules themselves (defaults, checks, scalars, NumPy update) are in ``rules.py``. The
kernels (``xferlib._kernels``) are imported inside the functions that launch them: their
sources are made from this package's rules, so the dependency runs one way at import.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, NamedTuple, Sequence

import numpy as np

from xferlib._backend import device_constant, is_cupy_array
from xferlib.optim.layout import FlatLayout
from xferlib.optim.rule_rows import adam_hyper_row
from xferlib.optim.rules import (COMMON, FLAT_RULES, SCALARS, Rule, common_scalars, get_rule,
                                 preamble_numpy, resolve_hyper)

__all__ = ["FlatState", "FlatOptimizer", "sgd", "adam", "adamw", "adagrad", "rmsprop",
           "adamax", "nadam", "radam", "lion", "step_scalars", "fill_step_table",
           "apply_table", "apply_adam_device_scalars", "adam_device_hyper", "CudaStep",
           "TableRing", "fresh_value"]


def fresh_value(rule: str, buffer: str, hyper: dict) -> float:
    """The value state ``buffer`` of ``rule`` starts from for a segment of hyperparameters
    ``hyper``, as torch makes it: Adagrad's sum its initial accumulator value, every other
    buffer zero."""
    return float(hyper["initial_accumulator_value"]) if (rule, buffer) == ("adagrad", "sum") \
        else 0.0


class FlatState(NamedTuple):
    """Optimizer state: flat buffers by torch's state names, and per-segment scalars.

    ``steps``: int64 step count per segment (torch's ``state['step']``). ``scalars``: other
    per-segment host scalars by name (NAdam's ``mu_product``).
    """

    buffers: dict
    steps: np.ndarray
    scalars: dict


@dataclasses.dataclass(frozen=True)
class FlatOptimizer:
    """An ``(init, update)`` pair with the metadata adapters need."""

    name: str
    defaults: dict
    init: Callable
    update: Callable
    state_names: Callable  # hyper -> names of the flat state buffers
    kind: int  # the kernel's optimizer id


def _make(name: str):
    rule = FLAT_RULES[name]

    def factory(**hyper) -> FlatOptimizer:
        defaults = resolve_hyper(name, hyper)

        def state_names(h=None):
            return rule.buffers(defaults if h is None else h)

        def init(layout: FlatLayout, hypers: Sequence[dict] | None = None, xp=None):
            """Zeroed state for ``layout`` (``xp``: numpy or cupy; default numpy)."""
            xp = np if xp is None else xp
            hypers = _group_hypers(layout, hypers, defaults, name)
            names = []
            for h in hypers:
                names += [n for n in rule.buffers(h) if n not in names]
            buffers = {n: layout.zeros(xp) for n in names}
            for n in names:
                for seg in layout.segments:
                    value = fresh_value(name, n, hypers[seg.group])
                    if value:
                        buffers[n][seg.offset:seg.offset + seg.size] = value
            scalars = {"mu_product": np.ones(len(layout.segments))} if name == "nadam" else {}
            return FlatState(buffers, np.zeros(len(layout.segments), dtype=np.int64), scalars)

        def update(layout: FlatLayout, params, grads, state: FlatState,
                   hypers: Sequence[dict] | None = None, active=None, stream=None,
                   params_lowp=None) -> FlatState:
            """One step in place on ``params`` and ``state``; returns ``state``.

            ``hypers``: one dict per group (default: this optimizer's hyperparameters).
            ``active``: bool per segment; inactive segments (no gradient) are skipped and
            their step counters stay. Mixed precision: ``params`` are the float32 master
            weights, ``grads`` may be bfloat16 or float16, and ``params_lowp`` (the model's
            low-precision copy, same dtype as ``grads``) receives the updated weights rounded.
            """
            layout.check(params, "params")
            _check_grads(layout, grads, "grads")
            if params_lowp is not None:
                _check_grads(layout, params_lowp, "params_lowp")
            hypers = _group_hypers(layout, hypers, defaults, name)
            active = (np.ones(len(layout.segments), dtype=bool) if active is None
                      else np.asarray(active, dtype=bool))
            if active.shape != (len(layout.segments),):
                raise ValueError(f"active must have one flag per segment "
                                 f"({len(layout.segments)}), got shape {active.shape}")
            table = step_scalars(rule, layout, state, hypers, active)
            apply_table(name, layout, params, grads, state.buffers, table, stream=stream,
                        params_lowp=params_lowp)
            return state

        return FlatOptimizer(name, defaults, init, update, state_names, rule.kind)

    factory.__name__ = name
    factory.__qualname__ = name
    factory.__doc__ = (f"Flat {name}: torch.optim's rule, names and defaults "
                       f"{FLAT_RULES[name].defaults}." if name != "lion" else
                       f"Flat lion: optax.lion's rule, names and defaults "
                       f"{FLAT_RULES[name].defaults}.")
    return factory


def _group_hypers(layout, hypers, defaults, name):
    if hypers is None:
        hypers = [defaults] * max(1, layout.num_groups)
    hypers = list(hypers)
    if len(hypers) < layout.num_groups:
        raise ValueError(f"layout has {layout.num_groups} groups but {len(hypers)} "
                         "hyperparameter dicts were given")
    return hypers


def step_scalars(rule: Rule, layout: FlatLayout, state: FlatState, hypers, active):
    """Advance the step counters of active segments and return the per-segment scalar table
    (float64, ``COMMON + SCALARS`` columns; rows of inactive segments are zero).

    Scalars are computed once per group and distinct step (segments of a group usually share
    their step), so the host cost does not grow with the number of tensors."""
    if _is_uniform(state, active):
        return _uniform_rows(rule, layout, state, hypers)[layout.group_ids]
    return _mixed_step_scalars(rule, layout, state, hypers, active)


def fill_step_table(rule: Rule, layout: FlatLayout, state: FlatState, hypers, active,
                    out) -> None:
    """:func:`step_scalars` written into ``out`` (a ``(segments, COMMON + SCALARS)`` float32
    array, e.g. pinned staging memory). The common case (every segment steps, all at the same
    count) computes one row per group and allocates nothing per step."""
    if _is_uniform(state, active):
        rows = _uniform_rows(rule, layout, state, hypers)
        if len(rows) == 1:
            out[...] = rows[0]  # broadcast: one group
        else:
            out[...] = rows[layout.group_ids]
        return
    out[...] = _mixed_step_scalars(rule, layout, state, hypers, active)


def _is_uniform(state, active) -> bool:
    """Every segment steps, all at one count and with the same per-segment scalars (NAdam's
    mu_product: segments of one count may carry different histories)."""
    steps = state.steps
    return bool(active.all()) and (len(steps) == 0 or steps.min() == steps.max()) and all(
        len(v) == 0 or v.min() == v.max() for v in state.scalars.values())


def _mixed_step_scalars(rule, layout, state, hypers, active):
    table = np.zeros((len(layout.segments), COMMON + SCALARS))
    state.steps[active] += 1
    groups = layout.group_ids
    for group, h in enumerate(hypers[:max(1, layout.num_groups)]):
        selected = np.flatnonzero(active & (groups == group))
        if selected.size == 0:
            continue
        common = common_scalars(rule, h)
        keys = [state.steps[selected]] + [state.scalars[k][selected] for k in state.scalars]
        unique, inverse = np.unique(np.stack(keys, axis=1), axis=0, return_inverse=True)
        rows = np.empty((len(unique), COMMON + SCALARS))
        new_extra = {k: np.empty(len(unique)) for k in state.scalars}
        for u, key in enumerate(unique):
            extra = dict(zip(state.scalars, key[1:]))
            rows[u, :COMMON] = common
            rows[u, COMMON:] = rule.row(rule.scalars(h, int(key[0]), extra))
            for k in state.scalars:
                new_extra[k][u] = extra[k]
        inverse = inverse.reshape(-1)
        table[selected] = rows[inverse]
        for k in state.scalars:
            state.scalars[k][selected] = new_extra[k][inverse]
    return table


def _uniform_rows(rule, layout, state, hypers):
    """The common case: every segment steps, all at the same count. One row per group
    (``rows[layout.group_ids]`` is the per-segment table)."""
    step = int(state.steps[0]) + 1 if len(state.steps) else 1
    state.steps[...] += 1
    groups = layout.group_ids
    rows = np.zeros((max(1, layout.num_groups), COMMON + SCALARS))
    single = len(rows) == 1
    for group in range(len(rows)):
        members = slice(None) if single else groups == group
        first = 0 if single else np.flatnonzero(members)
        if not single:
            if first.size == 0:
                continue
            first = int(first[0])
        h = hypers[group]
        extra = {k: v[first] for k, v in state.scalars.items()}
        rows[group, :COMMON] = common_scalars(rule, h)
        rows[group, COMMON:] = rule.row(rule.scalars(h, step, extra))
        for k, v in extra.items():
            state.scalars[k][members] = v
    return rows


def _update_numpy(rule, layout, params, grads, buffers, table):
    # Runs of adjacent active segments that share every scalar update as one slice.
    segments = layout.segments
    active = table[:, 0] != 0
    i = 0
    while i < len(segments):
        if not active[i]:
            i += 1
            continue
        j = i + 1
        while j < len(segments) and active[j] and np.array_equal(table[j], table[i]):
            j += 1
        start = segments[i].offset
        end = segments[j].offset if j < len(segments) else layout.total
        p = params[start:end]
        g = preamble_numpy(table[i, :COMMON], p, grads[start:end])
        rule.numpy(rule.read_row(table[i, COMMON:]), p, g,
                   {n: b[start:end] for n, b in buffers.items()})
        i = j


def apply_table(name: str, layout: FlatLayout, params, grads, buffers: dict, table, *,
                updates=None, stream=None, params_lowp=None) -> None:
    """The elementwise half of a step, given the per-segment scalar table.

    ``table``: ``(segments, COMMON + SCALARS)``, a host array (copied to the GPU for the CUDA
    path) or, on the GPU, a device array already there (the JAX adapter computes it inside
    ``jit``). A row whose sign is 0 skips its segment. With ``updates``, ``params`` stay as
    they are and ``updates`` receives the step (new - old), optax's convention; ``updates`` may
    be ``grads`` itself.
    """
    rule = get_rule(name, FLAT_RULES, "flat optimizer")
    if is_cupy_array(params):
        _update_cuda(rule, layout, params, grads, buffers, table, updates, stream, params_lowp)
        return
    if grads.dtype != np.float32:
        grads = grads.astype(np.float32)
    if updates is None:
        _update_numpy(rule, layout, params, grads, buffers, table)
        if params_lowp is not None:
            params_lowp[...] = params.astype(params_lowp.dtype)
        return
    new = params.copy()
    _update_numpy(rule, layout, new, grads, buffers, table)
    np.subtract(new, params, out=updates)


def adam_device_hyper(name: str, h: dict) -> list:
    """One group's row for :func:`apply_adam_device_scalars`: lr, beta1, beta2, eps,
    weight_decay, decoupled, amsgrad, maximize."""
    if name not in ("adam", "adamw"):
        raise ValueError(f"device-side step scalars exist for adam and adamw, not {name}")
    return adam_hyper_row(FLAT_RULES[name], h)


def apply_adam_device_scalars(layout: FlatLayout, params, grads, buffers: dict, hyper,
                              segment_groups, steps, active, *, stream=None,
                              params_lowp=None, grad_mul=None, grad_scale=None,
                              found_inf=None) -> None:
    """An Adam/AdamW step whose scalars are computed on the GPU from device-resident state.

    ``hyper``: float32 ``(groups, 8)`` rows of :func:`adam_device_hyper`; ``segment_groups``:
    int32 group per segment; ``steps``: float32 step count per segment (advanced here for
    active segments); ``active``: uint8 per segment. All CuPy arrays: nothing crosses from the
    host, so the two launches can be captured in a CUDA graph and replayed.

    Optional float32 one-element device arrays, read by the kernel: ``grad_mul`` multiplies
    the gradients (a clipping factor from :func:`global_norm_clip_factor`); ``grad_scale``
    divides them (a loss scale); ``found_inf`` != 0 skips the step entirely: parameters,
    state and step counts stay as they are (GradScaler's contract).
    """
    from xferlib._backend import as_cupy_stream
    from xferlib._kernels import grid_1d, named
    from xferlib._kernels.optim import (ADVANCE_STEPS, CHUNK_ARGS, FLAT_ADAM_DEVICE_SCALARS,
                                        GRAD_TYPES, OPTIM_MODULE)

    layout.check(params, "params")
    _check_grads(layout, grads, "grads")
    for name in ("exp_avg", "exp_avg_sq"):
        layout.check(buffers[name], name)
    n = len(layout.segments)
    if steps.shape != (n,) or active.shape != (n,) or segment_groups.shape != (n,):
        raise ValueError(f"steps, active and segment_groups need one entry per segment ({n})")
    stream = as_cupy_stream(stream)
    chunks = chunk_table(layout)
    grad_dtype = np.dtype(grads.dtype).name
    vmax = buffers.get("max_exp_avg_sq")
    with stream:
        FLAT_ADAM_DEVICE_SCALARS.launch(
            OPTIM_MODULE, (GRAD_TYPES[grad_dtype],), (len(chunks[0]),), (256,), stream=stream,
            params=params, grads=grads, s0=buffers["exp_avg"], s1=buffers["exp_avg_sq"],
            s2=vmax, hyper=hyper, seg_group=segment_groups, steps=steps, active=active,
            **named(CHUNK_ARGS, chunks), lowp=params_lowp, grad_mul=grad_mul,
            grad_scale=grad_scale, found_inf=found_inf)
        ADVANCE_STEPS.launch(OPTIM_MODULE, (), *grid_1d(n), stream=stream, steps=steps,
                             active=active, n=n, found_inf=found_inf)


def flat_update_arguments(params, grads, slots, table, chunks, ncols: int, updates=None,
                          lowp=None) -> tuple:
    """The flat update kernel's arguments (``flat_update``'s declaration in
    ``xferlib/_kernels/optim.py``), made here for every launch of it: ``slots`` the rule's
    state buffers in its slot order (None where unused, at most three), ``table`` the
    per-step scalar table of ``ncols`` columns, ``chunks`` :func:`chunk_table`'s three
    arrays, ``updates`` / ``lowp`` or None. Arrays or raw device addresses."""
    from xferlib._kernels import named
    from xferlib._kernels.optim import CHUNK_ARGS, FLAT_UPDATE

    s0, s1, s2 = tuple(slots) + (None,) * (3 - len(slots))
    return FLAT_UPDATE.arguments(params=params, grads=grads, s0=s0, s1=s1, s2=s2, table=table,
                                 **named(CHUNK_ARGS, chunks), ncols=ncols, updates=updates,
                                 lowp=lowp)


def _check_grads(layout: FlatLayout, grads, name: str) -> None:
    """Gradients (and low-precision parameter copies): the layout's length, float32 or a
    16-bit float type."""
    if grads.ndim != 1 or grads.shape[0] != layout.total:
        raise ValueError(f"{name} must be a flat array of {layout.total} elements, got shape "
                         f"{tuple(grads.shape)}")
    if np.dtype(grads.dtype).name not in ("float32", "bfloat16", "float16"):
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {grads.dtype}")


def _update_cuda(rule, layout, params, grads, buffers, table, updates, stream, params_lowp):
    """One launch over the whole buffer: a block per chunk of a segment, the segment's scalars
    from the table (inactive segments have a zero sign and exit)."""
    from xferlib._backend import as_cupy_stream
    from xferlib._kernels.optim import FLAT_UPDATE, GRAD_TYPES, OPTIM_MODULE

    stream = as_cupy_stream(stream)
    chunks = chunk_table(layout)
    pointers = []
    for slot in rule.slots:
        buffer = buffers.get(slot)
        if buffer is not None:
            layout.check(buffer, slot)
        pointers.append(buffer)
    with stream:
        grad_dtype = np.dtype(grads.dtype).name
        if params_lowp is not None and np.dtype(params_lowp.dtype).name != grad_dtype:
            raise TypeError(f"params_lowp dtype {params_lowp.dtype} must match the gradients' "
                            f"{grads.dtype}")
        kernel = FLAT_UPDATE.function(OPTIM_MODULE, int(rule.kind), GRAD_TYPES[grad_dtype])
        slot = None
        if is_cupy_array(table):
            device_table = table
        else:
            ring = _table_ring(layout, table.shape)
            slot = ring.acquire()
            slot.host[...] = table
            ring.upload(slot, stream)
            device_table = slot.device
        kernel((len(chunks[0]),), (256,),
               flat_update_arguments(params, grads, pointers, device_table, chunks,
                                     table.shape[1], updates, params_lowp), stream=stream)
        if slot is not None:
            ring.release(slot, stream)


def _table_ring(layout, shape):
    import cupy

    cache = layout.derived("tables")
    key = (cupy.cuda.runtime.getDevice(), tuple(shape))
    ring = cache.get(key)
    if ring is None:
        ring = cache[key] = TableRing(shape)
    return ring


_RING_MAX = 256  # staging slots per table shape before the host waits for the GPU


class _Slot:
    __slots__ = ("block", "host", "device", "host_ptr", "device_ptr", "event", "args")

    def __init__(self, block, host, device):
        import cupy

        self.block = block  # the pinned allocation this slot's host view lives in
        self.host = host
        self.device = device
        self.host_ptr = host.ctypes.data
        self.device_ptr = device.data.ptr
        self.event = cupy.cuda.Event(block=False, disable_timing=True, interprocess=False)
        self.args = None  # a prepared launch's arguments with this slot's table (CudaStep)


class TableRing:
    """Pinned staging slots for a per-step scalar table, each with its device copy.

    A slot is reused only once the event recorded behind its last use has completed, so the
    host never overwrites a table the GPU has yet to copy or read. When every slot is still in
    flight (the host is running ahead of the GPU) slots are added rather than waited for,
    as many again as there are, in one pinned and one device allocation (pinning memory costs
    far more than a step), up to 256: a step's host path does not wait for the GPU in
    practice, where two slots used in turn made every step wait for the one before last (the
    eager step then ran at the GPU's pace, not the host's)."""

    def __init__(self, shape):
        self.shape = tuple(shape)
        self.nbytes = int(np.prod(self.shape)) * 4
        self.free = []
        self.busy = collections.deque()
        self.count = 0

    def _grow(self) -> None:
        import cupy

        from xferlib.memory import pinned_empty

        k = min(max(4, self.count), _RING_MAX - self.count)
        block = pinned_empty((k, *self.shape), np.float32)
        host = np.asarray(block)  # plain ndarray views: cheaper to write into
        device = cupy.empty((k, *self.shape), dtype=np.float32)
        self.free += [_Slot(block, host[j], device[j]) for j in range(k)]
        self.count += k

    def acquire(self) -> _Slot:
        busy = self.busy
        while busy and busy[0].event.done:
            self.free.append(busy.popleft())
        if not self.free and self.count < _RING_MAX:
            self._grow()
        if self.free:
            return self.free.pop()
        slot = busy.popleft()
        slot.event.synchronize()
        return slot

    def upload(self, slot: _Slot, stream) -> None:
        """Queue the copy of ``slot.host`` to ``slot.device`` on ``stream`` (a CuPy stream)."""
        import cupy

        cupy.cuda.runtime.memcpyAsync(slot.device_ptr, slot.host_ptr, self.nbytes,
                                      cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)

    def release(self, slot: _Slot, stream) -> None:
        """After the launch that reads ``slot``: it is free again once ``stream`` gets here."""
        slot.event.record(stream)
        self.busy.append(slot)


class CudaStep:
    """One rule's flat update on the GPU over fixed buffers, prepared once for repeated steps.

    Everything a launch needs is resolved here (the kernel, the chunk table, the buffers' raw
    pointers, the argument tuple for each staging slot), so a step is: the scalar table
    written into pinned staging memory (:func:`fill_step_table`, one row per group in the
    common case), one small asynchronous host-to-device copy, one launch. No allocation, no
    DLPack exchange and no synchronization per step. The buffers must stay alive and in place
    (the torch adapter holds them).

    >>> # step = CudaStep("adam", layout, params, grads, state.buffers)   # CuPy arrays
    >>> # step(state, hypers, active, stream)                             # each step
    """

    def __init__(self, name: str, layout: FlatLayout, params, grads, buffers: dict,
                 params_lowp=None):
        import cupy

        from xferlib._kernels.optim import FLAT_UPDATE, GRAD_TYPES, OPTIM_MODULE

        rule = get_rule(name, FLAT_RULES, "flat optimizer")
        layout.check(params, "params")
        _check_grads(layout, grads, "grads")
        grad_dtype = np.dtype(grads.dtype).name
        if params_lowp is not None:
            _check_grads(layout, params_lowp, "params_lowp")
            if np.dtype(params_lowp.dtype).name != grad_dtype:
                raise TypeError(f"params_lowp dtype {params_lowp.dtype} must match the "
                                f"gradients' {grads.dtype}")
        slots = []
        for slot in rule.slots:
            buffer = buffers.get(slot)
            if buffer is not None:
                layout.check(buffer, slot)
            slots.append(buffer)
        self.rule, self.layout = rule, layout
        self.device = params.device.id
        with cupy.cuda.Device(self.device):
            chunks = chunk_table(layout)
            self.kernel = FLAT_UPDATE.function(OPTIM_MODULE, int(rule.kind),
                                               GRAD_TYPES[grad_dtype])
        self.grid, self.block = (len(chunks[0]),), (256,)
        self._keep = (params, grads, dict(buffers), params_lowp, chunks)  # pointers below
        # Raw addresses (the arrays are kept alive above): the launch reads no array.
        self._pointers = dict(params=_pointer(params), grads=_pointer(grads),
                              slots=tuple(_pointer(a) for a in slots),
                              chunks=tuple(_pointer(c) for c in chunks),
                              lowp=_pointer(params_lowp))
        self.ring = TableRing((len(layout.segments), COMMON + SCALARS))

    def __call__(self, state: FlatState, hypers, active, stream) -> None:
        """One step: ``hypers`` one dict per group, ``active`` bool per segment, ``stream`` a
        CuPy stream (``as_cupy_stream`` wraps torch's)."""
        ring = self.ring
        slot = ring.acquire()
        fill_step_table(self.rule, self.layout, state, hypers, active, slot.host)
        ring.upload(slot, stream)
        args = slot.args
        if args is None:
            p = self._pointers
            args = slot.args = flat_update_arguments(
                p["params"], p["grads"], p["slots"], slot.device_ptr, p["chunks"],
                COMMON + SCALARS, None, p["lowp"])
        self.kernel(self.grid, self.block, args, stream=stream)
        ring.release(slot, stream)


def _pointer(array):
    return np.uint64(0) if array is None else np.uint64(array.data.ptr)


_CHUNK = 8192  # elements per block


def chunk_table(layout: FlatLayout):
    """(segment id, start, end) per block, cached per layout and device."""
    import cupy

    cache = layout.derived("chunks")
    device = cupy.cuda.runtime.getDevice()
    cached = cache.get(device)
    if cached is None:
        seg_ids, starts, ends = [], [], []
        for i, seg in enumerate(layout.segments):
            end = (layout.segments[i + 1].offset if i + 1 < len(layout.segments)
                   else layout.total)  # the padding rides along: it stays zero
            for start in range(seg.offset, end, _CHUNK):
                seg_ids.append(i)
                starts.append(start)
                ends.append(min(end, start + _CHUNK))
        cached = cache[device] = (device_constant(seg_ids, np.int32),
                                 device_constant(starts, np.int64),
                                 device_constant(ends, np.int64))
    return cached


sgd = _make("sgd")
adam = _make("adam")
adamw = _make("adamw")
adagrad = _make("adagrad")
rmsprop = _make("rmsprop")
adamax = _make("adamax")
nadam = _make("nadam")
radam = _make("radam")
lion = _make("lion")
