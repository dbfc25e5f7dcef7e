import os

import numpy as np
import pytest

import xferlib
from xferlib.testing import (assert_outputs_match, for_each_backend, reference_check,
                             table_arrays)

# (optimizer, hyperparameters, torch.optim class name): every variant the kernels branch on.
VARIANTS = [
    ("sgd", {"lr": 0.1}, "SGD"),
    ("sgd", {"lr": 0.1, "momentum": 0.9}, "SGD"),
    ("sgd", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}, "SGD"),
    ("sgd", {"lr": 0.1, "momentum": 0.8, "dampening": 0.1, "maximize": True}, "SGD"),
    ("adam", {"lr": 0.01}, "Adam"),
    ("adam", {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True}, "Adam"),
    ("adam", {"lr": 0.01, "maximize": True, "betas": (0.8, 0.99)}, "Adam"),
    ("adamw", {"lr": 0.01}, "AdamW"),
    ("adamw", {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True}, "AdamW"),
    ("adagrad", {"lr": 0.1}, "Adagrad"),
    ("adagrad", {"lr": 0.1, "lr_decay": 0.01, "weight_decay": 0.01,
                 "initial_accumulator_value": 0.1}, "Adagrad"),
    ("adamax", {"lr": 0.01}, "Adamax"),
    ("adamax", {"lr": 0.01, "weight_decay": 0.01, "maximize": True}, "Adamax"),
    ("rmsprop", {"lr": 0.01}, "RMSprop"),
    ("rmsprop", {"lr": 0.01, "momentum": 0.5}, "RMSprop"),
    ("rmsprop", {"lr": 0.01, "centered": True, "momentum": 0.9, "weight_decay": 0.01},
     "RMSprop"),
    ("adadelta", {}, "Adadelta"),
    ("adadelta", {"lr": 0.5, "rho": 0.8, "weight_decay": 0.01}, "Adadelta"),
    ("rowwise_adagrad", {"lr": 0.1}, None),
    ("rowwise_adagrad", {"lr": 0.1, "weight_decay": 0.01, "initial_accumulator_value": 0.1},
     None),
]
NUM_ROWS, STEPS = 50, 6
# A host table lives in host RAM whatever the backend: the backend places its indices and
# gradients (NumPy: the CPU path; CuPy: the GPU path, reading and writing the pinned table).
each_backend = for_each_backend("numpy", "cupy")


def _batches(rng, dim, index_dtype, n=40):
    for _ in range(STEPS):
        # Skewed, so some rows repeat within a batch and some are never touched.
        idx = (rng.zipf(1.5, size=n) % NUM_ROWS).astype(index_dtype)
        yield idx, rng.standard_normal((n, dim)).astype(np.float32)


def _state_of(table):
    return {name: np.array(table.state(name), dtype=np.float64)
            for name in table.state_names() if name != "step"}


def training_reference(name, hyper, init, batches, lookups=False):
    """``sparse_update_reference`` over ``batches`` from a fresh table's state: the final
    weights and every state array (``step`` too), keyed as :func:`table_arrays` keys them;
    with ``lookups``, also the rows each batch looks up before its update."""
    fresh = xferlib.HostTable(len(init), init.shape[1], optimizer=name, optimizer_kwargs=hyper,
                              init=init.copy())
    weights, state, steps = init.astype(np.float64), _state_of(fresh), np.zeros(len(init))
    seen = []
    for idx, grads in batches:
        seen.append(weights[idx])
        weights, state, steps = xferlib.sparse_update_reference(name, weights, state, steps,
                                                                idx, grads, hyper)
    out = {"weights": weights, **state, "step": steps.astype(np.int64)}
    return ({"lookups": seen} | out) if lookups else out


def _trained(name, hyper, init, batches):
    """A table of rows ``init`` after ``apply_gradients`` of each batch."""
    table = xferlib.HostTable(len(init), init.shape[1], optimizer=name, optimizer_kwargs=hyper,
                              init=init.copy())
    for idx, grads in batches:
        table.apply_gradients(idx, grads)
    return table


