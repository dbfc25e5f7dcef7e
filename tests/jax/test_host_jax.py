import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import xferlib  # noqa: E402
from xferlib.adapters.jax import host_lookup, host_update  # noqa: E402

ROWS, DIM, N = 64, 8, 48


def _loss(rows, targets):
    return jnp.sum((rows - targets) ** 2)


def _tables(rng, optimizer="adam", hyper=None):
    init = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    hyper = hyper or {"lr": 0.05}
    return (xferlib.HostTable(ROWS, DIM, optimizer=optimizer, optimizer_kwargs=hyper,
                              init=init.copy()),
            xferlib.HostTable(ROWS, DIM, optimizer=optimizer, optimizer_kwargs=hyper,
                              init=init.copy()))


def _reference_step(table, idx, targets):
    rows = table.lookup(idx)
    table.apply_gradients(idx, 2.0 * (rows - targets))  # d/drows of the squared error
    return float(np.sum((rows.astype(np.float64) - targets) ** 2))


def test_jit_training_loop_matches_the_core(device, rng):
    table, reference = _tables(rng)

    @jax.jit
    def train_step(idx, targets):
        rows = host_lookup(table, idx)
        loss, g = jax.value_and_grad(_loss)(rows, targets)
        return loss, host_update(table, idx, g)

    for _ in range(5):
        idx = rng.integers(0, 20, size=N)  # repeats within and across steps
        targets = rng.standard_normal((N, DIM)).astype(np.float32)
        loss, token = train_step(jax.device_put(idx, device), jax.device_put(targets, device))
        jax.block_until_ready(token)
        expected = _reference_step(reference, idx, targets)
        np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    np.testing.assert_allclose(table.numpy(), reference.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(table.state("step"), reference.state("step"))


def test_scan_sees_every_previous_update(device, rng):
    """The same indices every iteration: a lookup hoisted out of the loop or run before the
    previous update would train on stale rows."""
    table, reference = _tables(rng, "sgd", {"lr": 0.1})
    idx = rng.integers(0, ROWS, size=N)
    targets = rng.standard_normal((6, N, DIM)).astype(np.float32)

    @jax.jit
    def train(idx, targets):
        def body(carry, t):
            rows = host_lookup(table, idx)
            loss, g = jax.value_and_grad(_loss)(rows, t)
            token = host_update(table, idx, g)
            return carry + token, loss
        return jax.lax.scan(body, jnp.int32(0), targets)

    _, losses = train(jax.device_put(idx, device), jax.device_put(targets, device))
    expected = [_reference_step(reference, idx, t) for t in targets]
    np.testing.assert_allclose(np.asarray(losses), expected, rtol=1e-5)
    np.testing.assert_allclose(table.numpy(), reference.numpy(), rtol=1e-5, atol=1e-6)


def test_bad_input(device, rng):
    table, _ = _tables(rng)
    with pytest.raises(TypeError, match="HostTable"):
        host_lookup(np.zeros((4, 4)), jnp.arange(2))
    with pytest.raises(TypeError, match="int32 or int64"):
        host_lookup(table, jnp.zeros(2))
    with pytest.raises(ValueError, match="grad_rows must have shape"):
        host_update(table, jnp.arange(2), jnp.zeros((3, DIM)))
    before = np.array(table.numpy())
    with pytest.raises(Exception, match="out of range"):
        jax.block_until_ready(host_update(table, jax.device_put(np.array([1, ROWS]), device),
                                          jnp.ones((2, DIM))))
        table.check()  # on the GPU the input check is deferred (no host sync in the step)
    np.testing.assert_array_equal(table.numpy(), before)
