"""The DLRM in JAX on N devices of one host (``--devices N``): the collection's tables sharded
by xferlib's plan, the dense part data-parallel.

The tables (HBM, or host RAM with a GPU cache of hot rows) are one
``xferlib.adapters.jax.ShardedCollection``: each device holds the shards the plan
(``sharding.sharding_plan``) gives it, in its own GPU's memory or pinned host RAM. The step
runs inside ``jax.shard_map`` over a 1-D mesh, the global batch sharded: every device sends
each lookup of its samples to the owner of its table (``all_to_all``), each owner pools its
rows in one pass, the pooled rows come back; in the backward each owner runs its fused
backward + Adagrad update on the rows it holds. The MLPs live in one flat buffer, replicated;
their gradient is summed over the mesh (JAX's transpose of a replicated value) and every
device applies the same ``flat_step(flat_adam)``.

Each device's loss is its samples' summed BCE over the GLOBAL batch size, so the model trained
is the one a single device trains on the global batch (``jax_run.py``; the same initial
values). TT placements (``--placement tt``) keep the replicated design of ``jax_mesh_run.py``.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before jax is imported


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from xferlib.adapters.jax import ShardedCollection, collection_anchor, flat_step  # noqa: E402

from .jax_mesh_run import mesh_devices  # noqa: E402
from .jax_run import ChunkStep, JaxRun  # noqa: E402

AXIS = "batch"


def _timed(method, spent: list):
    """``method``, appending each call's host seconds to ``spent``."""
    def call(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - t0)
    return call


def _bce_sum(logit, label):
    return jnp.sum(jnp.maximum(logit, 0) - logit * label + jnp.log1p(jnp.exp(-jnp.abs(logit))))


