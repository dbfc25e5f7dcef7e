"""The DLRM in JAX: one ``jax.jit`` training step with donated buffers.

Every table of the plan (HBM, or host RAM with a GPU cache of hot rows) is one
``xferlib.collection.EmbeddingCollection``, read inside the step by
``embedding_bag_collection`` (one pooled lookup of all tables) and trained when the step takes
gradients with respect to ``collection_anchor()`` (one fused backward + Adagrad update, on
XLA's stream). The MLPs live in one flat buffer trained by ``flat_step(flat_adam)``. TT
tables (``--placement tt``) go through ``tt_embedding_bag`` with Adagrad in ``jax.numpy``
(the collection's ``tt`` placement runs every lookup of a GPU batch through each tt
table's kernels). The same initial values as the torch run.

``--devices N`` runs ``jax_mesh_run.py`` (the per-table data-parallel design) instead.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before jax is imported


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import xferlib  # noqa: E402
from xferlib.adapters.jax import (collection_anchor, dot_interaction,  # noqa: E402
                                  embedding_bag_collection, flat_adam, flat_step, ravel,
                                  recording_scratch_bytes, tt_embedding_bag)
from xferlib.collection import EmbeddingCollection, TableConfig  # noqa: E402

from . import init as initial  # noqa: E402

EPS = 1e-10  # torch.optim.Adagrad's default, as the collection's Adagrad uses


def _bce(logit, label):
    return jnp.mean(jnp.maximum(logit, 0) - logit * label + jnp.log1p(jnp.exp(-jnp.abs(logit))))


def _adagrad(w, acc, g, lr):
    acc = acc + g * g
    return w - lr * g / (jnp.sqrt(acc) + EPS), acc


class ChunkStep(tuple):
    """Step ``k`` of a chunk: ``(chunk arrays, k)``, ``k`` a device scalar. The jitted step
    slices its batch out of the chunk itself, so the batch the collection's callbacks read
    lies in the step's own scratch, at the same address every step: XLA then replays the
    callbacks it recorded into its command buffers instead of recording them again
    (recordings are keyed by the addresses of the buffers they touch)."""

    def batch(self):
        """The step's ``(dense, cat, label)`` as arrays of their own (eager slices)."""
        arrays, k = self
        return tuple(a[k] for a in arrays)


