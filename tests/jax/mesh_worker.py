"""Runs the JAX mesh equality checks in a fresh process (forced host devices must be set before
JAX starts its backends) and prints one JSON line: ``{case: max abs error or error text}``.

    python tests/jax/mesh_worker.py --devices 2 [--platform gpu]

Every case trains the same model twice from the same start: inside ``jax.shard_map`` over a
1-D mesh of N devices (the batch sharded) and on ONE device with the global batch.
"""

from __future__ import annotations

import argparse
import os
import sys


def _parse():
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--platform", default="cpu", choices=("cpu", "gpu"))
    return p.parse_args()


ARGS = _parse()
if ARGS.platform == "cpu":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={ARGS.devices}")
    os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import xferlib  # noqa: E402
from xferlib import tt  # noqa: E402
from xferlib.adapters.jax import (host_lookup, host_update, sharded_host_update,  # noqa: E402
                                  tt_embedding_bag)
from xferlib.table import SPARSE_OPTIMIZERS  # noqa: E402
from worker_cases import run_cases  # noqa: E402  (this folder: run as a script)

N = ARGS.devices
DEVICES = jax.devices(ARGS.platform)[:N]
if len(DEVICES) < N:
    sys.exit(f"needs {N} {ARGS.platform} devices, found {len(DEVICES)}")
MESH = Mesh(np.array(DEVICES), ("batch",))
ONE = DEVICES[0]
DIM, PER_DEVICE, STEPS = 8, 5, 3  # 5 rows per device: odd shards, repeats across devices
HYPER = {"sgd": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}, "adam": {"lr": 0.05},
         "adamw": {"lr": 0.05}, "adagrad": {"lr": 0.1}, "rowwise_adagrad": {"lr": 0.1},
         "adamax": {"lr": 0.05}, "rmsprop": {"lr": 0.01, "momentum": 0.5},
         "adadelta": {"lr": 1.0}}


def _sharded(f, in_specs, out_specs, check_vma=True):
    return jax.jit(jax.shard_map(f, mesh=MESH, in_specs=in_specs, out_specs=out_specs,
                                 check_vma=check_vma))


def _host_case(optimizer, rows, check_vma=True):
    """Host table: lookups, a loss over the batch, the update; N devices vs one."""
    rng = np.random.default_rng(7)
    init = rng.standard_normal((rows, DIM)).astype(np.float32)
    hyper = HYPER.get(optimizer, {"lr": 0.05})
    mesh_table, one_table = (xferlib.HostTable(rows, DIM, optimizer=optimizer,
                                               optimizer_kwargs=hyper, init=init.copy())
                             for _ in range(2))
    B = PER_DEVICE * N

    def loss_fn(r, t):  # global-batch mean on one device; each shard's part on the mesh
        return jnp.sum((r - t) ** 2 * jnp.arange(1, DIM + 1)) / B

    def mesh_step(idx, targets, token):
        r = host_lookup(mesh_table, idx, after=token)
        loss, g = jax.value_and_grad(loss_fn)(r, targets)
        token = sharded_host_update(mesh_table, idx, g, axis_name="batch")
        return jax.lax.psum(loss, "batch"), token

    def one_step(idx, targets):
        r = host_lookup(one_table, idx)
        loss, g = jax.value_and_grad(loss_fn)(r, targets)
        return loss, host_update(one_table, idx, g)

    mesh_f = _sharded(mesh_step, (P("batch"), P("batch"), P()), (P(), P()), check_vma)
    one_f = jax.jit(one_step)
    token, err = jnp.int32(0), 0.0
    for _ in range(STEPS):
        idx = rng.integers(0, rows, B).astype(np.int32)  # many repeats across devices
        targets = rng.standard_normal((B, DIM)).astype(np.float32)
        loss, token = mesh_f(idx, targets, token)
        ref_loss, ref_token = one_f(jax.device_put(idx, ONE), jax.device_put(targets, ONE))
        jax.block_until_ready((token, ref_token))
        err = max(err, abs(float(loss) - float(ref_loss)) / max(1.0, abs(float(ref_loss))))
    err = max(err, float(np.abs(mesh_table.numpy() - one_table.numpy()).max()))
    for name in one_table.state_names():
        a, b = mesh_table.state(name), one_table.state(name)
        err = max(err, float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max()))
    return err


