"""Saving a host table to a file and loading it back.

:func:`save_table` writes the format of ``io_format.py`` (version 2: a checksummed header, then
the raw arrays) to a temporary file in the target's directory, syncs it, renames it over the
target and syncs the directory, so a crash leaves the old file or the new one, never a torn
one. The target must be a regular file or absent: a device, FIFO, socket or directory is
refused, never renamed over. The new file gets the permissions ``open(path, "w")`` would give
(a new one ``0o666`` less the umask, an existing one its mode). Every error names the path
the caller gave.

:func:`load_table` reads version 2 and the ``.npz`` files of format 1 (:data:`FORMAT`) that
earlier versions wrote, streaming either into the table's own arrays: memory holds the table
and a few chunk buffers, never a second copy.
"""

from __future__ import annotations

import json
import os

import numpy as np

from xferlib.atomic import atomic_write
from xferlib.table import io_format
from xferlib.table.io_format import read_header, read_table_file, write_table_file

FORMAT = "xferlib.HostTable/1"  # the .npz format of earlier versions, still read



def table_config(table) -> dict:
    """The HostTable constructor's arguments that rebuild ``table`` (the saved configuration)."""
    return dict(num_rows=table.num_rows, dim=table.dim, dtype=table.dtype.name,
                optimizer=table.optimizer, optimizer_kwargs=table.hyper or None,
                cache_rows=table.cache_rows, cache_policy=table.cache_policy,
                cache_admission=table.cache_admission)


# ------------------------------------------------------------------ save


def save_table(table, path, arrays: dict) -> None:
    """Write ``table``'s configuration and its named host ``arrays`` (weights, each state
    array; the table already flushed) to ``path``, crash-safely (``xferlib.atomic_write``:
    a temporary file beside it, synced, renamed over it, the directory synced; devices,
    FIFOs, sockets and directories refused; every error names ``path``)."""

    def write(f) -> None:
        fd = f.fileno()
        write_table_file(fd, table_config(table), arrays)
        os.fsync(fd)
        io_format.drop_cached(fd)  # synced: the pages are clean copies of the table

    atomic_write(path, write, what="the table")


# ------------------------------------------------------------------ load


def load_table(path, build):
    """The table saved at ``path``. ``build(config)`` makes an empty table from the saved
    constructor arguments and returns ``(table, arrays)``, its named host arrays to fill;
    the file is streamed into them. ValueError for a truncated, corrupt or foreign file."""
    path = os.fspath(path)
    fd = io_format.open_for_reading(path, "a table", "HostTable")
    try:
        head = os.read(fd, 8)
        if head.startswith(b"PK"):  # a zip archive: format 1 (.npz)
            return _load_npz(path, build)
        meta = read_header(fd, path)
        kind = meta["config"].get("kind")
        if kind is not None:  # the same file format holds other objects (a collection)
            raise ValueError(f"{path} holds a {kind}, not a HostTable: load it with "
                             f"{kind}.load")
        table, arrays = _build(build, dict(meta["config"]), path)
        try:
            io_format.check_arrays(meta, arrays, path)
            read_table_file(fd, meta, arrays, path)
        except BaseException:
            table.close()
            raise
        return table
    finally:
        os.close(fd)


def _build(build, config: dict, path: str):
    """``build(config)``, a configuration it refuses (an option of a newer xferlib, a value
    out of range) refused with a ValueError naming ``path``."""
    try:
        return build(config)
    except (TypeError, ValueError) as err:
        raise ValueError(f"cannot load a table from {path}: its configuration does not make a "
                         f"HostTable ({type(err).__name__}: {err})") from None


def _load_npz(path: str, build):
    """A table from a format-1 ``.npz``: members ``meta`` (JSON bytes), ``weights`` and
    ``state`` (the state block as it sat in host RAM), streamed member by member."""
    import zipfile

    def refused(err):
        return ValueError(f"{path} is truncated or not an xferlib HostTable file: "
                          f"{type(err).__name__}: {err}")

    try:
        with zipfile.ZipFile(path) as archive:
            names = sorted(n[:-4] if n.endswith(".npy") else n for n in archive.namelist())
            if names != ["meta", "state", "weights"]:
                raise ValueError(f"{path} is not an xferlib HostTable file (arrays {names})")
            with archive.open("meta.npy") as member:
                meta = json.loads(bytes(np.lib.format.read_array(member)).decode())
            if meta.get("format") != FORMAT:
                raise ValueError(f"{path} is not an xferlib HostTable file (format "
                                 f"{meta.get('format')!r})")
            table, arrays = _build(build, dict(
                num_rows=meta["num_rows"], dim=meta["dim"], dtype=meta["dtype"],
                optimizer=meta["optimizer"], optimizer_kwargs=meta["hyper"] or None,
                cache_rows=meta["cache_rows"], cache_policy=meta["cache_policy"],
                cache_admission=meta.get("cache_admission", "second-sight")), path)
            try:
                _npz_into(archive, path, table, arrays)
            except BaseException:
                table.close()
                raise
            return table
    except (zipfile.BadZipFile, EOFError, KeyError, json.JSONDecodeError,
            UnicodeDecodeError) as err:
        raise refused(err) from err
    except OSError as err:
        if isinstance(err, FileNotFoundError):
            raise
        raise refused(err) from err


def _npz_into(archive, path, table, arrays) -> None:
    from xferlib.table.layout import split_state

    layout = table.layout
    dtype = np.dtype(table.dtype)

    def weights(start, stop, rows):
        arrays["weights"][start:stop] = rows

    def state(start, stop, rows):
        slots, scalars, steps = split_state(layout, rows)
        for name, part in {**slots, **scalars, "step": steps}.items():
            arrays[name][start:stop] = part

    # Format 1 saved the state block as it sat in RAM: the rest of each storage row after the
    # weights (row padding included), or state_width wide for a table made from an init array.
    state_widths = (layout.row_width - layout.state_offset, layout.state_width)
    for member, widths, fill in (("weights", (table.dim,), weights),
                                 ("state", state_widths, state)):
        with archive.open(member + ".npy") as f:
            try:
                version = np.lib.format.read_magic(f)
                shape, fortran, found = (np.lib.format.read_array_header_1_0 if version ==
                                         (1, 0) else np.lib.format.read_array_header_2_0)(f)
            except ValueError as err:
                raise ValueError(f"{path} is truncated or not an xferlib HostTable file: "
                                 f"its {member!r} array: {err}") from None
            width = shape[1] if len(shape) == 2 else None
            if shape[:1] != (table.num_rows,) or width not in widths or fortran or (
                    found != dtype):
                raise ValueError(f"{path}: its {member!r} array is {found} {shape}, which does "
                                 f"not match its configuration ({dtype} "
                                 f"{(table.num_rows, widths[0])})")
            step = max(1, io_format.CHUNK_BYTES // (width * dtype.itemsize))
            for start in range(0, table.num_rows, step):
                stop = min(table.num_rows, start + step)
                data = f.read((stop - start) * width * dtype.itemsize)
                if len(data) < (stop - start) * width * dtype.itemsize:
                    raise EOFError(f"its {member!r} array ends early")
                fill(start, stop, np.frombuffer(data, dtype).reshape(stop - start, width))
            f.read()  # to the member's end: zipfile checks its CRC-32 there
