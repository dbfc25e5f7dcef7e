"""Runs the sharded-collection checks in a fresh process (forced host devices must be set
before JAX starts its backends) and prints one JSON line: ``{case: max abs error or error
text}``.

    python tests/jax/collection_dist_worker.py --devices 2 [--platform gpu]

Every case trains a :class:`ShardedCollection` inside ``jax.shard_map`` over N devices (each
device its own batch) and one unsharded collection on the global batch (the devices' batches
concatenated, bags device after device), from the same seed, and reports the largest
difference of the pooled rows, the weights and the optimizer state. ``--platform gpu``: the
mesh's devices are the first N GPUs, each rank's collection on its own GPU, the unsharded one
on the first.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys


def _parse():
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
    return p.parse_args()


ARGS = _parse()
os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
if ARGS.platform == "cpu":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={ARGS.devices}")
    os.environ["JAX_PLATFORMS"] = "cpu"
else:  # the recorded cases' collectives recorded too (the other cases record no callback)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_"
                               "buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,COLLECTIVES")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

from xferlib.adapters.jax import (ShardedCollection, collection_anchor,  # noqa: E402
                                  embedding_bag_collection)
from xferlib.collection import EmbeddingCollection, TableConfig, plan_sharding  # noqa: E402
from worker_cases import run_cases  # noqa: E402  (this folder: run as a script)

N = ARGS.devices
DEVICES = jax.devices(ARGS.platform)[:N]
if len(DEVICES) < N:
    sys.exit(f"needs {N} {ARGS.platform} devices, found {len(DEVICES)}")
CORE_DEVICE = "cuda" if ARGS.platform == "gpu" else "cpu"
MESH = Mesh(np.array(DEVICES), ("x",))
TABLES = [TableConfig(11, 4, name="a"), TableConfig(5, 3, name="b", placement="host"),
          TableConfig(17, 8, name="c"), TableConfig(3, 2, name="d")]
HYPER = {"sgd": {"lr": 0.3, "momentum": 0.9}, "rowwise_adagrad": {"lr": 0.2},
         "adam": {"lr": 0.05}, "adagrad": {"lr": 0.1}, "adamw": {"lr": 0.05, "weight_decay": 0.1},
         "adamax": {"lr": 0.05}, "rmsprop": {"lr": 0.01, "centered": True},
         "adadelta": {"lr": 1.0}}
B_LOCAL, MAX_LEN, PAD, STEPS = 3, 4, 5, 3


def _batches(rng, weighted, TABLES=TABLES, full=False):
    """Each device's batch (indices padded by PAD, offsets, weights) and the global one.
    ``full``: every bag holds MAX_LEN lookups (bounded rooms filled to the last slot)."""
    T = len(TABLES)
    lengths = (np.full((N, T, B_LOCAL), MAX_LEN) if full else
               rng.integers(0, MAX_LEN + 1, size=(N, T, B_LOCAL)))
    bags = [[[rng.integers(0, TABLES[t].num_rows, lengths[d, t, j])
              for j in range(B_LOCAL)] for t in range(T)] for d in range(N)]
    cap = T * B_LOCAL * MAX_LEN + PAD
    loc_idx = np.zeros((N, cap), np.int32)
    loc_w = np.zeros((N, cap), np.float32)
    loc_off = np.zeros((N, T * B_LOCAL + 1), np.int32)
    weights = [[[rng.uniform(0.5, 2.0, lengths[d, t, j]).astype(np.float32)
                 for j in range(B_LOCAL)] for t in range(T)] for d in range(N)]
    for d in range(N):
        flat = [x for t in range(T) for x in bags[d][t]]
        flat_w = [x for t in range(T) for x in weights[d][t]]
        n = sum(len(x) for x in flat)
        loc_idx[d, :n] = np.concatenate(flat)
        loc_idx[d, n:] = rng.integers(-5, 50, cap - n)  # padding: ignored whatever it holds
        loc_w[d, :n] = np.concatenate(flat_w)
        loc_off[d] = np.concatenate([[0], np.cumsum([len(x) for x in flat])])
    g_bags = [x for t in range(T) for d in range(N) for x in bags[d][t]]
    g_w = [x for t in range(T) for d in range(N) for x in weights[d][t]]
    g_idx = np.concatenate(g_bags).astype(np.int32)
    g_off = np.concatenate([[0], np.cumsum([len(x) for x in g_bags])]).astype(np.int32)
    g_wt = np.concatenate(g_w).astype(np.float32)
    return (loc_idx.reshape(-1), loc_off.reshape(-1), loc_w.reshape(-1),
            g_idx, g_off, g_wt if weighted else None)


def _case(optimizer, row_wise=(), pooling="sum", weighted=False, tables=TABLES,
          max_bag_size=None, full=False):
    TABLES = tables
    rng = np.random.default_rng(sum(map(ord, optimizer + pooling)) + len(row_wise))
    plan = plan_sharding(TABLES, N, optimizer=optimizer, row_wise=row_wise)
    sharded = ShardedCollection(TABLES, optimizer, HYPER[optimizer], plan=plan,
                                pooling=pooling, seed=3, device=CORE_DEVICE, devices=DEVICES,
                                max_bag_size=max_bag_size)
    one = EmbeddingCollection(TABLES, optimizer, HYPER[optimizer], pooling=pooling,
                              device=CORE_DEVICE, seed=3)
    total = one.total_dim

    def mesh_loss(anchor, idx, off, w, target):
        pooled = sharded(idx, off, w if weighted else None, axis_name="x", anchor=anchor)
        return jnp.sum(pooled * target), pooled

    def mesh_step(anchor, idx, off, w, target):
        g, pooled = jax.grad(mesh_loss, has_aux=True)(anchor, idx, off, w, target)
        return g, pooled

    mesh_f = jax.jit(jax.shard_map(mesh_step, mesh=MESH,
                                   in_specs=(P(), P("x"), P("x"), P("x"), P("x")),
                                   out_specs=(P(), P("x"))))

    def one_loss(anchor, idx, off, w, target):
        pooled = embedding_bag_collection(one, idx, off, w, anchor=anchor)
        return jnp.sum(pooled * target), pooled

    one_f = jax.jit(jax.grad(one_loss, has_aux=True))
    err = 0.0
    anchor = collection_anchor()
    for _ in range(STEPS):
        idx, off, w, g_idx, g_off, g_w = _batches(rng, weighted, TABLES, full)
        target = rng.standard_normal((N * B_LOCAL, total)).astype(np.float32)
        _, pooled = mesh_f(anchor, idx, off, w, target)
        _, ref = one_f(anchor, g_idx, g_off, g_w, target)
        err = max(err, float(np.abs(np.asarray(pooled) - np.asarray(ref)).max()))
    err = max(err, _state_error(sharded.state_dict(), one.state_dict()))
    return err


def _recorded_case(optimizer, row_wise=()):
    """``record=True``: each step slices its batch out of a chunk of every step's batches
    inside the jitted step, so the owners' buffers stay where they were and XLA replays its
    recordings (one GPU: fewer owner calls than steps); the tables and state are one
    collection's on the global batches."""
    rng = np.random.default_rng(7 + len(row_wise))
    plan = plan_sharding(TABLES, N, optimizer=optimizer, row_wise=row_wise)
    sharded = ShardedCollection(TABLES, optimizer, HYPER[optimizer], plan=plan, seed=3,
                                device=CORE_DEVICE, devices=DEVICES, record=True)
    one = EmbeddingCollection(TABLES, optimizer, HYPER[optimizer], device=CORE_DEVICE, seed=3)
    steps = 2 * STEPS
    batches = [_batches(rng, False) for _ in range(steps)]
    targets = [rng.standard_normal((N * B_LOCAL, one.total_dim)).astype(np.float32)
               for _ in range(steps)]
    calls = []
    for coll in sharded.shards:  # count this process's owners' lookups
        if coll is not None:
            coll.forward = lambda *a, _f=coll.forward, **k: calls.append(1) or _f(*a, **k)

    def mesh_step(anchor, idx, off, target, k):
        i, o, t = (jax.lax.dynamic_index_in_dim(a, k, keepdims=False)
                   for a in (idx, off, target))
        loss, g = jax.value_and_grad(
            lambda a: jnp.sum(sharded(i, o, axis_name="x", anchor=a) * t))(anchor)
        return g, jax.lax.psum(loss, "x")  # a training step's outputs

    chunk = jax.sharding.NamedSharding(MESH, P(None, "x"))
    mesh_f = jax.jit(jax.shard_map(mesh_step, mesh=MESH, out_specs=(P(), P()),
                                   in_specs=(P(), P(None, "x"), P(None, "x"), P(None, "x"),
                                             P())))
    one_f = jax.jit(jax.grad(lambda a, i, o, t: jnp.sum(
        embedding_bag_collection(one, i, o, anchor=a) * t)))
    idx, off, tgt = (jax.device_put(np.stack(a), chunk) for a in (
        [b[0] for b in batches], [b[1] for b in batches], targets))
    anchor = one_anchor = collection_anchor()
    for k in range(steps):
        anchor, _ = mesh_f(anchor, idx, off, tgt, jnp.int32(k))
        one_anchor = one_f(one_anchor, batches[k][3], batches[k][4], targets[k])
    jax.block_until_ready((anchor, one_anchor))
    sharded.check()
    # One GPU a process replays (the DLRM example's runs: a process per GPU); one process
    # driving several GPUs was seen calling the owners every step (the same tables).
    if ARGS.platform == "gpu" and N == 1 and len(calls) >= steps:
        return f"XLA replayed no step: {len(calls)} owner lookups in {steps} steps"
    return _state_error(sharded.state_dict(), one.state_dict())


