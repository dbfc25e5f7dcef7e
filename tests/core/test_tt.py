import math

import numpy as np
import pytest

from xferlib import tt
from xferlib.testing import assert_outputs_match, for_each_backend, reference_check
from xferlib.tt.rules import row_state, update_rows

SHAPES = [
    tt.TTShape([3, 4], [2, 3], [5]),
    tt.TTShape([5, 4, 3], [2, 2, 4], [3, 4]),
    tt.TTShape([2, 3, 2, 3], [2, 1, 3, 2], [2, 3, 2]),
]


@pytest.fixture
def rng():
    return np.random.default_rng(7)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"d{s.d}")
@for_each_backend("numpy", "cupy")
def test_rows_match_the_reference(backend, shape, rng):
    """The array path (NumPy, or CuPy with batched cuBLAS products) on every backend."""
    cores = tt.init_tt_cores(shape, "normal", rng=rng)
    reference_check(backend, lambda c, i: tt.tt_rows(c, shape, i),
                    lambda c, i: tt.tt_rows_reference(c, shape, i),
                    cores, rng.integers(0, shape.num_rows, 50), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"d{s.d}")
def test_dense_table_matches_the_reference(shape, rng):
    cores = tt.init_tt_cores(shape, "normal", rng=rng)
    idx = rng.integers(0, shape.num_rows, 50)
    assert_outputs_match(tt.tt_to_dense(cores, shape)[idx], tt.tt_rows_reference(cores, shape, idx),
                         rtol=1e-5, atol=1e-7)


def test_digits_are_most_significant_first():
    shape = tt.TTShape([3, 4, 5], [1, 1, 1], [1, 1])
    assert shape.digits([0, 1, 5, 59]).tolist() == [[0, 0, 0], [0, 0, 1], [0, 1, 0], [2, 3, 4]]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"d{s.d}")
def test_tt_svd_is_exact_at_full_rank(shape, rng):
    cores = tt.init_tt_cores(shape, "normal", rng=rng)
    dense = tt.tt_to_dense(cores, shape).astype(np.float64)
    again = tt.tt_from_dense(dense, shape.ranks, shape.p_shapes, shape.q_shapes)
    np.testing.assert_allclose(tt.tt_to_dense(again, shape), dense, rtol=1e-4, atol=1e-6)


def test_tt_svd_recovers_a_low_rank_table(rng):
    low = tt.TTShape([8, 8], [4, 4], [3])
    dense = tt.tt_to_dense(tt.init_tt_cores(low, "normal", rng=rng), low).astype(np.float64)
    for rank in (3, 6):  # the true TT rank, and more (padded with zeros)
        shape = tt.TTShape([8, 8], [4, 4], [rank])
        cores = tt.tt_from_dense(dense, [rank], shape.p_shapes, shape.q_shapes)
        np.testing.assert_allclose(tt.tt_to_dense(cores, shape), dense, rtol=1e-4, atol=1e-6)
    # fewer rows than prod(p): the missing rows are zero
    shape = tt.TTShape([8, 8], [4, 4], [32])
    cores = tt.tt_from_dense(dense[:50], [32], shape.p_shapes, shape.q_shapes)
    np.testing.assert_allclose(tt.tt_to_dense(cores, shape)[:50], dense[:50], atol=1e-5)
    np.testing.assert_allclose(tt.tt_to_dense(cores, shape)[50:], 0.0, atol=1e-5)


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
@for_each_backend("numpy", "cupy")
def test_bags_match_reference(backend, mode, weighted, rng):
    shape = SHAPES[1]
    cores = tt.init_tt_cores(shape, "normal", rng=rng)
    indices = rng.integers(0, shape.num_rows, 40)
    offsets = np.array([0, 3, 3, 17, 40])  # includes an empty bag
    weights = rng.random(40) if weighted else None

    def bags(cores, indices, offsets, weights):
        kw = dict(mode=mode, per_sample_weights=weights)
        return {"with_last": tt.tt_embedding_bag(cores, shape, indices, offsets, **kw),
                "without_last": tt.tt_embedding_bag(cores, shape, indices, offsets[:-1],
                                                    include_last_offset=False, **kw)}

    def reference(cores, indices, offsets, weights):
        ref = tt.tt_embedding_bag_reference(cores, shape, indices, offsets, mode=mode,
                                            per_sample_weights=weights)
        return {"with_last": ref, "without_last": ref}

    # The GPU kernels sum in another order: the rounding of large entries lands on small ones.
    out = reference_check(backend, bags, reference, cores, indices, offsets, weights,
                          rtol=1e-5, atol=1e-7, relative_to_max=backend.gpu)
    assert out["with_last"].shape == (4, shape.dim) and not out["with_last"][1].any()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"d{s.d}")
