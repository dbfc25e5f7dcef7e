"""Bad input at every public entry point: the right exception type, a message that names the
argument, the bad value and what is valid, and no state changed.

Each case builds fresh objects, snapshots their state, makes the bad call and checks the
exception and that the snapshot is unchanged. Row-transfer cases run on every backend (the GPU
paths check indices in a kernel, a different path from the NumPy one).
"""

from __future__ import annotations

import numpy as np
import pytest

import xferlib

# ----------------------------------------------------------------------------- helpers


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if hasattr(a, "detach"):  # torch
        a, b = a.detach().cpu().numpy(), b.detach().cpu().numpy()
    if hasattr(a, "get") and not isinstance(a, dict):  # cupy
        a, b = a.get(), b.get()
    if isinstance(a, np.ndarray):
        return a.shape == b.shape and np.array_equal(a, b, equal_nan=True)
    return a == b


def _copy(x):
    if isinstance(x, dict):
        return {k: _copy(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_copy(v) for v in x)
    if hasattr(x, "detach"):
        return x.detach().clone()
    if hasattr(x, "copy"):
        return x.copy()
    return x


def _check(call, snapshot, exc, needles):
    before = _copy(snapshot())
    with pytest.raises(exc) as info:
        call()
        xferlib.check_rows()  # GPU row transfers report a bad index after the call returns
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in the message: {message}"
    assert _same(before, snapshot()), "state changed by a rejected call"


def _nothing():
    return None


# ----------------------------------------------------------------------------- row transfer


def _rows_cases(b):
    """(id, call, snapshot, exception, needles) on backend ``b``."""
    host = np.arange(40, dtype=np.float32).reshape(10, 4)
    table = b.table(host)
    ones = b.array(np.ones((2, 4), np.float32))

    def snap():
        return b.to_host(table)

    idx = lambda *v: b.array(np.array(v, dtype=np.int64))  # noqa: E731
    return [
        ("gather index too large", lambda: xferlib.gather_rows(table, idx(1, 10)),
         IndexError, ["index 10", "position 1", "0 <= index < 10"]),
        ("gather negative index", lambda: xferlib.gather_rows(table, idx(-1)),
         IndexError, ["index -1", "0 <= index < 10"]),
        ("gather float indices", lambda: xferlib.gather_rows(table, b.array(np.array([1.0]))),
         TypeError, ["indices", "int32 or int64", "float64"]),
        ("gather 2-D indices",
         lambda: xferlib.gather_rows(table, b.array(np.zeros((2, 2), np.int64))),
         ValueError, ["indices", "1-D", "(2, 2)"]),
        ("gather out of the wrong shape",
         lambda: xferlib.gather_rows(table, idx(1, 2), out=b.array(np.zeros((3, 4), np.float32))),
         ValueError, ["out", "(2, 4)", "(3, 4)"]),
        ("gather out of the wrong dtype",
         lambda: xferlib.gather_rows(table, idx(1, 2), out=b.array(np.zeros((2, 4)))),
         TypeError, ["out", "float64", "float32"]),
        ("scatter index too large", lambda: xferlib.scatter_rows(table, idx(1, 11), ones),
         IndexError, ["index 11", "position 1", "0 <= index < 10"]),
        ("scatter-add index too large",
         lambda: xferlib.scatter_add_rows(table, idx(3, 10), ones),
         IndexError, ["index 10", "0 <= index < 10"]),
        ("scatter src of the wrong shape",
         lambda: xferlib.scatter_rows(table, idx(1, 2), b.array(np.ones((2, 3), np.float32))),
         ValueError, ["src", "(2, 4)", "(2, 3)"]),
        ("scatter-add src of the wrong dtype",
         lambda: xferlib.scatter_add_rows(table, idx(1, 2), b.array(np.ones((2, 4)))),
         TypeError, ["src", "float64", "float32"]),
        ("scatter unsorted under sorted_indices=True",
         lambda: xferlib.scatter_rows(table, idx(2, 1), ones, sorted_indices=True),
         ValueError, ["sorted_indices=True", "index 1", "after 2", "nothing was written"]),
    ], snap


ROW_CASE_NAMES = ["gather index too large", "gather negative index", "gather float indices",
                  "gather 2-D indices", "gather out of the wrong shape",
                  "gather out of the wrong dtype", "scatter index too large",
                  "scatter-add index too large", "scatter src of the wrong shape",
                  "scatter-add src of the wrong dtype",
                  "scatter unsorted under sorted_indices=True"]


@pytest.mark.parametrize("name", ROW_CASE_NAMES)
def test_row_transfer(backend, name):
    cases, snap = _rows_cases(backend)
    assert [c[0] for c in cases] == ROW_CASE_NAMES
    _name, call, exc, needles = next(c for c in cases if c[0] == name)

    def call_and_check():
        call()
        # The GPU path reads its index verdict later, without a host sync: check_rows()
        # waits for it (the bad call wrote nothing).
        xferlib.check_rows()

    _check(call_and_check, snap, exc, needles)


ROW_CASES_ON_THE_HOST = [
    ("table that is 1-D", lambda t: xferlib.gather_rows(t[:, 0].copy(), np.array([1])),
     ValueError, ["table", "2-D", "(10,)"]),
    ("table that is a list", lambda t: xferlib.gather_rows(t.tolist(), np.array([1])),
     TypeError, ["numpy.ndarray or cupy.ndarray", "list"]),
    ("indices that are a list", lambda t: xferlib.gather_rows(t, [1, 2]),
     TypeError, ["numpy.ndarray or cupy.ndarray", "list"]),
    ("scatter-add into an int table",
     lambda t: xferlib.scatter_add_rows(t.astype(np.int32), np.array([1]),
                                        np.ones((1, 4), np.int32)),
     TypeError, ["scatter_add_rows", "float32", "int32"]),
    ("unique of float indices", lambda t: xferlib.unique_indices(np.array([1.5])),
     TypeError, ["int32 or int64", "float64"]),
]


@pytest.mark.parametrize("name, call, exc, needles", ROW_CASES_ON_THE_HOST,
                         ids=[c[0] for c in ROW_CASES_ON_THE_HOST])
def test_row_transfer_arguments(name, call, exc, needles):
    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    _check(lambda: call(table), lambda: table, exc, needles)


def test_empty_batches_are_fine(backend):
    table = backend.table(np.ones((10, 4), np.float32))
    none = backend.array(np.zeros(0, np.int64))
    assert xferlib.gather_rows(table, none).shape == (0, 4)
    xferlib.scatter_add_rows(table, none, backend.array(np.zeros((0, 4), np.float32)))
    assert np.all(backend.to_host(table) == 1.0)


# ----------------------------------------------------------------------------- pinned memory


PINNED_CASES = [
    ("pin a list", lambda: xferlib.pin([1.0]), TypeError, ["numpy.ndarray", "list"]),
    ("pin a strided view", lambda: xferlib.pin(np.zeros((10, 10))[:, ::2]), ValueError,
     ["C-contiguous", "strides", "np.ascontiguousarray"]),
    ("pinned_empty of a negative size", lambda: xferlib.pinned_empty((-1, 3)), ValueError,
     ["shape (-1, 3)", "negative size -1", ">= 0"]),
    ("pinned_empty of a float size", lambda: xferlib.pinned_empty((2.5, 3)), TypeError,
     ["shape must hold ints", "2.5"]),
    ("pinned_empty of an unknown dtype", lambda: xferlib.pinned_empty((3, 3), "floaty"),
     TypeError, ["dtype 'floaty'", "not a NumPy dtype"]),
    ("pinned_zeros beyond host RAM", lambda: xferlib.pinned_zeros((1 << 40, 128)), MemoryError,
     ["pinned_zeros(shape=(1099511627776, 128), dtype=float32)", "562.95 TB", "available"]),
    ("check_host_memory beyond host RAM",
     lambda: xferlib.check_host_memory(1 << 62, "my table"), MemoryError,
     ["my table needs", "TB of host RAM", "available"]),
]


@pytest.mark.parametrize("name, call, exc, needles", PINNED_CASES,
                         ids=[c[0] for c in PINNED_CASES])
def test_pinned_memory(name, call, exc, needles, monkeypatch):
    monkeypatch.delenv("XFERLIB_HOST_MEMORY_CHECK", raising=False)
    _check(call, _nothing, exc, needles)


# ----------------------------------------------------------------------------- handoff


def test_handoff():
    import ml_dtypes

    _check(lambda: xferlib.to_torch([1, 2]), _nothing, TypeError,
           ["NumPy, CuPy, torch or JAX", "list"])
    _check(lambda: xferlib.to_numpy("x"), _nothing, TypeError, ["str"])
    pytest.importorskip("jax")
    _check(lambda: xferlib.to_jax(np.zeros(4, ml_dtypes.bfloat16), copy=False), _nothing,
           BufferError, ["bfloat16", "copy=None or copy=True"])


@pytest.mark.gpu
def test_handoff_pageable_to_gpu_without_copy():
    _check(lambda: xferlib.to_cupy(np.zeros(4), copy=False), _nothing, BufferError,
           ["pageable", "xferlib.pin"])


# ----------------------------------------------------------------------------- HostTable


def _host_table():
    table = xferlib.HostTable(100, 4, optimizer="adam", optimizer_kwargs={"lr": 0.1},
                              init=("normal", 0.0, 1.0), seed=0)

    def snap():
        return {"weights": table.numpy(), **{n: table.state(n) for n in table.state_names()}}

    return table, snap


HOST_TABLE_BUILD_CASES = [
    ("negative rows", dict(num_rows=-5, dim=4), ValueError, ["num_rows >= 0", "(-5, 4)"]),
    ("zero width", dict(num_rows=5, dim=0), ValueError, ["dim >= 1", "(5, 0)"]),
    ("float16 rows", dict(num_rows=5, dim=4, dtype="float16"), TypeError,
     ["float32 or float64", "float16"]),
    ("unknown optimizer", dict(num_rows=5, dim=4, optimizer="adamz"), ValueError,
     ["'adamz'", "'adam'", "'sgd'"]),
    ("negative learning rate",
     dict(num_rows=5, dim=4, optimizer="adam", optimizer_kwargs={"lr": -1}), ValueError,
     ["learning rate", "-1"]),
    ("NaN learning rate",
     dict(num_rows=5, dim=4, optimizer="adam", optimizer_kwargs={"lr": float("nan")}),
     ValueError, ["learning rate", "nan"]),
    ("beta out of range",
     dict(num_rows=5, dim=4, optimizer="adam", optimizer_kwargs={"betas": (1.5, 0.9)}),
     ValueError, ["beta", "1.5"]),
    ("misspelt hyperparameter",
     dict(num_rows=5, dim=4, optimizer="adam", optimizer_kwargs={"lrr": 1}), ValueError,
     ["'lrr'", "'lr'"]),
    ("negative cache", dict(num_rows=5, dim=4, cache_rows=-1), ValueError,
     ["cache_rows", "-1"]),
    ("unknown init", dict(num_rows=5, dim=4, init="ones"), ValueError, ["init", "'ones'"]),
    ("init array of the wrong shape",
     dict(num_rows=5, dim=4, init=np.zeros((4, 4), np.float32)), ValueError,
     ["init", "(5, 4)", "(4, 4)"]),
    ("larger than host RAM", dict(num_rows=10**13, dim=128, optimizer="adam"), MemoryError,
     ["HostTable(num_rows=10000000000000", "TB of host RAM", "available"]),
]


@pytest.mark.parametrize("name, kwargs, exc, needles", HOST_TABLE_BUILD_CASES,
                         ids=[c[0] for c in HOST_TABLE_BUILD_CASES])
def test_host_table_constructor(name, kwargs, exc, needles):
    kwargs = dict(kwargs)
    num_rows, dim = kwargs.pop("num_rows"), kwargs.pop("dim")
    _check(lambda: xferlib.HostTable(num_rows, dim, **kwargs), _nothing, exc, needles)


HOST_TABLE_CALL_CASES = [
    ("lookup index too large", lambda t: t.lookup(np.array([3, 100])), IndexError,
     ["index 100", "position 1", "0 <= index < 100"]),
    ("lookup float indices", lambda t: t.lookup(np.array([1.0])), TypeError,
     ["int32 or int64", "float64"]),
    ("update index too large",
     lambda t: t.apply_gradients(np.array([1, 200]), np.ones((2, 4), np.float32)), IndexError,
     ["index 200", "0 <= index < 100"]),
    ("update gradients of the wrong shape",
     lambda t: t.apply_gradients(np.array([1, 2]), np.ones((2, 3), np.float32)), ValueError,
     ["grad_rows", "(2, 4)", "(2, 3)"]),
]


@pytest.mark.parametrize("name, call, exc, needles", HOST_TABLE_CALL_CASES,
                         ids=[c[0] for c in HOST_TABLE_CALL_CASES])
def test_host_table_calls(name, call, exc, needles):
    table, snap = _host_table()
    _check(lambda: call(table), snap, exc, needles)


def test_host_table_without_optimizer_refuses_updates():
    table = xferlib.HostTable(10, 4)
    _check(lambda: table.apply_gradients(np.array([1]), np.ones((1, 4), np.float32)),
           table.numpy, ValueError, ["no optimizer", "optimizer="])


def test_host_table_load_of_truncated_and_foreign_files(tmp_path):
    table, _ = _host_table()
    good = tmp_path / "table.npz"
    table.save(good)
    data = good.read_bytes()
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(data[: len(data) // 2])
    _check(lambda: xferlib.HostTable.load(truncated), _nothing, ValueError,
           [str(truncated), "truncated or not an xferlib HostTable file"])
    foreign = tmp_path / "foreign.npz"
    np.savez(foreign, a=np.zeros(3))
    _check(lambda: xferlib.HostTable.load(foreign), _nothing, ValueError,
           [str(foreign), "not an xferlib HostTable file", "'a'"])
    _check(lambda: xferlib.HostTable.load(tmp_path / "missing.npz"), _nothing,
           FileNotFoundError, ["missing.npz"])
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a table" * 10)
    _check(lambda: xferlib.HostTable.load(garbage), _nothing, ValueError,
           [str(garbage), "truncated or not an xferlib HostTable file"])
    single = tmp_path / "single.npy"
    np.save(single, np.zeros(3))
    _check(lambda: xferlib.HostTable.load(single), _nothing, ValueError,
           [str(single), "not an xferlib HostTable file"])


def test_host_table_save_to_a_missing_directory(tmp_path):
    table, snap = _host_table()
    target = tmp_path / "no-such-dir" / "table.npz"
    _check(lambda: table.save(target), snap, FileNotFoundError,
           [str(target), str(target.parent)])


# ----------------------------------------------------------------------------- torch modules and optimizers


def _params(torch):
    return [torch.nn.Parameter(torch.arange(3, dtype=torch.float32))]


def test_flat_optimizers():
    torch = pytest.importorskip("torch")
    from xferlib.adapters.torch import FlatAdam, FlatSGD

    cases = [
        (lambda: FlatAdam(_params(torch), lr=-1), ValueError, ["learning rate", "-1"]),
        (lambda: FlatAdam(_params(torch), lr=float("nan")), ValueError, ["learning rate"]),
        (lambda: FlatAdam(_params(torch), betas=(1.0, 0.9)), ValueError, ["beta", "1.0"]),
        (lambda: FlatAdam(_params(torch), eps=-1), ValueError, ["epsilon", "-1"]),
        (lambda: FlatAdam([]), ValueError, ["empty parameter list"]),
        (lambda: FlatSGD(_params(torch), lr=0.1, nesterov=True), ValueError,
         ["Nesterov", "momentum"]),
        (lambda: FlatAdam([torch.nn.Parameter(torch.zeros(3, dtype=torch.int32),
                                              requires_grad=False)]),
         TypeError, ["float32", "torch.int32"]),
    ]
    for call, exc, needles in cases:
        _check(call, _nothing, exc, needles)


def test_flat_optimizer_load_of_a_foreign_state_dict():
    torch = pytest.importorskip("torch")
    from xferlib.adapters.torch import FlatAdam

    params = _params(torch)
    opt = FlatAdam(params, lr=0.1)
    params[0].grad = torch.ones(3)
    opt.step()

    def snap():
        return [params[0].data, opt.state_dict()["state"]]

    foreign = {"state": {}, "param_groups": [{**opt.state_dict()["param_groups"][0],
                                              "params": [0, 1]}]}
    _check(lambda: opt.load_state_dict(foreign), snap, ValueError, ["size"])


def test_core_flat_optimizer_hyperparameters():
    _check(lambda: xferlib.optim.adam(lr=-1), _nothing, ValueError, ["learning rate", "-1"])
    _check(lambda: xferlib.optim.adam(lrr=1), _nothing, ValueError, ["'lrr'", "'lr'"])
    _check(lambda: xferlib.optim.resolve_hyper("adamz"), _nothing, ValueError,
           ["'adamz'", "'adam'"])


def _tt(torch):
    from xferlib.adapters.torch import TTEmbeddingBag

    torch.manual_seed(0)
    module = TTEmbeddingBag(1000, 16, tt_ranks=[4, 4])
    return module, lambda: [p.data for p in module.parameters()]


def test_tt_embedding_bag():
    torch = pytest.importorskip("torch")
    from xferlib.adapters.torch import TTEmbeddingBag

    t = torch.tensor
    calls = [
        (lambda m: m(t([3, 1000]), t([0, 2])), IndexError, ["index 1000", "position 1", "1000 rows"]),
        (lambda m: m(t([-1]), t([0, 1])), IndexError, ["index -1", "1000 rows"]),
        (lambda m: m(t([1, 2, 3]), t([0, 2, 1])), ValueError, ["offsets", "[0, 2, 1]"]),
        (lambda m: m(t([1, 2, 3]), t([0, 1, 5])), ValueError, ["offsets", "end at 3", "[0, 1, 5]"]),
        (lambda m: m(torch.zeros((2, 2), dtype=torch.int64), t([0, 1])), ValueError,
         ["indices", "1-D", "(2, 2)"]),
        (lambda m: m(t([1, 2]), t([0, 2]), per_sample_weights=torch.ones(3)), ValueError,
         ["per_sample_weights", "(2,)", "(3,)"]),
        (lambda m: m(t([1.0, 2.0]), t([0, 2])), TypeError, ["indices", "integer", "float32"]),
        (lambda m: m(t([5, 1000]), t([0, 2])), IndexError, ["0 <= index < 1000"]),
        (lambda m: m.set_learning_rate(float("nan")), ValueError, ["learning rate", "nan"]),
    ]
    for call, exc, needles in calls:
        module, snap = _tt(torch)
        _check(lambda: call(module), snap, exc, needles)
    builds = [
        (lambda: TTEmbeddingBag(0, 16, tt_ranks=[4, 4]), ValueError, ["num_embeddings", "0"]),
        (lambda: TTEmbeddingBag(1000, 16, tt_ranks=[0, 4]), ValueError, ["ranks", "(0, 4)"]),
        (lambda: TTEmbeddingBag(1000, 16, tt_ranks=[4, 4], tt_q_shapes=[2, 2, 2]), ValueError,
         ["tt_q_shapes", "8", "16"]),
        (lambda: TTEmbeddingBag(1000, 16, tt_ranks=[4, 4], mode="max"), ValueError,
         ["mode", "'max'"]),
        (lambda: TTEmbeddingBag(1000, 16, tt_ranks=[4, 4], learning_rate=-1), ValueError,
         ["learning_rate", "-1"]),
    ]
    for call, exc, needles in builds:
        _check(call, _nothing, exc, needles)


def test_tt_embedding_bag_empty_batch():
    torch = pytest.importorskip("torch")
    module, _ = _tt(torch)
    out = module(torch.tensor([], dtype=torch.int64), torch.tensor([0, 0, 0]))
    assert out.shape == (2, 16) and not out.any()
    out.sum().backward()


def test_host_embedding_bag():
    torch = pytest.importorskip("torch")
    from xferlib.adapters.torch import HostEmbeddingBag

    bag = HostEmbeddingBag(100, 4, optimizer="adam", optimizer_kwargs={"lr": 0.1})
    snap = lambda: bag.table.numpy()  # noqa: E731

    def bad_lookup():
        bag(torch.tensor([3, 100]), torch.tensor([0]))
        bag.check()  # on the GPU the index check is read back later (no sync per step)

    _check(bad_lookup, snap, IndexError, ["index 100", "0 <= index < 100"])
    _check(lambda: bag(torch.tensor([1.0]), torch.tensor([0])), snap, TypeError,
           ["int32 or int64", "float32"])


# ----------------------------------------------------------------------------- JAX


def test_jax_host_ops():
    pytest.importorskip("jax")
    import jax.numpy as jnp

    from xferlib.adapters.jax import host_lookup, host_update

    table, snap = _host_table()
    _check(lambda: host_lookup(table, jnp.array([1.0])), snap, TypeError,
           ["idx", "int32 or int64", "float32"])
    _check(lambda: host_update(table, jnp.array([1]), jnp.zeros((1, 3))), snap, ValueError,
           ["grad_rows", "(1, 4)", "(1, 3)"])


def test_jax_host_lookup_past_the_table_inside_jit():
    pytest.importorskip("jax")
    import jax
    import jax.numpy as jnp

    from xferlib.adapters.jax import host_lookup

    table, snap = _host_table()
    step = jax.jit(lambda i: host_lookup(table, i))
    if jax.default_backend() == "cpu":
        # The callback's IndexError comes back as JAX's runtime error, message included.
        exc = RuntimeError
        call = lambda: jax.block_until_ready(step(jnp.array([100])))  # noqa: E731
    else:
        # The GPU path checks on the device and raises at table.check() or a later call.
        exc = IndexError

        def call():
            jax.block_until_ready(step(jnp.array([100])))
            table.check()
    _check(call, snap, exc, ["index 100", "0 <= index < 100"])