class JaxShardedRun(JaxRun):
    """``JaxRun``'s model with its collection sharded over ``devices`` devices by
    ``sharding`` (a :class:`xferlib.collection.ShardingPlan` of the plan's tables)."""

    def __init__(self, preset, plan, seed, device, sharding, xp=np, devices=2,
                 optimizer="adagrad", processes=False):
        if any(t.where == "tt" for t in plan.tables):
            raise ValueError("TT tables are not sharded: use jax_mesh_run.JaxMeshRun")
        self.xp, self.gpu = xp, device != "cpu"
        self.preset, self.plan, self.dim = preset, plan, preset.dim
        # processes: one device a process (jax.distributed, torchrun's ranks), the mesh
        # over every process's device; each process feeds its own samples
        self.processes = bool(processes)
        found = jax.devices() if processes else mesh_devices(device, devices)
        if len(found) < devices:
            raise ValueError(f"{devices} devices needed, {len(found)} found")
        if sharding.world_size != devices:
            raise ValueError(f"the sharding plan is for {sharding.world_size} ranks, not "
                             f"--devices {devices}")
        self.devices = int(devices)
        self.device = jax.local_devices()[0] if processes else found[0]
        if processes:  # ClickLog.batches' part: this process's slice of each global batch,
            # at its device's place in the mesh
            self.part = (list(found[:devices]).index(self.device), self.devices)
            if self.gpu:  # JAX's one GPU must be the one CuPy (and the shards) use
                import cupy

                hardware = getattr(self.device, "local_hardware_id", None)
                if hardware is not None and hardware != cupy.cuda.runtime.getDevice():
                    raise RuntimeError(f"JAX's GPU {hardware} is not this rank's GPU "
                                       f"{cupy.cuda.runtime.getDevice()}")
        self.mesh = Mesh(np.array(found[:devices]), (AXIS,))
        self._replicated = NamedSharding(self.mesh, PartitionSpec())
        self._batch_specs = (PartitionSpec(AXIS), PartitionSpec(None, AXIS),
                             PartitionSpec(AXIS))
        self._batch = tuple(NamedSharding(self.mesh, s) for s in self._batch_specs)
        # a chunk of batches: the steps first, each batch sharded as above
        self._chunk_specs = tuple(PartitionSpec(None, *s) for s in self._batch_specs)
        self._chunk = tuple(NamedSharding(self.mesh, s) for s in self._chunk_specs)
        self.where = self._replicated  # the MLPs and their state on every device
        self._dense_state(seed)
        self.coll_tables, self.tt_tables = [t.index for t in plan.tables], []
        self.tt, self.tt_acc, self.tt_shapes = [], [], []
        # every bag holds `pooling` lookups: each owner's room is its tables' lookups;
        # record: XLA replays the owners' callbacks (and, with the collectives dlrm.py puts
        # in its command buffers, the whole step) without calling back into Python
        self.collection = ShardedCollection(
            sharding.tables, optimizer, {"lr": preset.lr_embedding}, plan=sharding, seed=seed,
            device="cuda" if self.gpu else "cpu", devices=found[:devices],
            max_bag_size=preset.pooling, record=self.gpu)
        self.anchor = jax.device_put(np.asarray(collection_anchor()), self._replicated)
        self.steps_done = 0
        self._step_numbers = []
        self.graph_note = (f"one jax.jit step over {devices} devices (shard_map), the "
                           f"collection sharded: {sharding.describe().splitlines()[0]}")
        self._build()

    # ------------------------------------------------------------------ the model
    def _embed(self, anchor, tt, cat):
        """This device's ``(b, tables, dim)``: its samples' lookups sent to the owners of
        their tables, pooled there, and brought back."""
        T, b, L = cat.shape
        offsets = jnp.arange(0, T * b * L + 1, L, dtype=jnp.int32)
        pooled = self.collection(cat.reshape(-1), offsets, axis_name=AXIS, anchor=anchor)
        return pooled.reshape(b, T, self.dim)

    def _build(self):
        tx, rep, n_devices = self.tx, PartitionSpec(), self.devices

        def loss_fn(flat, anchor, dense, cat, label):
            logits = self._interact(flat, dense, self._embed(anchor, (), cat))
            # this device's share of the global mean: the devices' gradients add up to it
            return _bce_sum(logits, label) / (label.shape[0] * n_devices)

        def step(flat, opt_state, anchor, chunk_dense, chunk_cat, chunk_label, k):
            # the step's batch sliced out of its chunk here: it lies at one address every
            # step, and XLA replays the collection's recorded callbacks
            dense, cat, label = (jax.lax.dynamic_index_in_dim(a, k, keepdims=False)
                                 for a in (chunk_dense, chunk_cat, chunk_label))
            # the owners' tables take their Adagrad step while the gradient is taken
            loss, (g_flat, _) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
                flat, anchor, dense, cat, label)
            flat, opt_state = flat_step(tx, g_flat, opt_state, flat)
            return flat, opt_state, jax.lax.psum(loss, AXIS)

        self._train_step = jax.jit(jax.shard_map(
            step, mesh=self.mesh, in_specs=(rep, rep, rep) + self._chunk_specs + (rep,),
            out_specs=rep), donate_argnums=(0, 1))

        def predict(flat, dense, cat):
            return self._interact(flat, dense, self._embed(None, (), cat))

        self._predict = jax.jit(jax.shard_map(
            predict, mesh=self.mesh, in_specs=(rep,) + self._batch_specs[:2],
            out_specs=PartitionSpec(AXIS)))

    # ------------------------------------------------------------------ runner interface
    def chunk_steps(self, chunk):
        """A chunk's steps in one go (``JaxRun.chunk_steps``): the chunk crosses to JAX
        once, as the global chunk (with processes, this process's part of it made global
        without a copy; in one process, placed on the mesh); each step takes it with its
        step number and slices its batch."""
        views = JaxRun.to_framework(self, chunk)
        if self.processes:
            global_chunk = self._global_batch(views, self._chunk, self._chunk_specs)
        else:
            global_chunk = tuple(jax.device_put(a, s) for a, s in zip(views, self._chunk))
        return [ChunkStep((global_chunk, k)) for k in self._step_numbers_upto(len(chunk.cat))]

    def to_framework(self, batch):
        data = JaxRun.to_framework(self, batch)  # each device gets its slice of the batch
        if self.processes:  # this process's samples, the global batch's slice on its device
            return self._global_batch(data)
        if data[2].shape[0] % self.devices:
            return data  # an evaluation chunk that does not split: predict pads it
        return tuple(jax.device_put(a, s) for a, s in zip(data, self._batch))

    def _global_batch(self, data, shardings=None, specs=None):
        """The global batch's arrays whose one shard on this process's device is this
        process's ``data`` (already there: no copy, no slicing op, as
        ``make_array_from_process_local_data`` would dispatch per array and step); with
        ``shardings`` and ``specs``, of that layout (a chunk's)."""
        out = []
        for local, sharding, spec in zip(data, shardings or self._batch,
                                         specs or self._batch_specs):
            shape = list(local.shape)
            shape[list(spec).index(AXIS)] *= self.devices
            if local.devices() != {self.device}:
                local = jax.device_put(local, self.device)
            out.append(jax.make_array_from_single_device_arrays(tuple(shape), sharding,
                                                                [local]))
        return tuple(out)

    def eval_to_framework(self, batch):
        """An evaluation chunk (the whole chunk, every process alike): with processes, this
        process's slice of it, padded to split evenly; else :meth:`to_framework`'s."""
        if not self.processes:
            return self.to_framework(batch)
        B, (me, n) = batch.label.shape[0], self.part
        share = -(-B // n)
        pick = self.xp.minimum(self.xp.arange(me * share, (me + 1) * share), B - 1)
        part = type(batch)(batch.dense[pick], batch.cat[:, pick], batch.label[pick],
                           batch.logit[pick])
        return (*self.to_framework(part), B)

    def step(self, data):
        chunk, k = data  # a ChunkStep (Feed takes every step from chunk_steps)
        self.flat, self.opt_state, loss = self._train_step(
            self.flat, self.opt_state, self.anchor, *chunk, k)
        self.steps_done += 1
        # with processes the loss (the same everywhere) is read from this process's copy
        return loss.addressable_shards[0].data if self.processes else loss

    def predict(self, data):
        if self.processes:  # every process's logits, gathered (a collective)
            from jax.experimental import multihost_utils

            dense, cat, _, B = data
            out = self._predict(self.flat, dense, cat)
            return np.asarray(multihost_utils.process_allgather(out, tiled=True))[:B]
        dense, cat, _ = data
        B = dense.shape[0]
        pad = -B % self.devices
        if pad:  # every device takes an equal slice: pad with copies of the first sample
            dense = jnp.concatenate([dense, jnp.repeat(dense[:1], pad, axis=0)])
            cat = jnp.concatenate([cat, jnp.repeat(cat[:, :1], pad, axis=1)], axis=1)
            dense, cat = (jax.device_put(a, s) for a, s in zip((dense, cat), self._batch))
        return self._predict(self.flat, dense, cat)[:B]

    def sync(self):
        jax.block_until_ready((self.flat, self.opt_state))
        self.collection.check()  # every rank's refused batches (bad index, too-long bag)

    def profile(self, batches):
        """Where this process's step time goes, host side first (the sharded step is one
        jitted call; its pieces are not timed apart), milliseconds per step: dispatching a
        step; the owners' collection forward and backward calls, the bulk of the
        collection's callbacks (Python launching the owners' kernels: on a GPU XLA runs the
        callbacks from the dispatching thread, so they are part of the dispatch; on the CPU
        they run on XLA's threads); the steps queued back to back; each step waited for.
        Half the batches run each way; they train (full steps)."""
        half = max(len(batches) // 2, 1)
        calls = {"forward": [], "backward": []}
        owned = [c for c in self.collection.shards if c is not None]
        try:
            for coll in owned:  # time this process's owners' calls (instance attributes)
                for name, spent in calls.items():
                    setattr(coll, name, _timed(getattr(coll, name), spent))
            host, t0 = [], time.perf_counter()
            for data in batches[:half]:
                h0 = time.perf_counter()
                self.step(data)
                host.append(time.perf_counter() - h0)
            jax.block_until_ready(self.flat)  # the step's last output
            queued = (time.perf_counter() - t0) / half
            waited = []
            for data in batches[half:]:
                h0 = time.perf_counter()
                self.step(data)
                jax.block_until_ready(self.flat)
                waited.append(time.perf_counter() - h0)
        finally:
            for coll in owned:
                for name in calls:
                    coll.__dict__.pop(name, None)
        self.sync()
        median = lambda v: 1e3 * float(np.median(v)) if len(v) else 0.0  # noqa: E731
        steps = len(batches)
        return {"host (dispatch a step, median)": median(host),
                "the owners' collection forward (host, mean)": 1e3 * sum(
                    calls["forward"]) / steps,
                "the owners' collection backward (host, mean)": 1e3 * sum(
                    calls["backward"]) / steps,
                "whole step, steps queued back to back (mean)": 1e3 * queued,
                "whole step, each waited for (median)": median(waited)}

    def cache_hit_rate(self):
        if not self.gpu:
            return None
        hits = lookups = 0
        for rank, coll in enumerate(self.collection.shards):
            if coll is not None:
                with self.collection.shard_scope(rank):
                    stats = coll.cache_stats()
                hits, lookups = hits + stats.get("hits", 0), lookups + stats.get("lookups", 0)
        return hits / lookups if lookups else None

    def close(self):
        from .torch_run import release_collection

        self.sync()
        for rank, coll in enumerate(self.collection.shards):
            if coll is not None:
                with self.collection.shard_scope(rank):
                    release_collection(coll)
        self.collection = self.flat = self.opt_state = self._chunk_views = None
        self._train_step = self._predict = None

    # checkpoints: JaxRun's save_state / load_state (every table whole, ``coll.*``), so a
    # checkpoint of N devices continues on any number of devices or on one
