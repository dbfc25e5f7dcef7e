"""TTTable: lookups and fused updates against float64 references for every fused optimizer,
awkward batches, bad input that changes nothing, several tables, the row cache."""

import numpy as np
import pytest

from xferlib import tt
from xferlib.testing import assert_outputs_match
from xferlib.tt import TTShape, TTTable
from tests.core.test_tt import fbgemm_row_update

SHAPE = TTShape([4, 5, 6], [2, 2, 3], [3, 2])
HYPER = dict(lr=0.05, eps=1e-8, weight_decay=0.01, eta=0.01, momentum=0.5)


@pytest.fixture
def rng():
    return np.random.default_rng(7)


# ----------------------------------------------------------------------------- references


def _slices(cores, shape):
    return [shape.core_slices(np.asarray(c, np.float64), k) for k, c in enumerate(cores)]


def bags_reference(cores, shape, indices, offsets, weights=None, mode="sum"):
    """Pooled bags in float64 (``include_last_offset=True`` offsets)."""
    return tt.tt_embedding_bag_reference(cores, shape, indices, offsets, mode=mode,
                                         per_sample_weights=weights)


def core_grads_reference(cores, shape, indices, offsets, grad_bags, weights=None, mode="sum"):
    """Each core's gradient in float64, one lookup and one core at a time: the slice
    ``G_k[i_k]`` gets ``Left^T (w g) Right^T``, Left / Right the products before / after it."""
    slices = _slices(cores, shape)
    grads = [np.zeros(s.shape) for s in slices]
    digits = shape.digits(indices)
    for b in range(len(offsets) - 1):
        lo, hi = offsets[b], offsets[b + 1]
        for n in range(lo, hi):
            w = 1.0 if weights is None else float(weights[n])
            if mode == "mean":
                w /= hi - lo
            g = w * np.asarray(grad_bags[b], np.float64)
            for k in range(shape.d):
                left = np.ones((1, 1))  # (columns before k, R_k)
                for j in range(k):
                    s = slices[j][digits[n, j]]
                    left = np.einsum("ar,rjs->ajs", left, s).reshape(-1, s.shape[2])
                right = np.ones((1, 1))  # (R_{k+1}, columns after k)
                for j in range(shape.d - 1, k, -1):
                    s = slices[j][digits[n, j]]
                    right = np.einsum("rjs,sb->rjb", s, right).reshape(s.shape[0], -1)
                q = shape.q_shapes[k]
                gk = g.reshape(left.shape[0], q, right.shape[1])
                grads[k][digits[n, k]] += np.einsum("ar,ajb,sb->rjs", left, gk, right)
    return [gr.reshape(shape.core_shape(k)) for k, gr in enumerate(grads)]


def update_reference(optimizer, w, g, state, step, h):
    """One row's update in float64 (FBGEMM's rules for the global-step ones)."""
    lr, eps, (b1, b2) = h["lr"], h["eps"], h["betas"]
    if optimizer == "sgd":
        return w - lr * g
    if optimizer == "adagrad":
        state["sum"] = state["sum"] + g * g
        return w - lr * g / (np.sqrt(state["sum"]) + eps)
    if optimizer == "rowwise_adagrad":
        state["sum"] = state["sum"] + np.mean(g * g)
        return w - lr * g / (np.sqrt(state["sum"]) + eps)
    if optimizer == "rowwise_adam":
        state["step"] = state["step"] + 1
        t = state["step"]
        state["exp_avg"] = b1 * state["exp_avg"] + (1 - b1) * g
        state["exp_avg_sq"] = b2 * state["exp_avg_sq"] + (1 - b2) * np.mean(g * g)
        return w - lr * state["exp_avg"] / (1 - b1 ** t) / (
            np.sqrt(state["exp_avg_sq"] / (1 - b2 ** t)) + eps)
    return fbgemm_row_update(optimizer, w, g, state, step, lr, eps=eps, b1=b1, b2=b2,
                             wd=h["weight_decay"], eta=h["eta"], momentum=h["momentum"])


