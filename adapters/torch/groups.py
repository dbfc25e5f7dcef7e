"""Which torch.distributed group a module trains with (the one rule the host-table and TT
modules share for their ``process_group=`` argument), and how a multi-process script leaves
its groups."""

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


def leave_process_group(wait: bool = True) -> None:
    """Leave torch.distributed at the end of a multi-process script, on every rank, instead
    of a bare ``dist.destroy_process_group()``: a barrier (``wait=False``: none, for a rank
    that failed), the groups destroyed, garbage collected (modules that sum gradients hold
    their group in reference cycles) and the interpreter released for 50 ms.

    Why: torch's gloo worker threads free their last collectives' tensors on their own, and
    torch may keep the group alive past ``destroy_process_group`` (it does once
    ``torch._dynamo`` is imported, as ``torch.optim`` imports it). A thread that frees a
    tensor only after the script's end aborts a finished run ("terminate called without an
    active exception", SIGABRT), now and then. Releasing the interpreter lets the threads
    finish first: best effort (a thread starved of CPU for 50 ms still loses), not a proof.
    A no-op when torch.distributed is not initialized.

    Release every CUDA graph that captured NCCL collectives (``del graph``) before calling
    it: NCCL's communicator teardown waits for such graphs to be destroyed, so a graph still
    alive here makes this call (as ``destroy_process_group``) wait forever.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if wait:
            dist.barrier()
    finally:
        dist.destroy_process_group()
        gc.collect()
        time.sleep(0.05)  # the interpreter released: the worker threads' last frees run now
