"""One HostTable, several GPUs: a per-device view that shares the table's pinned memory.

A :class:`xferlib.HostTable` keeps its GPU side (kernels' launch sizes, the hyperparameter
array, the pending input checks, events) for ONE device, the one current when it first ran
on a GPU: its "home". Under ``shard_map`` every device of the mesh runs the lookup and update
callbacks on its own stream, so each other device gets a view
(:meth:`xferlib.HostTable.device_view`): the table's weights and state (the same pinned
arrays, no copy), its own GPU side, no GPU cache, the table's hyperparameters. The table's
own cache (on its home device) is refused by :func:`sharded_host_update`.
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
    side = table.device_side
    return device if side is None else side.device_id()


def on_device(table: HostTable, device: int) -> HostTable:
    """``table`` itself on its home device, else this device's view of it
    (:meth:`HostTable.device_view`, made once). Call with ``device`` current."""
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
                view = views[device] = table.device_view()
    return view