class ReferenceTable:
    """A TTTable's training in float64: cores and per-row state, updated row by row."""

    def __init__(self, table: TTTable):
        self.shape, self.optimizer, self.hyper = table.joint_shape, table.optimizer, table.hyper
        self.cores = [np.asarray(c, np.float64).copy() for c in table.cores]
        self.states = [{k: np.asarray(v, np.float64).copy() for k, v in s.items()}
                       for s in table.states]
        self.step = table.step

    def train(self, indices, offsets, grad_bags, weights=None, mode="sum"):
        grads = core_grads_reference(self.cores, self.shape, indices, offsets, grad_bags,
                                     weights, mode)
        self.step += 1
        digits = self.shape.digits(indices)
        for k, (core, grad, state) in enumerate(zip(self.cores, grads, self.states)):
            for row in np.unique(digits[:, k]):
                row_state = {name: v[row] for name, v in state.items()}
                core[row] = update_reference(self.optimizer, core[row], grad[row], row_state,
                                             self.step, self.hyper)
                for name, v in row_state.items():
                    state[name][row] = v


def snapshot(table: TTTable) -> dict:
    out = {f"core{k}": np.array(c) for k, c in enumerate(table.cores)}
    out.update({f"state{k}.{n}": np.array(v) for k, s in enumerate(table.states)
                for n, v in s.items()})
    out["step"] = np.array(table.step_array)
    if table.cache is not None:
        out.update({f"cache.{n}": np.array(v) for n, v in table.cache.arrays().items()})
    return out


def assert_unchanged(table, before):
    after = snapshot(table)
    assert after.keys() == before.keys()
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)