@pytest.mark.parametrize("name, hyper, torch_name", VARIANTS)
# 16: the 16-byte-word path on the GPU; 100: rows padded to a 64-byte line (xferlib.table.layout)
@pytest.mark.parametrize("dim", [5, 16, 33, 100])
@each_backend
def test_matches_reference(backend, rng, name, hyper, torch_name, dim):
    init = rng.standard_normal((NUM_ROWS, dim)).astype(np.float32)

    reference_check(backend, lambda b: table_arrays(_trained(name, hyper, init, b)), lambda b: training_reference(name, hyper, init, b),
                    list(_batches(rng, dim, "int64")), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name, hyper, torch_name", VARIANTS)
@pytest.mark.parametrize("dim", [5, 16, 33, 100])
@each_backend
def test_update_of_a_lookup_batch_matches_reference(backend, rng, name, hyper, torch_name, dim):
    """lookup(return_batch=True) then apply_gradients(batch): on the GPU the update reads the
    rows' weights from the lookup's copy in HBM (nothing wrote to the table in between)."""
    init = rng.standard_normal((NUM_ROWS, dim)).astype(np.float32)

    def train(batches):
        table = xferlib.HostTable(NUM_ROWS, dim, optimizer=name, optimizer_kwargs=hyper,
                                  init=init.copy())
        seen = []
        for idx, grads in batches:
            rows, batch = table.lookup(idx, return_batch=True)
            seen.append(rows)
            table.apply_gradients(batch, grads)
        return {"lookups": seen, **table_arrays(table)}

    reference_check(backend, train,
                    lambda b: training_reference(name, hyper, init, b, lookups=True),
                    list(_batches(rng, dim, "int64")), rtol=2e-5, atol=2e-6)


@for_each_backend("cupy")
def test_another_tables_batch_updates_this_tables_rows(backend, rng):
    """A batch returned by table a's lookup, applied to table b (same indices): b's update
    reads b's rows, never a's copy of a's."""
    dim = 16
    a = xferlib.HostTable(NUM_ROWS, dim, optimizer="sgd", optimizer_kwargs={"lr": 0.5},
                          init=rng.standard_normal((NUM_ROWS, dim)).astype(np.float32))
    init_b = rng.standard_normal((NUM_ROWS, dim)).astype(np.float32)
    b = xferlib.HostTable(NUM_ROWS, dim, optimizer="sgd", optimizer_kwargs={"lr": 0.5},
                          init=init_b.copy())
    reference = xferlib.HostTable(NUM_ROWS, dim, optimizer="sgd", optimizer_kwargs={"lr": 0.5},
                                  init=init_b.copy())
    idx = backend.array(np.arange(0, NUM_ROWS, 3))
    grads = backend.array(rng.standard_normal((idx.shape[0], dim)).astype(np.float32))
    _, batch = a.lookup(idx, return_batch=True)
    b.apply_gradients(batch, grads)
    reference.apply_gradients(idx, grads)
    assert_outputs_match(table_arrays(b), table_arrays(reference), rtol=0, atol=0)


def test_rows_are_padded_to_a_line_where_cheap():
    from xferlib.table.layout import RowLayout

    sgd = RowLayout(128, 4, (), ())  # 512 B of weights + 16 B of state -> 576 B
    assert (sgd.used_width * 4, sgd.row_width * 4) == (528, 576)
    adam = RowLayout(100, 4, ("exp_avg", "exp_avg_sq"), ())
    assert adam.row_width * 4 % 64 == 0 and adam.row_width >= adam.used_width
    small = RowLayout(16, 4, (), ())  # 80 B: a line of padding would cost 60%
    assert small.row_width == small.used_width == 20
    table = xferlib.HostTable(10, 100, optimizer="sgd")
    assert table._storage.strides[0] == 448 and table.numpy().shape == (10, 100)


@pytest.mark.parametrize("cache_rows", [0, 12])
@each_backend
def test_update_after_a_write_reads_the_current_rows(backend, rng, cache_rows):
    """A lookup's copy of its rows goes stale when the table is written after it (another
    batch's update, a scatter): updates of such batches read the rows where they live, so
    no write is lost. Overlapping batches, every order against the plain-index reference."""
    dim = 16
    init = rng.standard_normal((NUM_ROWS, dim)).astype(np.float32)
    kw = dict(optimizer="sgd", optimizer_kwargs={"lr": 0.5, "momentum": 0.9}, init=init.copy())
    table = xferlib.HostTable(NUM_ROWS, dim, cache_rows=cache_rows, cache_admission="always",
                              **kw)
    reference = xferlib.HostTable(NUM_ROWS, dim, **kw)

    def batch():
        return backend.array((rng.zipf(1.3, size=64) % NUM_ROWS).astype(np.int64))

    def grads():
        return backend.array(rng.standard_normal((64, dim)).astype(np.float32))

    for _ in range(3):
        a, b = batch(), batch()
        _, plan_a = table.lookup(a, return_batch=True)
        _, plan_b = table.lookup(b, return_batch=True)
        for idx, plan in ((a, plan_a), (b, plan_b)):  # b's copy is stale after a's update
            g = grads()
            table.apply_gradients(plan, g)
            reference.apply_gradients(idx, g)
        c = batch()
        _, plan_c = table.lookup(c, return_batch=True)
        rows = backend.array(rng.standard_normal((3, dim)).astype(np.float32))
        hit = c[:3]  # rows c looked up, overwritten before c's update
        table.scatter(hit, rows)
        reference.scatter(hit, rows)
        g = grads()
        table.apply_gradients(plan_c, g)
        reference.apply_gradients(c, g)
        _, plan_d = table.lookup(c, return_batch=True)
        g = grads()
        table.apply_gradients(plan_d, g)
        table.apply_gradients(plan_d, g)  # the same batch twice: the second reads the rows
        reference.apply_gradients(c, g)
        reference.apply_gradients(c, g)
    assert_outputs_match(table_arrays(table), table_arrays(reference), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name, hyper, torch_name",
                         [v for v in VARIANTS if v[2] is not None])
@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
@each_backend
def test_matches_torch_optim_per_row(backend, rng, name, hyper, torch_name, index_dtype):
    """Lazy semantics: each touched row steps exactly like a torch.optim parameter of its own
    that receives the row's summed gradient on the steps the row is in the batch."""
    torch = pytest.importorskip("torch")
    dim = 7
    init = rng.standard_normal((NUM_ROWS, dim)).astype(np.float32)

    def torch_reference(batches):
        params = [torch.nn.Parameter(torch.tensor(row, dtype=torch.float64)) for row in init]
        optimizers = [getattr(torch.optim, torch_name)([p], **hyper) for p in params]
        for idx, grads in batches:
            summed = np.zeros((NUM_ROWS, dim))
            np.add.at(summed, idx, grads.astype(np.float64))
            for row in np.unique(idx):
                params[row].grad = torch.tensor(summed[row])
                optimizers[row].step()
        return np.stack([p.detach().numpy() for p in params])

    reference_check(backend, lambda b: _trained(name, hyper, init, b).numpy(), torch_reference, list(_batches(rng, dim, index_dtype)),
                    rtol=3e-5, atol=3e-6)


def test_rowwise_adagrad_formula():
    table = xferlib.HostTable(3, 4, optimizer="rowwise_adagrad",
                              optimizer_kwargs={"lr": 0.5, "eps": 0.0}, init="zeros")
    g = np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)
    table.apply_gradients(np.array([1]), g)
    total = np.mean(g ** 2)  # FBGEMM: one accumulator per row, fed the mean square
    np.testing.assert_allclose(table.numpy()[1], -0.5 * g[0] / np.sqrt(total), rtol=1e-6)
    np.testing.assert_allclose(table.state("sum"), [0.0, total, 0.0], rtol=1e-6)


