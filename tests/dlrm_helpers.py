"""What the tests of examples/dlrm.py share: the script run in a subprocess, its exit status
checked, and the example's ``dlrm_parts`` package imported from examples/."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
SCRIPT = EXAMPLES / "dlrm.py"


def _run(*args, timeout=240):
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    return subprocess.run([sys.executable, str(SCRIPT), "--quiet", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env)


def _ok(result):
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def resumed_equals_full(directory, auc_abs: float = 1e-6) -> dict:
    """The run resumed from a checkpoint (``resumed.json`` in ``directory``) against the
    uninterrupted one (``full.json``): 24 steps in all, the same logloss and AUC (within
    ``auc_abs``: a pair of evaluation samples swapping ranks moves the AUC by about
    1 / (positives x negatives)). Returns the resumed run's JSON."""
    full = json.loads((directory / "full.json").read_text())
    resumed = json.loads((directory / "resumed.json").read_text())
    assert resumed["runs"][0]["total_steps"] == 24
    assert resumed["logloss"] == pytest.approx(full["logloss"], rel=1e-6)
    assert resumed["auc"] == pytest.approx(full["auc"], abs=auc_abs)
    return resumed


def import_parts():
    """Yields ``dlrm_parts`` (its config and data imported) with examples/ on ``sys.path``,
    taking examples/ off again when resumed: the body of each test module's ``parts``
    fixture."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        import dlrm_parts.config
        import dlrm_parts.data

        yield dlrm_parts
    finally:
        sys.path.remove(str(EXAMPLES))
