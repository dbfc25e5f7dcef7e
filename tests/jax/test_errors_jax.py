"""Bad indices in the JAX ops raise errors a caller catches by type, before anything changes.

Eager calls raise the core's IndexError / ValueError before the op runs; under ``jit`` XLA's
error is raised again inside ``typed_errors()`` as ``CallbackIndexError`` /
``CallbackValueError`` (subclasses of IndexError / ValueError and of ``JaxRuntimeError``).
``warm``: the jitted function ran once on good input first, so the bad call takes JAX's C++
fast path (which reports a failed callback as a ValueError, not a ``JaxRuntimeError``).
"""

import doctest
import importlib

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

import xferlib  # noqa: E402
from xferlib import tt  # noqa: E402
from xferlib.adapters.jax import (CallbackIndexError, CallbackValueError, gather_rows,  # noqa: E402
                                  host_lookup, host_update, tt_embedding_bag, typed_errors)

ROWS, DIM = 8, 4
BAD = np.array([1, 3, ROWS, 2], dtype=np.int32)  # index 8 at position 2
HOST_MESSAGE = f"index {ROWS} at position 2 is out of range for a table of {ROWS} rows"
SHAPE = tt.TTShape([6, 10, 10], [2, 2, 4], [3, 4])  # 600 rows of 16
TT_BAD = np.array([0, 5, 700, 3], dtype=np.int32)
TT_MESSAGE = "index 700 at position 2 is out of range for a TT table of 600 rows"


def _table():
    init = np.random.default_rng(0).standard_normal((ROWS, DIM)).astype(np.float32)
    return xferlib.HostTable(ROWS, DIM, optimizer="adam", init=init)


def _snapshot(table):
    return np.array(table.numpy()), np.array(table.state("step"))


def _assert_unchanged(table, snapshot):
    np.testing.assert_array_equal(table.numpy(), snapshot[0])
    np.testing.assert_array_equal(table.state("step"), snapshot[1])


def _assert_typed(err, kind, message, device):
    """``err`` is ``kind`` with ``message`` first; on the CPU it is typed_errors' class, with
    XLA's error as its cause (a GPU host table may report from ``table.check()`` instead)."""
    assert isinstance(err, kind)
    assert str(err).startswith(message), str(err)
    if device.platform == "cpu":
        typed = CallbackIndexError if kind is IndexError else CallbackValueError
        assert isinstance(err, typed) and isinstance(err, jax.errors.JaxRuntimeError)
        assert isinstance(err.__cause__, jax.errors.JaxRuntimeError)


# ----------------------------------------------------------------------------- host tables


@pytest.mark.parametrize("op", ["lookup", "update"])
def test_host_eager_raises_index_error_before_the_op(device, op):
    table = _table()
    before = _snapshot(table)
    idx = jax.device_put(BAD, device)
    with pytest.raises(IndexError) as info:
        if op == "lookup":
            host_lookup(table, idx)
        else:
            host_update(table, idx, jnp.ones((len(BAD), DIM)))
    assert type(info.value) is IndexError  # the core's own, raised before XLA runs anything
    assert str(info.value).startswith(HOST_MESSAGE)
    _assert_unchanged(table, before)


@pytest.mark.parametrize("warm", [False, True], ids=["first-call", "warm"])
@pytest.mark.parametrize("op", ["lookup", "update", "step"])
def test_host_jit_raises_a_typed_error(device, op, warm):
    table = _table()
    before = _snapshot(table)

    def step(idx):
        if op == "lookup":
            return host_lookup(table, idx)
        if op == "update":
            return host_update(table, idx, jnp.ones((idx.shape[0], DIM)))
        rows = host_lookup(table, idx)  # a training step: the update after a failed lookup
        return host_update(table, idx, jax.grad(lambda r: jnp.sum(r ** 2))(rows))

    step = jax.jit(step)
    if warm:
        jax.block_until_ready(step(jax.device_put(BAD % ROWS, device)))
        before = _snapshot(table)
    idx = jax.device_put(BAD, device)
    with pytest.raises(IndexError) as info:
        with typed_errors():
            jax.block_until_ready(step(idx))
            table.check()  # a GPU batch's check is read later (no host sync in a step)
    _assert_typed(info.value, IndexError, HOST_MESSAGE, device)
    _assert_unchanged(table, before)
    # the table still works, and the good batch after the bad one trains
    good = jax.device_put(np.array([1, 3], dtype=np.int32), device)
    steps = table.state("step")[[1, 3]]
    jax.block_until_ready(jax.jit(lambda i: host_update(table, i, jnp.ones((2, DIM))))(good))
    assert (table.state("step")[[1, 3]] - steps).tolist() == [1, 1]


def test_without_typed_errors_jit_raises_xla_error():
    """What typed_errors is for: XLA's own error is a JaxRuntimeError, not an IndexError."""
    if jax.default_backend() != "cpu":
        pytest.skip("on a GPU a host table reads its input check later (a later call or "
                    "table.check() raises), so this call itself does not fail")
    table = _table()
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        jax.block_until_ready(jax.jit(lambda i: host_lookup(table, i))(jnp.asarray(BAD)))
    assert not isinstance(info.value, IndexError) and HOST_MESSAGE in str(info.value)


