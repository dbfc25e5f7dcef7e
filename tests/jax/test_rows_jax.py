import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import xferlib  # noqa: E402
from xferlib.adapters.jax import gather_rows  # noqa: E402
from xferlib.testing import assert_matches_reference  # noqa: E402

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _data(device, shape, n, dtype, seed=0):
    rng = np.random.default_rng(seed)
    table = rng.standard_normal(shape).astype(np.float32)
    idx = rng.integers(0, shape[0], size=n).astype(np.int32)
    return (jax.device_put(jnp.asarray(table, dtype=dtype), device),
            jax.device_put(jnp.asarray(idx), device))


@pytest.mark.parametrize("dtype", DTYPES)
def test_jit_forward_and_grad_match_reference(device, dtype):
    table, idx = _data(device, (41, 24), 300, dtype)
    name = jnp.dtype(dtype).name
    host_table = np.asarray(table).astype(np.float64)
    host_idx = np.asarray(idx)
    out = jax.jit(gather_rows)(table, idx)
    assert out.dtype == dtype and out.shape == (300, 24)
    assert_matches_reference(np.asarray(out), host_table[host_idx], name)

    w = jax.device_put(jnp.asarray(np.random.default_rng(1).standard_normal((300, 24)),
                                   dtype=dtype), device)
    grad = jax.jit(jax.grad(lambda t: (gather_rows(t, idx) * w).sum().astype(jnp.float32)))(table)
    expected = xferlib.scatter_add_rows_reference(np.zeros((41, 24)), host_idx,
                                                  np.asarray(w).astype(np.float64))
    assert_matches_reference(np.asarray(grad), expected, name, scale=40)


def test_matches_jnp_indexing_grad(device):
    table, idx = _data(device, (30, 8), 64, jnp.float32)
    proj = jnp.linspace(-1, 1, 8)

    def loss(t, take):
        return jnp.tanh(take(t, idx) @ proj).sum()

    ours = jax.jit(jax.grad(lambda t: loss(t, gather_rows)))(table)
    ref = jax.grad(lambda t: loss(t, lambda a, i: a[i]))(table)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-5, atol=1e-6)


def test_inside_lax_scan(device):
    table, _ = _data(device, (20, 4), 1, jnp.float32)
    batches = jax.device_put(jnp.asarray(np.random.default_rng(2).integers(0, 20, (5, 7)),
                                         dtype=jnp.int32), device)

    def train(t):
        def step(t, idx):
            g = jax.grad(lambda t: (gather_rows(t, idx) ** 2).sum())(t)
            return t - 0.1 * g, gather_rows(t, idx).sum()

        return jax.lax.scan(step, t, batches)

    final, sums = jax.jit(train)(table)

    def train_ref(t):
        def step(t, idx):
            g = jax.grad(lambda t: (t[idx] ** 2).sum())(t)
            return t - 0.1 * g, t[idx].sum()

        return jax.lax.scan(step, t, batches)

    ref_final, ref_sums = train_ref(table)
    np.testing.assert_allclose(np.asarray(final), np.asarray(ref_final), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(sums), np.asarray(ref_sums), rtol=1e-5, atol=1e-5)


def test_vmap_over_indices(device):
    table, _ = _data(device, (20, 4), 1, jnp.float32)
    idx = jax.device_put(jnp.asarray([[1, 2, 2], [19, 0, 5]], dtype=jnp.int32), device)
    out = jax.jit(jax.vmap(gather_rows, in_axes=(None, 0)))(table, idx)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(table)[np.asarray(idx)])


def test_bad_index_raises(device):
    table, _ = _data(device, (10, 4), 1, jnp.float32)
    idx = jax.device_put(jnp.asarray([0, 12], dtype=jnp.int32), device)
    with pytest.raises(Exception, match="index 12 at position 1"):
        jax.block_until_ready(jax.jit(gather_rows)(table, idx))


def test_bad_arguments():
    with pytest.raises(TypeError, match="int32 or int64"):
        gather_rows(jnp.ones((3, 2)), jnp.array([0.5]))
    with pytest.raises(ValueError, match="2-D"):
        gather_rows(jnp.ones(3), jnp.array([0]))