def _batch(rng, num_bags, rows, dtype=np.int64, empty_bag=True):
    sizes = rng.integers(1, 6, num_bags)
    if empty_bag:
        sizes[num_bags // 2] = 0  # an empty bag in the middle
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(dtype)
    # few distinct rows: repeated indices within bags and across them
    indices = rng.integers(0, rows, int(offsets[-1])).astype(dtype)
    indices[:2] = indices[0]
    return indices, offsets


# ----------------------------------------------------------------------------- training


@pytest.mark.parametrize("optimizer", tt.SPARSE_OPTIMIZERS)
def test_training_matches_the_float64_reference(optimizer, rng):
    table = TTTable(SHAPE, optimizer, HYPER, num_embeddings=110, seed=3)
    ref = ReferenceTable(table)
    for step in range(4):
        dtype = np.int32 if step % 2 else np.int64
        indices, offsets = _batch(rng, 5, 25 if step < 2 else 110, dtype)
        weights = rng.uniform(0.5, 1.5, len(indices)).astype(np.float32) if step == 1 else None
        mode = "mean" if step == 2 else "sum"
        bags, residuals = table.lookup(indices, offsets, per_sample_weights=weights, mode=mode,
                                       include_last_offset=True)
        expected = bags_reference(ref.cores, SHAPE, indices, offsets, weights, mode)
        assert_outputs_match(bags, expected, rtol=1e-5, atol=1e-6, what=f"step {step} bags")
        grad = rng.standard_normal(bags.shape).astype(np.float32)
        table.apply_gradients(residuals, grad)
        ref.train(indices, offsets, grad, weights, mode)
        assert table.step == ref.step == step + 1
        assert_outputs_match(list(table.cores), ref.cores, rtol=2e-4, atol=2e-6,
                             what=f"step {step} cores")
        for k, (got, want) in enumerate(zip(table.states, ref.states)):
            assert_outputs_match(dict(got), want, rtol=2e-4, atol=1e-6,
                                 what=f"step {step} state of core {k}")


def test_two_runs_are_bitwise_identical(rng):
    def run():
        r = np.random.default_rng(11)
        table = TTTable(SHAPE, "partial_rowwise_lamb", HYPER, seed=5)
        for _ in range(3):
            indices, offsets = _batch(r, 6, SHAPE.num_rows)
            bags, res = table.lookup(indices, offsets, include_last_offset=True)
            table.apply_gradients(res, r.standard_normal(bags.shape).astype(np.float32))
        return snapshot(table)

    first, second = run(), run()
    for name in first:
        np.testing.assert_array_equal(first[name], second[name], err_msg=name)


def test_awkward_batches(rng):
    table = TTTable(SHAPE, "rowwise_adagrad", HYPER, seed=1)
    before = snapshot(table)
    # an empty batch: no bag at all, then bags with no lookups
    for offsets in (np.array([0]), np.array([0, 0, 0])):
        bags, res = table.lookup(np.zeros(0, np.int64), offsets, include_last_offset=True)
        assert bags.shape == (len(offsets) - 1, SHAPE.dim) and not bags.any()
        table.apply_gradients(res, np.ones(bags.shape, np.float32))
    for name in before:  # nothing touched, the steps counted
        if name != "step":
            np.testing.assert_array_equal(snapshot(table)[name], before[name])
    assert table.step == 2
    # B offsets without the last one; the same bags as B + 1 with it
    indices = np.array([3, 3, 7, 119], np.int32)
    a, _ = table.lookup(indices, np.array([0, 2, 2], np.int32), train=False)
    b, _ = table.lookup(indices, np.array([0, 2, 2, 4]), include_last_offset=True)
    np.testing.assert_array_equal(a, b)
    out = np.full((3, SHAPE.dim), np.nan, np.float32)
    assert table.lookup(indices, np.array([0, 2, 2]), out=out)[0] is out
    np.testing.assert_array_equal(out, a)


def test_bad_input_raises_and_changes_nothing(rng):
    table = TTTable(SHAPE, "rowwise_adam", HYPER, num_embeddings=100, cache_size=8, seed=2)
    indices, offsets = _batch(rng, 4, 100)
    bags, res = table.lookup(indices, offsets, include_last_offset=True)
    table.apply_gradients(res, np.ones(bags.shape, np.float32))
    before = snapshot(table)
    good = np.array([1, 2, 3])
    cases = [
        (IndexError, "index 100 at position 1", np.array([1, 100, 3]), np.array([0, 3])),
        (IndexError, "index -1 at position 2", np.array([1, 2, -1]), np.array([0, 3])),
        (ValueError, "offsets must start at 0", good, np.array([1, 3])),
        (ValueError, "offsets must start at 0", good, np.array([0, 2, 1, 3])),
        (ValueError, "offsets must start at 0", good, np.array([0, 2])),
        (TypeError, "indices must be int32 or int64", good.astype(np.float64),
         np.array([0, 3])),
        (TypeError, "offsets must be int32 or int64", good, np.array([0, 3], np.uint8)),
        (ValueError, "indices must be 1-D", good.reshape(1, 3), np.array([0, 3])),
    ]
    for error, match, idx, off in cases:
        with pytest.raises(error, match=match):
            table.lookup(idx, off, include_last_offset=True)
        with pytest.raises(error, match=match):
            table.residuals(idx, off, include_last_offset=True)
        assert_unchanged(table, before)
    with pytest.raises(ValueError, match="mode must be"):
        table.lookup(good, np.array([0, 3]), include_last_offset=True, mode="max")
    with pytest.raises(ValueError, match="per_sample_weights must have shape"):
        table.lookup(good, np.array([0, 3]), include_last_offset=True,
                     per_sample_weights=np.ones(2, np.float32))
    _, res = table.lookup(good, np.array([0, 3]), include_last_offset=True,
                          count_cache=False)  # a lookup that changes nothing
    for grad, error in ((np.ones((2, SHAPE.dim), np.float32), ValueError),
                        (np.ones((1, SHAPE.dim), np.int32), TypeError)):
        with pytest.raises(error, match="grad_bags"):
            table.apply_gradients(res, grad)
    with pytest.raises(TypeError, match="residuals"):
        table.apply_gradients((good,), np.ones((1, SHAPE.dim), np.float32))
    with pytest.raises(IndexError, match="out of range for 100 embeddings"):
        table.count_cache(np.array([5, 100]))
    for bad in (np.array([5.9, 0.5]), np.array([True, False])):  # cast: rows 5, 0 and 1, 0
        with pytest.raises(TypeError, match="indices must be integers"):
            table.count_cache(bad)
    with pytest.raises(ValueError, match="lr must be"):
        table.set_hyper(lr=-1.0)
    with pytest.raises(ValueError, match="unknown hyperparameters"):
        table.set_hyper(momentun=0.5)
    assert_unchanged(table, before)
    assert table.hyper["lr"] == HYPER["lr"]


def test_construction_errors():
    with pytest.raises(ValueError, match="optimizer must be one of"):
        TTTable(SHAPE, "lion")
    with pytest.raises(TypeError, match="TTShape"):
        TTTable((4, 5), "sgd")
    with pytest.raises(ValueError, match="num_embeddings must be between"):
        TTTable(SHAPE, "sgd", num_embeddings=SHAPE.num_rows + 1)
    with pytest.raises(ValueError, match="needs num_tables == 1"):
        TTTable(SHAPE, "sgd", num_tables=2, cache_size=4)
    with pytest.raises(ValueError, match="eps must be"):
        TTTable(SHAPE, "sgd", {"eps": float("nan")})


# ----------------------------------------------------------------------------- several tables


def test_several_tables_look_up_and_train_each_table(rng):
    tables = TTTable(SHAPE, "adagrad", HYPER, num_tables=3, num_embeddings=100, seed=4)
    fbtt = tables.tables_cores()
    B = 4
    indices, offsets = _batch(rng, 3 * B, 100, empty_bag=False)
    bags, res = tables.lookup(indices, offsets, include_last_offset=True)
    for t in range(3):
        cores = [c[t] for c in fbtt]
        lo, hi = offsets[t * B], offsets[(t + 1) * B]
        expected = bags_reference(cores, SHAPE, indices[lo:hi],
                                  offsets[t * B:(t + 1) * B + 1] - lo)
        assert_outputs_match(bags[t * B:(t + 1) * B], expected, rtol=1e-5, atol=1e-6,
                             what=f"table {t}")
        assert_outputs_match(tables.full_weight(t)[indices[lo:hi]],
                             tt.tt_rows_reference(cores, SHAPE, indices[lo:hi]),
                             rtol=1e-5, atol=1e-6, what=f"table {t} dense rows")
    assert tables.full_weight().shape == (3, SHAPE.num_rows, SHAPE.dim)
    # Start offsets alone (include_last_offset=False) give each bag to the same table.
    starts, _ = tables.lookup(indices, offsets[:-1], include_last_offset=False, train=False)
    assert_outputs_match(starts, bags, rtol=0, atol=0, what="start offsets")
    before = snapshot(tables)
    with pytest.raises(IndexError, match="index 100 at position 5"):
        bad = indices.copy()
        bad[5] = 100
        tables.lookup(bad, offsets, include_last_offset=True)
    with pytest.raises(ValueError, match="num_tables \\* B bags"):
        tables.lookup(indices, offsets[:-1], include_last_offset=True)
    assert_unchanged(tables, before)
    tables.apply_gradients(res, np.ones(bags.shape, np.float32))
    assert tables.step == 1


# ----------------------------------------------------------------------------- the row cache


def test_cache_serves_hot_rows_and_trains_them(rng):
    table = TTTable(SHAPE, "sgd", {"lr": 0.1}, cache_size=4, hashtbl_size=32, seed=6)
    assert not table.cache_active
    hot = np.array([5, 5, 5, 9, 9, 1, 2, 3])
    _, res = table.lookup(hot, np.array([0, 8]), include_last_offset=True)  # counted
    table.populate_cache()
    assert table.cache_active
    np.testing.assert_array_equal(np.sort(table.cache.rows[:4]), [1, 2, 5, 9])
    dense = table.numpy()
    bags, res = table.lookup(np.array([5, 9]), np.array([0, 1, 2]), include_last_offset=True)
    np.testing.assert_allclose(bags, dense[[5, 9]], rtol=1e-6)
    table.apply_gradients(res, np.ones((2, SHAPE.dim), np.float32))
    # the cached rows took the step on their dense values (and the cores learned it too)
    np.testing.assert_allclose(table.numpy()[[5, 9]], dense[[5, 9]] - 0.1, rtol=1e-5,
                               atol=1e-6)
    table.reset_cache()
    assert not table.cache_active and (table.cache.freq_counts == 0).all()
    with pytest.raises(RuntimeError, match="no row cache"):
        TTTable(SHAPE, "sgd").populate_cache()


def test_bind_checks_arrays_and_keeps_the_state_it_should(rng):
    table = TTTable(SHAPE, "lamb", HYPER, cache_size=4, seed=8)
    table.populate_cache()
    clone = table.without_arrays()
    assert clone.cores is None and clone.hyper == table.hyper
    with pytest.raises(RuntimeError, match="no arrays bound"):
        clone.lookup(np.array([0]), np.array([0, 1]), include_last_offset=True)
    cores = [c.copy() for c in table.cores]
    states = [{k: v.copy() for k, v in s.items()} for s in table.states]
    with pytest.raises(TypeError, match="float32"):
        clone.bind([c.astype(np.float16) for c in cores], states, np.zeros(1, np.int64))
    with pytest.raises(TypeError, match="float32"):  # cores of two dtypes
        clone.bind([cores[0]] + [c.astype(np.float64) for c in cores[1:]], states,
                   np.zeros(1, np.int64))
    with pytest.raises(ValueError, match="state 'exp_avg' of core 0 must be float64"):
        clone.bind([c.astype(np.float64) for c in cores], states, np.zeros(1, np.int64))
    with pytest.raises(ValueError, match="state 'exp_avg'"):
        clone.bind(cores, [{} for _ in states], np.zeros(1, np.int64))
    with pytest.raises(ValueError, match="step must be"):
        clone.bind(cores, states, np.zeros(2, np.int64))
    cache = tt.TTRowCache(SHAPE, 4, 16, "lamb")
    clone.bind(cores, states, np.array([7]), cache)
    assert clone.step == 7 and clone.cache_active  # the warmup flag carried over
    same = TTTable.from_arrays(SHAPE, cores, states, np.array([7]), optimizer="lamb",
                               optimizer_kwargs=HYPER)
    idx, off = np.array([3, 4]), np.array([0, 2])
    np.testing.assert_array_equal(same.lookup(idx, off, include_last_offset=True)[0],
                                  TTTable.from_arrays(SHAPE, table.cores, table.states,
                                                      table.step_array, optimizer="lamb")
                                  .lookup(idx, off, include_last_offset=True)[0])
    # training through a table over the caller's arrays writes those arrays in place
    before = [c.copy() for c in cores]
    bags, res = same.lookup(idx, off, include_last_offset=True)
    same.apply_gradients(res, np.ones_like(bags))
    assert same.step == 8 and all(c is d for c, d in zip(same.cores, cores))
    assert any((c != b).any() for c, b in zip(cores, before))


def test_float64_cores_train_on_the_array_path(rng):
    """A float64 table (a framework module's .double()) trains as the float32 one does,
    closer to the float64 reference."""
    table = TTTable(SHAPE, "rowwise_adagrad", HYPER, seed=3)
    wide = TTTable.from_arrays(
        SHAPE, [c.astype(np.float64) for c in table.cores],
        [{k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in s.items()}
         for s in table.states], np.zeros(1, np.int64), optimizer="rowwise_adagrad",
        optimizer_kwargs=HYPER)
    ref = ReferenceTable(table)
    for _ in range(3):
        indices, offsets = _batch(rng, 4, 60)
        bags, res = wide.lookup(indices, offsets, include_last_offset=True)
        grad = rng.standard_normal(bags.shape)
        wide.apply_gradients(res, grad)
        ref.train(indices, offsets, grad, None)
    assert wide.step == 3 and wide.cores[0].dtype == np.float64
    assert_outputs_match(list(wide.cores), ref.cores, rtol=1e-6, atol=1e-9, what="cores")


def test_residuals_of_another_table_or_binding_are_refused(rng):
    one, other = TTTable(SHAPE, "sgd", HYPER, seed=1), TTTable(SHAPE, "sgd", HYPER, seed=2)
    indices, offsets = _batch(rng, 3, 60)
    bags, res = other.lookup(indices, offsets, include_last_offset=True)
    before = snapshot(one), snapshot(other)
    with pytest.raises(ValueError, match="this table"):
        one.apply_gradients(res, np.ones_like(bags))
    bags, res = one.lookup(indices, offsets, include_last_offset=True)
    one.bind([c.copy() for c in one.cores], one.states, one.step_array)
    with pytest.raises(ValueError, match="current arrays"):
        one.apply_gradients(res, np.ones_like(bags))
    assert_unchanged(other, before[1])
    assert_unchanged(one, before[0])


def test_bad_out_is_refused_before_the_cache_counts(rng):
    table = TTTable(SHAPE, "sgd", HYPER, cache_size=4, seed=1)
    before = snapshot(table)
    indices, offsets = _batch(rng, 3, 60)
    with pytest.raises(ValueError, match="out must have shape"):
        table.lookup(indices, offsets, include_last_offset=True,
                     out=np.zeros((2, SHAPE.dim), np.float32))
    with pytest.raises(TypeError, match="out must be a float32"):
        table.lookup(indices, offsets, include_last_offset=True,
                     out=np.zeros((3, SHAPE.dim), np.int32))
    # float64 passed the first check, then the batch was counted and refused (ValueError)
    with pytest.raises(TypeError, match="out must be a float32"):
        table.lookup(indices, offsets, include_last_offset=True,
                     out=np.zeros((3, SHAPE.dim), np.float64))
    assert_unchanged(table, before)
    # the forward itself checks out before it counts the batch in the cache
    with pytest.raises(ValueError, match="out must be float32"):
        tt.tt_embedding_bag_fwd(table.cores, table.joint_shape, indices, offsets,
                                cache=table.cache, cache_count=True,
                                out=np.zeros((3, SHAPE.dim), np.float64))
    assert_unchanged(table, before)


@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad"])
def test_cache_rows_not_hit_stay_finite_with_eps_zero(optimizer):
    """eps = 0 (allowed: >= 0): a cached row the batch did not hit has a zero gradient and
    a zero accumulator; stepping it anyway gave 0 / 0 = NaN, which its lookups then read."""
    table = TTTable(SHAPE, optimizer, {"lr": 0.1, "eps": 0.0}, cache_size=3, hashtbl_size=32,
                    seed=4)
    table.lookup(np.array([5, 5, 9]), np.array([0, 3]), include_last_offset=True)
    table.populate_cache()  # rows 5 and 9 cached, one slot empty
    row9 = table.numpy()[9].copy()
    bags, res = table.lookup(np.array([5]), np.array([0, 1]), include_last_offset=True)
    with np.errstate(invalid="raise", divide="raise"):
        table.apply_gradients(res, np.ones_like(bags))
    assert np.isfinite(table.cache.weight).all()
    np.testing.assert_array_equal(table.numpy()[9], row9)  # not hit: unchanged
    assert (table.numpy()[5] != bags[0]).all()  # hit: trained


# ----------------------------------------------------------------------------- GPU


def _on_gpu(table: TTTable, optimizer: str) -> TTTable:
    """A CuPy twin of a NumPy table: the same cores, state and step, on the GPU."""
    import cupy

    states = [{k: cupy.asarray(v) for k, v in s.items()} for s in table.states]
    return TTTable.from_arrays(table.shape, [cupy.asarray(c) for c in table.cores], states,
                               cupy.asarray(table.step_array), optimizer=optimizer,
                               optimizer_kwargs=HYPER, num_embeddings=table.num_embeddings)


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", tt.SPARSE_OPTIMIZERS)
def test_gpu_training_matches_the_float64_reference(optimizer, rng):
    """The CUDA kernel path of lookup and apply_gradients (device-side checks, fused
    update, device step counter) against the float64 reference, as the NumPy test above."""
    import cupy

    cpu = TTTable(SHAPE, optimizer, HYPER, num_embeddings=110, seed=3)
    table, ref = _on_gpu(cpu, optimizer), ReferenceTable(cpu)
    for step in range(4):
        dtype = np.int32 if step % 2 else np.int64
        indices, offsets = _batch(rng, 5, 25 if step < 2 else 110, dtype)
        weights = rng.uniform(0.5, 1.5, len(indices)).astype(np.float32) if step == 1 else None
        mode = "mean" if step == 2 else "sum"
        bags, residuals = table.lookup(
            cupy.asarray(indices), cupy.asarray(offsets), mode=mode, include_last_offset=True,
            per_sample_weights=None if weights is None else cupy.asarray(weights))
        expected = bags_reference(ref.cores, SHAPE, indices, offsets, weights, mode)
        assert_outputs_match(cupy.asnumpy(bags), expected, rtol=1e-5, atol=1e-6,
                             what=f"step {step} bags")
        grad = rng.standard_normal(bags.shape).astype(np.float32)
        table.apply_gradients(residuals, cupy.asarray(grad))
        ref.train(indices, offsets, grad, weights, mode)
    table.check()
    assert table.step == ref.step == 4
    assert_outputs_match([cupy.asnumpy(c) for c in table.cores], ref.cores, rtol=2e-4,
                         atol=2e-6, what="cores")
    for k, (got, want) in enumerate(zip(table.states, ref.states)):
        assert_outputs_match({n: cupy.asnumpy(v) for n, v in got.items()}, want, rtol=2e-4,
                             atol=1e-6, what=f"state of core {k}")


@pytest.mark.gpu
def test_gpu_bad_batch_raises_with_nothing_changed(rng):
    """An index out of range in a GPU training batch: the device-side check raises at the
    update, before any core, state or step changes."""
    import cupy

    table = _on_gpu(TTTable(SHAPE, "rowwise_adagrad", HYPER, num_embeddings=110, seed=3),
                    "rowwise_adagrad")
    indices, offsets = _batch(rng, 5, 110)
    indices[3] = 110
    before = {f"core{k}": cupy.asnumpy(c) for k, c in enumerate(table.cores)}
    before["step"] = cupy.asnumpy(table.step_array)
    with pytest.raises(IndexError, match="110"):
        bags, residuals = table.lookup(cupy.asarray(indices), cupy.asarray(offsets),
                                       include_last_offset=True)
        table.apply_gradients(residuals, cupy.ones(bags.shape, np.float32))
        table.check()
    after = {f"core{k}": cupy.asnumpy(c) for k, c in enumerate(table.cores)}
    after["step"] = cupy.asnumpy(table.step_array)
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
