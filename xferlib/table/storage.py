"""Where a HostTable's rows live: one row of storage per table row (``layout.py``: the weights,
then the optimizer state), in pinned host RAM beside a GPU, in plain NumPy memory without one,
or in a named shared-memory block other processes of the host open (``shared.py``).

Each allocation checks the host's RAM first (a table larger than it fails with both sizes,
instead of being killed part-way through its initialization), then initializes the rows in
chunks: the weights from ``init``, the state slots and row scalars from the rule's initial
value, the step counts and the padding zero.
"""

from __future__ import annotations

import json

import numpy as np

from xferlib._backend import cupy_available
from xferlib.memory import check_host_memory, pin, pinned_empty
from xferlib.table.layout import INIT_CHUNK_ROWS, initial_weights, split_state

__all__ = ["allocate_rows", "allocate_shared_rows", "shared_header"]


def allocate_rows(num_rows, dim, dtype, layout, initial, init, rng, what: str):
    """``(storage, weights, state)`` of a private table. ``init`` a NumPy array: its memory
    holds the weights in place (pinned beside a GPU) and the state gets its own block
    (``storage`` None); else one block of whole rows, the weights drawn by ``init``
    (``"zeros"``, ``("uniform", a, b)``, ``("normal", mean, std)``) from ``rng``.
    ``initial``: the state slots' and row scalars' starting value; ``what``: the table, as
    the host-memory check names it."""
    alloc = pinned_empty if cupy_available() else np.empty
    width = layout.state_width if isinstance(init, np.ndarray) else layout.row_width
    check_host_memory(num_rows * width * dtype.itemsize, what)
    if isinstance(init, np.ndarray):
        _check_init_array(init, num_rows, dim, dtype)
        if not init.flags.c_contiguous:
            raise ValueError("init array must be C-contiguous (it is used in place)")
        storage = None
        weights = pin(init) if cupy_available() else init
        state = alloc((num_rows, layout.state_width), dtype)
        fill_weights = None
    else:
        fill_weights = initial_weights(init, rng)
        storage = alloc((num_rows, layout.row_width), dtype)
        weights = storage[:, :dim]
        state = storage[:, layout.state_offset:]
    for start in range(0, num_rows, INIT_CHUNK_ROWS):
        stop = min(start + INIT_CHUNK_ROWS, num_rows)
        if fill_weights is not None:
            fill_weights(weights[start:stop])
        chunk = state[start:stop]
        chunk[...] = 0
        slots, scalars, steps = split_state(layout, chunk)
        for view in (*slots.values(), *scalars.values()):
            view[...] = initial
        steps[...] = 0
    return storage, weights, state


def shared_header(num_rows, dim, dtype, optimizer, hyper, row_width) -> dict:
    """What a shared table's block records of its configuration (the processes that open
    it must build the same table), as JSON gives it back."""
    return json.loads(json.dumps(dict(
        kind="HostTable", num_rows=num_rows, dim=dim, dtype=dtype.name, optimizer=optimizer,
        hyper=hyper, row_width=row_width)))


def allocate_shared_rows(num_rows, dim, dtype, layout, initial, header, shared, init, rng):
    """``(memory, storage, weights, state)`` of a shared table: ``shared=True`` creates a
    block and initializes its rows as :func:`allocate_rows` does (an ``init`` array copied
    in); a name opens another process's block, refused unless it was made with the same
    ``header``."""
    from xferlib.table.shared import SharedMemory

    if shared is True:
        fill_weights = None if isinstance(init, np.ndarray) else initial_weights(init, rng)
        if isinstance(init, np.ndarray):
            _check_init_array(init, num_rows, dim, dtype)
        memory = SharedMemory.create(num_rows * layout.row_width * dtype.itemsize, header)
    elif isinstance(shared, str):
        memory = SharedMemory.open(shared)
        theirs = memory.header
        if theirs != header:
            memory.close()
            diff = sorted(k for k in set(header) | set(theirs)
                          if header.get(k) != theirs.get(k))
            raise ValueError(
                "shared table " + repr(shared) + " was made with a different "
                "configuration: " + ", ".join(f"{k}={theirs.get(k)!r} there, "
                                              f"{header.get(k)!r} here" for k in diff))
    else:
        raise TypeError(f"shared must be False, True or a shared table's name, got "
                        f"{shared!r}")
    storage = memory.array((num_rows, layout.row_width), dtype)
    weights = storage[:, :dim]
    state = storage[:, layout.state_offset:]
    if shared is True:  # an opened block was initialized by its creator
        for start in range(0, num_rows, INIT_CHUNK_ROWS):
            stop = min(start + INIT_CHUNK_ROWS, num_rows)
            if fill_weights is None:
                weights[start:stop] = init[start:stop]
            else:
                fill_weights(weights[start:stop])
            slots, scalars, steps = split_state(layout, state[start:stop])
            for view in (*slots.values(), *scalars.values()):  # the rest stays zero
                view[...] = initial
    return memory, storage, weights, state


def _check_init_array(init, num_rows, dim, dtype) -> None:
    if init.shape != (num_rows, dim) or init.dtype != dtype:
        raise ValueError(f"init array must have shape {(num_rows, dim)} and dtype {dtype}, "
                         f"got {init.shape} {init.dtype}")
