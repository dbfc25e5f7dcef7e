"""Checkpoints: a directory holding everything a run needs to continue as if never stopped.

    PATH/LATEST                 the name of the complete step directory to load
    PATH/step-<n>/meta.json     configuration, the data stream's position (steps done), history
    PATH/step-<n>/state.pt|npz  MLPs + flat optimizer state, the embedding collection (every
                                table's weights and Adagrad state, host tables included), TT
                                cores + their optimizer state (torch: torch.save; JAX: npz)
    PATH/step-<n>/host<f>.<name>.npy   a ``--devices`` JAX run's host tables (HostTable)

The click log is a pure function of ``(seed, step)``, so the stream's position is the step.
Crash-safe: a save writes a new step directory beside the old one (every file synced), then
replaces ``LATEST`` atomically (``xferlib.atomic_write``: a temporary file, synced, renamed,
the directory synced), then removes older step directories. A crash at any point leaves
``LATEST`` naming a complete checkpoint: the old one until the switch, the new one after.
(A checkpoint written as one flat directory, ``PATH/meta.json``, still loads.) Loading
checks the configuration first and raises ValueError naming every difference, before
anything is read into the model.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

import xferlib

FORMAT = "xferlib-dlrm-2"  # 2: the tables are one embedding collection
LATEST = "LATEST"


def _state_file(framework):
    return "state.pt" if framework == "torch" else "state.npz"


def _sync(path) -> None:
    """Flush a written file (or a directory's entries) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def current(path) -> str:
    """The directory of the checkpoint at ``path``: the step directory ``LATEST`` names, or
    ``path`` itself for a checkpoint written as one flat directory."""
    path = os.fspath(path)
    latest = os.path.join(path, LATEST)
    if os.path.isfile(latest):
        with open(latest) as fh:
            name = fh.read().strip()
        if os.path.basename(name) != name or not name.startswith("step-"):
            raise ValueError(f"--load {path}: {LATEST} names {name!r}, not a step directory")
        return os.path.join(path, name)
    return path


def save(path, run, framework, config, step, history) -> None:
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--save {path} exists and is not a directory")
    os.makedirs(path, exist_ok=True)
    name = f"step-{step:09d}"
    tmp = os.path.join(path, f".{name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        files = [os.path.join(tmp, _state_file(framework))]
        run.save_state(files[0])
        for f, table in run.host_tables().items():
            arrays = {"weights": table.numpy(),
                      **{name_: table.state(name_) for name_ in table.state_names()}}
            for key, array in arrays.items():
                files.append(os.path.join(tmp, f"host{f}.{key}.npy"))
                np.save(files[-1], array)
        files.append(os.path.join(tmp, "meta.json"))
        with open(files[-1], "w") as fh:
            json.dump({"format": FORMAT, "config": config, "step": step, "history": history},
                      fh, indent=1)
        for file in files:
            _sync(file)
        final = os.path.join(path, name)
        shutil.rmtree(final, ignore_errors=True)  # a step directory LATEST does not name
        os.replace(tmp, final)
        _sync(path)
        xferlib.atomic_write(os.path.join(path, LATEST), lambda fh: fh.write(name.encode()),
                             what="the checkpoint's LATEST pointer")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for entry in os.listdir(path):  # older steps, once LATEST names the new one
        if entry != name and (entry.startswith("step-") or entry == "meta.json"
                              or entry.startswith(".step-")):
            full = os.path.join(path, entry)
            shutil.rmtree(full) if os.path.isdir(full) else os.remove(full)


def read_meta(path, config) -> dict:
    """The checkpoint's metadata; ValueError if it is not one or was made for another
    configuration (each differing setting named)."""
    meta_path = os.path.join(current(path), "meta.json")
    if not os.path.isfile(meta_path):
        raise ValueError(f"--load {path}: not a checkpoint of this example (no meta.json)")
    with open(meta_path) as fh:
        try:
            meta = json.load(fh)
        except json.JSONDecodeError as err:
            raise ValueError(f"--load {path}: unreadable meta.json ({err})") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"--load {path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    theirs = meta["config"]
    diffs = [f"{k}: checkpoint {theirs.get(k)!r}, this run {config[k]!r}"
             for k in sorted(set(config) | set(theirs)) if theirs.get(k) != config.get(k)]
    if diffs:
        raise ValueError(f"--load {path} was saved by another configuration; nothing was "
                         f"loaded or overwritten. Differences: " + "; ".join(diffs))
    return meta


def check_jax_tt_layout(path, mesh: bool) -> None:
    """ValueError where a JAX checkpoint with TT tables was written on the other side of
    ``--devices 1`` / ``--devices N``: with TT tables N devices run the per-table mesh design
    (``jax_mesh_run.py``, its other tables saved as ``hbm.<i>``), one device the collection
    (``coll.<name>``), and neither state loads into the other."""
    state = os.path.join(current(path), _state_file("jax"))
    if not os.path.isfile(state):
        return
    with np.load(state) as z:
        names = z.files
    saved_mesh = any(n.startswith("hbm.") for n in names)
    saved_one = any(n.startswith("coll.") for n in names)
    if (mesh and saved_one) or (not mesh and saved_mesh):
        saved, needs = (("on one device", "without --devices") if saved_one else
                        ("with --devices N > 1", "with --devices N > 1"))
        raise ValueError(f"--load {path} holds a JAX run with TT tables saved {saved}: one "
                         f"device and N devices keep TT runs' tables differently, so continue "
                         f"it {needs}; nothing was loaded or overwritten")


def load(path, run, framework) -> None:
    path = current(path)
    run.load_state(os.path.join(path, _state_file(framework)))
    for f, table in run.host_tables().items():
        weights = np.load(os.path.join(path, f"host{f}.weights.npy"), mmap_mode="r")
        state = {name: np.load(os.path.join(path, f"host{f}.{name}.npy"), mmap_mode="r")
                 for name in table.state_names()}
        table.restore(weights, state)
