"""Flat JAX optimizers against optax under jax.jit, both implementations (jax.numpy fused by
XLA, and the flat kernel through buffer_callback)."""

import functools
import inspect

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
# Options only the jax.numpy path has.
XLA_CASES = [
    (flat_adam, optax.adam, dict(learning_rate=1e-2, eps_root=1e-8)),
    (flat_adamw, optax.adamw, dict(learning_rate=optax.linear_schedule(1e-2, 1e-3, 20),
                                   weight_decay=0.05)),
    (flat_sgd, optax.sgd, dict(learning_rate=0.05, momentum=0.0)),
    (flat_lion, optax.lion, dict(learning_rate=optax.linear_schedule(1e-3, 1e-4, 20), b1=0.8,
                                 weight_decay=0.0)),
]
if "nesterov" in inspect.signature(optax.adam).parameters:
    XLA_CASES.append((flat_adam, optax.adam, dict(learning_rate=1e-2, nesterov=True)))
ALL = [(*c, "xla") for c in CASES + XLA_CASES] + [(*c, "kernel") for c in CASES]
ALL_IDS = [f"{c[0].__name__}-{c[3]}-{i}" for i, c in enumerate(ALL)]


def _params(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {"w": jax.random.normal(k1, (7, 5)), "b": jax.random.normal(k2, (5,)),
            "emb": {"table": jax.random.normal(k3, (33, 3))}}


def _loss(params, x):
    h = jnp.tanh(x @ params["w"] + params["b"])
    return jnp.mean(h ** 2) + jnp.mean(params["emb"]["table"] ** 2)


@pytest.mark.parametrize("ours,theirs,kw,impl", ALL, ids=ALL_IDS)
def test_jit_training_matches_optax(device, ours, theirs, kw, impl):
    params = jax.device_put(_params(jax.random.key(0)), device)
    xs = jax.device_put(jax.random.normal(jax.random.key(1), (30, 4, 7)), device)
    flat, unravel = ravel(params)
    tx, ref_tx = ours(**kw, impl=impl), theirs(**kw)
    assert tx.update.impl == impl

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


@pytest.mark.parametrize("ours,theirs,kw,impl", ALL, ids=ALL_IDS)
def test_flat_step_in_place_matches_optax(device, ours, theirs, kw, impl):
    """flat_step: parameters updated in one pass, donated to the jitted step."""
    params = jax.device_put(_params(jax.random.key(0)), device)
    xs = jax.device_put(jax.random.normal(jax.random.key(1), (12, 4, 7)), device)
    flat, unravel = ravel(params)
    tx, ref_tx = ours(**kw, impl=impl), theirs(**kw)

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


def test_state_moves_between_implementations():
    """Both implementations keep FlatState(count, buffers) in the same order."""
    flat = jnp.linspace(-1.0, 1.0, 16)
    grads = jnp.cos(jnp.arange(16.0))
    xla, kernel = flat_adam(1e-2, impl="xla"), flat_adam(1e-2, impl="kernel")
    state = xla.init(flat)
    for _ in range(3):
        updates, state = xla.update(grads, state, flat)
        flat = optax.apply_updates(flat, updates)
    ref_flat, ref_state = flat, state
    for _ in range(2):
        updates, state = kernel.update(grads, state, flat)
        flat = optax.apply_updates(flat, updates)
        ref_updates, ref_state = xla.update(grads, ref_state, ref_flat)
        ref_flat = optax.apply_updates(ref_flat, ref_updates)
    assert int(state.count) == 5
    np.testing.assert_allclose(np.asarray(flat), np.asarray(ref_flat), rtol=1e-6, atol=1e-7)
    for a, b in zip(state.buffers, ref_state.buffers):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-9)


def test_updates_without_params_where_optax_allows_it():
    grads = jnp.cos(jnp.arange(8.0))
    for ours, theirs, kw in ((flat_adam, optax.adam, {}),
                             (flat_sgd, optax.sgd, dict(momentum=0.9))):
        tx, ref = ours(1e-2, **kw), theirs(1e-2, **kw)
        updates, _ = tx.update(grads, tx.init(grads))
        ref_updates, _ = ref.update(grads, ref.init(grads))
        np.testing.assert_allclose(np.asarray(updates), np.asarray(ref_updates), rtol=1e-6)
    for tx in (flat_adamw(1e-2), flat_lion(1e-2), flat_adam(1e-2, impl="kernel")):
        with pytest.raises(ValueError, match="needs params"):
            tx.update(grads, tx.init(grads))


def test_bad_input():
    tx = flat_adam(1e-3)
    with pytest.raises(TypeError, match="ravel"):
        tx.init({"w": jnp.ones(4)})
    with pytest.raises(TypeError, match="float32"):
        tx.init(jnp.ones(8, jnp.int32))
    with pytest.raises(ValueError, match="differ"):
        tx.update(jnp.ones(8), tx.init(jnp.ones(8)), jnp.ones(12))
    with pytest.raises(ValueError, match="multiple of 4"):
        flat_adam(1e-3, impl="kernel").init(jnp.ones(6))
    tx.init(jnp.ones(6))  # the jax.numpy path takes any length
    with pytest.raises(ValueError, match="eps_root"):
        flat_adam(1e-3, eps_root=1e-8, impl="kernel")
    with pytest.raises(ValueError, match="impl"):
        flat_sgd(1e-3, impl="triton")
    with pytest.raises(ValueError, match="beta"):
        flat_adam(1e-3, b1=1.5)
    with pytest.raises(ValueError, match="weight_decay"):
        flat_adamw(1e-3, weight_decay=-1.0)


@pytest.mark.parametrize("kw", [dict(momentum=0.9), dict(momentum=0.9, nesterov=True),
                                dict(momentum=0.0)])
def test_injected_momentum_under_jit_matches_optax(kw):
    """optax.inject_hyperparams traces momentum under jit: flat_sgd took float() of it."""
    params = jnp.linspace(-1.0, 1.0, 8)
    tx = optax.inject_hyperparams(flat_sgd)(learning_rate=0.1, **kw)
    ref = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, **kw)
    state, ref_state = tx.init(params), ref.init(params)
    for k in range(3):
        grads = jnp.cos(jnp.arange(8.0) * (k + 1))
        updates, state = jax.jit(tx.update)(grads, state, params)
        ref_updates, ref_state = jax.jit(ref.update)(grads, ref_state, params)
        np.testing.assert_allclose(np.asarray(updates), np.asarray(ref_updates), rtol=1e-6)


def test_kernel_refuses_traced_options_by_name():
    """The kernel path has no eps_root, and its SGD momentum and AdamW decay must be numbers:
    traced ones (inject_hyperparams under jit) are refused naming them, not a tracer error."""
    params = jnp.ones(8)
    for make, name in ((flat_adam, "eps_root"), (flat_sgd, "momentum"),
                       (flat_adamw, "weight_decay")):
        kw = dict(momentum=0.9) if make is flat_sgd else {}
        static = ("impl", "eps_root") if make is flat_adamw else ("impl",)
        tx = optax.inject_hyperparams(make, static_args=static)(1e-2, impl="kernel", **kw)
        with pytest.raises(ValueError, match=f"{name}.*static_args"):
            jax.jit(tx.update)(params, tx.init(params), params)
    tx = optax.inject_hyperparams(flat_adam, static_args=("impl", "eps_root"))(1e-2,
                                                                               impl="kernel")
    jax.jit(tx.update)(params, tx.init(params), params)  # eps_root static: runs