def _state_error(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(float(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)).max())
               for k in a)


def _checkpoint_case():
    """A trained sharded collection saved per shard loads into another plan (row-wise, the
    ranks reversed) and into one collection, and its state dict into both: equal state."""
    import tempfile

    # Names with dots, each the start of another's state keys ("a.b.c.weight" starts with
    # "a." and "a.b."); on two ranks at least two of them share a rank.
    renamed = {"b": "a.b", "c": "a.b.c"}
    TABLES_ = [dataclasses.replace(c, name=renamed.get(c.name, c.name)) for c in TABLES]
    if N < 2:
        return 0.0  # a plan over one rank has nothing to reshard
    rng = np.random.default_rng(5)
    hyper = HYPER["adam"]
    plan = plan_sharding(TABLES_, N, optimizer="adam")
    sharded = ShardedCollection(TABLES_, "adam", hyper, plan=plan, seed=4,
                                device=CORE_DEVICE, devices=DEVICES)
    step = jax.jit(jax.shard_map(
        lambda a, i, o, t: jax.grad(lambda a: jnp.sum(
            sharded(i, o, axis_name="x", anchor=a) * t))(a),
        mesh=MESH, in_specs=(P(), P("x"), P("x"), P("x")), out_specs=P()))
    for _ in range(2):
        idx, off, *_ = _batches(rng, False, TABLES_)
        target = rng.standard_normal((N * B_LOCAL, sharded.total_dim)).astype(np.float32)
        jax.block_until_ready(step(collection_anchor(), idx, off, target))
    saved = sharded.state_dict()
    other = ShardedCollection(TABLES_, "adam", hyper, device=CORE_DEVICE, devices=DEVICES,
                              plan=plan_sharding(TABLES_, N, optimizer="adam",
                                                 row_wise=("a", "a.b.c")))
    one = EmbeddingCollection(TABLES_, "adam", hyper, device=CORE_DEVICE)
    with tempfile.TemporaryDirectory() as folder:
        sharded.save(folder, tag="s1")
        other.load(folder)
        err = _state_error(other.state_dict(), saved)
    one.load_state_dict(saved)  # the sharded state dict loads into one collection
    err = max(err, _state_error(one.state_dict(), saved))
    fresh = ShardedCollection(TABLES_, "adam", hyper, device=CORE_DEVICE, devices=DEVICES,
                              plan=plan)
    fresh.load_state_dict(one.state_dict())  # and one collection's into a sharded one
    err = max(err, _state_error(fresh.state_dict(), saved))
    # A state dict whose last table is narrower (and whose first differs): refused before
    # any rank's shards change.
    first, last = (f"{sharded.tables[t].name}.weight" for t in (0, -1))
    bad = dict(saved, **{first: saved[first] + 1, last: saved[last][:, :-1]})
    try:
        fresh.load_state_dict(bad)
        return float("inf")
    except ValueError:
        pass
    return max(err, _state_error(fresh.state_dict(), saved))


