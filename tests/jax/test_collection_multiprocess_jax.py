"""ShardedCollection across processes (``jax.distributed``, one device a process): each
process builds and trains only its own rank's shards, and the processes together train what
one unsharded collection trains on the global batch; ``state_dict`` gathers every table
across the processes, and a checkpoint saved by the processes loads into one process. Run on
the CPU backend (gloo collectives), each process a fresh interpreter
(``collection_multiprocess_worker.py``)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.jax.worker_cases import results_of
from xferlib.testing import free_port, gpu_count

pytest.importorskip("jax")

WORKER = Path(__file__).with_name("collection_multiprocess_worker.py")
TOLERANCE = 2e-5  # row-wise: partial sums added per owner, equal to float32 rounding


def _check(tmp_path, processes, platform):
    port = free_port()
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, str(WORKER), "--process", str(p), "--processes",
                               str(processes), "--port", str(port), "--platform", platform,
                               "--out", str(tmp_path / "ckpt")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for p in range(processes)]
    outputs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outputs):
        results = results_of(p.returncode, out, err)
        assert len(results) == 5, results
        for case, value in results.items():
            assert not isinstance(value, str), f"{case}: {value}"
            # table-wise on the CPU: the same bits; the GPU's sums place their chunk edges
            # by the owner's batch, so they may round apart
            exact = case.startswith("table_wise") and platform == "cpu"
            limit = 0.0 if exact else TOLERANCE
            assert value <= limit, f"{case} on {processes} processes differs by {value}"


@pytest.mark.parametrize("processes", [2, 3])
def test_processes_train_what_one_collection_trains(tmp_path, processes):
    _check(tmp_path, processes, "cpu")


@pytest.mark.gpu
def test_processes_on_two_gpus_train_what_one_collection_trains(tmp_path):
    """A process per GPU (NCCL through XLA), each rank's shards on its own GPU."""
    if gpu_count() < 2:
        pytest.skip(f"needs 2 GPUs, found {gpu_count()}")
    _check(tmp_path, 2, "gpu")
