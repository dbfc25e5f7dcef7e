"""ShardedCollection (a collection's tables sharded by a plan over a JAX mesh, lookups and
pooled rows moved by all_to_all) trains what one unsharded collection trains on the global
batch: 2 and 3 forced host devices, table-wise and row-wise plans; on GPUs, a mesh of each
GPU the machine has (one GPU: a mesh of one, the callbacks' GPU path).

JAX fixes its device count when its backends start, so the checks run in a fresh process
(``collection_dist_worker.py``, about 10 s each) with N forced host devices."""

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.jax.worker_cases import results_of
from xferlib.testing import gpu_count

pytest.importorskip("jax")

WORKER = Path(__file__).with_name("collection_dist_worker.py")
TOLERANCE = 2e-5  # float32: a row-wise table's partial sums are added per owner
CASES = (["table_wise-sgd", "table_wise-rowwise_adagrad", "table_wise-adam",
          "table_wise-adagrad", "table_wise-adamw", "table_wise-adamax", "table_wise-rmsprop",
          "table_wise-adadelta", "row_wise-sgd", "row_wise-rowwise_adagrad",
          "table_wise-mean", "table_wise-weighted", "ranks-without-shards", "bad-index",
          "checkpoint-reshard", "table_wise-bounded", "table_wise-bounded-full",
          "row_wise-bounded-mean", "too-long-bag", "too-long-bag-bad-offsets",
          "bad-offsets-start", "bad-offsets-end", "bad-offsets-decreasing",
          "table_wise-recorded", "row_wise-recorded"])
EXACT = [c for c in CASES if not c.startswith("row_wise")]


@functools.lru_cache(maxsize=None)
def _run(devices: int, platform: str = "cpu") -> dict:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, str(WORKER), "--devices", str(devices),
                           "--platform", platform],
                          capture_output=True, text=True, env=env, timeout=300)
    return results_of(proc.returncode, proc.stdout, proc.stderr, CASES)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("devices", [2, 3])
def test_sharded_equals_one_collection_on_the_global_batch(devices, case):
    result = _run(devices)[case]
    assert not isinstance(result, str), f"{case} on {devices} devices: {result}"
    # Table-wise plans: each table pooled and updated by one owner in the global batch's
    # order, so the pooled rows, weights and optimizer state are bit for bit equal.
    limit = 0.0 if case in EXACT else TOLERANCE
    assert result <= limit, f"{case} on {devices} devices differs by {result}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("devices", [1, 2])
def test_sharded_on_gpus_equals_one_collection(devices, case):
    """Each rank's shards on its own GPU, the kernels on XLA's stream there."""
    if gpu_count() < devices:
        pytest.skip(f"needs {devices} GPUs, found {gpu_count()}")
    result = _run(devices, "gpu")[case]
    assert not isinstance(result, str), f"{case} on {devices} GPUs: {result}"
    # The GPU's gradient sums split each row's sorted run into fixed chunks of positions:
    # an owner's shorter batch places the chunk edges elsewhere, so sums may round apart.
    assert result <= TOLERANCE, f"{case} on {devices} GPUs differs by {result}"


@pytest.mark.parametrize("value", [1.0, None])
def test_load_state_dict_refuses_a_scalar_before_any_change(value):
    """A state entry without rows (a scalar, None) is a ValueError naming it, not a bare
    IndexError from its shape, and no table changes (the first table's new rows included)."""
    import numpy as np

    from xferlib.adapters.jax import ShardedCollection

    sharded = ShardedCollection([(4, 2), (3, 2)], "adam", {"lr": 0.1}, world_size=1)
    saved = sharded.state_dict()
    bad = dict(saved, **{"t0.weight": saved["t0.weight"] + 1})
    bad[sorted(k for k in saved if k.startswith("t1."))[-1]] = value
    with pytest.raises(ValueError, match="must be an array of rows"):
        sharded.load_state_dict(bad)
    for key, before in saved.items():
        np.testing.assert_array_equal(sharded.state_dict()[key], before)


@pytest.mark.parametrize("max_bag_size", [None, 2])
def test_sharded_step_compiles_without_loops(max_bag_size):
    """The routing (each lookup's bag and shard, the owner's batch layout) is straight-line
    code: a ``while`` in the step would, on a GPU, launch its body from the host at every
    iteration (``jnp.searchsorted``'s default method is such a loop)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from xferlib.adapters.jax import ShardedCollection, collection_anchor

    sharded = ShardedCollection([(10, 4), (7, 4)], "adagrad", {"lr": 0.1}, world_size=1,
                                max_bag_size=max_bag_size)
    mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("x",))

    def loss(anchor, idx, off):
        return sharded(idx, off, anchor=anchor, axis_name="x").sum()

    step = jax.jit(jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=(P(), P("x"), P("x")),
                                 out_specs=P()))
    idx, off = jnp.array([1, 1, 3, 6, 0], jnp.int32), jnp.array([0, 2, 3, 4, 5], jnp.int32)
    lowered = step.lower(collection_anchor(), idx, off)
    assert "stablehlo.while" not in lowered.as_text()
    assert " while(" not in lowered.compile().as_text()
    before = np.array(sharded.table_weights(1)[6])
    step(collection_anchor(), idx, off)  # and it runs: the summed loss's rows go down
    assert (np.array(sharded.table_weights(1)[6]) < before).all()