def _bad_index_case(max_bag_size=None, bad_offsets=False, offsets_fault=None):
    """An index out of range on the last device (or, with ``max_bag_size``, one bag longer
    than the bound there; with ``bad_offsets`` too, offsets not starting at 0 that route more
    lookups into a bag than their differences say; ``offsets_fault``: the last device's
    offsets not starting at 0 ("start"), past the padded length ("end") or decreasing
    ("decreasing")): an error, no table changes, and the next check() is clean."""
    plan = plan_sharding(TABLES, N, optimizer="sgd")
    sharded = ShardedCollection(TABLES, "sgd", {"lr": 0.1}, plan=plan, device=CORE_DEVICE,
                                devices=DEVICES, max_bag_size=max_bag_size)
    before = [sharded.table_weights(t).copy() for t in range(len(TABLES))]
    rng = np.random.default_rng(0)
    idx, off, w, *_ = _batches(rng, False)
    cap = idx.size // N
    idx = idx.copy()
    if offsets_fault is not None:
        off = off.copy()
        last = slice((N - 1) * (off.size // N), N * (off.size // N))
        if offsets_fault == "start":
            off[last.start] = 2
        elif offsets_fault == "end":
            off[last.stop - 1] = cap + 1
        else:  # a bag of 5 lookups, then one of -2
            off[last.start + 1:last.start + 3] = (5, 3)
    elif max_bag_size is None:
        idx[(N - 1) * cap] = 99  # the last device's first lookup (table a)
    else:  # the last device: its first bag MAX_LEN + 1 rows of table a, the others empty
        off = off.copy()
        last = slice((N - 1) * (off.size // N), N * (off.size // N))
        idx[(N - 1) * cap:(N - 1) * cap + MAX_LEN + 1] = np.arange(MAX_LEN + 1)
        if bad_offsets:  # differences within the bound, the lookups before offsets[1] more
            off[last] = np.minimum(np.arange(off.size // N) + MAX_LEN, MAX_LEN + 1)
            off[last.start] = 2
        else:
            off[last] = MAX_LEN + 1
            off[last.start] = 0
    expected = ("malformed offsets" if offsets_fault or bad_offsets else
                "out of range" if max_bag_size is None else "longer than max_bag_size")

    def step(anchor, i, o):
        # The pooled rows come back too: a program whose every output is zero-size (the
        # anchor's gradient alone) is not run at all.
        return jax.grad(lambda a: (lambda p: (p.sum(), p))(
            sharded(i, o, axis_name="x", anchor=a)), has_aux=True)(anchor)

    f = jax.jit(jax.shard_map(step, mesh=MESH, in_specs=(P(), P("x"), P("x")),
                              out_specs=(P(), P("x"))))
    try:
        jax.block_until_ready(f(collection_anchor(), idx, off))
        sharded.check()  # a GPU reports a refused batch without a wait: here
    except Exception as err:
        if expected not in str(err):
            return f"wrong error: {err}"[:300]
    else:
        return "no error"
    try:
        sharded.check()  # reported once
    except Exception as err:
        return f"raised again: {err}"[:300]
    return max(float(np.abs(sharded.table_weights(t) - before[t]).max())
               for t in range(len(TABLES)))


def main():
    cases = {}
    for optimizer in HYPER:
        cases[f"table_wise-{optimizer}"] = lambda o=optimizer: _case(o)
    cases["row_wise-sgd"] = lambda: _case("sgd", row_wise=("a", "c"))
    cases["row_wise-rowwise_adagrad"] = lambda: _case("rowwise_adagrad", row_wise=("c",))
    cases["table_wise-mean"] = lambda: _case("adam", pooling="mean")
    cases["table_wise-weighted"] = lambda: _case("rowwise_adagrad", weighted=True)
    # One table: every rank but one holds no shard (its callback writes zero columns).
    cases["ranks-without-shards"] = lambda: _case("adam", tables=TABLES[2:3])
    cases["bad-index"] = _bad_index_case
    # max_bag_size: rooms sized by the bound train the same; a longer bag is refused
    cases["table_wise-bounded"] = lambda: _case("adam", max_bag_size=MAX_LEN)
    cases["table_wise-bounded-full"] = lambda: _case("sgd", max_bag_size=MAX_LEN, full=True)
    cases["row_wise-bounded-mean"] = lambda: _case("rowwise_adagrad", row_wise=("c",),
                                                   pooling="mean", max_bag_size=MAX_LEN + 1)
    cases["too-long-bag"] = lambda: _bad_index_case(max_bag_size=MAX_LEN)
    cases["too-long-bag-bad-offsets"] = lambda: _bad_index_case(MAX_LEN, bad_offsets=True)
    for fault in ("start", "end", "decreasing"):
        cases[f"bad-offsets-{fault}"] = lambda f=fault: _bad_index_case(offsets_fault=f)
    cases["checkpoint-reshard"] = _checkpoint_case
    cases["table_wise-recorded"] = lambda: _recorded_case("adam")
    cases["row_wise-recorded"] = lambda: _recorded_case("sgd", row_wise=("a", "c"))
    run_cases(cases)


if __name__ == "__main__":
    main()
