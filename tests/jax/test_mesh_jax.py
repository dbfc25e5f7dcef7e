"""Host tables and TT tables on a JAX device mesh equal one device on the global batch.

JAX fixes its device count when its backends start, and the rest of the suite has started
them by now, so the checks run in a fresh process (``mesh_worker.py``) with N forced host
devices (or N GPUs); each case there trains N devices inside ``jax.shard_map`` and one device
on the global batch from the same start, and reports the largest difference."""

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.jax.worker_cases import results_of
from xferlib.testing import gpu_count

pytest.importorskip("jax")
pytest.importorskip("optax")

from xferlib.table import SPARSE_OPTIMIZERS  # noqa: E402

WORKER = Path(__file__).with_name("mesh_worker.py")
TOLERANCE = 2e-5  # float32: summation order differs (psum of shards vs one sum)
CASES = ([f"host-{o}" for o in SPARSE_OPTIMIZERS]
         + ["host-fewer-rows-than-devices", "host-check_vma-off", "host-scan-ordering",
            "host-views-ready-at-trace", "host-bad-index"]
         + [f"tt-{o}" for o in ("sgd", "adagrad", "adam", "lamb", "lars")]
         + ["tt-weighted", "tt-check_vma-off"])


@functools.lru_cache(maxsize=None)
def _run(devices: int, platform: str) -> dict:
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, str(WORKER), "--devices", str(devices),
                           "--platform", platform], capture_output=True, text=True, env=env,
                          timeout=300)
    return results_of(proc.returncode, proc.stdout, proc.stderr, CASES)


def _check(devices, platform, case):
    result = _run(devices, platform)[case]
    assert not isinstance(result, str), f"{case} on {devices} {platform} devices: {result}"
    assert result <= TOLERANCE, f"{case} on {devices} {platform} devices differs by {result}"


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("devices", [2, 3])
def test_mesh_equals_one_device_on_the_global_batch(devices, case):
    _check(devices, "cpu", case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_two_gpus_equal_one_gpu_on_the_global_batch(case):
    if gpu_count() < 2:
        pytest.skip(f"needs 2 GPUs, found {gpu_count()}")
    _check(2, "gpu", case)


def test_sharded_update_refuses_a_cached_table_and_a_missing_axis():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    import xferlib
    from xferlib.adapters.jax import sharded_host_update

    table = xferlib.HostTable(8, 4, optimizer="sgd", init="zeros")
    with pytest.raises(ValueError, match="not a mesh axis"):
        sharded_host_update(table, jnp.arange(2), jnp.zeros((2, 4)), axis_name="batch")
    cached = xferlib.HostTable(8, 4, optimizer="sgd", init="zeros", cache_rows=4)
    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
    step = jax.shard_map(lambda i: sharded_host_update(cached, i, jnp.zeros((2, 4)),
                                                       axis_name="batch"),
                         mesh=mesh, in_specs=P("batch"), out_specs=P())
    step(jnp.arange(2))  # one device: the cache is fine
    with pytest.raises(ValueError, match="grad_rows must have shape"):
        jax.shard_map(lambda i: sharded_host_update(table, i, jnp.zeros((3, 4)),
                                                    axis_name="batch"),
                      mesh=mesh, in_specs=P("batch"), out_specs=P())(jnp.arange(2))


def test_device_views_share_the_table():
    """Each other device's view of a host table is the same memory, without a cache, and
    follows set_hyper (the GPU path takes these views; the layout is checked here)."""
    import numpy as np

    import xferlib
    from xferlib.adapters.jax._views import on_device

    table = xferlib.HostTable(6, 4, optimizer="adam", init="zeros", cache_rows=2)
    assert on_device(table, 0) is table  # no GPU side yet: the first device is its home
    view = on_device(table, 1)
    assert view is not table and on_device(table, 1) is view
    assert np.shares_memory(view._weights, table._weights)
    assert np.shares_memory(view._state, table._state)
    assert view.cache_rows == 0 and view._gpu is None
    table.set_hyper(lr=0.5)
    assert on_device(table, 1).hyper["lr"] == 0.5
