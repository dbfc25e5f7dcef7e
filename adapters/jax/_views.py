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


def _home(table: HostTable, device: int) -> int:
    """The device the table's own GPU side lives on (``device`` when it has none yet)."""
    side = table._gpu
    if side is None:
        return device
    hyper = getattr(side, "hyper", None)
    if hyper is not None and hasattr(hyper, "device"):
        return int(hyper.device.id)
    cache = getattr(side, "cache", None)
    for value in vars(cache).values() if cache is not None else ():
        if hasattr(value, "device") and hasattr(value, "data"):
            return int(value.device.id)
    import cupy

    return int(cupy.cuda.runtime.getDevice())


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


def views_of(table: HostTable) -> list:
    """The table's device views made so far (not the table itself)."""
    views = _VIEWS.get(table) or {}
    return [v for k, v in views.items() if k != "home"]