@each_backend
def test_duplicates_sum_like_dense_sgd(backend, rng):
    """For SGD the result equals a dense step on the summed gradient."""
    init = rng.standard_normal((20, 6)).astype(np.float32)

    def step(idx, grads):
        table = xferlib.HostTable(20, 6, optimizer="sgd", optimizer_kwargs={"lr": 0.1},
                                  init=init.copy())
        table.apply_gradients(idx, grads)
        return table.numpy()

    def dense_sgd(idx, grads):
        dense = np.zeros((20, 6))
        np.add.at(dense, idx, grads.astype(np.float64))
        return init - 0.1 * dense

    reference_check(backend, step, dense_sgd, np.array([3, 3, 3, 9, 3, 0], np.int32),
                    rng.standard_normal((6, 6)).astype(np.float32), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [0, 1, 5, 4097, 20000])
@each_backend
def test_lookup_matches_weights(backend, rng, n):
    table = xferlib.HostTable(3000, 9, init=("uniform", -1.0, 1.0), seed=1)
    rows = reference_check(backend, table.lookup, lambda idx: np.asarray(table.numpy())[idx],
                           rng.integers(0, 3000, size=n), rtol=0, atol=0)
    assert rows.shape == (n, 9) and rows.dtype == np.float32


@each_backend
def test_float64_table(backend, rng):
    def step(idx, grads):
        table = xferlib.HostTable(10, 3, "float64", optimizer="adam",
                                  optimizer_kwargs={"lr": 0.1}, init="zeros")
        table.apply_gradients(idx, grads)
        return table_arrays(table)

    def reference(idx, grads):
        w, state, steps = xferlib.sparse_update_reference(
            "adam", np.zeros((10, 3)), {"exp_avg": np.zeros((10, 3)),
                                        "exp_avg_sq": np.zeros((10, 3))},
            np.zeros(10), idx, grads, {"lr": 0.1})
        return {"weights": w, **state, "step": steps}

    reference_check(backend, step, reference, np.array([1, 1, 4]),
                    rng.standard_normal((3, 3)), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("bad", [-1, 10])
@each_backend
def test_bad_index_changes_nothing(backend, rng, bad):
    table = xferlib.HostTable(10, 4, optimizer="adam", seed=0)
    before = table_arrays(table)
    idx = backend.array(np.array([1, bad, 2]))
    grads = backend.array(np.ones((3, 4), np.float32))
    # On the GPU the check is deferred (no host sync): raised by check() at the latest.
    with pytest.raises(IndexError, match=f"index {bad} at position 1"):
        table.apply_gradients(idx, grads)
        table.check()
    with pytest.raises(IndexError, match=f"index {bad} at position 1"):
        table.lookup(idx)
        table.check()
    assert_outputs_match(table_arrays(table), before, rtol=0, atol=0)
    assert not table.state("step").any()


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown optimizer"):
        xferlib.HostTable(4, 2, optimizer="lamb")
    with pytest.raises(ValueError, match="unknown hyperparameter"):
        xferlib.HostTable(4, 2, optimizer="adam", optimizer_kwargs={"momentum": 0.9})
    with pytest.raises(ValueError, match="Invalid learning rate"):
        xferlib.HostTable(4, 2, optimizer="adam", optimizer_kwargs={"lr": -1.0})
    with pytest.raises(ValueError, match="Invalid beta"):
        xferlib.HostTable(4, 2, optimizer="adamw", optimizer_kwargs={"betas": (0.9, 1.0)})
    with pytest.raises(ValueError, match="Nesterov"):
        xferlib.HostTable(4, 2, optimizer="sgd", optimizer_kwargs={"nesterov": True})
    with pytest.raises(TypeError, match="float32 or float64"):
        xferlib.HostTable(4, 2, dtype="int32")
    with pytest.raises(ValueError, match="init"):
        xferlib.HostTable(4, 2, init="ones")
    with pytest.raises(ValueError, match="cache_admission"):
        xferlib.HostTable(4, 2, cache_admission="never")
    with pytest.raises(ValueError, match="shape"):
        xferlib.HostTable(4, 2, init=np.zeros((4, 3), np.float32))
    table = xferlib.HostTable(4, 2, optimizer="sgd")
    with pytest.raises(ValueError, match="grad_rows must have shape"):
        table.apply_gradients(np.array([0, 1]), np.zeros((2, 3), np.float32))
    with pytest.raises(TypeError, match="int32 or int64"):
        table.lookup(np.array([0.0]))
    with pytest.raises(ValueError, match="no optimizer"):
        xferlib.HostTable(4, 2).apply_gradients(np.array([0]), np.zeros((1, 2), np.float32))
    with pytest.raises(ValueError, match="state layout"):
        table.set_hyper(momentum=0.9)
    with pytest.raises(KeyError, match="exp_avg"):
        table.state("exp_avg")


def test_set_hyper_changes_lr():
    table = xferlib.HostTable(4, 2, optimizer="sgd", optimizer_kwargs={"lr": 1.0}, init="zeros")
    table.set_hyper(lr=0.25)
    table.apply_gradients(np.array([2]), np.ones((1, 2), np.float32))
    np.testing.assert_array_equal(table.numpy()[2], [-0.25, -0.25])
    assert table.hyper["lr"] == 0.25


def test_init_array_is_used_in_place():
    weights = np.arange(12, dtype=np.float32).reshape(6, 2)
    table = xferlib.HostTable(6, 2, optimizer="sgd", optimizer_kwargs={"lr": 1.0},
                              init=weights)
    table.apply_gradients(np.array([5]), np.ones((1, 2), np.float32))
    assert np.shares_memory(table.numpy(), weights)
    np.testing.assert_array_equal(weights[5], [9.0, 10.0])


def test_initializers():
    uniform = np.asarray(xferlib.HostTable(20000, 4, init=("uniform", -0.5, 0.25),
                                           seed=3).numpy())
    assert uniform.min() >= -0.5 and uniform.max() <= 0.25 and uniform.std() > 0.1
    normal = np.asarray(xferlib.HostTable(20000, 4, init=("normal", 2.0, 0.5), seed=3).numpy())
    assert abs(normal.mean() - 2.0) < 0.02 and abs(normal.std() - 0.5) < 0.02
    assert not xferlib.HostTable(7, 3, init="zeros").numpy().any()
    adagrad = xferlib.HostTable(7, 3, optimizer="adagrad",
                                optimizer_kwargs={"initial_accumulator_value": 0.3})
    np.testing.assert_allclose(adagrad.state("sum"), 0.3)


def test_save_load_round_trip(tmp_path, rng):
    table = xferlib.HostTable(30, 5, optimizer="adam", optimizer_kwargs={"lr": 0.05}, seed=2)
    for idx, grads in _batches(rng, 5, "int64"):
        table.apply_gradients(idx % 30, grads[:, :5])
    path = tmp_path / "table.npz"
    table.save(path)
    loaded = xferlib.HostTable.load(path)
    assert loaded.optimizer == "adam" and loaded.hyper == table.hyper
    np.testing.assert_array_equal(loaded.numpy(), table.numpy())
    for name in table.state_names():
        np.testing.assert_array_equal(loaded.state(name), table.state(name))
    # Training goes on identically from the restored copy.
    idx, grads = np.array([1, 2, 2]), rng.standard_normal((3, 5)).astype(np.float32)
    table.apply_gradients(idx, grads)
    loaded.apply_gradients(idx, grads)
    np.testing.assert_array_equal(loaded.numpy(), table.numpy())


def test_lookup_out_is_checked_and_numpy_scalars_are_hyperparameters():
    table = xferlib.HostTable(10, 3, optimizer="sgd", optimizer_kwargs={"lr": np.float32(0.1)})
    for out in (np.zeros((1, 3), np.int32), np.zeros((2, 3), np.float32), [[0.0] * 3]):
        with pytest.raises(ValueError, match="out must be a NumPy array of shape"):
            table.lookup(np.array([1]), out=out)
    out = np.zeros((1, 3), np.float32)
    assert table.lookup(np.array([1]), out=out) is out
    with pytest.raises(ValueError, match="Invalid learning rate"):
        xferlib.HostTable(10, 3, optimizer="sgd", optimizer_kwargs={"lr": True})


def test_a_pickled_table_trains_as_the_original(rng):
    """torch.save of a model pickles its tables: the rule comes back by name."""
    import pickle

    table = xferlib.HostTable(30, 5, optimizer="adagrad", optimizer_kwargs={"lr": 0.05},
                              seed=2)
    copy = pickle.loads(pickle.dumps(table))
    idx, grads = np.array([1, 2, 2]), rng.standard_normal((3, 5)).astype(np.float32)
    for t in (table, copy):
        t.apply_gradients(idx, grads)
    np.testing.assert_array_equal(copy.numpy(), table.numpy())
    np.testing.assert_array_equal(copy.state("sum"), table.state("sum"))


def test_load_rejects_truncated_and_foreign_files(tmp_path):
    table = xferlib.HostTable(100, 8, optimizer="sgd")
    path = tmp_path / "t.npz"
    table.save(path)
    data = path.read_bytes()
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or not an xferlib HostTable"):
        xferlib.HostTable.load(truncated)
    foreign = tmp_path / "foreign.npz"
    np.savez(foreign, weights=np.zeros(3))
    with pytest.raises(ValueError, match="not an xferlib HostTable file"):
        xferlib.HostTable.load(foreign)
    with pytest.raises(FileNotFoundError):
        xferlib.HostTable.load(tmp_path / "missing.npz")
    assert not list(tmp_path.glob(".xferlib-*"))  # no temporary file left behind


def test_save_is_atomic_on_failure(tmp_path, monkeypatch):
    table = xferlib.HostTable(10, 2, optimizer="sgd", init="zeros")
    path = tmp_path / "t.npz"
    table.save(path)
    before = path.read_bytes()

    def broken(fd, data):
        raise OSError(28, "disk full")

    monkeypatch.setattr(os, "write", broken)
    with pytest.raises(OSError, match="disk full"):
        table.save(path)
    assert path.read_bytes() == before
    assert not list(tmp_path.glob(".xferlib-*"))


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="needs Linux")
@each_backend
def test_tables_are_freed(backend, rng):
    """Create, train and drop 128 MB tables (with Adam state) again and again: resident (and,
    with a GPU, pinned) memory comes back."""
    rows = (128 << 20) // (4 * 64 * 3)
    idx, grads = rng.integers(0, rows, size=1000), rng.standard_normal((1000, 64))
    baseline = None
    for i in range(6):
        table = xferlib.HostTable(rows, 64, optimizer="adam", init="zeros")
        table.apply_gradients(backend.array(idx), backend.array(grads.astype(np.float32)))
        table.numpy()
        del table
        import gc

        gc.collect()
        if i == 1:
            baseline = _resident_bytes()
    assert _resident_bytes() - baseline < (64 << 20)