def test_typed_errors_wraps_a_function():
    table = _table()
    if jax.default_backend() != "cpu":
        pytest.skip("on a GPU a host table reads its check later (test_host_* cover it)")
    lookup = typed_errors(jax.jit(lambda i: host_lookup(table, i)))
    with pytest.raises(CallbackIndexError, match=f"^{HOST_MESSAGE}"):
        jax.block_until_ready(lookup(jnp.asarray(BAD)))
    np.testing.assert_array_equal(np.asarray(lookup(jnp.array([2, 0]))), table.numpy()[[2, 0]])
    gather = typed_errors(jax.jit(gather_rows))
    jax.block_until_ready(gather(jnp.ones((ROWS, DIM)), jnp.array([0, 1])))
    with pytest.raises(CallbackIndexError, match=f"^{HOST_MESSAGE}"):  # the C++ fast path
        jax.block_until_ready(gather(jnp.ones((ROWS, DIM)), jnp.asarray(BAD)))


def test_typed_errors_passes_other_errors_unchanged():
    with pytest.raises(KeyError):
        with typed_errors():
            raise KeyError("x")
    other = jax.errors.JaxRuntimeError("INTERNAL: something else")
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        with typed_errors():
            raise other
    assert info.value is other


# ----------------------------------------------------------------------------- TT


def _tt_call(cores, indices, offsets):
    return tt_embedding_bag(cores, indices, offsets, p_shapes=SHAPE.p_shapes,
                            q_shapes=SHAPE.q_shapes, ranks=SHAPE.ranks)


def _cores(device):
    return [jax.device_put(c, device)
            for c in tt.init_tt_cores(SHAPE, "normal", rng=np.random.default_rng(1))]


def test_tt_eager_raises_index_and_value_errors(device):
    cores = _cores(device)
    offsets = jnp.array([0, 2, 4], jnp.int32)
    with pytest.raises(IndexError) as info:
        _tt_call(cores, jnp.asarray(TT_BAD), offsets)
    assert type(info.value) is IndexError and str(info.value).startswith(TT_MESSAGE)
    with pytest.raises(ValueError, match="offsets must start at 0, not decrease"):
        _tt_call(cores, jnp.asarray(TT_BAD % 600), jnp.array([0, 3, 2], jnp.int32))
    with pytest.raises(ValueError, match="per_sample_weights must have shape"):
        tt_embedding_bag(cores, jnp.asarray(TT_BAD % 600), offsets, p_shapes=SHAPE.p_shapes,
                         q_shapes=SHAPE.q_shapes, ranks=SHAPE.ranks,
                         per_sample_weights=jnp.ones(3))


@pytest.mark.parametrize("warm", [False, True], ids=["first-call", "warm"])
def test_tt_jit_training_step_raises_a_typed_error_and_keeps_the_cores(device, warm):
    cores = _cores(device)
    tx = optax.adam(0.1)
    state = tx.init(cores)

    @jax.jit
    def step(cores, state, indices, offsets):
        grads = jax.grad(lambda cs: jnp.sum(_tt_call(cs, indices, offsets) ** 2))(cores)
        updates, state = tx.update(grads, state, cores)
        return optax.apply_updates(cores, updates), state

    offsets = jax.device_put(np.array([0, 2, 4], np.int32), device)
    good = jax.device_put(TT_BAD % 600, device)
    if warm:
        cores, state = step(cores, state, good, offsets)
    before = [np.array(c) for c in cores]
    with pytest.raises(IndexError) as info:
        with typed_errors():
            jax.block_until_ready(step(cores, state, jax.device_put(TT_BAD, device), offsets))
    _assert_typed(info.value, IndexError, TT_MESSAGE, device)
    bad_offsets = jax.device_put(np.array([0, 3, 2], np.int32), device)
    with pytest.raises(ValueError) as info:
        with typed_errors():
            jax.block_until_ready(step(cores, state, good, bad_offsets))
    _assert_typed(info.value, ValueError, "offsets must start at 0, not decrease", device)
    for core, old in zip(cores, before):  # the rejected steps left the cores as they were
        np.testing.assert_array_equal(np.asarray(core), old)
    new_cores, _ = step(cores, state, good, offsets)
    assert not np.array_equal(np.asarray(new_cores[0]), before[0])  # a good step trains


# ----------------------------------------------------------------------------- gather_rows


@pytest.mark.parametrize("warm", [False, True], ids=["first-call", "warm"])
def test_gather_rows_eager_and_jit(device, warm):
    table = jax.device_put(jnp.ones((ROWS, DIM)), device)
    idx = jax.device_put(BAD, device)
    with pytest.raises(IndexError) as info:
        gather_rows(table, idx)
    assert type(info.value) is IndexError and str(info.value).startswith(HOST_MESSAGE)
    gather = jax.jit(gather_rows)
    if warm:
        jax.block_until_ready(gather(table, jax.device_put(BAD % ROWS, device)))
    with pytest.raises(IndexError) as info:
        with typed_errors():
            jax.block_until_ready(gather(table, idx))
    _assert_typed(info.value, IndexError, HOST_MESSAGE, device)


def test_docstring_examples():
    if jax.default_backend() != "cpu":
        pytest.skip("the module's example shows the CPU backend's error at the call")
    result = doctest.testmod(importlib.import_module("xferlib.adapters.jax.errors"))
    assert result.failed == 0 and result.attempted > 0
