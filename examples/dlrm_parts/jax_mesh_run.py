"""The DLRM in JAX on N devices of one host (``--devices N``): the per-table data-parallel
design, kept for the mesh until the sharding plan replaces it (one device runs
``jax_run.py``: every table in one embedding collection). It starts from the same initial
values as the collection run (``init.collection_rows``) and trains the same model.

Inside the step, host tables are read with ``host_lookup`` and trained with ``host_update``
(xferlib's fused Adagrad, on XLA's stream), TT tables go through ``tt_embedding_bag`` (a
``custom_vjp``), HBM tables are plain arrays, and the MLPs live in one flat buffer trained by
``flat_step(flat_adam)``. Adagrad on the HBM tables and TT cores is written in ``jax.numpy``
(XLA fuses it into one pass); a row with a zero gradient is left unchanged, as in the sparse
update, so every placement learns the same model as the torch run.

``devices > 1`` (``--devices N``): the step runs inside ``jax.shard_map`` over a 1-D mesh of N
devices, the global batch sharded, equal to one device on the global batch (docs/jax-mesh.md):
each device's loss is its samples' summed BCE over the GLOBAL batch size; the MLPs, HBM tables
and TT cores are replicated and their gradients summed over the mesh (JAX's own transpose of a
replicated value, and ``tt_embedding_bag``'s psum); the host tables are shared, their updates
applied by ``sharded_host_update`` (each device the rows it owns), without GPU caches.
Evaluation runs on the first device.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before jax is imported


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import xferlib  # noqa: E402
from xferlib.adapters.jax import dot_interaction, flat_adam, flat_step  # noqa: E402
from xferlib.adapters.jax import host_lookup, host_update  # noqa: E402
from xferlib.adapters.jax import ravel, sharded_host_update, tt_embedding_bag  # noqa: E402

from . import init as initial  # noqa: E402

EPS = 1e-10  # torch.optim.Adagrad's default, as the host tables and TT cores use


def _bce_terms(logit, label):
    return jnp.maximum(logit, 0) - logit * label + jnp.log1p(jnp.exp(-jnp.abs(logit)))


def _bce(logit, label):
    return jnp.mean(_bce_terms(logit, label))


def _adagrad(w, acc, g, lr):
    acc = acc + g * g
    return w - lr * g / (jnp.sqrt(acc) + EPS), acc


AXIS = "batch"


def mesh_devices(device: str, devices: int) -> list:
    """JAX's devices of the run's platform (``--device cpu`` names the CPU: on a GPU machine
    JAX's default is the GPU); ValueError, saying how to get more, when fewer than
    ``devices``."""
    found = jax.devices("cpu" if device == "cpu" else None)
    if len(found) < devices:
        raise ValueError(f"--devices {devices}: JAX sees {len(found)} {found[0].platform} "
                         f"device(s)" + (" (set XLA_FLAGS=--xla_force_host_platform_device_"
                                         f"count={devices} before jax is imported)"
                                         if device == "cpu" else ""))
    return found


class JaxMeshRun:
    def __init__(self, preset, plan, seed, device, xp=np, devices=1):
        self.xp, self.gpu = xp, device != "cpu"
        self.preset, self.plan = preset, plan
        self.kinds = [t.where for t in plan.tables]
        num_tables = len(plan.tables)
        dense = initial.dense_params(preset, num_tables, seed)
        # --device cpu on a GPU machine: JAX's default device is the GPU, so name the CPU.
        found = mesh_devices(device, devices)
        self.device, self.devices = found[0], int(devices)
        self.mesh = None
        if self.devices > 1:
            from jax.sharding import Mesh, NamedSharding, PartitionSpec

            self.mesh = Mesh(np.array(found[:self.devices]), (AXIS,))
            self._replicated = NamedSharding(self.mesh, PartitionSpec())
            self._batch_specs = (PartitionSpec(AXIS), PartitionSpec(None, AXIS),
                                 PartitionSpec(AXIS))
            self._batch = tuple(NamedSharding(self.mesh, s) for s in self._batch_specs)
        where = self._replicated if self.mesh is not None else self.device

        def to(a):  # NumPy initial values go to the device first (CuPy), then to JAX
            # JAX-owned (donatable), on the run's device (every device of a mesh)
            return jax.device_put(xferlib.to_jax(xp.asarray(a), copy=True), where)

        params = {name: [(to(dense[f"{name}.{i}.weight"]), to(dense[f"{name}.{i}.bias"]))
                         for i in range(len(sizes) - 1)]
                  for name, sizes in zip(("bottom", "top"), initial.mlp_sizes(preset, num_tables))}
        self.flat, self.unravel = ravel(params)
        self.tx = flat_adam(preset.lr_dense)
        # Every array committed to the device up front: an uncommitted one (the step count
        # from tx.init) would make the second call of the step compile again.
        self.opt_state = jax.device_put(self.tx.init(self.flat), where)
        lr = preset.lr_embedding
        self.hbm, self.hbm_acc, self.tt, self.tt_acc, self.host = [], [], [], [], []
        self.tt_shapes = []
        position = 0  # a table's position in the single-device run's collection (its init)
        for t in plan.tables:
            if t.where != "tt":
                position += 1
            if t.where == "hbm":
                w = to(initial.collection_rows(preset, seed, position - 1, t.rows, xp))
                self.hbm.append(w)
                self.hbm_acc.append(self._zeros(w.shape))
            elif t.where == "host":
                # A GPU cache lives on one device: none on a mesh (docs/jax-mesh.md).
                cache = t.cache_rows if self.gpu and self.mesh is None else 0
                table = xferlib.HostTable(t.rows, preset.dim, "float32", "adagrad", {"lr": lr},
                                          cache, init="zeros")
                initial.fill_host_table_like_collection(table, preset, seed, position - 1, xp)
                self.host.append(table)
            else:
                cores = tuple(to(c) for c in initial.tt_cores(t, seed))
                self.tt.append(cores)
                self.tt_acc.append(tuple(self._zeros(c.shape) for c in cores))
                self.tt_shapes.append((t.tt_p, t.tt_q, t.tt_ranks))
        self.steps_done = 0
        self._tokens = [jax.device_put(np.int32(0), where) for _ in self.host]
        self._build()

    def _zeros(self, shape):  # device_put compiles nothing (zeros_like would, per shape)
        return jax.device_put(np.zeros(shape, np.float32),
                              self._replicated if self.mesh is not None else self.device)

    # ------------------------------------------------------------------ the model
    def _forward(self, flat, hbm, tt, host_rows, dense, cat):
        p = self.unravel(flat)
        _, B, L = cat.shape
        x = dense
        for w, b in p["bottom"]:
            x = jax.nn.relu(x @ w.T + b)
        offsets = jnp.arange(0, B * L + 1, L, dtype=jnp.int32)
        vectors, it = [], {"hbm": iter(hbm), "tt": iter(tt), "host": iter(host_rows)}
        shapes = iter(self.tt_shapes)
        for f, kind in enumerate(self.kinds):
            idx = cat[f].reshape(-1)
            if kind == "hbm":
                e = jnp.take(next(it["hbm"]), idx, axis=0).reshape(B, L, -1).sum(1)
            elif kind == "host":
                e = next(it["host"]).reshape(B, L, -1).sum(1)
            else:
                pq, qq, rr = next(shapes)
                e = tt_embedding_bag(next(it["tt"]), idx, offsets, p_shapes=pq, q_shapes=qq,
                                     ranks=rr, mode="sum", include_last_offset=True)
            vectors.append(e)
        h = dot_interaction(x, jnp.stack(vectors, axis=1))
        top = p["top"]
        for i, (w, b) in enumerate(top):
            h = h @ w.T + b
            if i + 1 < len(top):
                h = jax.nn.relu(h)
        return h[:, 0]

    def _host_indices(self, cat):
        return [cat[f].reshape(-1) for f, k in enumerate(self.kinds) if k == "host"]

    def _build(self):
        lr, tx, host, mesh = self.preset.lr_embedding, self.tx, self.host, self.mesh

        def loss_fn(flat, hbm, tt, host_rows, dense, cat, label):
            logits = self._forward(flat, hbm, tt, host_rows, dense, cat)
            if mesh is None:
                return _bce(logits, label)
            # this shard's share of the global mean: the devices' gradients add up to it
            return jnp.sum(_bce_terms(logits, label)) / (label.shape[0] * self.devices)

        def step_body(flat, opt_state, hbm, hbm_acc, tt, tt_acc, dense, cat, label, after):
            idx = self._host_indices(cat)
            rows = [host_lookup(table, i, after=a) if mesh is not None else
                    host_lookup(table, i) for table, i, a in zip(host, idx, after)]
            loss, (g_flat, g_hbm, g_tt, g_rows) = jax.value_and_grad(
                loss_fn, argnums=(0, 1, 2, 3))(flat, hbm, tt, rows, dense, cat, label)
            if mesh is None:
                tokens = [host_update(table, i, g) for table, i, g in zip(host, idx, g_rows)]
            else:  # replicated parameters' gradients come summed over the mesh already
                tokens = [sharded_host_update(table, i, g, axis_name=AXIS)
                          for table, i, g in zip(host, idx, g_rows)]
                loss = jax.lax.psum(loss, AXIS)
            flat, opt_state = flat_step(tx, g_flat, opt_state, flat)
            new = [_adagrad(w, a, g, lr) for w, a, g in zip(hbm, hbm_acc, g_hbm)]
            hbm, hbm_acc = [w for w, _ in new], [a for _, a in new]
            new_tt = [[_adagrad(w, a, g, lr) for w, a, g in zip(*c)]
                      for c in zip(tt, tt_acc, g_tt)]
            tt = [tuple(w for w, _ in c) for c in new_tt]
            tt_acc = [tuple(a for _, a in c) for c in new_tt]
            return flat, opt_state, hbm, hbm_acc, tt, tt_acc, loss, tokens

        if mesh is None:
            train_step = jax.jit(lambda *a: step_body(*a, [None] * len(host)),
                                 donate_argnums=(0, 1, 2, 3, 4, 5))
        else:
            from jax.sharding import PartitionSpec

            rep = PartitionSpec()
            train_step = jax.jit(jax.shard_map(
                step_body, mesh=mesh, in_specs=(rep,) * 6 + self._batch_specs + (rep,),
                out_specs=rep), donate_argnums=(0, 1, 2, 3, 4, 5))

        @jax.jit
        def predict(flat, hbm, tt, dense, cat):
            rows = [host_lookup(table, i) for table, i in zip(host, self._host_indices(cat))]
            return self._forward(flat, hbm, tt, rows, dense, cat)

        self._train_step, self._predict = train_step, predict

    # ------------------------------------------------------------------ runner interface
    def to_framework(self, batch):
        # int32 rows: JAX runs without x64, and every preset's tables have < 2^31 rows
        to = xferlib.to_jax
        return to(batch.dense), to(batch.cat.astype(self.xp.int32)), to(batch.label)

    def step(self, data):
        dense, cat, label = data
        if self.mesh is not None:  # the global batch, sharded over the mesh
            if label.shape[0] % self.devices:
                raise ValueError(f"--batch-size {label.shape[0]} (the global batch) must be a "
                                 f"multiple of --devices {self.devices}")
            dense, cat, label = (jax.device_put(a, s)
                                 for a, s in zip((dense, cat, label), self._batch))
        (self.flat, self.opt_state, self.hbm, self.hbm_acc, self.tt, self.tt_acc, loss,
         self._tokens) = self._train_step(self.flat, self.opt_state, self.hbm, self.hbm_acc,
                                          self.tt, self.tt_acc, dense, cat, label,
                                          *(() if self.mesh is None else (self._tokens,)))
        self.steps_done += 1
        return loss

    def _first(self, tree):
        """A replicated value's copy on the first device (no transfer)."""
        if self.mesh is None:
            return tree
        return jax.tree_util.tree_map(
            lambda a: next(s.data for s in a.addressable_shards if s.device == self.device),
            tree)

    def predict(self, data):
        dense, cat, _ = data
        if self.mesh is not None:
            jax.block_until_ready(self._tokens)  # every device's last update is in the table
            dense, cat = (jax.device_put(a, self.device) for a in (dense, cat))
        return self._predict(*self._first((self.flat, self.hbm, self.tt)), dense, cat)

    def sync(self):
        # the host tables' kernels run on XLA's stream: the step's outputs and tokens cover them
        jax.block_until_ready((self.flat, self.hbm, self.tt, getattr(self, "_tokens", None)))

    def peak_gpu_bytes(self) -> int:
        if not self.gpu:
            return 0
        import cupy

        stats = self.device.memory_stats() or {}
        return int(stats.get("peak_bytes_in_use", 0)
                   + cupy.get_default_memory_pool().total_bytes())

    def cache_hit_rate(self):
        rates = [t.cache_stats()["hit_rate"] for t in self.host if t.cache_rows]
        return float(np.mean(rates)) if rates else None

    # ------------------------------------------------------------------ checkpoint
    def host_tables(self):
        host = iter(self.host)
        return {f: next(host) for f, k in enumerate(self.kinds) if k == "host"}

    def save_state(self, path):
        self.sync()
        arrays = {"flat": self.flat, "count": self.opt_state.count,
                  "steps_done": np.array(self.steps_done)}
        arrays.update({f"opt.{i}": b for i, b in enumerate(self.opt_state.buffers)})
        for i, (w, a) in enumerate(zip(self.hbm, self.hbm_acc)):
            arrays[f"hbm.{i}"], arrays[f"hbm_acc.{i}"] = w, a
        for i, (cores, accs) in enumerate(zip(self.tt, self.tt_acc)):
            for k, (c, a) in enumerate(zip(cores, accs)):
                arrays[f"tt.{i}.{k}"], arrays[f"tt_acc.{i}.{k}"] = c, a
        np.savez(path, **{k: np.asarray(v) for k, v in arrays.items()})

    def load_state(self, path):
        with np.load(path) as z:
            a = {k: z[k] for k in z.files}
        def to(a):
            return jax.device_put(a, self._replicated if self.mesh is not None else self.device)

        self.flat = to(a["flat"])
        self.opt_state = type(self.opt_state)(
            to(a["count"]), tuple(to(a[f"opt.{i}"]) for i in range(len(self.opt_state.buffers))))
        self.hbm = [to(a[f"hbm.{i}"]) for i in range(len(self.hbm))]
        self.hbm_acc = [to(a[f"hbm_acc.{i}"]) for i in range(len(self.hbm))]
        self.tt = [tuple(to(a[f"tt.{i}.{k}"]) for k in range(len(c)))
                   for i, c in enumerate(self.tt)]
        self.tt_acc = [tuple(to(a[f"tt_acc.{i}.{k}"]) for k in range(len(c)))
                       for i, c in enumerate(self.tt)]
        self.steps_done = int(a["steps_done"])