# ----------------------------------------------------------------------------- GPU only


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("cache_rows", [1, 8, 50])
@pytest.mark.parametrize("dim", [6, 8])
@pytest.mark.parametrize("admission", ["second-sight", "always"])
@for_each_backend("cupy")
def test_cache_gives_the_same_training(backend, rng, policy, cache_rows, dim, admission):
    init = rng.standard_normal((NUM_ROWS, dim)).astype(np.float32)
    plain = xferlib.HostTable(NUM_ROWS, dim, optimizer="adam", init=init.copy())
    cached = xferlib.HostTable(NUM_ROWS, dim, optimizer="adam", init=init.copy(),
                               cache_rows=cache_rows, cache_policy=policy,
                               cache_admission=admission)
    for i, (idx, grads) in enumerate(_batches(rng, dim, "int64")):
        idx, grads = backend.put((idx, grads))
        assert_outputs_match(backend.get(cached.lookup(idx)), backend.get(plain.lookup(idx)),
                             rtol=0, atol=0, what=f"lookup {i}")
        plain.apply_gradients(idx, grads)
        cached.apply_gradients(idx, grads)
    assert_outputs_match(table_arrays(cached), table_arrays(plain), rtol=1e-6, atol=1e-7)
    stats = cached.cache_stats()
    assert stats["hits"] + stats["misses"] == stats["lookups"] > 0
    assert stats["hits"] > 0 and stats["admitted"] <= stats["misses"]
    assert stats["evicted"] <= stats["admitted"]


