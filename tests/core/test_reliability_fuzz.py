"""Fuzz (issue 30, item 4): property-based tests (hypothesis) over the public inputs of the
row ops, HostTable and the collection (indices and their dtype, offsets, per-sample weights,
table dtypes and shapes, learning rates), against the float64 NumPy references. Inputs are
drawn valid or broken; a broken one must raise the documented exception type and leave
every table, its optimizer state and step counts exactly as they were.

Examples per test are few (CI time); ``XFERLIB_FUZZ_EXAMPLES`` raises them for a long run.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import xferlib  # noqa: E402
from xferlib.collection import (EmbeddingCollection, TableConfig,  # noqa: E402
                                collection_step_reference, pooled_lookup_reference)
from xferlib.testing import GPU_SKIP_REASON  # noqa: E402

EXAMPLES = int(os.environ.get("XFERLIB_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,  # no files in the tree
                suppress_health_check=list(hypothesis.HealthCheck))

FLOATS = st.sampled_from([np.float32, np.float64])
INDEX_DTYPES = st.sampled_from([np.int32, np.int64])


def tol(dtype):
    return dict(rtol=2e-5, atol=2e-5) if dtype == np.float32 else dict(rtol=1e-11, atol=1e-12)


@st.composite
def indices_for(draw, num_rows, max_size=40, allow_bad=True):
    """``(idx, bad)``: indices of a table of ``num_rows`` rows, sometimes with one out of
    range (negative or past the end), in int32 or int64."""
    n = draw(st.integers(0, max_size))
    idx = draw(st.lists(st.integers(0, num_rows - 1), min_size=n, max_size=n))
    bad = allow_bad and n > 0 and draw(st.booleans())
    if bad:
        where = draw(st.integers(0, n - 1))
        idx[where] = draw(st.sampled_from([-1, -num_rows - 3, num_rows, num_rows + 7]))
    return np.asarray(idx, dtype=draw(INDEX_DTYPES)), bad


# ------------------------------------------------------------------ row ops


@FUZZ
@given(data=st.data(), num_rows=st.integers(1, 30), dim=st.integers(1, 9), dtype=FLOATS,
       op=st.sampled_from(["gather", "scatter", "scatter_add"]))
def test_row_ops_match_references_or_refuse_unchanged(data, num_rows, dim, dtype, op):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    table = rng.standard_normal((num_rows, dim)).astype(dtype)
    before = table.copy()
    idx, bad = data.draw(indices_for(num_rows))
    src = rng.standard_normal((idx.shape[0], dim)).astype(dtype)
    fn = {"gather": lambda: xferlib.gather_rows(table, idx),
          "scatter": lambda: xferlib.scatter_rows(table, idx, src),
          "scatter_add": lambda: xferlib.scatter_add_rows(table, idx, src)}[op]
    if bad:
        with pytest.raises(IndexError):
            fn()
        assert table.tobytes() == before.tobytes()
        return
    got = fn()
    if op == "gather":
        np.testing.assert_allclose(got, xferlib.gather_rows_reference(before, idx), **tol(dtype))
    else:
        reference = getattr(xferlib, f"{op}_rows_reference")(before, idx, src)
        np.testing.assert_allclose(table, reference, **tol(dtype))


# ------------------------------------------------------------------ HostTable


def table_state(table):
    return {"weights": table.numpy().copy(),
            **{k: table.state(k).copy() for k in table.state_names()}}


@FUZZ
@given(data=st.data(), num_rows=st.integers(1, 40), dim=st.integers(1, 7), dtype=FLOATS,
       optimizer=st.sampled_from(xferlib.SPARSE_OPTIMIZERS),
       lr=st.floats(1e-4, 1.0), steps=st.integers(1, 3))
def test_host_table_matches_reference_or_refuses_unchanged(data, num_rows, dim, dtype,
                                                           optimizer, lr, steps):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    table = xferlib.HostTable(num_rows, dim, dtype, optimizer=optimizer,
                              optimizer_kwargs={"lr": lr}, seed=1)
    try:
        for _ in range(steps):
            before = table_state(table)
            idx, bad = data.draw(indices_for(num_rows))
            grads = rng.standard_normal((idx.shape[0], dim)).astype(dtype)
            wrong_shape = data.draw(st.booleans()) and data.draw(st.booleans())
            if bad or wrong_shape:
                g = grads[:, :-1] if wrong_shape and dim > 1 else grads[:-1] if wrong_shape \
                    else grads
                if wrong_shape and g.shape == grads.shape:  # (0, 1): nothing to cut
                    continue
                with pytest.raises(IndexError if not wrong_shape else ValueError):
                    table.apply_gradients(idx, g)
                after = table_state(table)
                for k in before:
                    assert after[k].tobytes() == before[k].tobytes(), k
                continue
            table.apply_gradients(idx, grads)
            w, s, steps_ref = xferlib.sparse_update_reference(
                optimizer, before["weights"], {k: v for k, v in before.items()
                                               if k not in ("weights", "step")},
                before["step"], idx, grads, table.hyper)
            after = table_state(table)
            np.testing.assert_allclose(after["weights"], w, **tol(dtype))
            for k, v in s.items():
                np.testing.assert_allclose(after[k], v, **tol(dtype))
            np.testing.assert_array_equal(after["step"], steps_ref)
    finally:
        table.close()


@FUZZ
@given(lr=st.one_of(st.floats(-10, -1e-9), st.just(float("nan"))),
       optimizer=st.sampled_from(xferlib.SPARSE_OPTIMIZERS))
def test_bad_learning_rates_are_refused(lr, optimizer):
    with pytest.raises(ValueError):
        xferlib.HostTable(4, 2, optimizer=optimizer, optimizer_kwargs={"lr": lr})
    with pytest.raises(ValueError):
        EmbeddingCollection([(4, 2)], optimizer, {"lr": lr}, device="cpu")


# ------------------------------------------------------------------ collection


@st.composite
def collection_batch(draw, rows, allow_bad=True):
    """``(indices, offsets, per_sample_weights, B, broken)``: FBGEMM's layout for tables of
    ``rows`` rows, sometimes broken in one way (an index out of its table, offsets of the
    wrong length, decreasing, not starting at 0 or not ending at the index count)."""
    T = len(rows)
    B = draw(st.integers(0, 6))
    lengths = [draw(st.integers(0, 4)) for _ in range(T * B)]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    indices = np.asarray([draw(st.integers(0, rows[k // B] - 1)) for k in range(T * B)
                          for _ in range(lengths[k])], dtype=np.int64)
    psw = (np.asarray([draw(st.floats(-2, 2, width=32)) for _ in indices], np.float32)
           if draw(st.booleans()) else None)
    broken = draw(st.sampled_from([None] * 4 + ["index", "length", "decrease", "first",
                                                "last"])) if allow_bad else None
    if broken == "index" and indices.size:
        k = draw(st.integers(0, indices.size - 1))
        table = int(np.searchsorted(offsets, k, side="right") - 1) // B
        indices[k] = draw(st.sampled_from([-1, rows[table], rows[table] + 5]))
    elif broken == "length":  # T * B + 1 never fits: one more for T > 1, none for T = 1
        offsets = np.concatenate([offsets, offsets[-1:]]) if T > 1 else offsets[:0]
    elif broken == "decrease" and offsets.size > 2 and offsets[1] > 0:
        offsets[1], offsets[2] = offsets[2] + 1, offsets[1]
    elif broken == "first":
        offsets = offsets + 1
    elif broken == "last" and indices.size:
        offsets[-1] -= 1
    else:
        broken = None
    dtype = draw(INDEX_DTYPES)
    return indices.astype(dtype), offsets.astype(dtype), psw, B, broken


@FUZZ
@given(data=st.data(), rows=st.lists(st.integers(1, 20), min_size=1, max_size=3),
       dims=st.lists(st.integers(1, 6), min_size=3, max_size=3),
       placements=st.lists(st.sampled_from(["hbm", "host"]), min_size=3, max_size=3),
       optimizer=st.sampled_from(xferlib.SPARSE_OPTIMIZERS), lr=st.floats(1e-4, 1.0),
       pooling=st.sampled_from(["sum", "mean"]), dtype=FLOATS)
def test_collection_matches_reference_or_refuses_unchanged(data, rows, dims, placements,
                                                           optimizer, lr, pooling, dtype):
    T = len(rows)
    coll = EmbeddingCollection([TableConfig(n, d, placement=p)
                                for n, d, p in zip(rows, dims[:T], placements[:T])],
                               optimizer, {"lr": lr}, pooling=pooling, dtype=dtype,
                               device="cpu", seed=data.draw(st.integers(0, 1000)))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    for _ in range(2):
        before = coll.state_dict()
        indices, offsets, psw, B, broken = data.draw(collection_batch(rows))
        if broken:
            with pytest.raises(IndexError if broken == "index" else ValueError):
                coll.forward(indices, offsets, psw)
            after = coll.state_dict()
            for k in before:
                assert after[k].tobytes() == before[k].tobytes(), k
            continue
        weights = [before[f"{n}.weight"] for n in coll.names]
        out, ctx = coll.forward(indices, offsets, psw)
        np.testing.assert_allclose(out, pooled_lookup_reference(weights, indices, offsets, psw,
                                                                pooling), **tol(dtype))
        grad = rng.standard_normal((B, coll.total_dim)).astype(dtype)
        coll.backward(ctx, grad)
        names = [k for k in coll.state_names() if k != "step"]
        new_w, new_s, new_steps = collection_step_reference(
            optimizer, coll.hypers, weights,
            [{k: before[f"{n}.{k}"] for k in names} for n in coll.names],
            [before[f"{n}.step"] for n in coll.names], indices, offsets, grad, psw, pooling)
        for t in range(T):
            np.testing.assert_allclose(coll.weights(t), new_w[t], **tol(dtype))
            for k, v in new_s[t].items():
                np.testing.assert_allclose(coll.state(t, k), v, **tol(dtype))
            np.testing.assert_array_equal(coll.state(t, "step"), new_steps[t])


# ------------------------------------------------------------------ GPU: valid inputs


@pytest.mark.gpu
@FUZZ
@given(data=st.data(), rows=st.lists(st.integers(1, 5000), min_size=1, max_size=3),
       optimizer=st.sampled_from(xferlib.SPARSE_OPTIMIZERS),
       pooling=st.sampled_from(["sum", "mean"]))
def test_gpu_collection_matches_reference(data, rows, optimizer, pooling):
    if not xferlib.cupy_available():
        pytest.skip(GPU_SKIP_REASON)
    import cupy

    T = len(rows)
    coll = EmbeddingCollection([TableConfig(n, 8, placement="host" if t % 2 else "hbm")
                                for t, n in enumerate(rows)], optimizer, {"lr": 0.05},
                               pooling=pooling, device="cuda", seed=1)
    indices, offsets, psw, B, _ = data.draw(collection_batch(rows, allow_bad=False))
    weights = [coll.weights(t).astype(np.float64) for t in range(T)]
    out, ctx = coll.forward(cupy.asarray(indices), cupy.asarray(offsets),
                            None if psw is None else cupy.asarray(psw))
    np.testing.assert_allclose(out.get(), pooled_lookup_reference(weights, indices, offsets,
                                                                  psw, pooling),
                               rtol=1e-4, atol=1e-4)
    grad = np.random.default_rng(0).standard_normal((B, coll.total_dim)).astype(np.float32)
    states = [{k: coll.state(t, k).copy() for k in coll.state_names() if k != "step"}
              for t in range(T)]
    steps = [coll.state(t, "step").copy() for t in range(T)]
    coll.backward(ctx, cupy.asarray(grad))
    coll.check()
    new_w, _, new_steps = collection_step_reference(optimizer, coll.hypers, weights, states,
                                                    steps, indices, offsets, grad, psw, pooling)
    for t in range(T):
        np.testing.assert_allclose(coll.weights(t), new_w[t], rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(coll.state(t, "step"), new_steps[t])
