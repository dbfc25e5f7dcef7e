"""EmbeddingCollection against its float64 references, on every backend: every placement,
optimizer, pooling and index width; awkward inputs; bad inputs change nothing; two runs give
the same bits."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import xferlib
from xferlib.collection import (EmbeddingCollection, TableConfig, collection_step_reference,
                                pooled_lookup_reference)
from xferlib.testing import backend_params, get_backend

OPTIMIZERS = xferlib.SPARSE_OPTIMIZERS
HYPER = {"sgd": {"lr": 0.3, "momentum": 0.9}, "adam": {"lr": 0.05},
         "adamw": {"lr": 0.05, "weight_decay": 0.1}, "adagrad": {"lr": 0.2},
         "rowwise_adagrad": {"lr": 0.2}, "adamax": {"lr": 0.05},
         "rmsprop": {"lr": 0.01, "centered": True}, "adadelta": {"lr": 1.0}}


def make_batch(rng, rows, B, max_len=4, dtype=np.int64, zipf=False):
    """FBGEMM-layout indices/offsets for tables of ``rows`` rows, bags of 0..max_len."""
    lengths = rng.integers(0, max_len + 1, size=len(rows) * B)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(dtype)
    parts = []
    for t, n in enumerate(rows):
        count = int(lengths[t * B:(t + 1) * B].sum())
        draw = (np.minimum(rng.zipf(1.3, count) - 1, n - 1) if zipf
                else rng.integers(0, n, count))
        parts.append(draw)
    return np.concatenate(parts).astype(dtype), offsets


def state_arrays(coll, t):
    names = coll.state_names()
    state = {k: coll.state(t, k).copy() for k in names if k != "step"}
    return state, coll.state(t, "step").copy()


def xp_of(backend):
    return backend.xp


def device_of(backend):
    return "cuda" if backend.gpu else "cpu"


def tolerance(dtype):
    return dict(rtol=2e-5, atol=2e-6) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-12)


BACKENDS = backend_params("numpy", "cupy")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("placement", ["hbm", "host", "mixed"])
def test_step_matches_reference(backend, optimizer, placement):
    backend = get_backend(backend)
    rng = np.random.default_rng(abs(hash((optimizer, placement))) % 2**32)
    rows, dims = [7, 1, 33], [4, 3, 8]
    places = {"hbm": ["hbm"] * 3, "host": ["host"] * 3, "mixed": ["host", "hbm", "host"]}
    tables = [TableConfig(n, d, placement=p, lr=0.5 * HYPER[optimizer]["lr"] if t == 2 else None)
              for t, (n, d, p) in enumerate(zip(rows, dims, places[placement]))]
    coll = EmbeddingCollection(tables, optimizer, HYPER[optimizer],
                               dtype="float64" if not backend.gpu else "float32",
                               device=device_of(backend), seed=3)
    xp = xp_of(backend)
    for step in range(3):
        indices, offsets = make_batch(rng, rows, B=5, zipf=step == 1)
        weights = [coll.weights(t).astype(np.float64) for t in range(3)]
        states = [state_arrays(coll, t) for t in range(3)]
        out, ctx = coll.forward(xp.asarray(indices), xp.asarray(offsets))
        expected = pooled_lookup_reference(weights, indices, offsets)
        np.testing.assert_allclose(_host(out), expected, **tolerance(coll.dtype))
        grad = rng.standard_normal((5, sum(dims)))
        coll.backward(ctx, xp.asarray(grad.astype(coll.dtype)))
        hypers = coll.hypers
        new_w, new_s, new_steps = collection_step_reference(
            optimizer, hypers, weights, [s for s, _ in states], [st for _, st in states],
            indices, offsets, grad)
        for t in range(3):
            np.testing.assert_allclose(coll.weights(t), new_w[t], **tolerance(coll.dtype))
            for k, v in new_s[t].items():
                np.testing.assert_allclose(coll.state(t, k), v, **tolerance(coll.dtype))
            np.testing.assert_array_equal(coll.state(t, "step"), new_steps[t])


def _host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("weighted", [False, True])
def test_pooling_weights_and_index_widths(backend, pooling, index_dtype, weighted):
    backend = get_backend(backend)
    rng = np.random.default_rng(7)
    rows, dims = [50, 4097 if backend.gpu else 300], [16, 5]
    coll = EmbeddingCollection([TableConfig(rows[0], dims[0], placement="host"),
                                TableConfig(rows[1], dims[1])], "adagrad", {"lr": 0.1},
                               pooling=pooling, device=device_of(backend), seed=1)
    indices, offsets = make_batch(rng, rows, B=9, max_len=6, dtype=index_dtype)
    psw = rng.uniform(0.5, 2.0, indices.size).astype(np.float32) if weighted else None
    weights = [coll.weights(t).astype(np.float64) for t in range(2)]
    states = [state_arrays(coll, t) for t in range(2)]
    xp = xp_of(backend)
    out, ctx = coll.forward(xp.asarray(indices), xp.asarray(offsets),
                            None if psw is None else xp.asarray(psw))
    np.testing.assert_allclose(_host(out), pooled_lookup_reference(weights, indices, offsets,
                                                                   psw, pooling),
                               rtol=2e-5, atol=2e-6)
    grad = rng.standard_normal((9, sum(dims))).astype(np.float32)
    coll.backward(ctx, xp.asarray(grad))
    new_w, new_s, _ = collection_step_reference(
        "adagrad", coll.hypers, weights, [s for s, _ in states], [st for _, st in states],
        indices, offsets, grad, psw, pooling)
    for t in range(2):
        np.testing.assert_allclose(coll.weights(t), new_w[t], rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("widths", [[4, 4], [8, 4], [16, 4], [32, 4], [64, 4], [12, 3],
                                    [100, 8], [260, 4]])
@pytest.mark.parametrize("lengths", ["long", "ones"])
def test_pooled_lookup_and_update_shapes(backend, widths, lengths):
    """The pooled lookup and the update on the shapes that pick their launches: lane groups
    of 1, 2, 4, 8, 16 and 32 lanes (the widest row's vectors: 4-float vectors, or single
    floats beside a 3-wide table), rows wider than one pass of a group (260 floats), bags
    longer than a group's turn (up to 70 lookups, empty ones too) and bags of about one lookup
    (two bags a group, an odd count of them); sum pooling with SGD (the update's rows a
    quarter of those lanes each), weighted mean pooling with row-wise Adagrad (half), host and
    HBM tables; one step against the float64 references."""
    backend = get_backend(backend)
    xp = xp_of(backend)
    rng = np.random.default_rng(sum(widths) + (lengths == "long"))
    rows, dims, B = [37, 5, 11], widths + [4], 7  # 21 bags
    for pooling, weighted, optimizer in (("sum", False, "sgd"),
                                         ("mean", True, "rowwise_adagrad")):
        coll = EmbeddingCollection([TableConfig(rows[0], dims[0], placement="host"),
                                    TableConfig(rows[1], dims[1]), TableConfig(rows[2], dims[2])],
                                   optimizer, {"lr": 0.1}, pooling=pooling,
                                   device=device_of(backend), seed=2)
        choices = [0, 1, 31, 32, 33, 70] if lengths == "long" else [0, 1, 1, 2]
        counts = rng.choice(choices, size=3 * B)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        indices = np.concatenate([rng.integers(0, rows[t], int(counts[t * B:(t + 1) * B].sum()))
                                  for t in range(3)]).astype(np.int64)
        psw = rng.uniform(0.5, 2.0, indices.size).astype(np.float32) if weighted else None
        weights = [coll.weights(t).astype(np.float64) for t in range(3)]
        states = [state_arrays(coll, t) for t in range(3)]
        out, ctx = coll.forward(xp.asarray(indices), xp.asarray(offsets),
                                None if psw is None else xp.asarray(psw))
        np.testing.assert_allclose(_host(out), pooled_lookup_reference(weights, indices,
                                                                       offsets, psw, pooling),
                                   rtol=2e-5, atol=2e-5)
        grad = rng.standard_normal((B, sum(dims))).astype(np.float32)
        coll.backward(ctx, xp.asarray(grad))
        new_w, new_s, new_steps = collection_step_reference(
            optimizer, coll.hypers, weights, [s for s, _ in states], [st for _, st in states],
            indices, offsets, grad, psw, pooling)
        for t in range(3):
            np.testing.assert_allclose(coll.weights(t), new_w[t], rtol=2e-5, atol=2e-5)
            for k, v in new_s[t].items():
                np.testing.assert_allclose(coll.state(t, k), v, rtol=2e-5, atol=2e-5)
            np.testing.assert_array_equal(coll.state(t, "step"), new_steps[t])


@pytest.mark.parametrize("backend", BACKENDS)
def test_awkward_batches(backend):
    """An empty batch, empty bags, one table, 1-row tables, one index repeated everywhere."""
    backend = get_backend(backend)
    xp = xp_of(backend)
    coll = EmbeddingCollection([TableConfig(1, 3)], "sgd", {"lr": 1.0},
                               device=device_of(backend), seed=0)
    before = coll.weights(0).copy()
    out, ctx = coll.forward(xp.zeros(0, np.int64), xp.zeros(4, np.int64))  # B = 3, empty bags
    assert _host(out).shape == (3, 3) and not _host(out).any()
    coll.backward(ctx, xp.ones((3, 3), np.float32))
    np.testing.assert_array_equal(coll.weights(0), before)
    out, ctx = coll.forward(xp.zeros(0, np.int64), xp.zeros(1, np.int64))  # B = 0
    assert _host(out).shape == (0, 3)
    coll.backward(ctx, xp.zeros((0, 3), np.float32))
    indices = xp.zeros(1000, np.int64)
    offsets = xp.asarray([0, 0, 1000])
    out, ctx = coll.forward(indices, offsets)
    np.testing.assert_allclose(_host(out)[1], 1000 * before[0], rtol=1e-4)
    coll.backward(ctx, xp.ones((2, 3), np.float32))
    np.testing.assert_allclose(coll.weights(0)[0], before[0] - 1000, rtol=1e-5)


def test_bad_inputs_change_nothing():
    coll = EmbeddingCollection([TableConfig(10, 4), TableConfig(5, 2, placement="host")],
                               "adam", device="cpu", seed=0)
    before = coll.state_dict()
    idx, off = np.array([1, 2, 3, 4]), np.array([0, 1, 2, 3, 4])
    with pytest.raises(IndexError, match=r"index 5 at position 3 .*table 't1' of 5 rows"):
        coll.forward(np.array([1, 2, 3, 5]), off)
    with pytest.raises(IndexError, match="index -1 at position 0"):
        coll.forward(np.array([-1, 2, 3, 4]), off)
    with pytest.raises(ValueError, match="T \\* B \\+ 1"):
        coll.forward(idx, np.array([0, 1, 4, 4]))
    with pytest.raises(ValueError, match="must not decrease"):
        coll.forward(idx, np.array([0, 2, 1, 3, 4]))
    with pytest.raises(ValueError, match=r"offsets\[-1\]"):
        coll.forward(idx, np.array([0, 1, 2, 3, 3]))
    with pytest.raises(ValueError, match=r"offsets\[0\]"):
        coll.forward(idx, np.array([1, 1, 2, 3, 4]))
    with pytest.raises(TypeError, match="int32 or int64"):
        coll.forward(idx.astype(np.int8), off)
    with pytest.raises(TypeError, match="int32 or int64"):
        coll.forward(idx.astype(np.float32), off)
    with pytest.raises(ValueError, match="per_sample_weights must have shape"):
        coll.forward(idx, off, np.ones(3, np.float32))
    _, ctx = coll.forward(idx, off)
    with pytest.raises(ValueError, match="grad_pooled must have shape"):
        coll.backward(ctx, np.ones((2, 5), np.float32))
    with pytest.raises(TypeError, match="floating point"):
        coll.backward(ctx, np.ones((2, 6), np.int64))
    after = coll.state_dict()
    for k in before:
        np.testing.assert_array_equal(after[k], before[k])


def test_bad_configs():
    with pytest.raises(TypeError, match="num_rows must be an integer, got 10.7"):
        TableConfig(10.7, 4)
    with pytest.raises(ValueError, match="placement"):
        TableConfig(10, 4, placement="gpu")
    with pytest.raises(ValueError, match="unique"):
        EmbeddingCollection([TableConfig(3, 2, name="a"), TableConfig(3, 2, name="a")],
                            device="cpu")
    with pytest.raises(ValueError, match="unknown optimizer"):
        EmbeddingCollection([(3, 2)], "adamm", device="cpu")
    with pytest.raises(ValueError, match="unknown hyperparameter"):
        EmbeddingCollection([(3, 2)], "sgd", {"beta": 1}, device="cpu")
    with pytest.raises(ValueError, match="at least one table"):
        EmbeddingCollection([], device="cpu")


def test_arguments_that_are_not_arrays_or_of_another_dtype_raise_named_errors():
    """``out`` of another dtype (an int array truncated the pooled rows, float16 rounded
    them), lists as ``per_sample_weights`` / ``grad_pooled`` (AttributeError), a table index
    or seed that is not an integer (truncated by int()): a TypeError naming the argument,
    nothing changed."""
    coll = EmbeddingCollection([TableConfig(10, 4, name="a"), TableConfig(5, 2, name="b")],
                               "adam", device="cpu", seed=0)
    before = coll.state_dict()
    idx, off = np.array([1, 2, 3, 4]), np.array([0, 1, 2, 3, 4])
    for dtype in (np.int64, np.float16, np.float64):
        with pytest.raises(TypeError, match="out must have the collection's dtype float32"):
            coll.lookup(idx, off, out=np.zeros((2, 6), dtype))
    with pytest.raises(TypeError, match="out must be an array"):
        coll.lookup(idx, off, out=[[0.0] * 6] * 2)
    with pytest.raises(TypeError, match="per_sample_weights must be an array, got list"):
        coll.forward(idx, off, [1.0, 1.0, 1.0, 1.0])
    _, ctx = coll.forward(idx, off)
    with pytest.raises(TypeError, match="grad_pooled must be an array, got list"):
        coll.backward(ctx, [[1.0] * 6] * 2)
    with pytest.raises(TypeError, match="table must be a name or an integer index"):
        coll.set_hyper(1.7, lr=0.5)
    with pytest.raises(TypeError, match="table must be a name or an integer index"):
        coll.weights(True)
    assert [h["lr"] for h in coll.hypers] == [0.001, 0.001]
    after = coll.state_dict()
    for k in before:
        np.testing.assert_array_equal(after[k], before[k])
    out = np.zeros((2, 6), np.float32)
    assert coll.lookup(idx, off, out=out) is out and out.any()
    with pytest.raises(TypeError, match="seed must be an integer or None, got 1.5"):
        EmbeddingCollection([TableConfig(10, 4)], device="cpu", seed=1.5)
    np.testing.assert_array_equal(
        EmbeddingCollection([TableConfig(10, 4)], device="cpu", seed=np.int64(3)).weights(0),
        EmbeddingCollection([TableConfig(10, 4)], device="cpu", seed=3).weights(0))


@pytest.mark.parametrize("init", [("normal", float("nan"), 1.0), ("normal", 0.0, float("inf")),
                                  ("uniform", 0.0, float("inf")),
                                  ("uniform", -float("inf"), 1.0)])
def test_non_finite_init_parameters_are_refused(init):
    """A NaN mean or an infinite bound passed init_kind's checks and filled the table with
    NaN or inf (HostTable's initializers refuse them)."""
    with pytest.raises(ValueError, match="finite"):
        TableConfig(10, 4, init=init)
    with pytest.raises(ValueError, match="init needs two numbers"):
        TableConfig(10, 4, init=("uniform", "low", 1.0))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("optimizer", ["adam", "rowwise_adagrad"])
def test_padded_batches_train_as_their_true_part(backend, optimizer):
    """``padded=True``: indices past offsets[-1] (any values, out of range included) are
    ignored; the pooled rows, weights and state equal the unpadded batch's, bit for bit,
    with host tables, their GPU cache and HBM tables. A batch that is all padding (B = 0)
    changes nothing."""
    backend = get_backend(backend)
    xp = xp_of(backend)
    rows, dims = [40, 7, 300], [8, 4, 8]  # the cached host tables share one width

    def build():
        cache = 16 if backend.gpu else 0
        return EmbeddingCollection([TableConfig(40, 8, placement="host", cache_rows=cache),
                                    TableConfig(7, 4), TableConfig(300, 8, placement="host")],
                                   optimizer, HYPER[optimizer], device=device_of(backend),
                                   seed=2)

    plain, padded = build(), build()
    rng = np.random.default_rng(4)
    for step in range(4):
        indices, offsets = make_batch(rng, rows, B=6, max_len=5, zipf=step % 2 == 1)
        psw = rng.uniform(0.5, 2.0, indices.size).astype(np.float32)
        pad = int(rng.integers(1, 40))
        junk = rng.integers(-9, 10**6, pad)  # padding: never read as a row
        p_idx = np.concatenate([indices, junk]).astype(np.int64)
        p_psw = np.concatenate([psw, np.full(pad, np.nan, np.float32)])
        grad = rng.standard_normal((6, sum(dims))).astype(np.float32)
        out_a, ctx_a = plain.forward(xp.asarray(indices), xp.asarray(offsets), xp.asarray(psw))
        out_b, ctx_b = padded.forward(xp.asarray(p_idx), xp.asarray(offsets), xp.asarray(p_psw),
                                      padded=True)
        assert _host(out_a).tobytes() == _host(out_b).tobytes()
        plain.backward(ctx_a, xp.asarray(grad))
        padded.backward(ctx_b, xp.asarray(grad))
    before = padded.state_dict()
    out, ctx = padded.forward(xp.asarray(np.arange(5, dtype=np.int64)), xp.zeros(1, np.int64),
                              padded=True)
    padded.backward(ctx, xp.zeros((0, sum(dims)), np.float32))
    assert _host(out).shape == (0, sum(dims))
    a, b = plain.state_dict(), padded.state_dict()
    for k in a:
        assert a[k].tobytes() == b[k].tobytes() == before[k].tobytes(), k
    with pytest.raises(ValueError, match="outside the padded"):
        EmbeddingCollection([TableConfig(4, 2)]).forward(np.zeros(2, np.int64),
                                                         np.array([0, 3]), padded=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_runs_bitwise_identical(backend):
    backend = get_backend(backend)
    xp = xp_of(backend)

    def train():
        rng = np.random.default_rng(11)
        coll = EmbeddingCollection([TableConfig(64, 8, placement="host"), TableConfig(9, 4)],
                                   "adam", {"lr": 0.01}, device=device_of(backend), seed=5)
        for _ in range(4):
            indices, offsets = make_batch(rng, [64, 9], B=33, max_len=8, zipf=True)
            out, ctx = coll.forward(xp.asarray(indices), xp.asarray(offsets))
            coll.backward(ctx, xp.asarray(rng.standard_normal(out.shape).astype(np.float32)))
        return coll.state_dict()

    first, second = train(), train()
    for k in first:
        assert first[k].tobytes() == second[k].tobytes(), k


def test_pack_dict_form():
    coll = EmbeddingCollection([TableConfig(10, 2, name="user"), TableConfig(4, 3, name="ad")],
                               device="cpu")
    idx, off = coll.pack({"ad": (np.array([3]), np.array([0, 0, 1])),
                          "user": (np.array([1, 2, 9], np.int32), np.array([0, 2, 3]))})
    assert idx.tolist() == [1, 2, 9, 3] and off.tolist() == [0, 2, 3, 3, 4]
    with pytest.raises(KeyError, match="missing"):
        coll.pack({"user": (np.array([1]), np.array([0, 1]))})
    with pytest.raises(ValueError, match="same number of bags"):
        coll.pack({"ad": (np.array([3]), np.array([0, 1])),
                   "user": (np.array([1, 2]), np.array([0, 1, 2]))})
    user = (np.array([1, 2, 9]), np.array([0, 2, 3]))
    for ad, error, message in (  # each table's own offsets and dtypes
            ((np.array([3]), np.array([1, 1, 1])), ValueError, r"'ad': offsets\[0\] must be 0"),
            ((np.array([3]), np.array([0, 1, 0])), ValueError, "'ad': offsets must not"),
            ((np.array([3, 1]), np.array([0, 0, 1])), ValueError, r"'ad': offsets\[-1\]"),
            ((np.array([3.0]), np.array([0, 0, 1])), TypeError, "'ad': indices must be int"),
            ((np.array([3]), np.array([0.0, 0, 1])), TypeError, "'ad': offsets must be int"),
            (([3], np.array([0, 0, 1])), TypeError, "'ad': indices must be an array"),
            ((np.array([[3]]), np.array([0, 0, 1])), ValueError, "'ad': indices must be 1-D"),
            ((np.array([3]), np.array([0, 0, 1]), np.ones(2)), ValueError, "one weight per")):
        entry = dict(user=user + (np.ones(3),) if len(ad) == 3 else user, ad=ad)
        with pytest.raises(error, match=message):
            coll.pack(entry)


def test_state_dict_round_trip_and_per_table_lr():
    coll = EmbeddingCollection([TableConfig(6, 2, lr=0.0), TableConfig(6, 2)], "sgd",
                               {"lr": 1.0}, device="cpu")
    before = coll.weights(0).copy()
    out, ctx = coll.forward(np.array([1, 1]), np.array([0, 1, 2]))
    coll.backward(ctx, np.ones((1, 4), np.float32))
    np.testing.assert_array_equal(coll.weights(0), before)   # lr 0 for table 0
    assert coll.state("t1", "step")[1] == 1
    saved = coll.state_dict()
    other = EmbeddingCollection([TableConfig(6, 2, lr=0.0), TableConfig(6, 2)], "sgd",
                                {"lr": 1.0}, device="cpu", seed=9)
    other.load_state_dict(saved)
    np.testing.assert_array_equal(other.weights(1), coll.weights(1))
    with pytest.raises(ValueError, match="missing"):
        other.load_state_dict({k: v for k, v in saved.items() if k != "t1.weight"})


def test_init_counter_based_and_chunk_independent():
    """Values depend on (seed, table, row, col) only: any chunking gives the same bits, and a
    table's rows do not depend on the other tables or the placement."""
    from xferlib.collection import init as init_mod

    a = EmbeddingCollection([TableConfig(300, 5, init=("uniform", -1, 1)),
                             TableConfig(50, 3, init=("normal", 0, 2))], "adagrad",
                            {"initial_accumulator_value": 0.25}, device="cpu", seed=4)
    old = init_mod.INIT_CHUNK_ELEMENTS
    init_mod.INIT_CHUNK_ELEMENTS = 7
    try:
        b = EmbeddingCollection([TableConfig(300, 5, init=("uniform", -1, 1), placement="host"),
                                 TableConfig(50, 3, init=("normal", 0, 2))], "adagrad",
                                {"initial_accumulator_value": 0.25}, device="cpu", seed=4)
    finally:
        init_mod.INIT_CHUNK_ELEMENTS = old
    for t in range(2):
        assert a.weights(t).tobytes() == b.weights(t).tobytes()
        np.testing.assert_array_equal(a.state(t, "sum"), 0.25)
        np.testing.assert_array_equal(a.state(t, "step"), 0)
    w = a.weights(0)
    assert -1 <= w.min() and w.max() < 1 and abs(w.mean()) < 0.1
    assert abs(a.weights(1).std() - 2) < 0.3
    c = EmbeddingCollection([TableConfig(300, 5, init=("uniform", -1, 1))], "sgd",
                            device="cpu", seed=5)
    assert c.weights(0).tobytes() != a.weights(0).tobytes()
    with pytest.raises(ValueError, match="init must be"):
        TableConfig(3, 2, init=("gamma", 1, 2))


@pytest.mark.gpu
def test_init_same_values_on_cpu_and_gpu():
    get_backend("cupy")
    tables = [TableConfig(5000, 12, init=("uniform", -0.5, 0.5), placement="host"),
              TableConfig(3000, 8, init=("uniform", 0, 3)), TableConfig(2000, 4)]
    cpu = EmbeddingCollection(tables, "adam", device="cpu", seed=8)
    gpu = EmbeddingCollection(tables, "adam", device="cuda", seed=8)
    for t in range(2):  # uniform: bitwise
        assert cpu.weights(t).tobytes() == gpu.weights(t).tobytes()
    np.testing.assert_array_max_ulp(cpu.weights(2), gpu.weights(2), maxulp=1)
    for k in ("exp_avg", "exp_avg_sq", "step"):
        for t in range(3):
            np.testing.assert_array_equal(cpu.state(t, k), gpu.state(t, k))

def test_cache_config_checks():
    with pytest.raises(ValueError, match="cache_rows is for host tables"):
        TableConfig(10, 4, cache_rows=5)
    with pytest.raises(ValueError, match="share one width"):
        EmbeddingCollection([TableConfig(10, 4, placement="host", cache_rows=4),
                             TableConfig(10, 8, placement="host")], device="cpu")
    coll = EmbeddingCollection([TableConfig(10, 4, placement="host", cache_rows=4)],
                               device="cpu")
    assert coll.cache_stats()["lookups"] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_partial_load_writes_only_what_it_is_given(backend):
    """``load_state_dict(partial=True)``: the arrays given are checked and loaded, every
    other array (of that table and of the others) keeps its value; a full load still needs
    every array, and a bad array in a partial load changes nothing."""
    backend = get_backend(backend)
    xp = xp_of(backend)
    rng = np.random.default_rng(3)
    coll = EmbeddingCollection([TableConfig(30, 4, placement="host", name="a"),
                                TableConfig(20, 8, name="b")], "adam", {"lr": 0.1},
                               device=device_of(backend), seed=1)
    indices, offsets = make_batch(rng, [30, 20], B=6)
    out, ctx = coll.forward(xp.asarray(indices), xp.asarray(offsets))
    coll.backward(ctx, xp.asarray(rng.standard_normal(out.shape).astype(np.float32)))
    before = coll.state_dict()
    new_b = rng.standard_normal((20, 8)).astype(np.float32)
    coll.load_state_dict({"b.weight": new_b}, partial=True)
    after = coll.state_dict()
    np.testing.assert_array_equal(after["b.weight"], new_b)
    for key in before:
        if key != "b.weight":
            assert after[key].tobytes() == before[key].tobytes(), key
    with pytest.raises(ValueError, match="missing"):
        coll.load_state_dict({"b.weight": new_b})
    with pytest.raises(ValueError, match="unexpected"):
        coll.load_state_dict({"c.weight": new_b}, partial=True)
    with pytest.raises(ValueError, match="shape"):
        coll.load_state_dict({"a.weight": np.zeros((30, 4), np.float32),
                              "b.weight": np.zeros((20, 7), np.float32)}, partial=True)
    assert all(coll.state_dict()[k].tobytes() == after[k].tobytes() for k in after)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("placement", ["hbm", "host"])
def test_write_rows_sets_weights_and_keeps_state(backend, placement):
    """``write_rows``: the rows given take the values, their optimizer state and every other
    row stay as they were; on the GPU a cached row is dropped first, so the next lookup
    reads the written values; bad rows or values change nothing."""
    backend = get_backend(backend)
    xp = xp_of(backend)
    rng = np.random.default_rng(5)
    cache = dict(cache_rows=8) if placement == "host" else {}
    coll = EmbeddingCollection([TableConfig(30, 4, placement=placement, **cache)], "adam",
                               {"lr": 0.1}, device=device_of(backend), seed=2)
    for _ in range(2):  # rows cached and with state
        indices, offsets = make_batch(rng, [30], B=5)
        out, ctx = coll.forward(xp.asarray(indices), xp.asarray(offsets))
        coll.backward(ctx, xp.asarray(rng.standard_normal(out.shape).astype(np.float32)))
    before = coll.state_dict()
    rows = np.array([indices[0], 29, 0]) if indices[0] not in (0, 29) else np.array([5, 29, 0])
    values = rng.standard_normal((3, 4)).astype(np.float32)
    for bad_rows, bad_values, error in [(np.array([1, 30, 2]), values, IndexError),
                                        (np.array([-1, 3, 2]), values, IndexError),
                                        (rows, values[:2], ValueError),
                                        (np.array([1.0, 2.0, 3.0]), values, TypeError)]:
        with pytest.raises(error):
            coll.write_rows(0, bad_rows, bad_values)
    assert all(coll.state_dict()[k].tobytes() == before[k].tobytes() for k in before)
    coll.write_rows("t0", rows, values)
    after = coll.state_dict()
    expected = before["t0.weight"].copy()
    expected[rows] = values
    np.testing.assert_array_equal(after["t0.weight"], expected)
    for key in before:
        if key != "t0.weight":
            assert after[key].tobytes() == before[key].tobytes(), key
    looked_up = coll.lookup(xp.asarray(rows), xp.asarray(np.arange(4)))
    np.testing.assert_array_equal(xferlib.handoff.to_numpy(looked_up), values)


@pytest.mark.parametrize("backend", BACKENDS)
def test_padded_batches_with_their_size_check_the_last_bag_against_it(backend):
    """``padded=True, total=``: the last bag must end at ``total[0]`` (the batch's true size,
    held on the device): a batch that does is the unpadded one, bit for bit; one that ends
    short of it or past it (in the padding) is refused as an unpadded batch with those
    offsets is (ValueError; on the GPU from a later call or the check) and changes nothing."""
    backend = get_backend(backend)
    xp = xp_of(backend)
    rng = np.random.default_rng(8)
    rows = [40, 300]

    def build():
        return EmbeddingCollection([TableConfig(40, 8, placement="host"), TableConfig(300, 8)],
                                   "adam", {"lr": 0.1}, device=device_of(backend), seed=3)

    plain, padded = build(), build()
    indices, offsets = make_batch(rng, rows, B=5, max_len=4)
    n = indices.size
    p_idx = xp.asarray(np.concatenate([indices, np.zeros(9, np.int64)]))
    total = xp.asarray(np.array([n], np.int64))
    grad = xp.asarray(rng.standard_normal((5, 16)).astype(np.float32))
    out_a, ctx_a = plain.forward(xp.asarray(indices), xp.asarray(offsets))
    out_b, ctx_b = padded.forward(p_idx, xp.asarray(offsets), padded=True, total=total)
    assert _host(out_a).tobytes() == _host(out_b).tobytes()
    plain.backward(ctx_a, grad)
    padded.backward(ctx_b, grad)
    before = padded.state_dict()
    for shift in (-1, 1):
        bad = offsets.copy()
        bad[-1] += shift
        with pytest.raises(ValueError, match="offsets"):
            _, ctx = padded.forward(p_idx, xp.asarray(bad), padded=True, total=total)
            padded.backward(ctx, grad)
            padded.check()
    after = padded.state_dict()
    for key in before:
        assert after[key].tobytes() == before[key].tobytes() == plain.state_dict()[key].tobytes()
    with pytest.raises(ValueError, match="padded"):
        padded.forward(p_idx, xp.asarray(offsets), total=total)
    with pytest.raises(TypeError, match="total"):
        padded.forward(p_idx, xp.asarray(offsets), padded=True,
                       total=xp.asarray([n], dtype=np.int32))


def test_recorded_contexts_are_kept_for_life_and_never_given_for_an_unrecorded_forward():
    """A forward recorded into a CUDA graph keeps its context under its key for as long as
    the collection lives (a replay may write its plan at any later step), whatever came
    between; a recording backward never gets the context of a forward that ran unrecorded
    (its plan lies where no replay writes), not even when an older recording had the
    same key: it raises (with raise_in_calls off, a collective step's, it only keeps the error
    for check() and gives None)."""
    coll = EmbeddingCollection([TableConfig(5, 2)], "sgd", {"lr": 0.1}, device="cpu")
    indices, offsets = np.array([1, 3], np.int32), np.array([0, 2], np.int32)
    recorded = {}
    for k in range(20):  # far past the unrecorded contexts kept
        _, recorded[k] = coll.forward(indices, offsets)
        coll.keep_context(("key", k), recorded[k], recorded=True)
    for k in range(20):  # a replayed forward: nothing kept this step, its recording's plan
        assert coll.take_context(("key", k), recorded=True) is recorded[k]
        assert coll.take_context(("key", k), recorded=True) is recorded[k]  # again
    assert coll.take_context(("key", 3)) is None  # unrecorded: only what this step kept
    _, again = coll.forward(indices, offsets)
    coll.keep_context(("key", 3), again, recorded=True)  # recorded again at the same key
    assert coll.take_context(("key", 3), recorded=True) is again
    assert coll.take_context(("key", 3), recorded=True) is again
    _, eager = coll.forward(indices, offsets)
    coll.keep_context(("key", 4), eager)  # this step's forward ran unrecorded
    with pytest.raises(RuntimeError, match="without a recording of its forward"):
        coll.take_context(("key", 4), recorded=True)
    with pytest.raises(RuntimeError, match="without a recording of its forward"):
        coll.take_context(("nowhere",), recorded=True)
    coll.keep_context(("key", 5), eager)
    assert coll.take_context(("key", 5)) is eager  # an unrecorded backward takes it
    assert coll.take_context(("key", 5)) is None
    coll.raise_in_calls = False  # a collective step's: no rank raises alone
    assert coll.take_context(("nowhere",), recorded=True) is None


def test_many_recorded_contexts_warn_that_their_memory_grows():
    """Recorded contexts are never dropped: at 64 of them (and at each doubling) a warning
    says the step's buffers wander and what to do; not before."""
    coll = EmbeddingCollection([TableConfig(5, 2)], "sgd", {"lr": 0.1}, device="cpu")
    _, ctx = coll.forward(np.array([1], np.int32), np.array([0, 1], np.int32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for k in range(63):
            coll.keep_context(("key", k), ctx, recorded=True)
        coll.keep_context(("key", 0), ctx, recorded=True)  # the same key: still 63
    with pytest.warns(RuntimeWarning, match="64 recorded lookups of this collection"):
        coll.keep_context(("key", 63), ctx, recorded=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for k in range(64, 127):
            coll.keep_context(("key", k), ctx, recorded=True)
    with pytest.warns(RuntimeWarning, match="128 recorded lookups"):
        coll.keep_context(("key", 127), ctx, recorded=True)
