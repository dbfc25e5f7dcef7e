"""One HostTable, several GPUs: a per-device view that shares the table's pinned memory.

A :class:`xferlib.HostTable` keeps its GPU side (kernels' launch sizes, the hyperparameter
array, the pending input checks, events) for ONE device, the one current when it first ran
on a GPU: its "home". Under ``shard_map`` every device of the mesh runs the lookup and update
callbacks on its own stream, so each other device gets a view: a HostTable object whose
weights and state ARE the table's (the same pinned arrays, no copy) and whose GPU side is its
own. Pinned memory is registered portable (``xferlib.memory``), so every GPU reaches it.

A view has no GPU cache: a cached row would go stale when another device updates it. The
table's own cache (on its home device) is refused by :func:`sharded_host_update`.
"""

from __future__ import annotations

import threading
import weakref

from xferlib.table import HostTable

_VIEWS: "weakref.WeakKeyDictionary[HostTable, dict]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()  # device threads may meet a table for the first time together


def _home(table: HostTable, device: int):
    """The device the table's own GPU side lives on: ``device`` when it has none yet (this
    call makes it), the device of its cache or hyperparameter array, else None (a GPU side
    made outside JAX, by a write or a flush, that says nothing of its device: every device
    then gets a view, and the table's own side is left to the code that made it)."""
    side = table._gpu
    if side is None:
        return device
    arrays = [getattr(side, "hyper", None)]
    cache = getattr(side, "cache", None)
    arrays += list(vars(cache).values()) if cache is not None else []
    for value in arrays:
        owner = getattr(value, "device", None)
        if owner is not None and hasattr(owner, "id") and hasattr(value, "data"):
            return int(owner.id)
    return None


def on_device(table: HostTable, device: int) -> HostTable:
    """``table`` itself on its home device, else this device's view of it (made once).
    Call with ``device`` current."""
    views = _VIEWS.get(table)
    if views is None:
        with _LOCK:
            views = _VIEWS.get(table)
            if views is None:
                views = _VIEWS[table] = {"home": _home(table, device)}
    if device == views["home"]:
        return table
    view = views.get(device)
    if view is None:
        with _LOCK:
            view = views.get(device)
            if view is None:
                view = object.__new__(HostTable)
                view.__dict__.update(table.__dict__)  # the same arrays: one table in memory
                view._gpu, view.cache_rows = None, 0
                views[device] = view
    if view._hyper is not table._hyper:  # set_hyper() on the table reaches every device
        view._hyper = table._hyper
        if view._gpu is not None:
            view._gpu.hyper = None
    return view