def test_core_gradients_are_exact(shape, rng):
    # The bags are linear in each core: <grad_k, delta_k> equals the change of <g, bags>.
    cores = [c.astype(np.float64) for c in tt.init_tt_cores(shape, "normal", rng=rng)]
    indices = rng.integers(0, shape.num_rows, 30)
    indices[:5] = indices[5]  # repeated rows add up
    offsets = np.array([0, 10, 30])
    weights = rng.random(30)
    g = rng.standard_normal((2, shape.dim))
    _, residuals = tt.tt_embedding_bag_fwd(cores, shape, indices, offsets, mode="mean",
                                           per_sample_weights=weights)
    grads = tt.tt_embedding_bag_bwd(cores, shape, residuals, g)

    def loss(cs):
        return float(np.sum(g * tt.tt_embedding_bag_reference(
            cs, shape, indices, offsets, mode="mean", per_sample_weights=weights)))

    base = loss(cores)
    for k in range(shape.d):
        delta = rng.standard_normal(cores[k].shape)
        moved = list(cores)
        moved[k] = cores[k] + delta
        assert np.sum(grads[k] * delta) == pytest.approx(loss(moved) - base, rel=1e-4, abs=1e-6)


def test_suggest_tt_shapes():
    assert tt.suggest_tt_shapes(128, 3, allow_round_up=False) == [4, 4, 8]
    assert tt.suggest_tt_shapes(64, 3, allow_round_up=False) == [4, 4, 4]
    p = tt.suggest_tt_shapes(11_000_000, 3)
    assert math.prod(p) >= 11_000_000 and max(p) / min(p) < 2
    p = tt.suggest_tt_shapes(1_000_003, 3)  # a prime: rounding up balances it
    assert math.prod(p) >= 1_000_003 and max(p) / min(p) < 2
    with pytest.raises(ValueError):
        tt.suggest_tt_shapes(10, 5)


@pytest.mark.parametrize("dist", ["uniform", "naive-uniform", "normal", "approx-normal",
                                  "approx-uniform"])
def test_initializers(dist, rng):
    shape = tt.TTShape([20, 22, 25], [4, 4, 4], [8, 8])
    cores = tt.init_tt_cores(shape, dist, rng=rng)
    for k, core in enumerate(cores):
        assert core.shape == shape.core_shape(k) and core.dtype == np.float32
        assert np.isfinite(core).all() and core.std() > 0
    if dist == "approx-normal":
        scale = (1.0 / math.sqrt(3 * shape.num_rows)) ** (1.0 / 3.0)
        assert all(np.abs(c).min() >= 2 * scale * (1 - 1e-6) for c in cores)
    if dist == "uniform":
        assert all(c.min() >= 0 for c in cores)
    if dist == "naive-uniform":  # FBTT's U(0, 1 / sqrt(rows))
        assert all(c.min() >= 0 and c.max() <= 1 / math.sqrt(shape.num_rows) for c in cores)
    with pytest.raises(ValueError, match="weight_dist"):
        tt.init_tt_cores(shape, "bogus")


def test_approx_normal_is_fast_for_large_cores():
    import time

    shape = tt.TTShape([200, 220, 250], [4, 4, 4], [32, 32])
    t0 = time.perf_counter()
    tt.init_tt_cores(shape, "approx-normal", rng=np.random.default_rng(0))
    assert time.perf_counter() - t0 < 60  # FBTT's per-element loop takes minutes here


def test_bad_input(rng):
    shape = SHAPES[0]
    cores = tt.init_tt_cores(shape, "normal", rng=rng)
    with pytest.raises(IndexError, match="index 12 at position 1"):
        tt.tt_rows(cores, shape, np.array([0, 12]))
    with pytest.raises(ValueError, match="core 0 must have shape"):
        tt.tt_rows([cores[1], cores[0]], shape, np.array([0]))
    with pytest.raises(ValueError, match="offsets"):
        tt.tt_embedding_bag(cores, shape, np.array([0, 1]), np.array([0, 3]))
    with pytest.raises(ValueError, match="2 to 4 cores"):
        tt.TTShape([2], [2], [])
    with pytest.raises(ValueError, match="mode"):
        tt.tt_embedding_bag(cores, shape, np.array([0, 1]), np.array([0, 2]), mode="max")
    # a bound past the factorization's rows would let rows without digits through
    with pytest.raises(ValueError, match=f"num_embeddings must be between 0 and {shape.num_rows}"):
        tt.tt_embedding_bag_fwd(cores, shape, np.array([0, 1]), np.array([0, 2]),
                                num_embeddings=shape.num_rows + 1)