class JaxRun:
    def __init__(self, preset, plan, seed, device, xp=np, optimizer="adagrad"):
        self.xp, self.gpu = xp, device != "cpu"
        self.preset, self.plan, self.dim = preset, plan, preset.dim
        # --device cpu on a GPU machine: JAX's default device is the GPU, so name the CPU.
        self.device = jax.devices("cpu" if device == "cpu" else None)[0]
        self.where = self.device  # where the run's values live (load_state puts them there)
        to = self._dense_state(seed)
        self.coll_tables = [t.index for t in plan.tables if t.where != "tt"]
        self.tt_tables = [t.index for t in plan.tables if t.where == "tt"]
        self.collection = EmbeddingCollection(
            [TableConfig(t.rows, preset.dim, name=f"t{t.index}", placement=t.where,
                         cache_rows=t.cache_rows if self.gpu else 0,
                         init=initial.table_init_spec(preset))
             for t in plan.tables if t.where != "tt"],
            optimizer, {"lr": preset.lr_embedding}, device="cuda" if self.gpu else "cpu",
            seed=seed)
        self.anchor = collection_anchor()
        self.tt, self.tt_acc, self.tt_shapes = [], [], []
        for t in plan.tables:
            if t.where == "tt":
                cores = tuple(to(c) for c in initial.tt_cores(t, seed))
                self.tt.append(cores)
                self.tt_acc.append(tuple(to(np.zeros(c.shape, np.float32)) for c in cores))
                self.tt_shapes.append((t.tt_p, t.tt_q, t.tt_ranks))
        self.steps_done = 0
        self._step_numbers = []
        self.graph_note = "one jax.jit step, buffers donated"
        self._build()

    def _dense_state(self, seed):
        """The MLPs in one flat buffer and its Adam state, at ``self.where``; returns the
        function that puts an initial value there."""
        preset, num_tables = self.preset, len(self.plan.tables)

        def to(a):  # a NumPy value to a JAX-owned (donatable) array at self.where; from the
            # host, so a mesh over processes takes it too (every process puts the same value)
            return jax.device_put(np.asarray(a), self.where)

        dense = initial.dense_params(preset, num_tables, seed)
        params = {name: [(to(dense[f"{name}.{i}.weight"]), to(dense[f"{name}.{i}.bias"]))
                         for i in range(len(sizes) - 1)]
                  for name, sizes in zip(("bottom", "top"), initial.mlp_sizes(preset, num_tables))}
        self.flat, self.unravel = ravel(params)
        self.tx = flat_adam(preset.lr_dense)
        # Every array committed to the device up front: an uncommitted one (the step count
        # from tx.init) would make the second call of the step compile again.
        self.opt_state = jax.device_put(self.tx.init(self.flat), self.where)
        return to

    # ------------------------------------------------------------------ the model
    def _embed(self, anchor, tt, cat):
        """``(B, tables, dim)``: the collection's pooled lookup (FBGEMM's layout: ``cat`` of
        shape (tables, B, pooling) flattened is the indices) and the TT tables."""
        T, B, L = cat.shape
        coll = cat if not self.tt_tables else cat[np.array(self.coll_tables)]
        offsets = jnp.arange(0, coll.shape[0] * B * L + 1, L, dtype=jnp.int32)
        # record=True: on a GPU, XLA replays the collection's kernels from its command
        # buffers (the step slices its batch out of the chunk: one address every step)
        pooled = embedding_bag_collection(self.collection, coll.reshape(-1), offsets,
                                          anchor=anchor, record=True).reshape(B, -1, self.dim)
        if not self.tt_tables:
            return pooled
        vectors = dict(zip(self.coll_tables, (pooled[:, k] for k in range(pooled.shape[1]))))
        per_bag = jnp.arange(0, B * L + 1, L, dtype=jnp.int32)
        for f, cores, (p, q, r) in zip(self.tt_tables, tt, self.tt_shapes):
            vectors[f] = tt_embedding_bag(cores, cat[f].reshape(-1), per_bag, p_shapes=p,
                                          q_shapes=q, ranks=r, mode="sum",
                                          include_last_offset=True)
        return jnp.stack([vectors[f] for f in range(T)], axis=1)

    def _interact(self, flat, dense, pooled):
        p = self.unravel(flat)
        x = dense
        for w, b in p["bottom"]:
            x = jax.nn.relu(x @ w.T + b)
        h = dot_interaction(x, pooled)  # x and every pair's dot: one kernel each way
        top = p["top"]
        for i, (w, b) in enumerate(top):
            h = h @ w.T + b
            if i + 1 < len(top):
                h = jax.nn.relu(h)
        return h[:, 0]

    def _build(self):
        lr, tx = self.preset.lr_embedding, self.tx

        def loss_fn(flat, anchor, tt, dense, cat, label):
            return _bce(self._interact(flat, dense, self._embed(anchor, tt, cat)), label)

        def step(flat, opt_state, tt, tt_acc, anchor, chunk, k):
            dense, cat, label = (jax.lax.dynamic_index_in_dim(a, k, keepdims=False)
                                 for a in chunk)
            # the collection's tables take their Adagrad step while the gradient is taken
            loss, (g_flat, _, g_tt) = jax.value_and_grad(loss_fn, argnums=(0, 1, 2))(
                flat, anchor, tt, dense, cat, label)
            flat, opt_state = flat_step(tx, g_flat, opt_state, flat)
            new_tt = [[_adagrad(w, a, g, lr) for w, a, g in zip(*c)]
                      for c in zip(tt, tt_acc, g_tt)]
            tt = [tuple(w for w, _ in c) for c in new_tt]
            tt_acc = [tuple(a for _, a in c) for c in new_tt]
            return flat, opt_state, tt, tt_acc, loss

        self._train_step = jax.jit(step, donate_argnums=(0, 1, 2, 3))
        self._predict = jax.jit(lambda flat, tt, dense, cat: self._interact(
            flat, dense, self._embed(None, tt, cat)))
        # --profile's pieces, each its own jit
        self._p_embed = jax.jit(lambda tt, cat: self._embed(None, tt, cat))
        self._p_dense = jax.jit(jax.value_and_grad(
            lambda flat, pooled, dense, label: _bce(self._interact(flat, dense, pooled), label),
            argnums=(0, 1)))
        self._p_opt = jax.jit(lambda g, s, f: flat_step(tx, g, s, f))

    # ------------------------------------------------------------------ runner interface
    def to_framework(self, batch):
        # int32 rows: JAX runs without x64, and every preset's tables have < 2^31 rows
        to = xferlib.to_jax
        return to(batch.dense), to(batch.cat.astype(self.xp.int32)), to(batch.label)

    def chunk_steps(self, chunk):
        """A chunk's steps in one go: the chunk crosses to JAX once and one jitted call
        splits it into its steps' batches (a conversion per batch would cost each step
        more host time than the step's own dispatch)."""
        # The views share the chunk's CuPy memory: held until the next chunk replaces them,
        # steps after the split that reads them was queued.
        self._chunk_views = views = self.to_framework(chunk)
        return [ChunkStep((views, k)) for k in self._step_numbers_upto(len(chunk.cat))]

    def _step_numbers_upto(self, n):
        """Scalars 0 .. n - 1 where the run's values live (one device, or replicated over a
        mesh), made once: a transfer per step would cost host time."""
        if len(self._step_numbers) < n:
            self._step_numbers = [jax.device_put(np.int32(k), self.where) for k in range(n)]
        return self._step_numbers[:n]

    def step(self, data):
        chunk, k = data  # a ChunkStep (Feed takes every step from chunk_steps)
        self.flat, self.opt_state, self.tt, self.tt_acc, loss = self._train_step(
            self.flat, self.opt_state, self.tt, self.tt_acc, self.anchor, chunk, k)
        self.steps_done += 1
        return loss

    def predict(self, data):
        dense, cat, _ = data
        return self._predict(self.flat, self.tt, dense, cat)

    def sync(self):
        # the collection's kernels run on XLA's stream: the step's outputs cover them
        jax.block_until_ready((self.flat, self.tt))
        self.collection.check()

    def profile(self, batches):
        """Milliseconds per phase, each phase its own jitted function timed alone (inside the
        one training step XLA fuses and overlaps them): data, embedding forward, dense
        forward + backward, optimizer; the embedding backward + update is the full step's
        time minus the others. Trains on ``batches`` (full steps)."""
        def ms(fn, n=len(batches)):
            out = fn(0)
            jax.block_until_ready(out)
            t0 = time.perf_counter()
            for i in range(n):
                out = fn(i)
            jax.block_until_ready(out)
            return 1e3 * (time.perf_counter() - t0) / n

        steps, batches = batches, [b.batch() if isinstance(b, ChunkStep) else b
                                   for b in batches]
        pooled = self._p_embed(self.tt, batches[0][1])
        grads = self._p_dense(self.flat, pooled, batches[0][0], batches[0][2])[1][0]
        opt_state = jax.tree_util.tree_map(jnp.copy, self.opt_state)
        flat = jnp.copy(self.flat)
        out = {"embedding forward": ms(lambda i: self._p_embed(self.tt, batches[i][1])),
               "dense forward + backward": ms(lambda i: self._p_dense(
                   self.flat, pooled, batches[i][0], batches[i][2])),
               "optimizer": ms(lambda i: self._p_opt(grads, opt_state, flat))}
        t0 = time.perf_counter()
        host = []
        for data in steps:
            h0 = time.perf_counter()
            self.step(data)
            host.append(time.perf_counter() - h0)
        self.sync()
        step = 1e3 * (time.perf_counter() - t0) / len(batches)
        out["embedding backward + update (step - the rest)"] = max(
            0.0, step - sum(out.values()))
        out["whole step (one jit)"] = step
        out["host (dispatch a step)"] = 1e3 * float(np.median(host))
        return out

    def peak_gpu_bytes(self) -> int:
        if not self.gpu:
            return 0
        import cupy

        stats = self.device.memory_stats() or {}
        return int(stats.get("peak_bytes_in_use", 0)
                   + cupy.get_default_memory_pool().total_bytes()
                   + recording_scratch_bytes(self.collection))

    def cache_hit_rate(self):
        if not self.gpu:
            return None
        stats = self.collection.cache_stats()
        return stats["hits"] / stats["lookups"] if stats.get("lookups") else None

    def close(self):
        """Free the run's memory now (see ``TorchRun.close``)."""
        from .torch_run import release_collection

        self.sync()
        release_collection(self.collection)
        self.collection = self.flat = self.opt_state = self.tt = self.tt_acc = None
        self._chunk_views = None
        self._train_step = self._predict = None

    # ------------------------------------------------------------------ checkpoint
    def host_tables(self):
        return {}  # the collection's tables travel in state.npz

    def save_state(self, path):
        self.sync()
        arrays = {"flat": self.flat, "count": self.opt_state.count,
                  "steps_done": np.array(self.steps_done)}
        arrays.update({f"opt.{i}": b for i, b in enumerate(self.opt_state.buffers)})
        for i, (cores, accs) in enumerate(zip(self.tt, self.tt_acc)):
            for k, (c, a) in enumerate(zip(cores, accs)):
                arrays[f"tt.{i}.{k}"], arrays[f"tt_acc.{i}.{k}"] = c, a
        arrays.update({f"coll.{k}": v for k, v in self.collection.state_dict().items()})
        np.savez(path, **{k: np.asarray(v) for k, v in arrays.items()})

    def load_state(self, path):
        with np.load(path) as z:
            a = {k: z[k] for k in z.files}

        def to(v):
            return jax.device_put(v, self.where)

        self.flat = to(a["flat"])
        self.opt_state = type(self.opt_state)(
            to(a["count"]), tuple(to(a[f"opt.{i}"]) for i in range(len(self.opt_state.buffers))))
        self.tt = [tuple(to(a[f"tt.{i}.{k}"]) for k in range(len(c)))
                   for i, c in enumerate(self.tt)]
        self.tt_acc = [tuple(to(a[f"tt_acc.{i}.{k}"]) for k in range(len(c)))
                       for i, c in enumerate(self.tt)]
        self.collection.load_state_dict({k[5:]: v for k, v in a.items()
                                         if k.startswith("coll.")})
        self.steps_done = int(a["steps_done"])