def _scan_case():
    """The same indices every iteration of a lax.scan: a lookup that ran before another
    device's update of the previous iteration would read a stale row."""
    rng = np.random.default_rng(3)
    rows = 2 * N + 1
    init = rng.standard_normal((rows, DIM)).astype(np.float32)
    mesh_table, one_table = (xferlib.HostTable(rows, DIM, optimizer="sgd",
                                               optimizer_kwargs={"lr": 0.2}, init=init.copy())
                             for _ in range(2))
    B = PER_DEVICE * N
    idx = rng.integers(0, rows, B).astype(np.int32)
    targets = rng.standard_normal((4, B, DIM)).astype(np.float32)

    def body_for(table, update):
        def body(token, t):
            r = host_lookup(table, idx_arg[0], after=token)
            loss, g = jax.value_and_grad(lambda r: jnp.sum((r - t) ** 2))(r)
            return update(table, idx_arg[0], g), loss
        return body

    idx_arg = [None]

    def mesh_train(i, ts):
        idx_arg[0] = i
        body = body_for(mesh_table, lambda tb, i, g: sharded_host_update(tb, i, g,
                                                                         axis_name="batch"))
        token, losses = jax.lax.scan(body, jnp.int32(0), ts)
        return token, jax.lax.psum(losses, "batch")

    def one_train(i, ts):
        idx_arg[0] = i
        token, losses = jax.lax.scan(body_for(one_table, host_update), jnp.int32(0), ts)
        return token, losses

    token, losses = _sharded(mesh_train, (P("batch"), P(None, "batch")), (P(), P()))(
        idx, targets)
    ref_token, ref_losses = jax.jit(one_train)(jax.device_put(idx, ONE),
                                               jax.device_put(targets, ONE))
    jax.block_until_ready((token, ref_token))
    err = float(np.abs(np.asarray(losses) - np.asarray(ref_losses)).max()
                / max(1.0, float(np.abs(np.asarray(ref_losses)).max())))
    return max(err, float(np.abs(mesh_table.numpy() - one_table.numpy()).max()))


def _views_ready_case():
    """Tracing a sharded update makes every GPU's view of the table and its pinned check ring
    (made later, inside the step's callbacks, the ring's pinned allocation could wait for a
    peer device whose collective waits for that thread); on CPU devices it makes nothing.
    The number of devices found without them."""
    from xferlib.adapters.jax._views import on_device

    table = xferlib.HostTable(4 * N, DIM, optimizer="adam", init="zeros")

    def step(i):
        return sharded_host_update(table, i, jnp.ones((i.shape[0], DIM)), axis_name="batch")

    _sharded(step, (P("batch"),), P()).lower(np.arange(2 * N, dtype=np.int32))
    if ARGS.platform == "cpu":
        return 0.0 if table.device_side is None else 1.0
    sides = [on_device(table, d.local_hardware_id).device_side for d in DEVICES]
    return float(sum(side is None or side.checks.host is None for side in sides))


def _bad_index_case():
    """An index out of range on one device: every device refuses, the table is unchanged."""
    table = xferlib.HostTable(4 * N, DIM, optimizer="adam", init="zeros")
    before = np.array(table.numpy())
    idx = np.arange(N * 2, dtype=np.int32)
    idx[-1] = 4 * N  # the last device's shard holds the bad index

    def step(i):
        return sharded_host_update(table, i, jnp.ones((i.shape[0], DIM)), axis_name="batch")

    try:
        jax.block_until_ready(_sharded(step, (P("batch"),), P())(idx))
    except Exception as err:  # an XLA runtime error carrying the IndexError's message
        if "out of range" not in str(err):
            return f"wrong error: {err}"
    else:
        return "no error"
    changed = float(np.abs(table.numpy() - before).max())
    steps = int(table.state("step").max())
    return changed + steps


