"""One process of a multi-process ShardedCollection check (``jax.distributed``, one CPU
device a process, gloo collectives): prints one JSON line, ``{case: max abs error or error
text}``.

    python tests/jax/collection_multiprocess_worker.py --process P --processes N --port PORT
        --out DIR

Every process makes the same batches (one seed) and trains its rank's shards inside one
``jax.shard_map`` over the global mesh, feeding its own samples
(``jax.make_array_from_process_local_data``); it also trains one unsharded collection on the
global batch and reports the largest difference of its own samples' pooled rows and of every
table's weights and state (``state_dict``, a collective across the processes). The checkpoint
case saves from the processes (each its shards, process 0 the manifest) and loads the files
into one unsharded collection.
"""

from __future__ import annotations

import argparse
import os


def _parse():
    p = argparse.ArgumentParser()
    p.add_argument("--process", type=int, required=True)
    p.add_argument("--processes", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
    return p.parse_args()


ARGS = _parse()
os.environ.pop("XLA_FLAGS", None)  # one device a process
os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
GPU = ARGS.platform == "gpu"
if GPU:  # process p on GPU p alone, for JAX (local_device_ids, below) and for CuPy
    import cupy

    cupy.cuda.Device(ARGS.process).use()
else:
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

if not GPU:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
# (JAX_CUDA_VISIBLE_DEVICES alone left each process both GPUs: the mesh then had four)
jax.distributed.initialize(f"127.0.0.1:{ARGS.port}", num_processes=ARGS.processes,
                           process_id=ARGS.process,
                           local_device_ids=[ARGS.process] if GPU else None,
                           cluster_detection_method="deactivate")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from xferlib.adapters.jax import (ShardedCollection, collection_anchor,  # noqa: E402
                                  embedding_bag_collection)
from xferlib.collection import EmbeddingCollection, TableConfig, plan_sharding  # noqa: E402
from worker_cases import run_cases  # noqa: E402  (this folder: run as a script)

N, ME = ARGS.processes, ARGS.process
DEVICES = jax.devices()
CORE_DEVICE = "cuda" if GPU else "cpu"
MESH = Mesh(np.array(DEVICES), ("x",))
TABLES = [TableConfig(11, 4, name="a"), TableConfig(5, 4, name="b", placement="host"),
          TableConfig(17, 4, name="c"), TableConfig(3, 4, name="d")]
HYPER = {"sgd": {"lr": 0.3}, "rowwise_adagrad": {"lr": 0.2}, "adam": {"lr": 0.05}}
B_LOCAL, MAX_LEN, STEPS = 3, 3, 3
CAP = len(TABLES) * B_LOCAL * MAX_LEN


def _batch(rng):
    """Every device's padded batch (``(N, CAP)`` indices, ``(N, T*B+1)`` offsets) and the
    global one (bags device after device, table by table)."""
    T = len(TABLES)
    lengths = rng.integers(0, MAX_LEN + 1, size=(N, T, B_LOCAL))
    bags = [[[rng.integers(0, TABLES[t].num_rows, lengths[d, t, j]) for j in range(B_LOCAL)]
             for t in range(T)] for d in range(N)]
    idx = np.zeros((N, CAP), np.int32)
    off = np.zeros((N, T * B_LOCAL + 1), np.int32)
    for d in range(N):
        flat = [x for t in range(T) for x in bags[d][t]]
        n = sum(len(x) for x in flat)
        if n:
            idx[d, :n] = np.concatenate(flat)
        off[d] = np.concatenate([[0], np.cumsum([len(x) for x in flat])])
    g_bags = [x for t in range(T) for d in range(N) for x in bags[d][t]]
    g_idx = np.concatenate(g_bags).astype(np.int32)
    g_off = np.concatenate([[0], np.cumsum([len(x) for x in g_bags])]).astype(np.int32)
    return idx, off, g_idx, g_off


def _mine(array):
    """This process's part of a global array sharded over the mesh (one device each)."""
    return jax.make_array_from_process_local_data(NamedSharding(MESH, P("x")), array[ME])


def _case(optimizer, row_wise=(), checkpoint=False):
    rng = np.random.default_rng(sum(map(ord, optimizer)) + len(row_wise))
    plan = plan_sharding(TABLES, N, optimizer=optimizer, row_wise=row_wise)
    sharded = ShardedCollection(TABLES, optimizer, HYPER[optimizer], plan=plan, seed=3,
                                device=CORE_DEVICE, devices=DEVICES)
    assert sharded.local_ranks == (ME,) and sharded.multiprocess, (
        f"process {ME}: local ranks {sharded.local_ranks} of a mesh of {DEVICES}")
    one = EmbeddingCollection(TABLES, optimizer, HYPER[optimizer], seed=3, device=CORE_DEVICE)
    total = one.total_dim

    def mesh_step(anchor, idx, off, target):
        def loss(anchor):
            pooled = sharded(idx, off, axis_name="x", anchor=anchor)
            return jnp.sum(pooled * target), pooled
        return jax.grad(loss, has_aux=True)(anchor)

    mesh_f = jax.jit(jax.shard_map(mesh_step, mesh=MESH, in_specs=(P(), P("x"), P("x"),
                                                                    P("x")),
                                   out_specs=(P(), P("x"))))

    def one_loss(anchor, idx, off, target):
        pooled = embedding_bag_collection(one, idx, off, anchor=anchor)
        return jnp.sum(pooled * target), pooled

    one_f = jax.jit(jax.grad(one_loss, has_aux=True))
    anchor = collection_anchor()
    replicated = jax.make_array_from_process_local_data(NamedSharding(MESH, P()),
                                                        np.asarray(anchor))
    err = 0.0
    for _ in range(STEPS):
        idx, off, g_idx, g_off = _batch(rng)
        target = rng.standard_normal((N, B_LOCAL, total)).astype(np.float32)
        _, pooled = mesh_f(replicated, _mine(idx), _mine(off), _mine(target))
        _, ref = one_f(anchor, g_idx, g_off, target.reshape(N * B_LOCAL, total))
        mine = np.asarray(pooled.addressable_shards[0].data)
        err = max(err, float(np.abs(mine - np.asarray(ref)[ME * B_LOCAL:(ME + 1) * B_LOCAL])
                             .max()))
    want = one.state_dict()
    if checkpoint:
        sharded.save(ARGS.out)
        fresh = EmbeddingCollection(TABLES, optimizer, HYPER[optimizer], seed=11,
                                    device=CORE_DEVICE)
        fresh.load_state_dict(_read_back(ARGS.out, optimizer))
        got = fresh.state_dict()
    else:
        got = sharded.state_dict()  # a collective: every process gathers every table
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    return max(err, max(float(np.abs(np.asarray(got[k], np.float64)
                                     - np.asarray(want[k], np.float64)).max()) for k in want))


def _read_back(directory, optimizer):
    """The checkpoint's whole tables, read by a sharded collection of one rank."""
    single = ShardedCollection(TABLES, optimizer, HYPER[optimizer], world_size=1, seed=5,
                               device=CORE_DEVICE, devices=jax.local_devices())
    single.load(directory)
    return single.state_dict()


def _float64_and_foreign_mesh():
    """float64 tables gather exactly (as bytes: JAX without x64 would narrow them), and a
    process none of whose devices is in the mesh is refused (0.0 when both hold)."""
    plan = plan_sharding(TABLES, N, optimizer="adam", dtype="float64")
    sharded = ShardedCollection(TABLES, "adam", HYPER["adam"], plan=plan, seed=3,
                                dtype="float64", device=CORE_DEVICE, devices=DEVICES)
    one = EmbeddingCollection(TABLES, "adam", HYPER["adam"], seed=3, dtype="float64",
                              device=CORE_DEVICE)
    want = one.state_dict()
    got = sharded.state_dict()
    err = max(float(np.abs(np.asarray(got[k]) - np.asarray(want[k])).max()) for k in want)
    assert all(np.asarray(got[k]).dtype == np.asarray(want[k]).dtype for k in want)
    try:  # the first process's device alone: the others hold none of it
        ShardedCollection(TABLES, "sgd", HYPER["sgd"], world_size=1, device=CORE_DEVICE,
                          devices=DEVICES[:1])
        refused = False
    except ValueError as e:
        refused = "none of the mesh's devices" in str(e)
    return err if refused == (ME != 0) else f"refused={refused} on process {ME}"


CASES = {"table_wise-sgd": lambda: _case("sgd"),
         "row_wise-rowwise_adagrad": lambda: _case("rowwise_adagrad", row_wise=("a", "c")),
         "table_wise-adam": lambda: _case("adam"),
         "checkpoint-row_wise-adam": lambda: _case("adam", row_wise=("c",), checkpoint=True),
         "table_wise-float64-foreign-mesh": _float64_and_foreign_mesh}

run_cases(CASES, max_text=4000)
