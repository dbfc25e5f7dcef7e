"""The tables of an :class:`~xferlib.collection.EmbeddingCollection` read and written from the
host: each table's weights and optimizer state, the state dict, and rows written by hand.
A base of the collection (its attributes: ``tables``, ``names``, ``dims``, ``layouts``,
``blocks``, ``buffers``, ``tt_tables``, ``dtype``, the GPU side ``_gpu``)."""

from __future__ import annotations

import numpy as np

from xferlib._backend import array_module, is_cupy_array
from xferlib.collection.numpy_path import table_error
from xferlib.collection.tt_tables import tt_state_arrays, tt_state_shapes
from xferlib.handoff import to_numpy

__all__ = ["TableState"]


class TableState:
    """Weights, optimizer state and state dicts of the collection's tables."""

    def _host_rows(self, t: int) -> np.ndarray:
        """Table ``t``'s ``(num_rows, row_width)`` block as NumPy (a copy for an hbm table on
        the GPU), queued GPU work finished first."""
        self.synchronize()
        buffer = self.buffers[self._placement(t)]
        rows = self.blocks[t].rows(buffer)
        return rows.get() if is_cupy_array(rows) else rows

    def weights(self, table) -> np.ndarray:
        """Table ``table``'s (index or name) weights as a ``(num_rows, dim)`` NumPy array
        (read-only view of host memory, or a copy of GPU memory; a tt table's rows rebuilt
        from its cores, float32)."""
        t = self._index(table)
        if t in self.tt_tables:
            self.synchronize()
            view = self.tt_tables[t].numpy()[:self.tables[t].num_rows]
        else:
            view = self._host_rows(t)[:, :self.dims[t]]
        view.flags.writeable = False
        return view

    def state(self, table, name: str) -> np.ndarray:
        """Optimizer state ``name`` of table ``table``: a slot (``num_rows x dim``), a row
        scalar (``num_rows``) or ``"step"`` (how often each row was updated). A tt table's:
        ``"core<k>.<state>"`` or ``"step"`` (its step counter), copies."""
        t = self._index(table)
        if t in self.tt_tables:
            self.synchronize()
            found = {k.split(".", 1)[1]: to_numpy(v, copy=True)
                     for k, v in tt_state_arrays(self.tt_tables[t], "").items()
                     if k.count(".") == 2 or k == ".step"}
        else:
            found = self._state_views(t, self._host_rows(t))
        if name not in found:
            raise KeyError(f"no optimizer state {name!r}; this collection has {sorted(found)}")
        view = found[name]
        view.flags.writeable = False
        return view

    def tt_table(self, table):
        """The :class:`xferlib.tt.TTTable` of a tt table (index or name)."""
        t = self._index(table)
        if t not in self.tt_tables:
            raise ValueError(f"table {self.names[t]!r} is placed in "
                             f"{self._placement(t)!r}, not 'tt'")
        return self.tt_tables[t]

    def state_names(self) -> tuple:
        """The optimizer state of an hbm or host table's rows (:meth:`state`'s names)."""
        layout = self.layouts[0]
        return (*layout.slots, *layout.row_scalars, "step")

    def state_keys(self) -> list:
        """Every key of :meth:`state_dict`, tables in order."""
        return list(self._expected_state())

    def _state_views(self, t, rows):
        layout = self.layouts[t]
        from xferlib.table.layout import split_state

        state = rows[:, layout.state_offset:layout.state_offset + layout.state_width]
        slots, scalars, steps = split_state(layout, state)
        return {**slots, **scalars, "step": steps}

    def state_dict(self) -> dict:
        """``{"<table>.weight": weights, "<table>.<state>": state}`` as NumPy copies; a tt
        table's cores, their optimizer state and its step counter
        (``"<table>.core<k>"``, ``"<table>.core<k>.<state>"``, ``"<table>.step"``)."""
        out = {}
        self.synchronize()
        for t, name in enumerate(self.names):
            if t in self.tt_tables:
                out.update({k: to_numpy(v, copy=True)
                            for k, v in tt_state_arrays(self.tt_tables[t], name).items()})
                continue
            rows = self._host_rows(t)
            out[f"{name}.weight"] = rows[:, :self.dims[t]].copy()
            for key, view in self._state_views(t, rows).items():
                out[f"{name}.{key}"] = view.copy()
        return out

    def load_state_dict(self, state: dict, partial: bool = False) -> None:
        """Restore every table's weights and state from :meth:`state_dict`'s form. Every
        array's presence and shape is checked before anything is written. ``partial``:
        ``state`` may hold only some of the arrays; those are checked and loaded, the
        others keep their values, and only the tables it names are rewritten."""
        self.check_state_dict(state, partial=partial)
        self._before_host_write()
        for t, name in enumerate(self.names):
            if t in self.tt_tables:
                for key, target in tt_state_arrays(self.tt_tables[t], name).items():
                    if key not in state:
                        continue
                    xp = array_module(target)
                    target[...] = xp.asarray(np.asarray(state[key]), dtype=target.dtype)
                    if xp is not np:  # written on CuPy's stream: done before any step reads
                        xp.cuda.get_current_stream().synchronize()
                continue
            weight = f"{name}.weight"
            if weight not in state and not any(f"{name}.{k}" in state
                                               for k in self.state_names()):
                continue  # a table the state does not name: not touched
            rows = self._host_rows(t).copy()
            if weight in state:
                rows[:, :self.dims[t]] = np.asarray(state[weight])
            for key, view in self._state_views(t, rows).items():
                if f"{name}.{key}" in state:
                    view[...] = np.asarray(state[f"{name}.{key}"])
            buffer = self.buffers[self._placement(t)]
            target = self.blocks[t].rows(buffer)
            if is_cupy_array(target):
                target.set(rows)
            else:
                target[...] = rows

    def write_rows(self, table, rows, values) -> None:
        """Overwrite the weights of ``rows`` (integers) of an hbm or host table with
        ``values`` (``(len(rows), dim)``), their optimizer state kept: a padding row zeroed,
        weights given as an array (``HostTable.scatter``'s twin). Checked before anything is
        written; queued GPU work finishes first and cached rows are dropped."""
        t = self._index(table)
        if t in self.tt_tables:
            raise ValueError(f"table {self.names[t]!r} is a tt table: its rows are products "
                             f"of its cores and cannot be written one by one")
        rows = np.asarray(rows)
        if rows.dtype.kind not in "iu" or rows.ndim != 1:
            raise TypeError(f"rows must be a 1-D integer array, got {rows.dtype} of shape "
                            f"{rows.shape}")
        values = np.asarray(values)
        if values.shape != (rows.shape[0], self.dims[t]):
            raise ValueError(f"values must have shape {(rows.shape[0], self.dims[t])}, got "
                             f"{values.shape}")
        num_rows = self.tables[t].num_rows
        bad = (rows < 0) | (rows >= num_rows)
        if bad.any():
            k = int(np.argmax(bad))
            raise table_error(self, t, k, int(rows[k]))
        self._before_host_write()
        target = self.blocks[t].weights(self.buffers[self._placement(t)])
        if is_cupy_array(target):
            import cupy

            target[cupy.asarray(rows)] = cupy.asarray(values, dtype=self.dtype)
            cupy.cuda.get_current_stream().synchronize()  # done before any step reads
        else:
            target[rows] = values

    def _before_host_write(self) -> None:
        """Queued GPU work done and the cache emptied before rows are written from the host:
        no cached row may outlive the write, and staged copies of an earlier forward are
        stale."""
        if self._gpu is not None:
            self._gpu.synchronize(drop_cache=True)
            self._gpu.writes += 1

    def check_state_dict(self, state: dict, partial: bool = False) -> None:
        """ValueError unless ``state`` holds exactly this collection's arrays (``partial``:
        some of them), each of its shape and numeric (what :meth:`load_state_dict` checks
        before writing; a sharded collection checks every rank's part before any rank
        loads)."""
        expected = self._expected_state()
        missing = [] if partial else sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        if missing or unexpected:
            raise ValueError(f"state_dict does not match this collection: missing {missing}, "
                             f"unexpected {unexpected}")
        for key, shape in expected.items():
            if key not in state:
                continue
            if np.shape(state[key]) != shape:
                raise ValueError(f"{key} must have shape {shape}, got {np.shape(state[key])}")
            dtype = getattr(state[key], "dtype", None)
            try:
                dtype = np.asarray(state[key]).dtype if dtype is None else np.dtype(dtype)
            except TypeError:  # another framework's dtype: converted when loaded
                continue
            if dtype.kind not in "fiub":
                raise ValueError(f"{key} must hold numbers, got dtype {dtype}")

    def _expected_state(self) -> dict:
        """``{state_dict key: shape}``, tables in order."""
        return dict(self._state_entries())

    def _state_entries(self) -> list:
        """``[(state_dict key, shape)]``, tables in order."""
        entries = []
        for t, name in enumerate(self.names):
            if t in self.tt_tables:
                entries += list(tt_state_shapes(self.tt_tables[t], name).items())
                continue
            entries.append((f"{name}.weight", (self.tables[t].num_rows, self.dims[t])))
            for key, view in self._state_views(t, np.empty((1, self.layouts[t].row_width),
                                                           self.dtype)).items():
                entries.append((f"{name}.{key}", (self.tables[t].num_rows,) + view.shape[1:]))
        return entries

    def _refuse_shared_state_keys(self) -> None:
        """Two tables whose state keys meet (a tt table ``e``'s ``e.core0.sum`` and a table
        named ``e.core0``'s ``sum``) would share one entry of :meth:`state_dict`."""
        keys = [key for key, _ in self._state_entries()]
        shared = sorted({key for key in keys if keys.count(key) > 1})
        if shared:
            raise ValueError(f"table names {self.names} give two tables the state key(s) "
                             f"{shared}: rename a table")
