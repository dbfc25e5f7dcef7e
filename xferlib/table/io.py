"""Saving a host table to a ``.npz`` file and loading it back.

The file holds three arrays: ``meta`` (the configuration as JSON bytes, with a format tag),
``weights`` and ``state`` (the table's storage as it sits in host RAM, layout included). A
save is atomic: written to a temporary file in the same directory, synced, then renamed.
"""

from __future__ import annotations

import json
import os
import tempfile

import numpy as np

FORMAT = "xferlib.HostTable/1"


def save_table(table, path, weights, state) -> None:
    """Write ``table``'s configuration and its host arrays ``weights`` and ``state`` (the
    table already flushed) to ``path``."""
    layout = table.layout
    meta = dict(format=FORMAT, num_rows=table.num_rows, dim=table.dim,
                dtype=table.dtype.name, optimizer=table.optimizer, hyper=table.hyper,
                cache_rows=table.cache_rows, cache_policy=table.cache_policy,
                cache_admission=table.cache_admission,
                slots=list(layout.slots), row_scalars=list(layout.row_scalars))
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".xferlib-", suffix=".npz.tmp")
    except OSError as err:  # name the path asked for, not the temporary file
        raise type(err)(err.errno, f"cannot save the table to {path} ({err.strerror}: "
                        f"the directory {directory} must exist and be writable)") from None
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
                     weights=weights, state=state)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_table(path):
    """``(config, weights, state)`` read from ``path``: ``config`` the HostTable constructor's
    arguments, ``weights`` and ``state`` the saved host arrays. ValueError for a truncated or
    foreign file."""
    import zipfile

    path = os.fspath(path)
    try:
        data = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as err:  # not an .npz at all
        raise ValueError(f"{path} is truncated or not an xferlib HostTable file: "
                         f"{err}") from err
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise ValueError(f"{path} is not an xferlib HostTable file (a single array, not the "
                         f"archive save() writes)")
    try:
        with data:
            if set(data.files) != {"meta", "weights", "state"}:
                raise ValueError(f"{path} is not an xferlib HostTable file "
                                 f"(arrays {sorted(data.files)})")
            meta = json.loads(bytes(data["meta"]).decode())
            if meta.get("format") != FORMAT:
                raise ValueError(f"{path} is not an xferlib HostTable file "
                                 f"(format {meta.get('format')!r})")
            config = dict(num_rows=meta["num_rows"], dim=meta["dim"], dtype=meta["dtype"],
                          optimizer=meta["optimizer"], optimizer_kwargs=meta["hyper"] or None,
                          cache_rows=meta["cache_rows"], cache_policy=meta["cache_policy"],
                          cache_admission=meta.get("cache_admission", "second-sight"))
            weights, state = data["weights"], data["state"]
    except (zipfile.BadZipFile, EOFError, OSError, KeyError,
            json.JSONDecodeError, UnicodeDecodeError) as err:
        if isinstance(err, FileNotFoundError):
            raise
        raise ValueError(f"{path} is truncated or not an xferlib HostTable file: "
                         f"{err}") from err
    return config, weights, state
