"""What the JAX ops take from their callers: host int64 indices that JAX would wrap (x64
off) are refused; optax's array and traced hyperparameters are hyperparameters; gradient
trees must match the parameters' layout; a TT bag's empty offsets are refused under jit."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import xferlib  # noqa: E402
from xferlib.adapters.jax import (flat_adamw, flat_lion, flat_sgd, gather_rows,  # noqa: E402
                                  host_lookup, ravel, ravel_like, tt_embedding_bag)

WRAPS = np.array([1, 2**32 + 1], np.int64)  # JAX without x64: the second becomes 1


@pytest.mark.skipif(jax.config.jax_enable_x64, reason="x64 keeps int64 indices whole")
def test_int64_indices_jax_would_wrap_are_refused():
    table = xferlib.HostTable(8, 2, init="zeros")
    for call in (lambda: host_lookup(table, WRAPS),
                 lambda: gather_rows(jnp.zeros((8, 2)), WRAPS),
                 lambda: tt_embedding_bag([jnp.ones((2, 4)), jnp.ones((4, 2))], WRAPS,
                                          np.array([0, 2]), p_shapes=[2, 4], q_shapes=[2, 1],
                                          ranks=[2])):
        with pytest.raises(IndexError, match=r"\[1\] = 4294967297 does not fit"):
            call()


@pytest.mark.skipif(jax.config.jax_enable_x64, reason="x64 keeps int64 indices whole")
def test_python_int_indices_jax_would_wrap_are_refused():
    """A Python list is checked as NumPy's int64, not met by JAX's bare OverflowError."""
    from xferlib.adapters.jax import embedding_bag_collection
    from xferlib.collection import EmbeddingCollection, TableConfig

    table = xferlib.HostTable(8, 2, init="zeros")
    for call in (lambda: host_lookup(table, [1, 2**40]),
                 lambda: gather_rows(jnp.zeros((8, 2)), [1, 2**40])):
        with pytest.raises(IndexError, match=r"idx\[1\] = 1099511627776 does not fit"):
            call()
    coll = EmbeddingCollection([TableConfig(8, 2)], "sgd", {"lr": 1.0}, device="cpu")
    with pytest.raises(ValueError, match=r"offsets\[1\] = 1099511627776 does not fit"):
        embedding_bag_collection(coll, [1], [0, 2**40])
    with pytest.raises(IndexError, match="fit no 64-bit integer"):
        host_lookup(table, [1, 2**70])
    with pytest.raises(TypeError, match="idx must be an array of integers"):
        host_lookup(table, None)


@pytest.mark.parametrize("make", [flat_sgd, flat_adamw, flat_lion])
def test_array_and_injected_learning_rates(make):
    optax = pytest.importorskip("optax")
    params = jnp.ones(3)
    grads = jnp.full(3, 0.5)
    reference = make(0.1)
    expected, _ = reference.update(grads, reference.init(params), params)
    as_array = make(jnp.float32(0.1))
    got, _ = as_array.update(grads, as_array.init(params), params)
    np.testing.assert_allclose(got, expected, rtol=1e-5)  # lr rounded to float32
    injected = optax.inject_hyperparams(make)(learning_rate=0.1)
    got, _ = jax.jit(injected.update)(grads, injected.init(params), params)
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        make(jnp.float32(-0.1))


def test_ravel_like_refuses_another_layout():
    params = {"a": jnp.ones((3, 5)), "b": jnp.ones(2)}
    _, unravel = ravel(params)
    assert ravel_like({"a": jnp.zeros((3, 5)), "b": jnp.zeros(2)}, unravel).shape[0] >= 17
    with pytest.raises(ValueError, match="leaf 0 has shape"):
        ravel_like({"a": jnp.zeros((5, 3)), "b": jnp.zeros(2)}, unravel)
    with pytest.raises(ValueError, match="structure"):
        ravel_like({"a": jnp.zeros((3, 5))}, unravel)


def test_tt_bag_empty_offsets_under_jit():
    cores = [jnp.ones((2, 4)), jnp.ones((4, 2))]
    bag = jax.jit(lambda i, o: tt_embedding_bag(cores, i, o, p_shapes=[2, 4], q_shapes=[2, 1],
                                                ranks=[2]))
    with pytest.raises(ValueError, match="non-empty"):
        bag(jnp.zeros(0, jnp.int32), jnp.zeros(0, jnp.int32))