@for_each_backend("cupy")
def test_cache_rows_are_written_back_on_save(backend, tmp_path, rng):
    table = xferlib.HostTable(40, 4, optimizer="sgd", optimizer_kwargs={"lr": 1.0},
                              init="zeros", cache_rows=10, cache_admission="always")
    idx = backend.array(np.arange(10))
    table.lookup(idx)
    table.apply_gradients(idx, backend.array(np.ones((10, 4), dtype=np.float32)))
    table.save(tmp_path / "t.npz")
    loaded = xferlib.HostTable.load(tmp_path / "t.npz")
    np.testing.assert_array_equal(loaded.numpy()[:10], -1.0)
    # Evicting everything still keeps every update.
    other = backend.array(np.arange(10, 40))
    table.lookup(other)
    np.testing.assert_array_equal(table.numpy()[:10], -1.0)


@for_each_backend("cupy")
def test_prefetch_sees_updates_queued_after_it(backend, rng):
    dim = 8
    table = xferlib.HostTable(100, dim, optimizer="adam", optimizer_kwargs={"lr": 0.1},
                              seed=4)
    reference = xferlib.HostTable(100, dim, optimizer="adam", optimizer_kwargs={"lr": 0.1},
                                  seed=4)
    batches = [backend.array(rng.integers(0, 30, size=64)) for _ in range(5)]
    rows = table.lookup(batches[0])
    for step in range(4):
        table.prefetch(batches[step + 1])  # overlaps the rows of the batch being trained
        grads = backend.array(rng.standard_normal((64, dim)).astype(np.float32))
        table.apply_gradients(batches[step], grads)
        reference.lookup(batches[step])
        reference.apply_gradients(batches[step], grads)
        rows = table.lookup(batches[step + 1])
        assert_outputs_match(backend.get(rows), backend.get(reference.lookup(batches[step + 1])),
                             rtol=0, atol=0, what=f"lookup {step + 1}")
    assert_outputs_match(table_arrays(table), table_arrays(reference), rtol=0, atol=0)