SHAPE = tt.TTShape([6, 10, 10], [2, 2, 4], [3, 4])
TT_OPTIMIZERS = {"sgd": lambda: optax.sgd(0.5), "adagrad": lambda: optax.adagrad(0.1),
                 "adam": lambda: optax.adam(0.05), "lamb": lambda: optax.lamb(0.05),
                 "lars": lambda: optax.lars(0.5)}


def _tt_case(name, check_vma=True, weighted=False):
    """TT bags (2 rows per bag) + the optimizer on replicated cores: N devices vs one."""
    rng = np.random.default_rng(11)
    cores0 = tuple(jnp.asarray(c) for c in tt.init_tt_cores(SHAPE, "normal", rng=rng))
    tx = TT_OPTIMIZERS[name]()
    B, L = PER_DEVICE * N, 2
    kw = dict(p_shapes=SHAPE.p_shapes, q_shapes=SHAPE.q_shapes, ranks=SHAPE.ranks)

    def loss_fn(cores, idx, w, target, axis_name=None):
        n = idx.shape[0] // L
        offsets = jnp.arange(0, n * L + 1, L, dtype=jnp.int32)
        bags = tt_embedding_bag(cores, idx, offsets, per_sample_weights=w if weighted else None,
                                axis_name=axis_name, **kw)
        return jnp.sum((bags - target) ** 2) / B

    def step(cores, state, idx, w, target, axis_name=None):
        loss, g = jax.value_and_grad(loss_fn)(cores, idx, w, target, axis_name)
        updates, state = tx.update(g, state, cores)
        return optax.apply_updates(cores, updates), state, loss

    def mesh_step(cores, state, idx, w, target):
        # check_vma=False: the batch axis is named; otherwise JAX's types carry it.
        cores, state, loss = step(cores, state, idx, w, target,
                                  None if check_vma else "batch")
        return cores, state, jax.lax.psum(loss, "batch")

    mesh_f = _sharded(mesh_step, (P(), P(), P("batch"), P("batch"), P("batch")),
                      (P(), P(), P()), check_vma)
    one_f = jax.jit(step)
    with jax.default_matmul_precision("highest"):
        mesh_cores, one_cores = cores0, jax.device_put(cores0, ONE)
        mesh_state, one_state = tx.init(mesh_cores), jax.device_put(tx.init(cores0), ONE)
        err = 0.0
        for _ in range(STEPS):
            idx = rng.integers(0, SHAPE.num_rows, B * L).astype(np.int32)
            idx[:N] = idx[N:2 * N]  # the same rows on several devices
            w = rng.random(B * L).astype(np.float32)
            target = rng.standard_normal((B, SHAPE.dim)).astype(np.float32)
            mesh_cores, mesh_state, loss = mesh_f(mesh_cores, mesh_state, idx, w, target)
            one_cores, one_state, ref = one_f(one_cores, one_state, *(
                jax.device_put(a, ONE) for a in (idx, w, target)))
            err = max(err, abs(float(loss) - float(ref)) / max(1.0, abs(float(ref))))
        for a, b in zip(mesh_cores, one_cores):
            a, b = np.asarray(a), np.asarray(b)
            err = max(err, float(np.abs(a - b).max()) / max(1.0, float(np.abs(b).max())))
    return err


def main():
    cases = {}
    for optimizer in SPARSE_OPTIMIZERS:
        cases[f"host-{optimizer}"] = lambda o=optimizer: _host_case(o, 3 * N + 2)
    cases["host-fewer-rows-than-devices"] = lambda: _host_case("adam", N - 1 if N > 2 else 1)
    cases["host-check_vma-off"] = lambda: _host_case("adagrad", 3 * N + 2, check_vma=False)
    cases["host-scan-ordering"] = _scan_case
    for name in TT_OPTIMIZERS:
        cases[f"tt-{name}"] = lambda n=name: _tt_case(n)
    cases["tt-weighted"] = lambda: _tt_case("adagrad", weighted=True)
    cases["tt-check_vma-off"] = lambda: _tt_case("adam", check_vma=False)
    cases["host-views-ready-at-trace"] = _views_ready_case
    cases["host-bad-index"] = _bad_index_case  # last: a failed step ends nothing after it
    run_cases(cases, max_text=500)


if __name__ == "__main__":
    main()
