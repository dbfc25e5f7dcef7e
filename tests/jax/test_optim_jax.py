"""Flat JAX optimizers against optax under jax.jit."""

import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

from xferlib.adapters.jax import (flat_adam, flat_adamw, flat_lion, flat_sgd,  # noqa: E402
                                  flat_step, ravel, ravel_like)

CASES = [
    (flat_adam, optax.adam, dict(learning_rate=1e-2)),
    (flat_adam, optax.adam, dict(learning_rate=optax.exponential_decay(1e-2, 10, 0.5),
                                 b1=0.8)),
    (flat_adamw, optax.adamw, dict(learning_rate=1e-2, weight_decay=0.1)),
    (flat_sgd, optax.sgd, dict(learning_rate=0.05)),
    (flat_sgd, optax.sgd, dict(learning_rate=0.05, momentum=0.9, nesterov=True)),
    (flat_lion, optax.lion, dict(learning_rate=1e-3, weight_decay=0.1)),
]


def _params(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {"w": jax.random.normal(k1, (7, 5)), "b": jax.random.normal(k2, (5,)),
            "emb": {"table": jax.random.normal(k3, (33, 3))}}


def _loss(params, x):
    h = jnp.tanh(x @ params["w"] + params["b"])
    return jnp.mean(h ** 2) + jnp.mean(params["emb"]["table"] ** 2)


@pytest.mark.parametrize("ours,theirs,kw", CASES, ids=[f"{c[0].__name__}-{i}"
                                                        for i, c in enumerate(CASES)])
def test_jit_training_matches_optax(device, ours, theirs, kw):
    params = jax.device_put(_params(jax.random.key(0)), device)
    xs = jax.device_put(jax.random.normal(jax.random.key(1), (60, 4, 7)), device)
    flat, unravel = ravel(params)
    tx, ref_tx = ours(**kw), theirs(**kw)

    @jax.jit
    def train(flat, params, xs):
        def step(carry, x):
            flat, state, params, ref_state = carry
            grads = jax.grad(_loss)(unravel(flat), x)
            updates, state = tx.update(ravel_like(grads, unravel), state, flat)
            ref_grads = jax.grad(_loss)(params, x)
            ref_updates, ref_state = ref_tx.update(ref_grads, ref_state, params)
            return (optax.apply_updates(flat, updates), state,
                    optax.apply_updates(params, ref_updates), ref_state), None

        carry, _ = jax.lax.scan(step, (flat, tx.init(flat), params, ref_tx.init(params)), xs)
        return carry

    flat, _, ref_params, _ = train(flat, params, xs)
    for ours_leaf, ref_leaf in zip(jax.tree_util.tree_leaves(unravel(flat)),
                                   jax.tree_util.tree_leaves(ref_params)):
        np.testing.assert_allclose(np.asarray(ours_leaf), np.asarray(ref_leaf), rtol=2e-5,
                                   atol=2e-6)


@pytest.mark.parametrize("ours,theirs,kw", CASES, ids=[f"{c[0].__name__}-{i}"
                                                        for i, c in enumerate(CASES)])
def test_flat_step_in_place_matches_optax(device, ours, theirs, kw):
    """flat_step: parameters updated in one pass, donated to the jitted step."""
    params = jax.device_put(_params(jax.random.key(0)), device)
    xs = jax.device_put(jax.random.normal(jax.random.key(1), (20, 4, 7)), device)
    flat, unravel = ravel(params)
    tx, ref_tx = ours(**kw), theirs(**kw)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(flat, state, x):
        grads = ravel_like(jax.grad(_loss)(unravel(flat), x), unravel)
        return flat_step(tx, grads, state, flat)

    @jax.jit
    def ref_step(params, state, x):
        updates, state = ref_tx.update(jax.grad(_loss)(params, x), state, params)
        return optax.apply_updates(params, updates), state

    state, ref_state = tx.init(flat), ref_tx.init(params)
    for x in xs:
        flat, state = step(flat, state, x)
        params, ref_state = ref_step(params, ref_state, x)
    for ours_leaf, ref_leaf in zip(jax.tree_util.tree_leaves(unravel(flat)),
                                   jax.tree_util.tree_leaves(params)):
        np.testing.assert_allclose(np.asarray(ours_leaf), np.asarray(ref_leaf), rtol=2e-5,
                                   atol=2e-6)
    with pytest.raises(TypeError, match="flat_step takes"):
        flat_step(optax.adam(1e-3), flat, state, flat)


def test_ravel_roundtrip_and_alignment():
    params = _params(jax.random.key(0))
    flat, unravel = ravel(params)
    assert flat.dtype == jnp.float32 and flat.shape[0] % 4 == 0
    assert [s.offset % 4 for s in unravel.layout.segments] == [0, 0, 0]
    back = unravel(flat)
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_input():
    tx = flat_adam(1e-3)
    with pytest.raises(TypeError, match="ravel"):
        tx.init({"w": jnp.ones(4)})
    with pytest.raises(ValueError, match="multiple of 4"):
        tx.init(jnp.ones(6))
    with pytest.raises(ValueError, match="eps_root"):
        flat_adam(1e-3, eps_root=1e-8)
    with pytest.raises(ValueError, match="beta"):
        flat_adam(1e-3, b1=1.5)
