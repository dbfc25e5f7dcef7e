"""Saving an embedding collection to one file and loading it back.

The file is the host tables' format (``xferlib/table/io_format.py``, version 2: a checksummed
header, then each named array raw, with its CRC-32), written crash-safely by
:func:`xferlib.atomic_write` (temporary file, fsync, rename, fsync of the directory). Its
``config`` is the collection's (``"kind": "xferlib.EmbeddingCollection"``, every table's
:class:`~xferlib.collection.TableConfig`, the optimizer and each table's hyperparameters as
they are now, pooling, dtype); its arrays are the :meth:`EmbeddingCollection.state_dict`
keys (``"<table>.weight"``, ``"<table>.<state>"``; a tt table's ``"<table>.core<k>"``,
``"<table>.core<k>.<state>"``, ``"<table>.step"``), so a file does not depend on how rows
and state are laid out in memory, nor on the device: a collection saved on the GPU loads on
the CPU and back.

Memory: a save streams each table's rows from where they live through the format's two chunk
buffers (GPU tables a chunk at a time); a load builds the collection and streams the file into
its buffers, so it needs the collection plus the buffers (and, on the GPU, a host copy of the
HBM tables, which are staged in host RAM and copied over once checked). A truncated, corrupt
or mismatched file is refused with a ValueError naming the file and what differs, before the
new collection is returned.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from xferlib.atomic import atomic_write
from xferlib.collection.config import TableConfig
from xferlib.collection.storage import TableBlock
from xferlib.collection.tt_tables import tt_state_arrays
from xferlib.table.io_format import (check_arrays, open_for_reading, read_header,
                                     read_table_file, write_table_file)

__all__ = ["KIND", "collection_config", "save_collection", "load_collection"]

KIND = "xferlib.EmbeddingCollection"  # the config's "kind": what the file holds


def _plain(value):
    """JSON's form of a config value (tuples as lists)."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _tuples(value):
    """A config value back from JSON: lists as tuples (``init``, ``betas``)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def collection_config(coll) -> dict:
    """What rebuilds ``coll`` (the saved configuration): the constructor's arguments, and
    each table's hyperparameters as they are now (after any ``set_hyper``)."""
    return _plain(dict(
        kind=KIND, tables=[dataclasses.asdict(c) for c in coll.tables],
        optimizer=coll.optimizer, hypers=list(coll.hypers), pooling=coll.pooling,
        dtype=coll.dtype.name))


# ------------------------------------------------------------------ named arrays


def _named(name: str, layout, rows) -> dict:
    """``{"<name>.weight": ..., "<name>.<state>": ...}``: views of a NumPy
    ``(num_rows, row_width)`` block of one table's rows."""
    block = TableBlock(0, rows.shape[0], layout)
    flat = rows.reshape(-1)
    slots, scalars, steps = block.split(flat)
    return {f"{name}.weight": block.weights(flat),
            **{f"{name}.{k}": v for k, v in {**slots, **scalars, "step": steps}.items()}}


class _DeviceRows:
    """One named array of a table in GPU memory, read a chunk of rows at a time (the
    format's writer slices its arrays by rows): no host copy of the whole table."""

    def __init__(self, key: str, name: str, layout, rows):
        self.key, self.name, self.layout, self.rows = key, name, layout, rows
        sample = _named(name, layout, np.zeros((1, layout.row_width), rows.dtype))[key]
        self.dtype, self.shape = sample.dtype, (rows.shape[0], *sample.shape[1:])

    def __getitem__(self, rows: slice) -> np.ndarray:
        chunk = np.ascontiguousarray(self.rows[rows].get())
        return _named(self.name, self.layout, chunk)[self.key]