@pytest.mark.parametrize("optimizer", tt.SPARSE_OPTIMIZERS)
def test_sparse_updates_reach_every_touched_row(optimizer, rng):
    # More rows in the first core than R*q*R: FBTT's launch skips such rows; none is skipped
    # here, and rows no lookup touched stay as they were.
    shape = tt.TTShape([40, 3, 3], [2, 2, 2], [2, 2])
    cores = tt.init_tt_cores(shape, "normal", rng=rng)
    before = [c.copy() for c in cores]
    indices = np.arange(0, shape.num_rows, 2)  # every first-core row, half the table
    offsets = np.array([0, len(indices)])
    _, residuals = tt.tt_embedding_bag_fwd(cores, shape, indices, offsets)
    grads = tt.tt_embedding_bag_bwd(cores, shape, residuals, rng.standard_normal((1, shape.dim)))
    states = tt.tt_sparse_state(shape, optimizer)
    tt.tt_sparse_update(cores, shape, residuals, grads, states, optimizer, lr=0.1)
    touched = np.unique(shape.digits(indices)[:, 0])
    assert len(touched) == 40
    assert np.all(np.any(cores[0] != before[0], axis=1))
    if optimizer == "sgd":
        for c, b, g in zip(cores, before, grads):
            np.testing.assert_allclose(c, b - 0.1 * g, rtol=1e-6, atol=1e-7)
    # a batch touching one row leaves every other row and its state alone
    one = np.array([5])
    _, res1 = tt.tt_embedding_bag_fwd(cores, shape, one, np.array([0, 1]))
    g1 = tt.tt_embedding_bag_bwd(cores, shape, res1, np.ones((1, shape.dim)))
    snapshot = [c.copy() for c in cores]
    tt.tt_sparse_update(cores, shape, res1, g1, states, optimizer, lr=0.1)
    digits = shape.digits(one)[0]
    for k, (c, s) in enumerate(zip(cores, snapshot)):
        others = np.setdiff1d(np.arange(c.shape[0]), [digits[k]])
        np.testing.assert_array_equal(c[others], s[others])


def test_sparse_update_rejects_unknown_optimizer(rng):
    shape = SHAPES[0]
    with pytest.raises(ValueError, match="optimizer must be one of"):
        tt.tt_sparse_state(shape, "lion")


# FBGEMM's rules in float64, one row at a time (t: the global step).
def fbgemm_row_update(optimizer, w, g, state, t, lr, eps=1e-8, b1=0.9, b2=0.999, wd=0.01,
                      eta=0.001, momentum=0.9):
    w, g = w.astype(np.float64), g.astype(np.float64)
    if optimizer == "lars_sgd":
        w_norm, g_norm = np.linalg.norm(w), np.linalg.norm(g)
        adjusted = lr * eta * w_norm / (g_norm + wd * w_norm)
        state["momentum"] = momentum * state["momentum"] + adjusted * (g + wd * w)
        return w - state["momentum"]
    state["exp_avg"] = b1 * state["exp_avg"] + (1 - b1) * g
    if optimizer == "lamb":
        state["exp_avg_sq"] = b2 * state["exp_avg_sq"] + (1 - b2) * g * g
    else:
        state["exp_avg_sq"] = b2 * state["exp_avg_sq"] + (1 - b2) * np.mean(g * g)
    update = (state["exp_avg"] / (1 - b1 ** t) / (np.sqrt(state["exp_avg_sq"] / (1 - b2 ** t))
                                                  + eps) + wd * w)
    if optimizer == "partial_rowwise_adam":
        return w - lr * update
    return w - lr * np.linalg.norm(w) / np.linalg.norm(update) * update


FBGEMM_RULES = ["lamb", "lars_sgd", "partial_rowwise_adam", "partial_rowwise_lamb"]


@pytest.mark.parametrize("optimizer", FBGEMM_RULES)
def test_fbgemm_rules_match_a_float64_reference(optimizer, rng):
    rows, width = 6, 12
    param = rng.standard_normal((rows, width)).astype(np.float32)
    state = row_state(rows, width, optimizer)
    ref_w = param.astype(np.float64)
    ref_state = [{k: v.astype(np.float64).copy() for k, v in state.items()} for _ in range(rows)]
    ref_state = [{k: v[r].copy() for k, v in st.items()} for r, st in enumerate(ref_state)]
    hyper = dict(weight_decay=0.01, eta=0.001, momentum=0.9)
    for step in range(1, 5):
        grad = rng.standard_normal((rows, width)).astype(np.float32)
        touched = np.array([0, 2, 5]) if step % 2 else np.array([1, 2])
        update_rows(param, grad, state, touched, optimizer, 0.05, 1e-8, (0.9, 0.999),
                    step=step, **hyper)
        for r in touched:
            ref_w[r] = fbgemm_row_update(optimizer, ref_w[r], grad[r], ref_state[r], step, 0.05,
                                         wd=0.01)
        assert_outputs_match(param, ref_w, rtol=2e-5, atol=2e-6, what=f"step {step} weights")
        assert_outputs_match(state, {name: np.stack([st[name] for st in ref_state])
                                     for name in ref_state[0]},
                             rtol=2e-5, atol=1e-7, what=f"step {step} state")


def test_tt_hyper_record_names_the_update_kernels_scalars():
    """The TT update's scalar record is the kernel's declared scalar arguments, by name."""
    from xferlib._kernels.tt import HYPER_ARGS
    from xferlib.tt.update import TTHyper, tt_hyper

    assert TTHyper._fields == HYPER_ARGS
    record = tt_hyper("rowwise_adam", 0.1, 1e-8, (0.9, 0.99), weight_decay=0.01,
                      step=np.zeros(1, np.int64))
    assert record.lr == np.float32(0.1) and record.beta2 == np.float64(0.99)
    assert record.wd == np.float32(0.01) and record.iter.shape == (1,)
