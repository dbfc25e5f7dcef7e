"""EmbeddingCollection's tt placement: collections mixing hbm, host and tt tables against
float64 references (the hbm / host tables' collection reference; a tt table's pooled rows
from its cores and its TT table's own float64 update) for every optimizer TT runs, both
poolings, per-sample weights, both index widths, empty bags and batches, one table; bad
input that changes nothing (cores, state and step counters too); bitwise-identical runs;
state_dict / save / load; the sharding plan's refusal."""

from __future__ import annotations

import types

import numpy as np
import pytest

from tests.core.test_tt_table import ReferenceTable
from xferlib import tt
from xferlib.collection import (EmbeddingCollection, TableConfig, collection_step_reference,
                                plan_sharding, pooled_lookup_reference)
from xferlib.collection.sharding import ShardingPlan
from xferlib.collection.tt_tables import TT_COLLECTION_OPTIMIZERS
from xferlib.handoff import to_numpy
from xferlib.testing import backend_params, get_backend

BACKENDS = backend_params("numpy", "cupy")
HYPER = {"sgd": {"lr": 0.3}, "adagrad": {"lr": 0.2}, "rowwise_adagrad": {"lr": 0.2}}


def mixed_tables(tt_lr=None):
    """hbm, tt (three cores), host, tt (two cores, its own learning rate)."""
    return [TableConfig(7, 4, name="dense"),
            TableConfig(60, 6, name="ids", placement="tt", tt_ranks=3),
            TableConfig(33, 8, name="host", placement="host"),
            TableConfig(20, 4, name="small", placement="tt", tt_ranks=(2,),
                        tt_p_shapes=(4, 5), lr=tt_lr)]


def make_batch(rng, rows, B, max_len=4, dtype=np.int64):
    """FBGEMM's layout, bags of 0..max_len (an empty one in each table), repeated rows."""
    lengths = rng.integers(0, max_len + 1, size=len(rows) * B)
    lengths[::B] = 0
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(dtype)
    parts = []
    for t, n in enumerate(rows):
        draw = rng.integers(0, min(n, 6) if t % 2 else n, int(lengths[t * B:(t + 1) * B].sum()))
        parts.append(draw)
    return np.concatenate(parts).astype(dtype), offsets


def split(indices, offsets, T):
    """Each table's ``(indices, local offsets, positions)``."""
    B = (len(offsets) - 1) // T
    out = []
    for t in range(T):
        lo, hi = int(offsets[t * B]), int(offsets[(t + 1) * B])
        out.append((np.asarray(indices[lo:hi], np.int64),
                    np.asarray(offsets[t * B:(t + 1) * B + 1], np.int64) - lo, slice(lo, hi)))
    return out