@for_each_backend("cupy")
def test_gpu_bad_grads_namespace(backend):
    table = xferlib.HostTable(10, 2, optimizer="sgd")
    with pytest.raises(TypeError, match="CuPy"):
        table.apply_gradients(backend.array(np.arange(2)), np.zeros((2, 2), np.float32))


def test_restore_checks_every_array_before_writing():
    """An array that cannot be written (None in ``step``, strings) raises before the first
    write: the table is not left half restored."""
    table = xferlib.HostTable(3, 2, optimizer="adagrad", init="zeros")
    before = table_arrays(table)
    for weights, step, bad in [(np.ones((3, 2)), np.array([1, None, 2]), "state 'step'"),
                               (np.full((3, 2), "a"), np.zeros(3), "weights")]:
        with pytest.raises(TypeError, match=f"{bad} must hold real numbers"):
            table.restore(weights, {"sum": np.ones((3, 2)), "step": step})
        assert_outputs_match(table_arrays(table), before, rtol=0, atol=0)
    table.restore(np.ones((3, 2)), {"sum": [[2, 2]] * 3, "step": np.array([1, 5, 2], np.int32)})
    assert table.state("step").tolist() == [1, 5, 2] and table.state("sum").sum() == 12


def test_calls_after_close_raise():
    table = xferlib.HostTable(3, 2, optimizer="sgd", init="zeros")
    table.close()
    with pytest.raises(ValueError, match="closed"):
        table.restore(np.zeros((3, 2)), {"step": np.zeros(3)})
    with pytest.raises(ValueError, match="closed"):  # as lookup and the GPU path
        table.prefetch(np.array([1]))


