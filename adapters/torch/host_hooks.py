"""torch.optim's global step hooks for host modules built with ``optimizer=None``: around
``optimizer.step()`` each such module swaps its batch's rows' optimizer state in from host
RAM and writes the updated rows and state back (``host.py``)."""

from __future__ import annotations

import weakref

__all__ = ["follow_steps"]

_ANY_OPTIMIZER_MODULES: "weakref.WeakSet" = weakref.WeakSet()


def _modules_of(optimizer):
    if not _ANY_OPTIMIZER_MODULES:  # every other optimizer's step pays nothing more
        return []
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return [m for m in list(_ANY_OPTIMIZER_MODULES) if id(m.weight) in params]


def _pre_step(optimizer, args, kwargs):
    for module in _modules_of(optimizer):
        module._before_step(optimizer)


def _post_step(optimizer, args, kwargs):
    for module in _modules_of(optimizer):
        module._after_step(optimizer)


_HOOKS = []


def _install_step_hooks() -> None:
    """torch's global optimizer-step hooks, installed when the first module trained by a
    torch.optim optimizer is built (importing the adapter changes nothing process-wide)."""
    if _HOOKS:
        return
    from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                       register_optimizer_step_pre_hook)

    _HOOKS.append(register_optimizer_step_pre_hook(_pre_step))
    _HOOKS.append(register_optimizer_step_post_hook(_post_step))


def follow_steps(module) -> None:
    """Let every torch.optim optimizer's step reach ``module`` (its ``_before_step`` and
    ``_after_step``) while it lives."""
    _ANY_OPTIMIZER_MODULES.add(module)
    _install_step_hooks()