class Reference:
    """A collection's training in float64: hbm / host tables by the collection's reference,
    tt tables by :class:`tests.core.test_tt_table.ReferenceTable`."""

    def __init__(self, coll, lr):
        """``lr``: the optimizer's learning rate the test gave (a table's own ``lr`` in its
        config comes first), not read back from the code under test."""
        self.coll = coll
        self.dense, self.tt = {}, {}
        for t in range(coll.num_tables):
            if t in coll.tt_tables:
                table = coll.tt_table(t)
                own = coll.tables[t].lr
                self.tt[t] = ReferenceTable(types.SimpleNamespace(
                    joint_shape=table.joint_shape, optimizer=table.optimizer,
                    hyper=dict(table.hyper, lr=lr if own is None else own),
                    cores=[to_numpy(c) for c in table.cores],
                    states=[{k: to_numpy(v) for k, v in s.items()} for s in table.states],
                    step=table.step))
            else:
                names = [k for k in coll.state_names() if k != "step"]
                self.dense[t] = [coll.weights(t).astype(np.float64),
                                 {k: coll.state(t, k).astype(np.float64) for k in names},
                                 coll.state(t, "step").copy()]

    def pooled(self, indices, offsets, psw=None):
        coll, columns = self.coll, []
        for t, (idx, off, where) in enumerate(split(indices, offsets, coll.num_tables)):
            w = None if psw is None else np.asarray(psw[where], np.float64)
            if t in self.tt:
                columns.append(tt.tt_embedding_bag_reference(
                    self.tt[t].cores, self.tt[t].shape, idx, off, mode=coll.pooling,
                    per_sample_weights=w))
            else:
                columns.append(pooled_lookup_reference([self.dense[t][0]], idx, off, w,
                                                       coll.pooling))
        return np.concatenate(columns, axis=1)

    def train(self, indices, offsets, grad, psw=None):
        coll = self.coll
        for t, (idx, off, where) in enumerate(split(indices, offsets, coll.num_tables)):
            w = None if psw is None else np.asarray(psw[where], np.float64)
            g = np.asarray(grad, np.float64)[:, coll.dim_offsets[t]:coll.dim_offsets[t + 1]]
            if t in self.tt:
                self.tt[t].train(idx, off, g, w, coll.pooling)
                continue
            weights, state, steps = self.dense[t]
            new = collection_step_reference(coll.optimizer, [coll.hypers[t]], [weights],
                                            [state], [steps], idx, off, g, w, coll.pooling)
            self.dense[t] = [new[0][0], new[1][0], new[2][0]]

    def assert_matches(self, what):
        coll = self.coll
        tol = dict(rtol=2e-4, atol=2e-6)
        for t in range(coll.num_tables):
            name = f"{what}, table {coll.names[t]}"
            if t in self.tt:
                ref, table = self.tt[t], coll.tt_table(t)
                np.testing.assert_allclose(np.concatenate([to_numpy(c).ravel() for c in
                                                           table.cores]),
                                           np.concatenate([c.ravel() for c in ref.cores]),
                                           err_msg=name, **tol)
                for got, want in zip(table.states, ref.states):
                    for k in want:
                        np.testing.assert_allclose(to_numpy(got[k]), want[k], err_msg=name, **tol)
                assert table.step == ref.step, name
                continue
            weights, state, steps = self.dense[t]
            np.testing.assert_allclose(coll.weights(t), weights, err_msg=name, **tol)
            for k, v in state.items():
                np.testing.assert_allclose(coll.state(t, k), v, err_msg=name, **tol)
            np.testing.assert_array_equal(coll.state(t, "step"), steps, err_msg=name)


def collection(backend, optimizer="adagrad", pooling="sum", tables=None, **kw):
    return EmbeddingCollection(mixed_tables(0.5 * HYPER[optimizer]["lr"]) if tables is None
                               else tables, optimizer, HYPER[optimizer], pooling=pooling,
                               device="cuda" if backend.gpu else "cpu", seed=3, **kw)


ROWS = (7, 60, 33, 20)


