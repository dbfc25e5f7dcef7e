"""Which torch.distributed group a module trains with: the one rule the host-table and TT
modules share for their ``process_group=`` argument."""

from __future__ import annotations

import gc
import time

import torch.distributed as dist

__all__ = ["DEFAULT", "leave_process_group", "resolve_group"]

DEFAULT = "default"


def resolve_group(process_group):
    """The group a module shares its table (host tables) or its gradients (TT) with, or None
    for one process (no collectives).

    ``"default"`` (the modules' default): torch.distributed's default group when it is
    initialized with more than one rank, else None (single-process behaviour). ``None``: one
    process, whatever torch.distributed does. A group: that group (None when it has one
    rank)."""
    if process_group is None:
        return None
    if isinstance(process_group, str):
        if process_group != DEFAULT:
            raise ValueError(f"process_group must be 'default', None or a torch.distributed "
                             f"group, got {process_group!r}")
        if not (dist.is_available() and dist.is_initialized()):
            return None
        process_group = dist.group.WORLD
    elif not (dist.is_available() and dist.is_initialized()):
        raise ValueError("process_group given but torch.distributed is not initialized "
                         "(dist.init_process_group)")
    return process_group if dist.get_world_size(process_group) > 1 else None


def leave_process_group() -> None:
    """Leave torch.distributed cleanly: wait for every rank, destroy the process groups, and
    give their worker threads the interpreter to finish before Python shuts down.

    Call it on every rank at the end of a multi-process script instead of a bare
    ``dist.destroy_process_group()``. Why: torch's gloo backend frees its last collectives
    on its own worker threads, and freeing a tensor that Python made needs the interpreter.
    ``destroy_process_group`` does not stop those threads (torch keeps the default group
    referenced once ``torch.optim`` is imported), so a thread that gets there only after the
    script's end finds Python shutting down and aborts the process ("terminate called
    without an active exception", SIGABRT): a run that succeeded fails, now and then. Here,
    after the barrier, the garbage collector frees what still holds a group (modules that
    sum gradients sit in reference cycles through their hooks) and the main thread lets go
    of the interpreter for a moment, so the threads finish those frees while Python runs.
    A no-op when torch.distributed is not initialized.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()
    time.sleep(0.05)  # the interpreter released: the worker threads' last frees run now
