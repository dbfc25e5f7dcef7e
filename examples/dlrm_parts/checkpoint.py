"""Checkpoints: a directory holding everything a run needs to continue as if never stopped.

    PATH/meta.json              configuration, the data stream's position (steps done), history
    PATH/state.pt | state.npz   MLPs + flat optimizer state, the embedding collection (every
                                table's weights and Adagrad state, host tables included), TT
                                cores + their optimizer state (torch: torch.save; JAX: npz)
    PATH/host<f>.<name>.npy     a ``--devices`` JAX run's host tables (HostTable)

The click log is a pure function of ``(seed, step)``, so the stream's position is the step.
A checkpoint is written to a temporary directory and renamed into place (an old one is
replaced only once the new one is complete). Loading checks the configuration first and
raises ValueError naming every difference, before anything is read into the model.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

FORMAT = "xferlib-dlrm-2"  # 2: the tables are one embedding collection


def _state_file(framework):
    return "state.pt" if framework == "torch" else "state.npz"


def save(path, run, framework, config, step, history) -> None:
    path = os.path.abspath(os.fspath(path))
    tmp = f"{path}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        run.save_state(os.path.join(tmp, _state_file(framework)))
        for f, table in run.host_tables().items():
            np.save(os.path.join(tmp, f"host{f}.weights.npy"), table.numpy())
            for name in table.state_names():
                np.save(os.path.join(tmp, f"host{f}.{name}.npy"), table.state(name))
        with open(os.path.join(tmp, "meta.json"), "w") as fh:
            json.dump({"format": FORMAT, "config": config, "step": step, "history": history},
                      fh, indent=1)
        old = f"{path}.old-{os.getpid()}"
        if os.path.exists(path):
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_meta(path, config) -> dict:
    """The checkpoint's metadata; ValueError if it is not one or was made for another
    configuration (each differing setting named)."""
    meta_path = os.path.join(os.fspath(path), "meta.json")
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


def load(path, run, framework) -> None:
    path = os.fspath(path)
    run.load_state(os.path.join(path, _state_file(framework)))
    for f, table in run.host_tables().items():
        weights = np.load(os.path.join(path, f"host{f}.weights.npy"), mmap_mode="r")
        state = {name: np.load(os.path.join(path, f"host{f}.{name}.npy"), mmap_mode="r")
                 for name in table.state_names()}
        table.restore(weights, state)
