"""Which torch.distributed group a module trains with: the one rule the host-table and TT
modules share for their ``process_group=`` argument."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["DEFAULT", "resolve_group"]

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