def _arrays(coll, stage: bool = False):
    """``(arrays, staged)``: every table's named arrays, tables in order. Host rows are
    views of the collection's buffers. GPU rows are :class:`_DeviceRows` readers, or with
    ``stage`` views of new host blocks, listed in ``staged`` as ``(host, device)`` pairs to
    copy over once filled."""
    arrays, staged = {}, []
    for t, name in enumerate(coll.names):
        if t in coll.tt_tables:  # cores, optimizer state and step counter (tt_tables.py)
            for key, value in tt_state_arrays(coll.tt_tables[t], name).items():
                if isinstance(value, np.ndarray):
                    arrays[key] = value
                elif stage:
                    arrays[key] = np.zeros(value.shape, value.dtype)
                    staged.append((arrays[key], value))
                else:  # small next to the rows they replace: one copy each
                    arrays[key] = value.get()
            continue
        block = coll.blocks[t]
        rows = block.rows(coll.buffers[coll.tables[t].placement])
        if isinstance(rows, np.ndarray):
            arrays.update(_named(name, block.layout, rows))
        elif stage:
            host = np.zeros(rows.shape, coll.dtype)
            staged.append((host, rows))
            arrays.update(_named(name, block.layout, host))
        else:
            for key in _named(name, block.layout, np.zeros((1, rows.shape[1]), coll.dtype)):
                arrays[key] = _DeviceRows(key, name, block.layout, rows)
    return arrays, staged


# ------------------------------------------------------------------ save / load


def save_collection(coll, path) -> None:
    """Write ``coll``'s configuration and every table's weights and optimizer state to
    ``path``, crash-safely (see :func:`xferlib.atomic_write`). Queued GPU work finishes and
    cached rows are written back first."""
    coll.synchronize()
    arrays, _ = _arrays(coll)
    config = collection_config(coll)
    atomic_write(path, lambda f: write_table_file(f.fileno(), config, arrays),
                 what="the collection")


def load_collection(path, build, *, device=None):
    """The collection saved at ``path``: ``build(**kwargs)`` makes an empty one from the
    saved constructor arguments (``device`` passed on), then the file streams into it and its
    hyperparameters are restored. ValueError naming ``path`` for a truncated, corrupt or
    foreign file and for one that does not match the collection its configuration makes."""
    path = os.fspath(path)
    fd = open_for_reading(path, "a collection", "collection")
    try:
        meta = read_header(fd, path)
        config = meta["config"]
        if config.get("kind") != KIND:
            raise ValueError(f"{path} holds a HostTable, not an EmbeddingCollection: load it "
                             f"with xferlib.HostTable.load" if "kind" not in config else
                             f"{path} holds {config['kind']!r}, not an EmbeddingCollection")
        try:
            tables = [TableConfig(**{k: _tuples(v) for k, v in c.items()})
                      for c in config["tables"]]
            hypers = [{k: _tuples(v) for k, v in h.items()} for h in config["hypers"]]
            if len(hypers) != len(tables):
                raise ValueError(f"{len(hypers)} tables' hyperparameters for {len(tables)} "
                                 f"tables")
            # Built zero-filled: the file overwrites every row, and the random initializers'
            # working chunks would be the load's largest allocation. The tables' own configs
            # (their init included) are put back after.
            zeroed = [dataclasses.replace(c, init="zeros") for c in tables]
            # Built with one table's hyperparameters, each table's own set below. Those choose
            # the state layout (sgd's momentum, adam's amsgrad: the optimizer's defaults would
            # lay out fewer slots); a tt table's, if any, as the others would not fit it (it
            # takes only lr and eps, so every table's layout is then the defaults').
            base = next((h for c, h in zip(tables, hypers) if c.placement == "tt"), hypers[0])
            coll = build(zeroed, config["optimizer"], base, pooling=config["pooling"],
                         dtype=config["dtype"], device=device, seed=0)
            coll.tables = tuple(tables)
            for t, h in enumerate(hypers):  # each table's as saved (per-table lr, set_hyper)
                coll.set_hyper(t, **h)
        except (KeyError, TypeError, IndexError, AttributeError) as err:
            raise ValueError(f"{path} is corrupt: its collection configuration is incomplete "
                             f"({type(err).__name__}: {err})") from None
        except ValueError as err:  # a value the constructor refuses, named with the file
            raise ValueError(f"cannot load a collection from {path}: {err}") from None
        arrays, staged = _arrays(coll, stage=True)
        check_arrays(meta, arrays, path)
        read_table_file(fd, meta, arrays, path)
        for host, device_rows in staged:
            device_rows.set(host)
        return coll
    finally:
        os.close(fd)