def test_gradients_and_rows_must_be_arrays():
    import torch

    table = xferlib.HostTable(4, 2, optimizer="sgd", init="zeros")
    idx = np.array([0, 1])
    for grads in ([[1.0, 1.0]] * 2, torch.ones(2, 2)):
        with pytest.raises(TypeError, match="grad_rows must be a NumPy or CuPy array"):
            table.apply_gradients(idx, grads)
        with pytest.raises(TypeError, match="rows must be a NumPy or CuPy array"):
            table.scatter(idx, grads)
    with pytest.raises(TypeError, match="rows must hold real numbers"):
        table.scatter(idx, np.full((2, 2), "x"))
    assert not table.numpy().any()


def test_set_hyper_on_a_device_view_reaches_the_table():
    """A view follows its table's hyperparameters; set_hyper on the view was silently undone
    by that (the old lr trained on)."""
    table = xferlib.HostTable(4, 2, optimizer="sgd", optimizer_kwargs={"lr": 1.0}, init="zeros")
    view = table.device_view()
    view.set_hyper(lr=0.25)
    assert view.hyper["lr"] == table.hyper["lr"] == 0.25
    view.apply_gradients(np.array([1]), np.ones((1, 2), np.float32))
    np.testing.assert_array_equal(table.numpy()[1], [-0.25, -0.25])


def test_bad_dtype_and_nonfinite_init_parameters():
    with pytest.raises(TypeError, match=r"got dtype 'adam'; name the optimizer by keyword"):
        xferlib.HostTable(10, 4, "adam")
    for init in (("normal", 0.0, float("nan")), ("normal", float("inf"), 1.0),
                 ("uniform", 0.0, float("inf"))):
        with pytest.raises(ValueError, match="finite"):
            xferlib.HostTable(4, 2, init=init)


def test_zero_dimensional_hyperparameters_are_saved(tmp_path):
    table = xferlib.HostTable(4, 2, optimizer="adam", optimizer_kwargs={"lr": np.array(0.5)})
    table.set_hyper(eps=np.float32(1e-6))
    table.save(tmp_path / "t.xf")
    loaded = xferlib.HostTable.load(tmp_path / "t.xf")
    assert loaded.hyper == table.hyper and loaded.hyper["lr"] == 0.5