# ----------------------------------------------------------------------------- training


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("optimizer", TT_COLLECTION_OPTIMIZERS)
@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_mixed_collection_matches_the_float64_references(backend, optimizer, pooling):
    backend = get_backend(backend)
    xp = backend.xp
    rng = np.random.default_rng(sum(map(ord, optimizer + pooling)))
    coll = collection(backend, optimizer, pooling)
    ref = Reference(coll, HYPER[optimizer]["lr"])
    B = 5
    for step in range(4):
        indices, offsets = make_batch(rng, ROWS, B, dtype=np.int32 if step % 2 else np.int64)
        psw = rng.uniform(0.5, 2.0, indices.size).astype(np.float32) if step >= 2 else None
        out, ctx = coll.forward(xp.asarray(indices), xp.asarray(offsets),
                                None if psw is None else xp.asarray(psw))
        np.testing.assert_allclose(to_numpy(out), ref.pooled(indices, offsets, psw), rtol=1e-4,
                                   atol=1e-5, err_msg=f"step {step} pooled")
        grad = rng.standard_normal((B, coll.total_dim)).astype(np.float32)
        coll.backward(ctx, xp.asarray(grad))
        ref.train(indices, offsets, grad, psw)
        ref.assert_matches(f"step {step}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batches_one_table_and_float64(backend):
    backend = get_backend(backend)
    xp = backend.xp
    coll = collection(backend, "rowwise_adagrad")
    before = coll.state_dict()
    for offsets in (np.array([0]), np.zeros(4 * 3 + 1, np.int64)):  # no bag; empty bags
        out, ctx = coll.forward(xp.zeros(0, np.int64), xp.asarray(offsets))
        assert out.shape == ((len(offsets) - 1) // 4, coll.total_dim) and not to_numpy(out).any()
        coll.backward(ctx, xp.ones(out.shape, np.float32))
    after = coll.state_dict()
    for key, value in before.items():  # nothing moved; the tt step counters counted
        if key.endswith(".step") and key.split(".")[0] in ("ids", "small"):
            np.testing.assert_array_equal(after[key], value + 2)
        else:
            np.testing.assert_array_equal(after[key], value, err_msg=key)
    # one table, float64 rows (the TT bags are float32, written into float64 columns)
    rng = np.random.default_rng(2)
    only = EmbeddingCollection([TableConfig(60, 6, placement="tt", tt_ranks=3)], "sgd",
                               {"lr": 0.1}, dtype="float64",
                               device="cuda" if backend.gpu else "cpu", seed=1)
    ref = Reference(only, 0.1)
    for _ in range(2):
        indices, offsets = make_batch(rng, (60,), 4)
        out, ctx = only.forward(xp.asarray(indices), xp.asarray(offsets))
        assert out.dtype == np.float64
        np.testing.assert_allclose(to_numpy(out), ref.pooled(indices, offsets), rtol=1e-5,
                                   atol=1e-6)
        grad = rng.standard_normal(out.shape)
        only.backward(ctx, xp.asarray(grad))
        ref.train(indices, offsets, grad)
        ref.assert_matches("one table")


@pytest.mark.parametrize("backend", BACKENDS)
def test_dict_form_and_lookup_only(backend):
    backend = get_backend(backend)
    xp = backend.xp
    coll = collection(backend, "sgd")
    rng = np.random.default_rng(4)
    features = {name: (xp.asarray(rng.integers(0, rows, 5)), xp.asarray([0, 2, 2, 5]))
                for name, rows in zip(coll.names, ROWS)}
    indices, offsets = coll.pack(features)
    ref = Reference(coll, HYPER["sgd"]["lr"])
    before = coll.state_dict()
    pooled = coll.lookup(indices, offsets)  # a lookup: nothing trains
    np.testing.assert_allclose(to_numpy(pooled), ref.pooled(to_numpy(indices), to_numpy(offsets)),
                               rtol=1e-4, atol=1e-5)
    for key, value in coll.state_dict().items():
        np.testing.assert_array_equal(value, before[key], err_msg=key)


def test_padded_batches_ignore_their_tail():
    coll = collection(get_backend("numpy"), "adagrad")
    rng = np.random.default_rng(5)
    indices, offsets = make_batch(rng, ROWS, 3)
    padded = np.concatenate([indices, [10 ** 6] * 3])
    a, _ = coll.forward(padded, offsets, padded=True)
    b, _ = coll.forward(indices, offsets)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_runs_are_bitwise_identical(backend):
    backend = get_backend(backend)
    xp = backend.xp

    def run():
        rng = np.random.default_rng(11)
        coll = collection(backend, "rowwise_adagrad", "mean")
        for step in range(3):
            indices, offsets = make_batch(rng, ROWS, 6)
            psw = rng.uniform(0.5, 2, indices.size).astype(np.float32) if step else None
            out, ctx = coll.forward(xp.asarray(indices), xp.asarray(offsets),
                                    None if psw is None else xp.asarray(psw))
            coll.backward(ctx, xp.asarray(rng.standard_normal(out.shape).astype(np.float32)))
        coll.check()
        return coll.state_dict()

    first, second = run(), run()
    assert first.keys() == second.keys()
    for key in first:
        np.testing.assert_array_equal(first[key], second[key], err_msg=key)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad"])
def test_core_rows_no_lookup_reaches_stay_bitwise(backend, optimizer):
    """Training with tt lookups whose every digit is >= 1: row 0 of each core and its
    optimizer state stay bitwise as they were. On the GPU the other tables' lookups reach
    each tt table as row 0 in zero-gradient bags; that must move nothing."""
    backend = get_backend(backend)
    xp = backend.xp
    rng = np.random.default_rng(13)
    coll = collection(backend, optimizer)
    B = 5
    allowed = {}
    for t, table in coll.tt_tables.items():
        rows = np.arange(coll.tables[t].num_rows)
        allowed[t] = rows[(table.shape.digits(rows) >= 1).all(axis=1)]
        assert allowed[t].size > 0
    before = {t: ([to_numpy(c)[0].copy() for c in table.cores],
                  [{k: to_numpy(v)[0].copy() for k, v in s.items()} for s in table.states])
              for t, table in coll.tt_tables.items()}
    for _ in range(3):
        indices, offsets = make_batch(rng, ROWS, B)
        for t in coll.tt_tables:
            lo, hi = int(offsets[t * B]), int(offsets[(t + 1) * B])
            indices[lo:hi] = rng.choice(allowed[t], hi - lo)
        out, ctx = coll.forward(xp.asarray(indices), xp.asarray(offsets))
        coll.backward(ctx, xp.asarray(rng.standard_normal(out.shape).astype(np.float32)))
    coll.check()
    for t, table in coll.tt_tables.items():
        cores, states = before[t]
        for k, core in enumerate(table.cores):
            np.testing.assert_array_equal(to_numpy(core)[0], cores[k], err_msg=f"{t} core {k}")
            for name, value in table.states[k].items():
                np.testing.assert_array_equal(to_numpy(value)[0], states[k][name],
                                              err_msg=f"{t} core {k} {name}")
        assert table.step == 3


# ----------------------------------------------------------------------------- bad input


def assert_state_equal(coll, before):
    """``coll``'s state_dict holds exactly ``before``."""
    after = coll.state_dict()
    assert after.keys() == before.keys()
    for key in before:
        np.testing.assert_array_equal(after[key], before[key], err_msg=key)


def test_bad_input_raises_and_changes_nothing():
    coll = collection(get_backend("numpy"), "adagrad")
    rng = np.random.default_rng(6)
    indices, offsets = make_batch(rng, ROWS, 3)
    out, ctx = coll.forward(indices, offsets)
    coll.backward(ctx, np.ones(out.shape, np.float32))  # state, steps past their start
    before = coll.state_dict()
    lo = int(offsets[3])  # the first lookup of table "ids" (tt)
    bad = indices.copy()
    bad[lo] = 60
    assert int(offsets[6]) > lo  # "ids" has lookups
    down = offsets.copy()
    down[-2] = down[-1] + 1
    cases = [(IndexError, f"index 60 at position {lo} is out of range for table 'ids'", bad,
              offsets),
             (ValueError, "offsets must not decrease", indices, down),
             (TypeError, "indices must be an int32 or int64", indices.astype(np.float32),
               offsets),
              (ValueError, "T \\* B \\+ 1", indices, offsets[:-1])]
    for error, match, idx, off in cases:
        with pytest.raises(error, match=match):
            coll.forward(idx, off)
        assert_state_equal(coll, before)
    out, ctx = coll.forward(indices, offsets)
    for grad, error in ((np.ones((out.shape[0], 3), np.float32), ValueError),
                        (np.ones(out.shape, np.int32), TypeError)):
        with pytest.raises(error, match="grad_pooled"):
            coll.backward(ctx, grad)
        assert_state_equal(coll, before)
    with pytest.raises(ValueError, match="takes only \\['lr', 'eps'\\]; got \\{'lr_decay'"):
        coll.set_hyper(lr_decay=0.1)  # adagrad's lr_decay: TT has none
    with pytest.raises(ValueError, match="eps > 0"):
        coll.set_hyper(eps=0.0)
    assert coll.tt_table("ids").hyper["lr"] == HYPER["adagrad"]["lr"]
    coll.set_hyper("small", lr=0.01)
    assert coll.tt_table("small").hyper["lr"] == 0.01 == coll.hypers[3]["lr"]
    assert coll.tt_table("ids").hyper["lr"] == coll.hypers[1]["lr"] == 0.2


def test_construction_errors_name_the_table():
    tables = mixed_tables()
    with pytest.raises(ValueError, match="table 'ids' is placed in 'tt'.*'sgd', 'adagrad', "
                                         "'rowwise_adagrad'.*not 'adam'"):
        EmbeddingCollection(tables, "adam", device="cpu")
    with pytest.raises(ValueError, match="table 'ids' is placed in 'tt'.*momentum"):
        EmbeddingCollection(tables, "sgd", {"lr": 0.1, "momentum": 0.9}, device="cpu")
    with pytest.raises(ValueError, match="'adagrad' needs eps > 0"):
        EmbeddingCollection(tables, "adagrad", {"eps": 0.0}, device="cpu")
    with pytest.raises(ValueError, match="needs tt_ranks"):
        TableConfig(10, 4, placement="tt")
    with pytest.raises(ValueError, match="are for tt tables"):
        TableConfig(10, 4, tt_ranks=2)
    with pytest.raises(ValueError, match="multiply to 9, not its dim 4"):
        TableConfig(10, 4, placement="tt", tt_ranks=2, tt_q_shapes=(3, 3))
    with pytest.raises(ValueError, match="hold 6 rows, fewer than its 10"):
        TableConfig(10, 4, placement="tt", tt_ranks=2, tt_p_shapes=(2, 3))
    with pytest.raises(ValueError, match="init may only be 'zeros'"):
        TableConfig(10, 4, placement="tt", tt_ranks=2, init=("uniform", 0, 1))
    with pytest.raises(ValueError, match="tt_init must be one of"):
        TableConfig(10, 4, placement="tt", tt_ranks=2, tt_init="glorot")
    with pytest.raises(ValueError, match="cache_rows is for host tables"):
        TableConfig(10, 4, placement="tt", tt_ranks=2, cache_rows=4)
    with pytest.raises(TypeError, match="tt_ranks must be an int"):
        TableConfig(10, 4, placement="tt", tt_ranks=2.5)
    config = TableConfig(1000, 16, placement="tt", tt_ranks=8)
    assert (config.tt_p_shapes, config.tt_q_shapes, config.tt_ranks) == \
        ((10, 10, 10), (2, 2, 4), (8, 8))


def test_refused_hyperparameters_change_nothing():
    """A learning rate TT refuses (not finite) is refused before any table's changes."""
    coll = EmbeddingCollection(mixed_tables(), "adagrad", HYPER["adagrad"], device="cpu",
                               seed=1)
    hypers = [dict(h) for h in coll.hypers]
    tt_hypers = {t: dict(table.hyper) for t, table in coll.tt_tables.items()}
    # inf: TT's own refusal, naming its table; NaN eps: every table's rule refuses it
    for bad, match in (({"lr": float("inf")}, "table 'ids'"), ({"eps": float("inf")},
                       "table 'ids'"), ({"eps": float("nan")}, "Invalid epsilon value")):
        with pytest.raises(ValueError, match=match):
            coll.set_hyper(**bad)
        assert coll.hypers == hypers
        assert {t: table.hyper for t, table in coll.tt_tables.items()} == tt_hypers
    with pytest.raises(ValueError, match=r"table 'ids' \(tt\)"):
        EmbeddingCollection(mixed_tables(), "sgd", {"lr": float("inf")}, device="cpu")


def test_table_names_whose_state_keys_meet_are_refused():
    tables = [TableConfig(8, 4, name="e", placement="tt", tt_ranks=2),
              TableConfig(8, 4, name="e.core0")]
    with pytest.raises(ValueError, match=r"state key\(s\) \['e.core0.sum'\]"):
        EmbeddingCollection(tables, "adagrad", {"lr": 0.1}, device="cpu")
    EmbeddingCollection(tables, "sgd", {"lr": 0.1}, device="cpu")  # sgd keeps no sum


def test_sharding_refuses_tt_tables():
    with pytest.raises(ValueError, match="cannot hold tt tables \\(\\['ids', 'small'\\]\\)"):
        plan_sharding(mixed_tables(), 2)
    with pytest.raises(ValueError, match="a sharding plan cannot hold tt tables"):
        ShardingPlan(1, tuple(mixed_tables()), ("table_wise",) * 4, ())


# ----------------------------------------------------------------------------- state


def test_a_saved_hyperparameter_only_hbm_tables_take_loads(tmp_path):
    """Each table's hyperparameters as saved: weight decay set on an hbm table (a TT table's
    SGD takes none) does not stop the load, and every table gets its own back."""
    coll = EmbeddingCollection([TableConfig(10, 4, name="a"),
                                TableConfig(27, 8, name="c", placement="tt", tt_ranks=2)],
                               "sgd", {"lr": 0.1}, device="cpu")
    coll.set_hyper("a", weight_decay=0.01)
    coll.save(tmp_path / "coll.xf")
    loaded = EmbeddingCollection.load(tmp_path / "coll.xf", device="cpu")
    assert loaded.hypers == coll.hypers and loaded.hypers[0]["weight_decay"] == 0.01


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_dict_and_save_load_round_trip(backend, tmp_path):
    backend = get_backend(backend)
    xp = backend.xp
    rng = np.random.default_rng(8)
    coll = collection(backend, "rowwise_adagrad")
    batches = [make_batch(rng, ROWS, 4) for _ in range(4)]
    grads = [rng.standard_normal((4, coll.total_dim)).astype(np.float32) for _ in range(4)]

    def train(c, part):
        for (indices, offsets), grad in list(zip(batches, grads))[part]:
            _, ctx = c.forward(xp.asarray(indices), xp.asarray(offsets))
            c.backward(ctx, xp.asarray(grad))

    train(coll, slice(0, 2))
    state = coll.state_dict()
    assert {k for k in state if k.startswith("ids.")} == \
        {"ids.core0", "ids.core1", "ids.core2", "ids.core0.sum", "ids.core1.sum",
         "ids.core2.sum", "ids.step"}
    assert state["ids.step"].tolist() == [2] and state["ids.core1"].dtype == np.float32
    assert coll.state_keys() == list(state)
    coll.save(tmp_path / "coll.xf")
    other = EmbeddingCollection(mixed_tables(0.1), "rowwise_adagrad",
                                HYPER["rowwise_adagrad"], device=coll.device, seed=99)
    other.set_hyper("small", lr=coll.hypers[3]["lr"])
    other.load_state_dict(state)
    loaded = EmbeddingCollection.load(tmp_path / "coll.xf")
    assert loaded.tables == coll.tables and loaded.hypers == coll.hypers
    assert_state_equal(other, state)
    assert_state_equal(loaded, state)
    for c in (coll, other, loaded):
        train(c, slice(2, 4))
    for c in (other, loaded):  # NumPy's float32 sums may round by buffer alignment: an ulp
        for key, value in coll.state_dict().items():
            np.testing.assert_allclose(c.state_dict()[key], value, rtol=1e-6, atol=1e-7,
                                       err_msg=key)
    bad = dict(state, **{"ids.core0": state["ids.core0"][:1]})
    before = other.state_dict()
    with pytest.raises(ValueError, match="ids.core0 must have shape"):
        other.load_state_dict(bad)
    with pytest.raises(ValueError, match="missing \\['ids.step'\\]"):
        other.load_state_dict({k: v for k, v in state.items() if k != "ids.step"})
    assert_state_equal(other, before)
    assert set(coll.memory_bytes()) == {"hbm", "host", "tt"}
    assert coll.weights("ids").shape == (60, 6)
    assert coll.state("ids", "core0.sum").shape == coll.tt_table("ids").states[0]["sum"].shape
    with pytest.raises(ValueError, match="placed in 'hbm', not 'tt'"):
        coll.tt_table("dense")
