"""Non-finite gradients (issue 30, item 5): xferlib's policy is torch's, propagate. A NaN or
inf in a gradient reaches exactly the rows (flat optimizers: the elements) whose update
reads it, through the optimizer's formula, as the float64 NumPy reference computes it; every
other row keeps the finite values it would have had. No step is skipped and nothing is
counted (docs/reliability.md).
"""

from __future__ import annotations

import numpy as np
import pytest

import xferlib
from xferlib import optim
from xferlib.collection import EmbeddingCollection, TableConfig, collection_step_reference
from xferlib.testing import GPU_SKIP_REASON

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
BAD = [np.nan, np.inf, -np.inf]


def xp_for(device):
    if device == "cpu":
        return np
    if not xferlib.cupy_available():
        pytest.skip(GPU_SKIP_REASON)
    import cupy

    return cupy


def host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def nonfinite_rows(*arrays) -> set:
    """Rows holding a NaN or inf in any of ``arrays`` (first axis: rows)."""
    bad = np.zeros(arrays[0].shape[0], bool)
    for a in arrays:
        a = np.asarray(a, dtype=np.float64)
        bad |= ~np.isfinite(a.reshape(a.shape[0], -1)).all(axis=1)
    return set(np.flatnonzero(bad).tolist())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", xferlib.SPARSE_OPTIMIZERS)
@pytest.mark.parametrize("value", BAD, ids=["nan", "inf", "-inf"])
def test_host_table_nonfinite_gradient_reaches_exactly_its_rows(device, optimizer, value):
    xp = xp_for(device)
    rng = np.random.default_rng(1)
    table = xferlib.HostTable(20, 4, optimizer=optimizer, optimizer_kwargs={"lr": 0.1},
                              seed=2)
    try:
        idx = np.array([3, 7, 3, 11, 5], np.int64)
        grads = rng.standard_normal((5, 4)).astype(np.float32)
        grads[1, 2] = value  # row 7 only
        w0 = table.numpy().astype(np.float64)
        s0 = {k: table.state(k).astype(np.float64) for k in table.state_names() if k != "step"}
        st0 = table.state("step").copy()
        table.apply_gradients(xp.asarray(idx), xp.asarray(grads))
        w, s, steps = xferlib.sparse_update_reference(optimizer, w0, s0, st0, idx, grads,
                                                      table.hyper)
        got = [table.numpy()] + [table.state(k) for k in s]
        assert nonfinite_rows(*got) == nonfinite_rows(w, *s.values()) == {7}
        np.testing.assert_allclose(table.numpy(), w, rtol=2e-5, atol=2e-6, equal_nan=True)
        np.testing.assert_array_equal(table.state("step"), steps)  # the row still counts
    finally:
        table.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", ["sgd", "adam", "rowwise_adagrad"])
@pytest.mark.parametrize("value", BAD, ids=["nan", "inf", "-inf"])
def test_collection_nonfinite_gradient_reaches_exactly_its_rows(device, optimizer, value):
    xp = xp_for(device)
    rng = np.random.default_rng(3)
    tables = [TableConfig(12, 4, placement="host"), TableConfig(9, 2)]
    coll = EmbeddingCollection(tables, optimizer, {"lr": 0.1}, device=device, seed=1)
    # B = 2: table 0 bags [1, 4], [4, 6]; table 1 bags [2], [8, 8]
    indices = np.array([1, 4, 4, 6, 2, 8, 8], np.int64)
    offsets = np.array([0, 2, 4, 5, 7], np.int64)
    grad = rng.standard_normal((2, 6)).astype(np.float32)
    grad[0, 1] = value  # table 0, bag 0: rows 1 and 4 (row 4 also gets bag 1's finite part)
    weights = [coll.weights(t).astype(np.float64) for t in range(2)]
    names = [k for k in coll.state_names() if k != "step"]
    states = [{k: coll.state(t, k).astype(np.float64) for k in names} for t in range(2)]
    steps = [coll.state(t, "step").copy() for t in range(2)]
    out, ctx = coll.forward(xp.asarray(indices), xp.asarray(offsets))
    coll.backward(ctx, xp.asarray(grad))
    coll.check()
    new_w, new_s, new_steps = collection_step_reference(optimizer, coll.hypers, weights,
                                                        states, steps, indices, offsets, grad)
    for t, expected in enumerate([{1, 4}, set()]):
        got = [coll.weights(t)] + [coll.state(t, k) for k in names]
        assert nonfinite_rows(*got) == nonfinite_rows(new_w[t], *new_s[t].values()) == expected
        np.testing.assert_allclose(coll.weights(t), new_w[t], rtol=2e-5, atol=2e-6,
                                   equal_nan=True)
        np.testing.assert_array_equal(coll.state(t, "step"), new_steps[t])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", optim.OPTIMIZERS)
@pytest.mark.parametrize("value", BAD, ids=["nan", "inf", "-inf"])
def test_flat_optimizer_nonfinite_gradient_reaches_exactly_its_elements(device, name, value):
    xp = xp_for(device)
    rng = np.random.default_rng(4)
    shapes = [(5,), (3, 4), (7,)]
    layout = optim.FlatLayout.from_shapes(shapes)
    params = xp.asarray(layout.pack([rng.standard_normal(s).astype(np.float32)
                                     for s in shapes]))
    grads = layout.pack([rng.standard_normal(s).astype(np.float32) for s in shapes])
    segment = layout.segments[1]
    grads[segment.offset + 5] = value
    opt = getattr(optim, name)(**{"learning_rate" if name == "lion" else "lr": 1e-2})
    state = opt.init(layout, xp=xp)
    opt.update(layout, params, xp.asarray(grads), state)
    bad = ~np.isfinite(host(params))
    for buffer in state.buffers.values():
        bad |= ~np.isfinite(host(buffer))
    # Elementwise rules: the one element. (No flat rule reduces over a segment.)
    assert np.flatnonzero(bad).tolist() == [segment.offset + 5], name
