"""Fused updates: backward and the optimizer in one (:func:`tt_fused_update`), its second half
for gradients summed across processes (:func:`tt_apply_core_grads`, :func:`tt_cache_apply`),
and the arguments the update kernels take."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from xferlib._backend import array_module, as_cupy_stream
from xferlib._kernels import named
from xferlib._kernels.tt import (CACHE_CHUNK, CACHE_STATE_ARGS, TT_UPDATE,
                                 UPDATE_CACHE_ARGS, UPDATE_POINTER_ARGS, UPDATE_THREADS)
from xferlib.optim.rules import OptId
from xferlib.tt.cache import TTRowCache, tt_cache_grad
from xferlib.tt.grads import gpu_core_grads, tt_embedding_bag_bwd
from xferlib.tt.lookup import to_host
from xferlib.tt.plan import TTBagPlan, key_type, module_of, rows_scratch, uses_kernels
from xferlib.tt.rules import check_sparse_args, state_pointers, tt_sparse_update, update_rows
from xferlib.tt.shape import TTShape, grad_spans, total_core_rows

__all__ = ["tt_fused_update", "tt_apply_core_grads", "tt_cache_apply"]


def tt_fused_update(cores, shape: TTShape, residuals, grad_bags, states, optimizer: str, *,
                    lr: float, eps: float = 1e-10, betas=(0.9, 0.999), cache=None,
                    checks=None, stream=None, scratch=None, count=None, **hyper) -> None:
    """Backward and :func:`tt_sparse_update` in one: the cores change in place from the bag
    gradients. On the GPU kernel path no dense core gradient exists: each touched core row's
    gradient is summed (in sorted order, deterministic) and the optimizer runs on those rows
    only. A forward's deferred input check is read once the update is queued: the kernels of a
    rejected batch change nothing, and the error is raised before this function returns.
    With an active ``cache`` its hit rows take the same optimizer step on their dense values
    (on the kernel path inside the step's kernels: no launch of its own, no host sync,
    deterministic), and the cores still learn from every lookup (write-through, see
    :class:`TTRowCache`). ``hyper``: see :func:`tt_sparse_update`.

    ``checks`` (kernel path): a :class:`xferlib.batch.PendingChecks` (the module's queue):
    do not wait for the input check at all; the verdict is deferred into it and raised by its
    owner's next poll (the rejected batch changed nothing), so the step takes no host
    synchronization, and a step captured in a CUDA graph reports at the owner's explicit
    check after replays (see :mod:`xferlib.batch`). ``stream``: where the kernels run
    (default: CuPy's current stream). ``scratch`` (kernel path, not while a CUDA graph is
    captured): a :class:`xferlib.tt.scratch.Scratch` of ``stream`` that the step's working
    buffers come from instead of the memory pool. ``count``: a one-element integer array (a
    step counter, e.g. the ``step`` passed here) that the call adds 1 to before the optimizer
    reads ``step``; on the kernel path inside the gradient kernel (no launch of its own).
    """
    if "defer_check" in hyper:  # the keyword before xferlib.batch
        raise TypeError("tt_fused_update() no longer takes defer_check=; pass checks=, a "
                        "xferlib.batch.PendingChecks, to defer the input check")
    check_sparse_args(optimizer, lr)
    kernel_path = isinstance(residuals, TTBagPlan)
    if count is not None and not kernel_path:
        count += 1
    if not kernel_path:
        hyper = _host_step(hyper)  # a device step counter read on the host
    if cache is not None and cache.active and not kernel_path:
        grad, touched = tt_cache_grad(cache, shape, residuals, grad_bags)
        tt_cache_apply(cache, grad, touched, optimizer, lr=lr, eps=eps, betas=betas, **hyper)
    if not kernel_path:
        grads = tt_embedding_bag_bwd(cores, shape, residuals, grad_bags)
        tt_sparse_update(cores, shape, residuals, grads, states, optimizer, lr=lr, eps=eps,
                         betas=betas, **hyper)
        return
    stream = as_cupy_stream(stream)
    plan, n = residuals, residuals.n
    cached = cache is not None and cache.active and plan.slot is not None and n > 0
    sums = None
    if cached:  # the cached runs' gradient sums (the forward's row buffer, or a new one)
        with stream:
            sums = (_empty(n * shape.dim) if scratch is None
                    else rows_scratch(scratch, n, shape.dim))
    grad, touched = gpu_core_grads(
        cores, shape, plan, grad_bags, dense=False, stream=stream, scratch=scratch,
        counter=count, cache_sums=(plan.slot, cache.capacity64, sums) if cached else None)
    if grad is None:  # an empty batch touches nothing
        return
    with stream:
        args = tt_hyper(optimizer, lr, eps, betas, **hyper)
        blocks = total_core_rows(shape)
        pointers = _update_pointers(cores, states, optimizer)
        if cached:  # blocks past the core rows step the cache's hit rows
            blocks += min(-(-n // CACHE_CHUNK), _MAX_CACHE_BLOCKS)
            TT_UPDATE.launch(module_of(shape), (key_type(plan.rows),), (blocks,),
                             (UPDATE_THREADS,), stream=stream,
                             **named(UPDATE_POINTER_ARGS, pointers), grad=grad,
                             touched=touched, **args._asdict(), rows=plan.rows,
                             perm=plan.perm, n=n, slot=plan.slot, capacity=cache.capacity64,
                             cseg=sums, **named(CACHE_STATE_ARGS, cache.update_args(optimizer)),
                             verdict=plan.verdict.words)
        else:
            TT_UPDATE.launch(module_of(shape), (key_type(plan.rows),), (blocks,),
                             (UPDATE_THREADS,), stream=stream,
                             **named(UPDATE_POINTER_ARGS, pointers), grad=grad,
                             touched=touched, **args._asdict(),
                             **named(UPDATE_CACHE_ARGS, _NO_CACHE))
    # Read the input check only now: a rejected batch's kernels wrote nothing (no row was
    # flagged as touched), and the host waited for nothing while the step was being queued.
    if checks is not None and not residuals.checked:
        residuals.verdict.defer(checks, stream)
        return
    residuals.verdict.raise_now(stream)


def tt_apply_core_grads(cores, shape: TTShape, grad, touched, states, optimizer: str, *,
                        lr: float, eps: float = 1e-10, betas=(0.9, 0.999), stream=None,
                        **hyper) -> None:
    """The second half of :func:`tt_fused_update`: apply ``optimizer`` in place to the core
    rows flagged in ``touched`` (nonzero) from the flat ``grad`` (laid out as
    :func:`tt_core_grads` makes them), with the same rules, state and ``hyper`` as
    :func:`tt_sparse_update`. Unflagged rows keep their values and state. CuPy cores of a
    shape the kernels take run the fused kernel (no host sync; ``step`` may be a device
    counter); otherwise the array path.
    """
    check_sparse_args(optimizer, lr)
    total, size = total_core_rows(shape), grad_spans(shape)[-1][1]
    if tuple(grad.shape) != (size,) or tuple(touched.shape) != (total,):
        raise ValueError(f"grad must have shape ({size},) and touched ({total},), got "
                         f"{tuple(grad.shape)} and {tuple(touched.shape)}")
    shape.check_cores(cores)
    if uses_kernels(shape, touched, cores):
        import cupy

        stream = as_cupy_stream(stream)
        with stream:
            grad = cupy.ascontiguousarray(grad, dtype=np.float32)
            touched = cupy.ascontiguousarray(touched, dtype=np.int32)
            args = tt_hyper(optimizer, lr, eps, betas, **hyper)
            TT_UPDATE.launch(
                module_of(shape), ("int",), (total,), (UPDATE_THREADS,), stream=stream,
                **named(UPDATE_POINTER_ARGS, _update_pointers(cores, states, optimizer)),
                grad=grad, touched=touched, **args._asdict(),
                **named(UPDATE_CACHE_ARGS, _NO_CACHE))
        return
    hyper = _host_step(hyper)
    xp = array_module(grad)
    # as tt_sparse_update: rules a zero gradient leaves unchanged update whole cores
    whole = optimizer == "sgd" or (optimizer in ("adagrad", "rowwise_adagrad") and eps > 0)
    start = 0
    for k, ((lo, hi), core, state) in enumerate(zip(grad_spans(shape), cores, states)):
        p = shape.p_shapes[k]
        rows = slice(None) if whole else xp.flatnonzero(touched[start:start + p])
        update_rows(core, grad[lo:hi].reshape(shape.core_shape(k)), state, rows, optimizer,
                    lr, eps, betas, **hyper)
        start += p


def tt_cache_apply(cache: "TTRowCache", grad, touched, optimizer: str, *, lr: float,
                   eps: float = 1e-10, betas=(0.9, 0.999), **hyper) -> None:
    """The row cache's optimizer step from :func:`tt_cache_grad`'s ``(grad, touched)`` (or
    their sums over several batches): what :func:`tt_fused_update` applies to an active cache,
    on the array path (a host sync for the touched rows on the GPU)."""
    check_sparse_args(optimizer, lr)
    if tuple(grad.shape) != tuple(cache.weight.shape) or tuple(touched.shape) != (
            cache.capacity,):
        raise ValueError(f"grad must have shape {tuple(cache.weight.shape)} and touched "
                         f"({cache.capacity},), got {tuple(grad.shape)} and "
                         f"{tuple(touched.shape)}")
    xp = array_module(grad)
    # whole only for the rules a zero gradient leaves unchanged (an adagrad with eps = 0
    # would turn the rows the batch did not hit into NaN)
    whole = optimizer == "sgd" or (optimizer in ("adagrad", "rowwise_adagrad") and eps > 0)
    rows = slice(None) if whole else xp.flatnonzero(touched)
    update_rows(cache.weight, grad, cache.state, rows, optimizer, lr, eps, betas,
                **_host_step(hyper))


def _host_step(hyper: dict) -> dict:
    """``hyper`` with a device step counter read on the host (the array path needs it)."""
    step = hyper.get("step", 1)
    if isinstance(step, (int, np.integer)):
        return hyper
    return {**hyper, "step": int(to_host(step).reshape(-1)[0])}


_NULL = np.uint64(0)  # a NULL pointer argument
# tt_update's cache arguments without a cache (sorted batch, slots, sums, dense rows and their
# state, verdict): its blocks past the core rows return at once
_NO_CACHE = [_NULL, _NULL, np.int64(0), _NULL, np.int64(0), _NULL] + [_NULL] * 5 + [_NULL]
_MAX_CACHE_BLOCKS = 65535  # cache blocks of tt_update (they stride over the batch's chunks)


def _empty(size: int):
    import cupy

    return cupy.empty(size, dtype=np.float32)


def _update_pointers(cores, states, optimizer: str) -> list:
    """``tt_update``'s leading arguments: 4 core pointers, then for each of the 4 state
    slots one pointer per core (NULL-padded to 4 cores)."""
    pad = [_NULL] * (4 - len(cores))
    pointers = [state_pointers(st, optimizer) for st in states]
    return list(cores) + pad + [x for j in range(4) for x in
                                ([p[j] for p in pointers] + pad)]


class TTHyper(NamedTuple):
    """The TT update kernel's scalar record (its arguments of these names): the rule's id,
    its hyperparameters in the kernels' precision, and the step counter (a one-element
    int64 device array, read when the kernel runs: the bias corrections are made there)."""

    opt: np.int32
    lr: np.float32
    eps: np.float32
    beta1: np.float64
    beta2: np.float64
    wd: np.float32
    eta: np.float32
    mom: np.float32
    iter: object


def tt_hyper(optimizer, lr, eps, betas, *, weight_decay=0.0, eta=0.001, momentum=0.9,
             step=1) -> TTHyper:
    """The :class:`TTHyper` of one step; ``step``: an int or a one-element int64 device
    array."""
    if isinstance(step, (int, np.integer)):
        import cupy

        step = cupy.full(1, int(step), dtype=np.int64)
    key = (optimizer, lr, eps, betas[0], betas[1], weight_decay, eta, momentum)
    # Plain numbers only: a tensor or array hyperparameter may change in place (a scheduler)
    # while its hash (its identity) stays, so it is converted at every call.
    if all(isinstance(v, (int, float, np.number)) for v in key[1:]):
        scalars = _SCALARS.get(key)
    else:
        key, scalars = None, None
    if scalars is None:
        if len(_SCALARS) >= 64:  # a schedule changing lr at every step
            _SCALARS.clear()
        scalars = TTHyper(np.int32(OptId[optimizer.upper()]), np.float32(lr), np.float32(eps),
                          np.float64(betas[0]), np.float64(betas[1]),
                          np.float32(weight_decay), np.float32(eta), np.float32(momentum),
                          None)
        if key is not None:
            _SCALARS[key] = scalars
    return scalars._replace(iter=step)


_SCALARS = {}  # the kernels' scalar arguments per hyperparameter set
