"""EmbeddingCollection against its float64 references, on every backend: every placement,
optimizer, pooling and index width; awkward inputs; bad inputs change nothing; two runs give
the same bits."""

from __future__ import annotations

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
@pytest.mark.parametrize("widths", [[4, 4], [12, 3], [100, 8], [260, 4]])
@pytest.mark.parametrize("lengths", ["long", "ones"])
def test_pooled_lookup_shapes(backend, widths, lengths):
    """The pooled lookup on the shapes that pick its launch: lane groups of 1 to 32 lanes (the
    widest row's vectors), rows wider than one pass of a group (260 floats), bags longer than
    a group's turn (up to 70 lookups, empty ones too) and bags of about one lookup (two bags
    a group, an odd count of them), weighted and mean pooled, host and HBM tables."""
    backend = get_backend(backend)
    xp = xp_of(backend)
    rng = np.random.default_rng(sum(widths) + len(lengths))
    rows, dims, B = [37, 5, 11], widths + [4], 7  # 21 bags
    for pooling, weighted in (("sum", False), ("mean", True)):
        coll = EmbeddingCollection([TableConfig(rows[0], dims[0], placement="host"),
                                    TableConfig(rows[1], dims[1]), TableConfig(rows[2], dims[2])],
                                   "sgd", {"lr": 0.1}, pooling=pooling,
                                   device=device_of(backend), seed=2)
        choices = [0, 1, 31, 32, 33, 70] if lengths == "long" else [0, 1, 1, 2]
        counts = rng.choice(choices, size=3 * B)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        indices = np.concatenate([rng.integers(0, rows[t], int(counts[t * B:(t + 1) * B].sum()))
                                  for t in range(3)]).astype(np.int64)
        psw = rng.uniform(0.5, 2.0, indices.size).astype(np.float32) if weighted else None
        weights = [coll.weights(t).astype(np.float64) for t in range(3)]
        out, _ = coll.forward(xp.asarray(indices), xp.asarray(offsets),
                              None if psw is None else xp.asarray(psw))
        np.testing.assert_allclose(_host(out), pooled_lookup_reference(weights, indices,
                                                                       offsets, psw, pooling),
                                   rtol=2e-5, atol=2e-5)


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


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["sgd", "adam", "rowwise_adagrad"])
def test_gpu_large_zipf_batch_matches_reference(optimizer):
    """A batch of 40k lookups on the GPU: the sort's merge rounds, hot rows whose runs cross
    hundreds of the gradient sums' chunks, tables of different widths, host and HBM."""
    import cupy

    rng = np.random.default_rng(5)
    rows, dims, B = [5000, 300, 70_000], [16, 8, 128], 2000
    coll = EmbeddingCollection([TableConfig(rows[0], dims[0], placement="host"),
                                TableConfig(rows[1], dims[1]), TableConfig(rows[2], dims[2])],
                               optimizer, {"lr": 0.01}, device="cuda", seed=2)
    indices, offsets = make_batch(rng, rows, B=B, max_len=13, zipf=True)
    weights = [coll.weights(t).astype(np.float64) for t in range(3)]
    states = [state_arrays(coll, t) for t in range(3)]
    out, ctx = coll.forward(cupy.asarray(indices), cupy.asarray(offsets))
    np.testing.assert_allclose(_host(out), pooled_lookup_reference(weights, indices, offsets),
                               rtol=1e-4, atol=1e-4)
    grad = rng.standard_normal((B, sum(dims))) / 10
    coll.backward(ctx, cupy.asarray(grad.astype(np.float32)))
    new_w, new_s, new_steps = collection_step_reference(
        optimizer, coll.hypers, weights, [s for s, _ in states], [st for _, st in states],
        indices, offsets, grad)
    for t in range(3):
        np.testing.assert_allclose(coll.weights(t), new_w[t], rtol=1e-4, atol=2e-5)
        for k, v in new_s[t].items():
            np.testing.assert_allclose(coll.state(t, k), v, rtol=1e-3, atol=1e-5)
        np.testing.assert_array_equal(coll.state(t, "step"), new_steps[t])


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_gpu_run_across_a_thousand_chunks_matches_reference(optimizer):
    """One row looked up about 37,000 times among others: its gradient sum crosses more
    than a thousand of the sums' chunks (dozens of rounds of 32 heads in the span pass);
    weighted lookups, so every position's factor counts."""
    import cupy

    rng = np.random.default_rng(11)
    rows, dim, B = 3000, 24, 8192
    lengths = rng.integers(0, 11, B)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    indices = rng.integers(0, rows, int(offsets[-1])).astype(np.int64)
    indices[rng.random(indices.size) < 0.9] = 17  # the hot row
    assert (indices == 17).sum() > 33 * 32 * 32
    psw = rng.uniform(0.5, 1.5, indices.size)
    coll = EmbeddingCollection([TableConfig(rows, dim)], optimizer, {"lr": 0.01},
                               device="cuda", seed=3)
    weights = [coll.weights(0).astype(np.float64)]
    state, steps = state_arrays(coll, 0)
    out, ctx = coll.forward(cupy.asarray(indices), cupy.asarray(offsets),
                            cupy.asarray(psw.astype(np.float32)))
    grad = rng.standard_normal((B, dim)) / 10
    coll.backward(ctx, cupy.asarray(grad.astype(np.float32)))
    new_w, new_s, _ = collection_step_reference(optimizer, coll.hypers, weights, [state],
                                                [steps], indices, offsets, grad,
                                                per_sample_weights=psw)
    np.testing.assert_allclose(coll.weights(0), new_w[0], rtol=1e-4, atol=2e-5)
    for k, v in new_s[0].items():
        np.testing.assert_allclose(coll.state(0, k), v, rtol=1e-3, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("lead", [0, 1, 31])
def test_gpu_runs_across_a_few_or_many_chunks_match_the_numpy_path(dtype, lead):
    """Hot rows whose runs cross about LONG_SPAN chunks of the gradient sums, on both sides
    of it (the update sums a run across up to LONG_SPAN of them; longer runs are listed by
    the first pass and summed by a block each), shifted against the chunk boundaries by
    `lead` lookups of a row sorted first; a width past one block's 64 columns and not a
    multiple of them; row-wise Adagrad, whose row sum sees every column. Two backwards of
    the one lookup: the second lists the long runs afresh (the first's update emptied the
    list the forward zeroed)."""
    import cupy

    from xferlib._kernels.collection import LONG_SPAN, SUM_CHUNK

    rng = np.random.default_rng(lead)
    span = LONG_SPAN * SUM_CHUNK
    hot = [span - SUM_CHUNK + 1, span, span + 1, span + SUM_CHUNK, span + SUM_CHUNK + 1,
           2 * span + 7, 3]
    rows, dim = 400, 72
    indices = np.concatenate([np.zeros(lead, np.int64)]
                             + [np.full(c, 1 + k, np.int64) for k, c in enumerate(hot)]
                             + [rng.integers(10, rows, 3000)])
    rng.shuffle(indices)
    offsets = np.arange(indices.size + 1, dtype=np.int64)  # bags of one lookup
    grad = rng.standard_normal((indices.size, dim)) / 10

    def train(device):
        coll = EmbeddingCollection([TableConfig(rows, dim)], "rowwise_adagrad", {"lr": 0.05},
                                   dtype=dtype, device=device, seed=6)
        xp = cupy if device == "cuda" else np
        _, ctx = coll.forward(xp.asarray(indices), xp.asarray(offsets))
        coll.backward(ctx, xp.asarray(grad.astype(dtype)))
        coll.backward(ctx, xp.asarray(np.ascontiguousarray(grad[::-1], dtype=dtype)))
        return coll.weights(0), coll.state(0, "sum")

    (w_gpu, s_gpu), (w_cpu, s_cpu) = train("cuda"), train("cpu")
    tol = tolerance(np.dtype(dtype))
    np.testing.assert_allclose(w_gpu, w_cpu, **tol)
    np.testing.assert_allclose(s_gpu, s_cpu, **tol)


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


@pytest.mark.gpu
def test_gpu_pack_refuses_a_tables_bad_offsets():
    """GPU arrays in the dict form are not read back: a table's offsets that do not start at
    0 (or end at its indices) are refused by the collection's own check; nothing changes."""
    get_backend("cupy")
    import cupy

    coll = EmbeddingCollection([TableConfig(10, 2, name="user"), TableConfig(4, 3, name="ad")],
                               "sgd", {"lr": 1.0}, device="cuda")
    before = coll.state_dict()
    user = (cupy.asarray([1, 2, 9]), cupy.asarray([0, 2, 3]))
    for ad in ((cupy.asarray([3]), cupy.asarray([1, 1, 1])),
               (cupy.asarray([3, 1]), cupy.asarray([0, 0, 1]))):
        idx, off = coll.pack({"user": user, "ad": ad})
        with pytest.raises(ValueError, match=r"offsets\[0\] must be 0"):
            _, ctx = coll.forward(idx, off)
            coll.backward(ctx, cupy.ones((2, 5), cupy.float32))
            coll.check()
    idx, off = coll.pack({"user": user, "ad": (cupy.asarray([3]), cupy.asarray([0, 0, 1]))})
    assert cupy.asnumpy(off).tolist() == [0, 2, 3, 3, 4]
    for key, value in coll.state_dict().items():
        np.testing.assert_array_equal(value, before[key], err_msg=key)


@pytest.mark.gpu
def test_gpu_collection_takes_numpy_inputs():
    get_backend("cupy")
    tables = [TableConfig(40, 4, placement="host"), TableConfig(30, 8)]
    cpu = EmbeddingCollection(tables, "adam", device="cpu", seed=2)
    gpu = EmbeddingCollection(tables, "adam", device="cuda", seed=2)
    idx, off = np.array([1, 5, 5, 39, 0, 29]), np.array([0, 2, 4, 5, 6])
    a, ctx_a = cpu.forward(idx, off)
    b, ctx_b = gpu.forward(idx, off)
    assert isinstance(b, np.ndarray)
    np.testing.assert_allclose(a, b, rtol=1e-6)
    grad = np.random.default_rng(0).standard_normal(a.shape).astype(np.float32)
    cpu.backward(ctx_a, grad)
    gpu.backward(ctx_b, grad)
    for t in range(2):
        np.testing.assert_allclose(cpu.weights(t), gpu.weights(t), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_gpu_short_bags_match_the_numpy_path(pooling, weighted):
    """Bags of under two lookups on average (the pooled lookup then gives a group of lanes two
    bags): an odd number of bags, so the last group has one; tables of three widths, host
    and HBM; empty bags, repeated rows. Forward and one trained step against the NumPy path."""
    get_backend("cupy")
    import cupy

    rows, B = [50, 7, 300], 9  # 27 bags
    tables = [TableConfig(rows[0], 4, placement="host"), TableConfig(rows[1], 8),
              TableConfig(rows[2], 12)]
    cpu, gpu = (EmbeddingCollection(tables, "rowwise_adagrad", HYPER["rowwise_adagrad"],
                                    pooling=pooling, device=d, seed=4) for d in ("cpu", "cuda"))
    rng = np.random.default_rng(11)
    for _ in range(3):
        indices, offsets = make_batch(rng, rows, B=B, max_len=2)
        assert indices.size < 2 * len(rows) * B
        psw = rng.random(indices.size).astype(np.float32) if weighted else None
        a, ctx_a = cpu.forward(indices, offsets, psw)
        b, ctx_b = gpu.forward(cupy.asarray(indices), cupy.asarray(offsets),
                               None if psw is None else cupy.asarray(psw))
        np.testing.assert_allclose(a, b.get(), rtol=1e-6, atol=1e-7)
        grad = rng.standard_normal(a.shape).astype(np.float32)
        cpu.backward(ctx_a, grad)
        gpu.backward(ctx_b, cupy.asarray(grad))
    for t in range(len(rows)):
        np.testing.assert_allclose(cpu.weights(t), gpu.weights(t), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["sgd", "adam", "rowwise_adagrad"])
def test_gpu_cache_trains_as_uncached(optimizer):
    """Host tables with a GPU cache (small, so rows are admitted and evicted, dirty rows
    written back) train as without one, and two cached runs give the same bits; two forwards
    before their backwards locate their rows again. Cached and uncached agree to rounding,
    not bitwise: a cache keys its host rows in set order, which moves their lookups in the
    sorted batch and so how a row's gradient sum is split into chunks."""
    get_backend("cupy")
    import cupy

    rows = [3000, 500, 64]

    def build(cache):
        return EmbeddingCollection(
            [TableConfig(rows[0], 8, placement="host", cache_rows=cache),
             TableConfig(rows[1], 8, placement="host", cache_rows=cache // 2),
             TableConfig(rows[2], 4)], optimizer, HYPER[optimizer], device="cuda", seed=1)

    plain, cached, again = build(0), build(96), build(96)
    rng = np.random.default_rng(3)
    for step in range(12):
        indices, offsets = make_batch(rng, rows, B=64, max_len=6, zipf=True)
        other = make_batch(rng, rows, B=64, max_len=6)
        grad = rng.standard_normal((64, 20)).astype(np.float32)
        outs = []
        for coll in (plain, cached, again):
            out, ctx = coll.forward(cupy.asarray(indices), cupy.asarray(offsets))
            if step % 3 == 2:  # a second forward before the first backward
                coll.forward(cupy.asarray(other[0]), cupy.asarray(other[1]))
            coll.backward(ctx, cupy.asarray(grad))
            outs.append(out.get())
        assert outs[1].tobytes() == outs[2].tobytes()
        # float32 rounding of a dozen steps' sums, far below any wrong row's or step's effect
        assert np.abs(outs[1] - outs[0]).max() <= 1e-5 * np.abs(outs[0]).max(), step
        assert outs[0][:, 16:].tobytes() == outs[1][:, 16:].tobytes()  # the HBM table's
    stats = cached.cache_stats()
    assert stats["hits"] > 0 and stats["evicted"] > 0, stats
    a, b, c = plain.state_dict(), cached.state_dict(), again.state_dict()
    for k in a:  # the cache's dirty rows written back: the state is the cached run's
        assert b[k].tobytes() == c[k].tobytes(), k
        np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-5 * np.abs(a[k]).max())
    cached.load_state_dict(a)  # the cache emptied first: the loaded rows are what is read
    out_a, _ = plain.forward(cupy.asarray(indices), cupy.asarray(offsets))
    out_b, _ = cached.forward(cupy.asarray(indices), cupy.asarray(offsets))
    assert out_a.get().tobytes() == out_b.get().tobytes()



@pytest.mark.gpu
def test_gpu_cache_counts_the_host_tables_rows_only():
    """The cache pass looks at host tables' rows alone: its lookups are the distinct host
    rows of each batch (an HBM table's rows never reach it)."""
    get_backend("cupy")
    import cupy

    rows, B = [3000, 500], 64
    coll = EmbeddingCollection([TableConfig(rows[0], 8, placement="host", cache_rows=96),
                                TableConfig(rows[1], 8)], "sgd", HYPER["sgd"], device="cuda",
                               seed=1)
    rng = np.random.default_rng(5)
    distinct = 0
    for _ in range(3):
        indices, offsets = make_batch(rng, rows, B=B, max_len=6, zipf=True)
        distinct += np.unique(indices[offsets[0]:offsets[B]]).size
        _, ctx = coll.forward(cupy.asarray(indices), cupy.asarray(offsets))
        coll.backward(ctx, cupy.zeros((B, 16), np.float32))
    stats = coll.cache_stats()
    assert stats["lookups"] == stats["hits"] + stats["misses"] == distinct, stats


@pytest.mark.gpu
@pytest.mark.parametrize("tables", ["hbm", "host", "mixed"])
def test_gpu_radix_sorted_batches_of_every_placement_mix_match_the_numpy_path(tables):
    """Batches the radix sort takes (past one tile), every placement mix (HBM only, host
    only with and without a cache, HBM beside cached and uncached host tables and a tt
    table), bags of 0-3 lookups, several steps: the pooled outputs and every table's weights
    and state match the NumPy path; a refused batch in between pools zeros and changes
    nothing."""
    get_backend("cupy")
    import cupy

    from xferlib.batch import SMALL_SORT_TILE

    rows = {"hbm": [700, 90], "host": [900, 300], "mixed": [700, 900, 300, 60]}[tables]
    configs = {"hbm": [TableConfig(700, 8), TableConfig(90, 12)],
               "host": [TableConfig(900, 8, placement="host", cache_rows=64),
                        TableConfig(300, 8, placement="host")],
               "mixed": [TableConfig(700, 8), TableConfig(900, 8, placement="host",
                                                          cache_rows=64),
                         TableConfig(300, 8, placement="host"),
                         TableConfig(60, 4, placement="tt", tt_ranks=3)]}[tables]
    B = 1200
    rng = np.random.default_rng(21)
    batches = [make_batch(rng, rows, B=B, max_len=3, zipf=True) for _ in range(4)]
    assert all(b[0].size > SMALL_SORT_TILE for b in batches)  # the radix sort's batches
    width = sum(c.dim for c in configs)
    grads = [rng.standard_normal((B, width)).astype(np.float32) for _ in batches]

    def train(device):
        optimizer = "rowwise_adagrad" if tables == "mixed" else "adam"  # tt: not adam
        coll = EmbeddingCollection(configs, optimizer, {"lr": 0.05}, device=device, seed=4)
        coll.raise_in_calls = False
        xp = cupy if device == "cuda" else np
        outs = []
        for k, ((indices, offsets), grad) in enumerate(zip(batches, grads)):
            if k == 2 and device == "cuda":  # a refused batch: zeros out, nothing trained
                bad = indices.copy()
                bad[-1] = rows[-1]
                out, ctx = coll.forward(cupy.asarray(bad), cupy.asarray(offsets))
                coll.backward(ctx, cupy.asarray(grad))
                assert not out.any()
                with pytest.raises(IndexError):
                    coll.check()
            out, ctx = coll.forward(xp.asarray(indices), xp.asarray(offsets))
            coll.backward(ctx, xp.asarray(grad))
            outs.append(cupy.asnumpy(out) if device == "cuda" else out)
        return outs, coll.state_dict()

    (outs_gpu, state_gpu), (outs_cpu, state_cpu) = train("cuda"), train("cpu")
    tol = tolerance(np.dtype(np.float32))
    for a, b in zip(outs_gpu, outs_cpu):
        np.testing.assert_allclose(a, b, **tol)
    for k in state_cpu:
        np.testing.assert_allclose(state_gpu[k], state_cpu[k], err_msg=k, **tol)


@pytest.mark.gpu
@pytest.mark.parametrize("sort", ["tile", "radix"])
def test_gpu_cached_collection_keys_host_rows_in_set_order(sort):
    """With a GPU cache, a host row's key is its set-ordered key (the kernels' twin of
    SetOrder) and the cache pass takes the runs as the batch sort left them (no sort by
    set): the batch's sorted keys are those SetOrder gives, the HBM table's keys past every
    host key, and over batches that fill the cache and evict from it, the cache's counts
    (lookups, hits, misses, admitted, evicted) are those of the NumPy model of the same
    sets; one tile of the sort or the radix sort."""
    get_backend("cupy")
    import cupy

    from xferlib.table.cache import CacheModel, SetOrder

    rows, cache_rows = [3000, 500, 700], 96
    coll = EmbeddingCollection([TableConfig(3000, 8, placement="host", cache_rows=cache_rows),
                                TableConfig(500, 8), TableConfig(700, 8, placement="host")],
                               "sgd", HYPER["sgd"], device="cuda", seed=1)
    order = SetOrder.for_cache(3000 + 700, cache_rows)
    model = CacheModel(cache_rows, 3000 + 700, set_order=order)
    rng = np.random.default_rng(9)
    B = 100 if sort == "tile" else 900
    for _ in range(6):
        indices, offsets = make_batch(rng, rows, B=B, max_len=4, zipf=True)
        table = np.repeat(np.arange(3), np.diff(offsets[::B]))
        x = indices + np.array([0, 0, 3000])[table]  # a host row's place among all host rows
        want = np.where(table == 1, order.span + indices, order.key(x))
        _, ctx = coll.forward(cupy.asarray(indices), cupy.asarray(offsets))
        np.testing.assert_array_equal(cupy.asnumpy(ctx.plan.keys), np.sort(want))
        model.access(x[table != 1])
        coll.backward(ctx, cupy.ones((B, 24), np.float32))
    coll.check()
    assert coll.cache_stats() == model.stats, (coll.cache_stats(), model.stats)
    assert model.stats["evicted"] > 0

def test_cache_config_checks():
    with pytest.raises(ValueError, match="cache_rows is for host tables"):
        TableConfig(10, 4, cache_rows=5)
    with pytest.raises(ValueError, match="share one width"):
        EmbeddingCollection([TableConfig(10, 4, placement="host", cache_rows=4),
                             TableConfig(10, 8, placement="host")], device="cpu")
    coll = EmbeddingCollection([TableConfig(10, 4, placement="host", cache_rows=4)],
                               device="cpu")
    assert coll.cache_stats()["lookups"] == 0


@pytest.mark.gpu
def test_gpu_refused_batch_raises_only_from_check_when_asked():
    """raise_in_calls=False (a sharded step's collections): a refused batch changes nothing
    and pools zeros, the calls after it do not raise (other ranks would wait in a
    collective), and check() raises it once; the good batches after it train."""
    get_backend("cupy")
    import cupy

    def build():
        return EmbeddingCollection([TableConfig(10, 4, placement="host", cache_rows=4),
                                    TableConfig(5, 4)], "adam", device="cuda", seed=0)

    def step(coll, idx):
        # the output buffer full of NaN first: a refused batch must overwrite it
        out, ctx = coll.forward(cupy.asarray(idx), cupy.asarray([0, 1, 2, 3, 4]),
                                out=cupy.full((2, 8), np.nan, np.float32))
        coll.backward(ctx, cupy.ones((2, 8), np.float32))
        return out

    quiet, reference = build(), build()
    quiet.raise_in_calls = False
    refused = step(quiet, [1, 2, 3, 9])  # index 9 of the 5-row table: refused
    assert not refused.any()             # its pooled rows are zeros, not stale memory
    for _ in range(8):                 # more than the queue's limit of unread verdicts
        step(quiet, [1, 2, 3, 4])
        step(reference, [1, 2, 3, 4])
    cupy.cuda.Device().synchronize()
    with pytest.raises(IndexError, match="index 9 at position 3"):
        quiet.check()
    quiet.check()                      # reported once
    for k, v in reference.state_dict().items():
        assert quiet.state_dict()[k].tobytes() == v.tobytes(), k


@pytest.mark.gpu
def test_gpu_bad_inputs_change_nothing():
    """Out-of-range indices and broken offsets on the GPU: the batch's kernels write nothing
    (host tables, their cache, HBM tables), and check() raises the error naming them."""
    get_backend("cupy")
    import cupy

    coll = EmbeddingCollection([TableConfig(10, 4, placement="host", cache_rows=4),
                                TableConfig(5, 4)], "adam", device="cuda", seed=0)
    good_idx, off = cupy.asarray([1, 2, 3, 4]), cupy.asarray([0, 1, 2, 3, 4])
    _, ctx = coll.forward(good_idx, off)
    coll.backward(ctx, cupy.ones((2, 8), np.float32))
    before = coll.state_dict()
    cases = [(cupy.asarray([1, 2, 3, 5]), off, IndexError, "index 5 at position 3"),
             (cupy.asarray([1, 2, -7, 4]), off, IndexError, "index -7 at position 2"),
             (good_idx, cupy.asarray([0, 3, 2, 3, 4]), ValueError, "must not decrease"),
             (good_idx, cupy.asarray([0, 1, 2, 3, 9]), ValueError, r"offsets\[-1\]"),
             (good_idx, cupy.asarray([2, 1, 2, 3, 4]), ValueError, r"offsets\[0\]")]
    for idx, offsets, error, message in cases:
        # raised by the backward (the verdict arrived) or at the latest by check()
        with pytest.raises(error, match=message):
            out, ctx = coll.forward(idx, offsets)
            coll.backward(ctx, cupy.ones((2, 8), np.float32))
            coll.check()
        after = coll.state_dict()
        for k in before:
            assert after[k].tobytes() == before[k].tobytes(), (message, k)


def test_lane_groups_and_in_place_gradients():
    """The GPU kernels' launch choices, pure functions of shapes: lanes per row (enough for
    the row's vectors, a power of two, at most a warp) and which pooled gradients are read
    in place (rows of adjacent columns in the collection's dtype; others are copied)."""
    from xferlib.collection.device import _lane_group, _rows_of_columns

    assert [_lane_group(w, 4) for w in (1, 4, 8, 12, 64, 65, 128, 4096)] == \
        [1, 1, 2, 4, 16, 32, 32, 32]
    assert [_lane_group(w, 1) for w in (1, 2, 3, 31, 33)] == [1, 2, 4, 32, 32]
    wide = np.zeros((6, 40), np.float32)
    assert _rows_of_columns(wide, np.float32)
    assert _rows_of_columns(wide[:, 3:35], np.float32)  # a slice of wider rows
    assert _rows_of_columns(np.broadcast_to(wide[:1], (6, 40)), np.float32)  # stride 0
    assert not _rows_of_columns(wide[:, ::2], np.float32)  # columns apart
    assert not _rows_of_columns(wide[::-1], np.float32)  # rows backwards
    assert not _rows_of_columns(wide.T, np.float32)
    assert not _rows_of_columns(wide, np.float64)  # another dtype: converted


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gpu_gradient_read_in_words_or_columns_gives_the_same_bits(dtype):
    """The gradient sums read 16-byte words where the pooled gradient's rows allow and single
    columns where they do not (a slice of wider rows that starts off a word): the same sums
    in the same order, so both trainings end with the same bits."""
    import cupy

    rng = np.random.default_rng(9)
    rows, dims = [3000, 40, 700], [8, 4, 12]
    indices, offsets = make_batch(rng, rows, B=1500, max_len=9, zipf=True)
    grad = rng.standard_normal((1500, sum(dims))).astype(dtype)
    wide = cupy.zeros((1500, sum(dims) + 3), dtype=dtype)
    wide[:, 1:1 + sum(dims)] = cupy.asarray(grad)  # rows start one element off a word

    def train(gradient):
        coll = EmbeddingCollection([TableConfig(rows[0], dims[0], placement="host"),
                                    TableConfig(rows[1], dims[1]), TableConfig(rows[2], dims[2])],
                                   "adam", {"lr": 0.01}, dtype=dtype, device="cuda", seed=4)
        for _ in range(2):
            _, ctx = coll.forward(cupy.asarray(indices), cupy.asarray(offsets))
            coll.backward(ctx, gradient)
        return coll.state_dict()

    words, columns = train(cupy.asarray(grad)), train(wide[:, 1:1 + sum(dims)])
    for k in words:
        assert words[k].tobytes() == columns[k].tobytes(), k


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
