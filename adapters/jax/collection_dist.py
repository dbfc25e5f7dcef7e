"""A collection's tables sharded over the devices of a JAX mesh: the sharding plan
(:func:`xferlib.collection.plan_sharding`) inside ``jax.shard_map``, lookups routed to their
owners and pooled rows brought back with ``jax.lax.all_to_all``.

Each device of a 1-D mesh holds the shards the plan gives its rank (an
:class:`~xferlib.collection.EmbeddingCollection` built from ``plan.local_configs(rank)``,
starting with the rows an unsharded collection of the same ``seed`` starts with). Inside
``shard_map`` every device passes its own batch in FBGEMM's layout; a step:

1. routes each lookup to the shard holding its row (the index made local to the shard),
   sorted stably by owner and shard so a shard's lookups keep their bag order;
2. sends every owner, by one ``all_to_all``, the bag lengths of its shards and the local
   indices (and weights). ``all_to_all`` needs static shapes, so each (source, destination)
   message has a fixed capacity: the source's index capacity (the length of its padded
   ``indices``: every lookup of a batch could go to one owner, so nothing can overflow), and
   the lookups past the true count are masked off;
3. each owner lays out what it received as one batch (table by table, each table's bags
   device after device: the global batch's order) and runs its collection's pooled lookup;
4. the pooled rows return by a second ``all_to_all``; a row-wise table's partial sums are
   added.

Differentiating with respect to ``anchor`` runs the reverse: the pooled gradient's columns go
back to their owners (JAX's transpose of the ``all_to_all``), and each owner's collection runs
its fused backward + update on the rows it holds. Each row's gradients are summed in the order
one device sums them on the concatenated global batch.

On the CPU backend (forced host devices, ``--xla_force_host_platform_device_count``) every
rank's collection lives in host memory; on GPUs (``device="cuda"``) rank ``r``'s collection
lives on the ``r``-th device of the mesh and its kernels run on XLA's stream there. Either way
on the CPU the owner's callback reads its true lookup count from the received offsets, and on
a GPU it reads nothing back: the owner's collection takes the received buffers whole as a
padded batch (``EmbeddingCollection.forward(padded=True)``), and a bad lookup is reported by
:meth:`ShardedCollection.check` only (raised inside one device's callback, it would leave the
other devices waiting in the step's next collective), nothing written on any device.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from xferlib.adapters.jax.collection import collection_anchor
from xferlib.adapters.jax.collection_dist_vjp import OFFSETS_RULE, on_device, sharded_function
from xferlib.adapters.jax.errors import as_index_array, typed_errors
from xferlib.collection import EmbeddingCollection
from xferlib.collection.config import TableConfig
from xferlib.collection.sharding import (ShardingPlan, fill_shard_weights, plan_sharding,
                                         refuse_tt)

__all__ = ["ShardedCollection"]

# jnp.searchsorted's default ("scan") is a while loop: on a GPU, XLA launches its body's
# kernels and copies from the host once per halving (three searches a step). Unrolled, the
# same binary search is straight-line code that XLA fuses into a few kernels.
SEARCH = "scan_unrolled"


class ShardedCollection:
    """A collection's tables placed by a sharding plan on the ``plan.world_size`` devices of
    a 1-D mesh; call it inside ``jax.shard_map`` over that mesh's axis.

    Args:
      tables: :class:`~xferlib.collection.TableConfig` per table (or ``(rows, dim)``).
      optimizer, optimizer_kwargs, pooling, dtype, seed: as
        :class:`~xferlib.collection.EmbeddingCollection` takes them.
      plan: a :class:`~xferlib.collection.ShardingPlan` of these tables; default
        ``plan_sharding(tables, world_size, optimizer=...)``.
      world_size: the mesh axis's size (needed without ``plan``).
      device: ``"cpu"`` (JAX's CPU backend) or ``"cuda"`` (JAX's GPUs).
      devices: the mesh's devices in axis order (``mesh.devices.ravel()``): rank ``r``'s
        shards live on ``devices[r]``; default ``jax.devices()`` of that platform.
      max_bag_size: a bound on every bag's length: each device's message to an owner then
        has room for ``B_local x max_bag_size`` lookups per table an owner holds (at most),
        instead of all of the device's lookups, and the owners' batches carry that much
        less padding. A batch with a longer bag is refused: nothing travels, no table
        changes, and a ValueError is raised (in the step on the CPU backend, by
        :meth:`check` on GPUs).
      record: (GPUs) let XLA record the owners' callbacks into its command buffers and
        replay them, as :func:`~xferlib.adapters.jax.embedding_bag_collection`'s
        ``record`` does (the same conditions: one call per step, each step's batch
        sliced out of a chunk inside the jitted step). The all_to_alls and psum between
        them are recorded too when XLA puts collectives in its command buffers
        (``XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,``
        ``CUDNN,COLLECTIVES``): a step then replays whole, with no callback into Python.
        Off by default.

    ``shards[rank]`` is rank ``rank``'s collection of its shards (None for a rank without
    any); :meth:`table_weights` and :meth:`table_state` put a table back together.

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> from xferlib.collection import TableConfig
    >>> from xferlib.adapters.jax import ShardedCollection, collection_anchor
    >>> ebc = ShardedCollection([TableConfig(10, 4, init="zeros")], "sgd", {"lr": 1.0},
    ...                         world_size=1)
    >>> mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("x",))
    >>> def loss(anchor, idx, off):
    ...     return ebc(idx, off, anchor=anchor, axis_name="x").sum()
    >>> step = jax.jit(jax.shard_map(jax.grad(loss), mesh=mesh,
    ...                              in_specs=(P(), P("x"), P("x")), out_specs=P()))
    >>> _ = step(collection_anchor(), jnp.array([1, 1, 3]), jnp.array([0, 2, 3]))
    >>> ebc.table_weights(0)[[1, 3], 0].tolist()
    [-2.0, -1.0]
    """

    def __init__(self, tables, optimizer: str = "sgd", optimizer_kwargs=None, *,
                 plan: ShardingPlan | None = None, world_size: int | None = None,
                 pooling: str = "sum", dtype="float32", seed: int = 0,
                 device: str = "cpu", devices=None, max_bag_size: int | None = None,
                 record: bool = False):
        if max_bag_size is not None and (isinstance(max_bag_size, bool) or not isinstance(
                max_bag_size, int) or max_bag_size < 1):
            raise ValueError(f"max_bag_size must be a positive int, got {max_bag_size!r}")
        self._max_bag_size = max_bag_size
        self.record = bool(record)
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        configs = [t if isinstance(t, TableConfig) else TableConfig(*t) for t in tables]
        configs = [c.named(k) for k, c in enumerate(configs)]
        refuse_tt(configs)
        if plan is None:
            if world_size is None:
                raise ValueError("pass plan= or world_size=")
            plan = plan_sharding(configs, world_size, optimizer=optimizer,
                                 optimizer_kwargs=optimizer_kwargs, dtype=dtype)
        elif world_size is not None and world_size != plan.world_size:
            raise ValueError(f"world_size={world_size} but the plan is for "
                             f"{plan.world_size} ranks")
        if [(c.name, c.num_rows, c.dim) for c in plan.tables] != \
                [(c.name, c.num_rows, c.dim) for c in configs]:
            raise ValueError("the plan was made for other tables (names, rows, widths)")
        if pooling not in ("sum", "mean"):
            raise ValueError(f"pooling must be 'sum' or 'mean', got {pooling!r}")
        if devices is None:
            devices = jax.devices("gpu" if device == "cuda" else "cpu")
        devices = list(devices)
        if len(devices) < plan.world_size:
            raise ValueError(f"the plan is for {plan.world_size} ranks but only "
                             f"{len(devices)} {device} device(s) were given")
        self.plan, self.tables, self.world_size = plan, tuple(plan.tables), plan.world_size
        self.device = device
        # The ranks whose device is this process's: with several processes (one host or
        # many, ``jax.distributed``), each builds and runs only its own ranks' shards.
        process = jax.process_index()
        self._process_of = [getattr(d, "process_index", 0) for d in devices[:plan.world_size]]
        self.local_ranks = tuple(r for r, p in enumerate(self._process_of) if p == process)
        if not self.local_ranks:
            raise ValueError(f"none of the mesh's devices is this process's (process "
                             f"{process}): build the collection where its devices are, "
                             f"e.g. devices=jax.local_devices() for one process's mesh")
        # several processes' devices in the mesh: the same answer in every process
        self.multiprocess = len(set(self._process_of)) > 1
        # Rank r's collection on the CUDA device behind the mesh's r-th device (None for
        # another process's device).
        self._ordinals = [int(d.id if getattr(d, "local_hardware_id", None) is None
                               else d.local_hardware_id)
                          if device == "cuda" and r in self.local_ranks else None
                          for r, d in enumerate(devices[:plan.world_size])]
        self.optimizer, self.pooling, self.dtype = optimizer, pooling, np.dtype(dtype)
        self.optimizer_kwargs = dict(optimizer_kwargs or {})
        self._probes = {}  # width -> a one-row collection (_probe)
        self.dims = tuple(c.dim for c in self.tables)
        self.dim_offsets = tuple(int(x) for x in np.concatenate([[0], np.cumsum(self.dims)]))
        self.total_dim = self.dim_offsets[-1]
        # Each rank's collection, zero-built then filled with the unsharded start. Mean
        # pooling travels as weights (1 / bag length), so the shards pool by sums.
        self.shards = []
        for r in range(self.world_size):
            mine = plan.shards_of(r)
            if not mine or r not in self.local_ranks:
                self.shards.append(None)
                continue
            with self.shard_scope(r):
                local = EmbeddingCollection(
                    [dataclasses.replace(c, init="zeros") for c in plan.local_configs(r)],
                    optimizer, optimizer_kwargs, pooling="sum", dtype=dtype, device=device,
                    seed=0)
                for k, s in enumerate(mine):
                    fill_shard_weights(local, k, self.tables[s.table_index].init, seed,
                                       s.table_index, s.row_start)
            # A refused batch raises from check() only: raised inside one device's callback,
            # it would leave the other devices waiting in the step's next all_to_all.
            local.raise_in_calls = False
            self.shards.append(local)
        self._routes()
        # GPUs: per rank, the batches refused for a too-long bag and for malformed offsets,
        # counted on the device (read by check())
        self._refused = [None] * self.world_size
        if device == "cuda":
            import cupy

            for r in self.local_ranks:
                with self.shard_scope(r):
                    self._refused[r] = cupy.zeros(2, dtype=np.int32)
                    if self.shards[r] is not None:  # not inside the step's callbacks
                        self.shards[r].prepare_gpu()
        self._function = sharded_function(self)

    # ------------------------------------------------------------------ static routes

    def _routes(self) -> None:
        plan, world = self.plan, self.world_size
        rows = [c.num_rows for c in self.tables]
        base = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64)
        slots = {s: k for r in range(world) for k, s in enumerate(plan.shards_of(r))}
        self.max_slots = max(1, max(len(plan.shards_of(r)) for r in range(world)))
        # the most tables any owner holds a shard of: max_bag_size bounds each message by it
        self._tables_max = max(plan.tables_of(r) for r in range(world))
        self._rows = np.asarray(rows, np.int64)
        self._base = base
        # Shards in plan order (by table, then row start): their first global row.
        self._shard_start = np.asarray([base[s.table_index] + s.row_start
                                        for s in plan.shards], np.int64)
        self._shard_owner = np.asarray([s.rank for s in plan.shards], np.int32)
        self._shard_slot = np.asarray([slots[s] for s in plan.shards], np.int32)
        self._shard_first = np.asarray([s.row_start for s in plan.shards], np.int64)
        self._last_shard = np.asarray([max(i for i, s in enumerate(plan.shards)
                                           if s.table_index == t)
                                       for t in range(len(self.tables))], np.int32)
        # The owners' output columns: owner r's column c holds global column target[r, c]
        # (total_dim where it holds nothing: dropped).
        self.max_dim = max(1, max(sum(self.dims[s.table_index] for s in plan.shards_of(r))
                                  for r in range(world)))
        target = np.full((world, self.max_dim), self.total_dim, np.int32)
        for r in range(world):
            cols = [c for s in plan.shards_of(r)
                    for c in range(self.dim_offsets[s.table_index],
                                   self.dim_offsets[s.table_index + 1])]
            target[r, :len(cols)] = cols
        self._target = target
        # Each column from exactly one owner (no table split by rows): the output is the
        # owners' column blocks in table order, as static slices (their transposes are
        # slices too; a gather's would be a scatter over every pooled gradient value).
        flat_target = target.reshape(-1)
        held = flat_target[flat_target < self.total_dim]
        self._column_blocks = None
        if np.array_equal(np.sort(held), np.arange(self.total_dim)):
            source = np.empty(self.total_dim, np.int64)
            source[held] = np.nonzero(flat_target < self.total_dim)[0]
            breaks = np.nonzero(np.diff(source) != 1)[0] + 1
            starts = np.concatenate([[0], breaks])
            stops = np.concatenate([breaks, [self.total_dim]])
            self._column_blocks = tuple((int(source[a]), int(source[a] + z - a))
                                        for a, z in zip(starts, stops))

    # ------------------------------------------------------------------ the step

    def __call__(self, indices, offsets, per_sample_weights=None, *, axis_name,
                 anchor=None) -> jax.Array:
        """This device's pooled rows, ``(B_local, total_dim)``, every table at the columns
        the unsharded collection gives it. Call inside ``jax.shard_map`` over ``axis_name``
        (every device together: it is a collective).

        ``indices``: this device's lookups, table-major as FBGEMM lays them out, padded to a
        fixed length ``L`` (entries at ``offsets[-1]`` and after are ignored); ``L`` is the
        capacity of every message this device sends. ``offsets``: ``T * B_local + 1``.
        ``per_sample_weights``: optional, one per index (no gradient). ``anchor``:
        :func:`~xferlib.adapters.jax.collection_anchor`'s array, among the parameters you
        differentiate: its gradient runs every owner's fused backward + update. Let the
        jitted step return some value that is not zero-size (its loss): on a mesh of
        several devices XLA compiles away a ``shard_map`` whose outputs are all zero-size,
        the owners' callbacks with it, so a step returning the anchor's gradient alone
        trains nothing (seen with JAX 0.10-0.11 on CPUs and GPUs).
        """
        indices = as_index_array("indices", indices)
        offsets = as_index_array("offsets", offsets, ValueError)
        for name, a in (("indices", indices), ("offsets", offsets)):
            if a.dtype not in (jnp.int32, jnp.int64) or a.ndim != 1:
                raise TypeError(f"{name} must be a 1-D int32 or int64 array, got "
                                f"{a.dtype} of shape {a.shape}")
        T = len(self.tables)
        if offsets.shape[0] < 1 or (offsets.shape[0] - 1) % T:
            raise ValueError(f"offsets must have T * B + 1 entries for T = {T} tables, got "
                             f"{offsets.shape[0]}")
        n = int(jax.lax.axis_size(axis_name))
        if n != self.world_size:
            raise ValueError(f"mesh axis {axis_name!r} has {n} devices but the plan is for "
                             f"{self.world_size}")
        if per_sample_weights is not None:
            # no gradient for them: differentiating them alone trains nothing
            per_sample_weights = jax.lax.stop_gradient(jnp.asarray(per_sample_weights))
            if per_sample_weights.shape != indices.shape:
                raise ValueError(f"per_sample_weights must have shape {indices.shape}, got "
                                 f"{per_sample_weights.shape}")
        if anchor is None:
            anchor = collection_anchor()
        with typed_errors():
            return self._step(indices.astype(jnp.int32), offsets.astype(jnp.int32),
                              per_sample_weights, axis_name, anchor)

    def _step(self, indices, offsets, psw, axis_name, anchor):
        N, T, S = self.world_size, len(self.tables), self.max_slots
        L = indices.shape[0]
        b = (offsets.shape[0] - 1) // T
        # Room per owner in a message: all L lookups, or what max_bag_size bounds.
        R = L if self.max_bag_size is None else min(L, b * self.max_bag_size *
                                                     self._tables_max)
        me = jax.lax.axis_index(axis_name)
        # 1. Route: each lookup's bag, table, shard, owner, slot and local index.
        pos = jnp.arange(L, dtype=jnp.int32)
        valid = pos < offsets[-1]
        bag = jnp.searchsorted(offsets, pos, side="right", method=SEARCH).astype(jnp.int32)
        bag = jnp.clip(bag - 1, 0, max(T * b - 1, 0))
        t = bag // max(b, 1)
        j = bag % max(b, 1)
        rows = jnp.asarray(self._rows)[t]
        bad = valid & ((indices < 0) | (indices >= rows))
        grow = jnp.asarray(self._base)[t] + jnp.clip(indices, 0, rows - 1)
        shard = jnp.searchsorted(jnp.asarray(self._shard_start), grow,
                                 side="right", method=SEARCH).astype(jnp.int32) - 1
        # An index out of range goes to its table's last shard, out of the shard's range:
        # the owner's collection refuses it (IndexError). Every device learns of it (the
        # count of bad lookups, summed over the mesh) and raises in the same callback, so
        # no device is left waiting in a collective and no table changes.
        last = jnp.asarray(self._last_shard)[t]
        shard = jnp.where(bad, last, shard)
        owner = jnp.asarray(self._shard_owner)[shard]
        slot = jnp.asarray(self._shard_slot)[shard]
        local = jnp.where(bad, indices - jnp.asarray(self._shard_first)[last].astype(jnp.int32),
                          grow - jnp.asarray(self._shard_start)[shard]).astype(jnp.int32)
        # Malformed offsets (not starting at 0, decreasing, or past the padded length) and
        # bags longer than max_bag_size (counted as routed, whatever the offsets say).
        bad_offsets = (offsets[0] != 0) | (offsets[-1] > L) | jnp.any(offsets[1:] < offsets[:-1])
        too_long = jnp.int32(0)
        if self.max_bag_size is not None and T * b:
            routed = jnp.zeros((T * b,), jnp.int32).at[bag].add(valid.astype(jnp.int32))
            too_long = jnp.sum((routed > self.max_bag_size).astype(jnp.int32))
        # Every device learns of every device's errors in one collective, so all raise alike
        # in the same callback and none is left waiting in a later one.
        n_bad, n_off, n_long = jax.lax.psum(jnp.stack(
            [jnp.sum(bad.astype(jnp.int32)), bad_offsets.astype(jnp.int32), too_long]),
            axis_name)
        # A bad lookup anywhere: only the bad lookups travel, so no owner gets a batch it
        # would train on (each owner that gets one refuses its batch: nothing is written).
        # Malformed offsets or a bag too long anywhere: nothing travels.
        valid = jnp.where(n_bad > 0, bad, valid) & (n_off == 0) & (n_long == 0)
        # Weights travel only when some lookup is weighted (per-sample weights, or mean
        # pooling's 1 / bag length); else the owners pool by plain sums.
        weighted = psw is not None or self.pooling == "mean"
        if weighted:
            weights = jnp.ones((L,), self.dtype) if psw is None else psw.astype(self.dtype)
            if self.pooling == "mean":
                lengths = jnp.diff(offsets)
                weights = weights * (1 / jnp.maximum(lengths, 1).astype(self.dtype))[bag]
        # Sort stably by (owner, slot): each owner's lookups slot by slot, bags in order.
        key = jnp.where(valid, owner * S + slot, N * S)
        order = jnp.argsort(key, stable=True)
        sorted_owner = jnp.where(valid, owner, N)[order]
        # Each owner's first sorted position (sorted_owner ascends: no scatter needed).
        first = jnp.searchsorted(sorted_owner, jnp.arange(N + 1, dtype=jnp.int32),
                                 side="left", method=SEARCH).astype(jnp.int32)
        at = jnp.arange(L, dtype=jnp.int32) - first[sorted_owner]
        # (owner, at) pairs are distinct and ascending: XLA scatters them without atomics.
        place = dict(mode="drop", unique_indices=True, indices_are_sorted=True)
        send_idx = jnp.zeros((N, R), jnp.int32).at[sorted_owner, at].set(local[order], **place)
        # Lookups per (owner, slot, bag of this device).
        seg = jnp.where(valid, (owner * S + slot) * b + j, N * S * b)
        send_len = jnp.zeros((N * S * b + 1,), jnp.int32).at[seg].add(1)[:-1].reshape(
            N, S, b)
        # 2. To the owners, bag lengths and indices in one message: recv_*[src] is what
        # device src sent here.
        recv = jax.lax.all_to_all(jnp.concatenate([send_len.reshape(N, S * b), send_idx],
                                                  axis=1), axis_name, 0, 0, tiled=True)
        recv_len = recv[:, :S * b].reshape(N, S, b)
        recv_idx = recv[:, S * b:]
        if weighted:
            send_w = jnp.zeros((N, R), self.dtype).at[sorted_owner, at].set(
                weights[order], **place)
            recv_w = jax.lax.all_to_all(send_w, axis_name, 0, 0, tiled=True)
        # 3. One batch: slot by slot, each slot's bags source after source.
        per = recv_len.sum(axis=2)                                 # (src, slot)
        src_start = jnp.cumsum(per, axis=1) - per                  # in recv_idx[src]
        seg_len = per.T.reshape(-1)                                # (slot, src) order
        dst_start = jnp.cumsum(seg_len) - seg_len
        total = seg_len.sum()
        p = jnp.arange(N * R, dtype=jnp.int32)
        seg_of = jnp.searchsorted(dst_start, p, side="right", method=SEARCH).astype(jnp.int32)
        seg_of = jnp.clip(seg_of - 1, 0, S * N - 1)
        # Equal starts (empty segments) resolve to the last of them, whose start holds.
        src_pos = src_start.T.reshape(-1)[seg_of] + p - dst_start[seg_of]
        src_of = seg_of % N
        take = jnp.where(p < total, src_of * R + src_pos, 0)
        owner_idx = jnp.where(p < total, recv_idx.reshape(-1)[take], 0)
        # unweighted: an empty buffer, and the owners pool without weights
        owner_w = (jnp.where(p < total, recv_w.reshape(-1)[take], 0) if weighted else
                   jnp.zeros((0,), self.dtype))
        lens = recv_len.transpose(1, 0, 2).reshape(-1)            # (slot, src, bag)
        owner_off = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lens)])
        status = jnp.stack([me.astype(jnp.int32), n_bad, n_long.astype(jnp.int32), n_off])
        pooled = self._function(anchor, status, owner_idx, owner_off, owner_w,
                                N * b)                              # (N * b, max_dim)
        # 4. Back to the requesters: back[r] holds owner r's columns of this device's bags.
        back = jax.lax.all_to_all(pooled.reshape(N, b, self.max_dim), axis_name, 0, 0,
                                  tiled=True)
        flat = back.transpose(1, 0, 2).reshape(b, N * self.max_dim)
        if self._column_blocks is not None:  # each column from one owner
            return jnp.concatenate([flat[:, a:z] for a, z in self._column_blocks], axis=1)
        cols = jnp.asarray(self._target).reshape(-1)  # a row-wise table's partial sums add
        return jnp.zeros((b, self.total_dim + 1), self.dtype).at[:, cols].add(
            flat)[:, :self.total_dim]

    # ------------------------------------------------------------------ reading back

    def table_weights(self, table) -> np.ndarray:
        """Table ``table``'s (index or name) rows, gathered from its shards (with several
        processes a collective: every process calls it, as :meth:`table_state`,
        :meth:`state_dict` and :meth:`save`)."""
        return self._gather(table, lambda coll, k: coll.weights(k))

    def table_state(self, table, name: str) -> np.ndarray:
        """Table ``table``'s optimizer state ``name``, gathered from its shards."""
        return self._gather(table, lambda coll, k: coll.state(k, name))

    def state_names(self):
        coll = next((c for c in self.shards if c is not None), None)
        return (coll or self._probe(0)).state_names()

    def _probe(self, table) -> EmbeddingCollection:
        """A one-row collection of table ``table``'s width and the optimizer (on the CPU):
        the shapes and types of a row's weight and state, for a process holding none. One
        per width, kept (a state dict reads every table's every state through it)."""
        dim = self.dims[table]
        if dim not in self._probes:
            self._probes[dim] = EmbeddingCollection(
                [TableConfig(1, dim)], self.optimizer, self.optimizer_kwargs,
                dtype=self.dtype.name, device="cpu")
        return self._probes[dim]

    @property
    def max_bag_size(self):
        """The bound on every bag's length the messages are sized by (None: none)."""
        return self._max_bag_size

    def check(self) -> None:
        """Raise for the first bad batch any rank's collection refused on a GPU (reported
        from the GPU without a wait; on the CPU backend a bad batch raises in the step)."""
        too_long, bad_offsets = self._take_refused()
        if bad_offsets:
            raise ValueError(f"{bad_offsets} batch(es) with malformed offsets since the last "
                             f"check ({OFFSETS_RULE}; refused: no table changed)")
        if too_long:
            raise ValueError(f"{too_long} batch(es) with a bag longer than max_bag_size="
                             f"{self.max_bag_size} since the last check (refused: no table "
                             f"changed)")
        error = None
        try:
            for rank, coll in enumerate(self.shards):
                if coll is not None:
                    with self.shard_scope(rank):
                        coll.check()
        except Exception as err:  # noqa: BLE001  (raised below, on every process alike)
            if not self.multiprocess:
                raise
            error = err
        if self.multiprocess:  # every process raises, none goes on to a collective alone
            failed = np.asarray(multihost_utils.process_allgather(
                np.array([error is not None], np.int32)))
            if error is not None:
                raise error
            if failed.any():
                raise RuntimeError("another process's shards refused a batch (it raised the "
                                   "error); no table changed")

    def _take_refused(self) -> tuple:
        """GPUs: the batches refused since the last call, ``(too-long bag, malformed
        offsets)``, cleared. Every rank counted each one: the largest counts; each rank's
        read and cleared."""
        counts = [(0, 0)]
        for rank, flag in enumerate(self._refused):
            if flag is not None:
                import cupy

                with self.shard_scope(rank):
                    cupy.cuda.Device().synchronize()  # counted on XLA's stream
                    counts.append(tuple(int(v) for v in flag.get()))
                    flag.fill(0)
                    cupy.cuda.Device().synchronize()
        return tuple(max(c) for c in zip(*counts))

    def shard_scope(self, rank: int):
        """A ``with`` context making rank ``rank``'s GPU CuPy's current device (a no-op on
        the CPU backend): where to read or release ``shards[rank]``."""
        return on_device(self._ordinals[rank])

    def state_dict(self) -> dict:
        """Every table whole, as :meth:`EmbeddingCollection.state_dict` gives it
        (``"<table>.weight"``, ``"<table>.<state>"``, NumPy): loads into a collection of the
        same tables in one process, or into a :class:`ShardedCollection` of any plan."""
        out = {}
        for t, config in enumerate(self.tables):
            out[f"{config.name}.weight"] = self.table_weights(t)
            for name in self.state_names():
                out[f"{config.name}.{name}"] = self.table_state(t, name)
        return out

    def load_state_dict(self, state: dict) -> None:
        """Load a whole-table state dict (:meth:`state_dict`'s form, or an unsharded
        collection's): each rank's shards take their rows. KeyError / ValueError before any
        shard changes when a table or state is missing or has another shape."""
        local = []
        for r, coll in enumerate(self.shards):
            if coll is None:
                local.append(None)
                continue
            part = {}
            for s in self.plan.shards_of(r):
                for name in ("weight", *self.state_names()):
                    key = f"{s.table}.{name}"
                    if key not in state:
                        raise KeyError(f"state dict has no {key!r}")
                    whole = np.asarray(state[key])
                    if whole.ndim < 1:  # a scalar (or None): no rows to cut
                        raise ValueError(f"{key} must be an array of rows, got shape "
                                         f"{whole.shape}")
                    if whole.shape[0] != self.tables[s.table_index].num_rows:
                        raise ValueError(f"{key} has {whole.shape[0]} rows; table "
                                         f"{s.table!r} has "
                                         f"{self.tables[s.table_index].num_rows}")
                    part[f"{s.local_name}.{name}"] = whole[s.row_start:s.row_stop]
            local.append(part)
        for coll, part in zip(self.shards, local):  # every rank's part, before any loads
            if coll is not None:
                coll.check_state_dict(part)
        for r, (coll, part) in enumerate(zip(self.shards, local)):
            if coll is not None:
                with self.shard_scope(r):
                    coll.load_state_dict(part)

    def save(self, directory, tag: str = "") -> None:
        """Write a checkpoint into ``directory``: one crash-safe file per shard, then the
        manifest naming them (last). The same files as the torch
        ``save_sharded`` writes: either framework's sharded or unsharded collection loads
        them (``load``, ``xferlib.adapters.torch.load_sharded``), on any plan."""
        import os

        from xferlib.collection.sharding import save_shard_files, shard_arrays, write_manifest

        os.makedirs(directory, exist_ok=True)
        for r, coll in enumerate(self.shards):
            if coll is None:
                continue
            with self.shard_scope(r):
                arrays = shard_arrays(coll.state_dict(), self.plan.shards_of(r),
                                      ("weight", *coll.state_names()))
            save_shard_files(directory, self.plan, r, arrays, tag)
        if self.multiprocess:  # every process's shard files first, then one manifest
            multihost_utils.sync_global_devices(f"xferlib save {directory} shards")
        if not self.multiprocess or jax.process_index() == min(self._process_of):
            write_manifest(directory, self.plan, dict(optimizer=self.optimizer,
                                                      pooling=self.pooling,
                                                      dtype=self.dtype.name), tag)
        if self.multiprocess:  # the manifest written before any process goes on
            multihost_utils.sync_global_devices(f"xferlib save {directory} manifest")

    def load(self, directory) -> None:
        """Load the checkpoint in ``directory`` (saved on any plan, by either framework):
        each shard reads its rows from whichever saved shards hold them. ValueError when
        the tables (names, rows, widths) or the optimizer differ."""
        from xferlib.collection.sharding import read_checkpoint, read_rows

        manifest = read_checkpoint(directory, self.tables, self.optimizer)
        state = {}
        for t, config in enumerate(self.tables):
            rows = read_rows(directory, manifest, config.name, 0, config.num_rows)
            state.update({f"{config.name}.{k}": v for k, v in rows.items()})
        self.load_state_dict(state)

    def _gather(self, table, read) -> np.ndarray:
        """A table's rows from its shards; with several processes a collective (every
        process calls it): each shard's rows are broadcast from its owner's process, one
        shard at a time (memory: the table once, plus one shard in flight)."""
        shards = self.plan.table_shards(table)
        parts = {}
        for s in shards:
            if s.rank in self.local_ranks:
                k = self.plan.shards_of(s.rank).index(s)
                with self.shard_scope(s.rank):
                    parts[s] = np.array(read(self.shards[s.rank], k))
        if not self.multiprocess:
            return np.concatenate([parts[s] for s in shards])
        t = shards[0].table_index
        row = np.asarray(read(self._probe(t), 0))  # one row: the shape and type of each
        whole = np.zeros((self.tables[t].num_rows, *row.shape[1:]), row.dtype)
        for s in shards:  # each shard from its owner alone: one shard's bytes in flight,
            # not a whole table from every process
            if s.row_stop == s.row_start:
                continue
            rows = parts.get(s)
            if rows is None:  # another process's shard: zeros of its shape go in the sum
                rows = whole[s.row_start:s.row_stop]
            # as bytes: JAX without x64 would narrow float64 tables and int64 state
            raw = np.ascontiguousarray(rows).reshape(len(rows), -1).view(np.uint8)
            got = np.asarray(multihost_utils.broadcast_one_to_all(raw, is_source=s in parts))
            whole[s.row_start:s.row_stop] = got.view(whole.dtype).reshape(
                (-1, *whole.shape[1:]))
        return whole
