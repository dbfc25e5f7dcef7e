"""The DLRM in PyTorch, with one of three embedding engines (``torch_engines.py``):

- ``xferlib`` (the main job): every table in ONE ``EmbeddingBagCollection``, each at its
  planned placement (``hbm``, or ``host`` with a GPU cache of hot rows): one pooled lookup
  of all tables and one fused backward + Adagrad update inside ``loss.backward()``, the MLPs
  trained by a capturable ``FlatAdam``, and on a GPU the whole step captured in one CUDA
  graph after warm-up. TT tables (``--placement tt``) stay ``TTEmbeddingBag`` modules
  beside the collection (its ``tt`` placement runs every lookup of a GPU batch through
  each tt table's kernels). Under ``torchrun`` the collection is
  a ``ShardedEmbeddingBagCollection`` (each rank holds its shards of the sharding plan and
  looks up its own samples; on GPUs ``capturable``: fixed-size all_to_alls, no host read,
  so each rank's whole step is one CUDA graph too).
- ``torch`` (the plain-torch baseline): one ``nn.EmbeddingBag(sparse=True)`` per table in
  HBM, torch's sparse Adagrad, fused Adam, eager.
- ``fbgemm`` (``--compare`` where ``fbgemm_gpu`` imports): FBGEMM's table-batched
  embeddings (``DEVICE`` for HBM tables, ``MANAGED_CACHING`` with the same cache for host
  tables, its fused row-wise Adagrad), fused Adam, the whole step in one CUDA graph.

Every engine starts from the same initial rows (the collection's counter-based initializer,
``init.collection_rows``) and the same MLPs, so the runs learn the same model.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F

import xferlib
from xferlib.adapters.torch import FlatAdam, GradAllReduce, dot_interaction

from . import dist as ranks_
from . import init as initial
from . import metrics
from . import torch_engines as engines

WARMUP_STEPS = 2  # eager steps (on a side stream) before the step is captured


def _mlp(sizes, weights, prefix, device):
    layers = []
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        lin = torch.nn.Linear(fan_in, fan_out, device=device)
        with torch.no_grad():  # the shared initial values, handed over by xferlib
            lin.weight.copy_(xferlib.to_torch(weights[f"{prefix}.{i}.weight"]))
            lin.bias.copy_(xferlib.to_torch(weights[f"{prefix}.{i}.bias"]))
        layers.append(lin)
    return torch.nn.ModuleList(layers)


class _RankSlice(torch.autograd.Function):
    """Under torchrun with replicated tables (TT placements; the sharded collection needs
    none of this) every rank looks up the whole global batch: forward keeps this rank's
    samples; backward all-gathers every rank's gradient rows, so each rank's tables take the
    same update (that of one process on the global batch)."""

    @staticmethod
    def forward(ctx, x, ranks):
        ctx.ranks = ranks
        share = x.shape[0] // ranks.world
        return x[ranks.rank * share:(ranks.rank + 1) * share]

    @staticmethod
    def backward(ctx, grad):
        parts = [torch.empty_like(grad) for _ in range(ctx.ranks.world)]
        torch.distributed.all_gather(parts, grad.contiguous(), group=ctx.ranks.group)
        return torch.cat(parts), None


# ---------------------------------------------------------------------- the model

class DLRM(torch.nn.Module):
    """Bottom MLP on the dense features, one pooled embedding per table, dot products of
    every pair among them (and the bottom output), top MLP to a logit."""

    def __init__(self, preset, plan, seed, device, engine="xferlib", optimizer="adagrad",
                 ranks=None, sharding=None, overlap=False):
        super().__init__()
        self.ranks = ranks or ranks_.Ranks()
        self.local_batches = False  # training batches hold this rank's samples only
        # overlap (a GPU): the embeddings' lookup, exchange and (inside the backward) update
        # on a stream of their own, beside the dense model's work on the caller's stream
        self.side = (torch.cuda.Stream(torch.device(device))
                     if overlap and torch.device(device).type == "cuda" else None)
        num_tables = len(plan.tables)
        dense = initial.dense_params(preset, num_tables, seed)
        bottom, top = initial.mlp_sizes(preset, num_tables)
        self.bottom = _mlp(bottom, dense, "bottom", device)
        self.top = _mlp(top, dense, "top", device)
        if engine == "xferlib":
            self.embeddings = engines.XferlibEmbeddings(preset, plan, seed, device, optimizer,
                                                        sharding)
        elif engine == "torch":
            self.embeddings = engines.TorchEmbeddings(preset, plan, seed, device)
        else:
            self.embeddings = engines.FbgemmEmbeddings(preset, plan, seed, device)

    def dense_parameters(self):
        return [*self.bottom.parameters(), *self.top.parameters()]

    def embed(self, cat):
        """``(B, tables, dim)`` pooled rows (this rank's samples while training).

        Sharded: a training step looks up only this rank's samples (its slice of the global
        batch); evaluation is a collective too, every rank looking up the whole batch it was
        given (the same on every rank). Replicated (TT tables): every rank looks up the
        global batch and keeps its slice (``_RankSlice``)."""
        training = self.ranks.world > 1 and self.training and torch.is_grad_enabled()
        if training and getattr(self.embeddings, "sharded", False):
            if self.local_batches:  # the batch is this rank's part already
                return self.embeddings(cat)
            share = cat.shape[1] // self.ranks.world
            return self.embeddings(cat[:, self.ranks.rank * share:
                                       (self.ranks.rank + 1) * share])
        pooled = self.embeddings(cat)
        if training:
            pooled = _RankSlice.apply(pooled, self.ranks)
        return pooled

    def bottom_mlp(self, dense):
        x = dense
        for lin in self.bottom:
            x = torch.relu(lin(x))
        return x

    def interact(self, x, pooled):
        """The logit from the bottom MLP's output and the pooled rows."""
        # [x, the dot product of every pair of x and the pooled rows]: one kernel each way
        # (every engine's model alike)
        h = dot_interaction(x, pooled)
        for i, lin in enumerate(self.top):
            h = lin(h)
            if i + 1 < len(self.top):
                h = torch.relu(h)
        return h.squeeze(1)

    def forward(self, dense, cat):
        if self.side is None:
            return self.interact(self.bottom_mlp(dense), self.embed(cat))
        # The lookup on the side stream (after what the caller queued: the batch), the
        # bottom MLP meanwhile on the caller's; autograd runs each backward on its forward's
        # stream, so the embeddings' update (and exchange) go beside the dense backward.
        # The caller joins the side stream at the step's end (TorchRun.join_side).
        caller = torch.cuda.current_stream(self.side.device)
        self.side.wait_stream(caller)
        with torch.cuda.stream(self.side):
            pooled = self.embed(cat)
        x = self.bottom_mlp(dense)
        caller.wait_stream(self.side)
        pooled.record_stream(caller)  # made on the side stream, read on the caller's
        if pooled.requires_grad:  # its gradient: made on the caller's, read on the side
            pooled.register_hook(self._read_on_side)
        return self.interact(x, pooled)

    def _read_on_side(self, grad):
        grad.record_stream(self.side)  # kept from reuse until the side stream's update


# ---------------------------------------------------------------------- one training run

class TorchRun:
    """One training run: model, optimizers, step (eager or one CUDA graph), predict,
    profile, checkpoint."""

    def __init__(self, preset, plan, seed, device, engine="xferlib", graph=True,
                 optimizer="adagrad", ranks=None, sharding=None, overlap=False):
        self.device, self.engine = torch.device(device), engine
        self.ranks = ranks or ranks_.Ranks()
        cuda = self.device.type == "cuda"
        if not cuda:  # small CPU batches: one thread beats an OpenMP pool on shared cores
            torch.set_num_threads(1)
        else:
            torch.cuda.reset_peak_memory_stats(self.device)
        # overlap: the xferlib and FBGEMM engines (each trains its tables inside the
        # backward); the plain-torch baseline's sparse optimizer steps after it
        self.model = DLRM(preset, plan, seed, self.device, engine, optimizer, self.ranks,
                          sharding if engine == "xferlib" else None,
                          overlap=overlap and engine != "torch")
        params = self.model.dense_parameters()
        if engine == "xferlib":
            self.dense_opt = FlatAdam(params, lr=preset.lr_dense, capturable=cuda)
        else:  # what one writes with torch: its fused Adam (capturable for FBGEMM's graph)
            self.dense_opt = torch.optim.Adam(params, lr=preset.lr_dense, **(
                {"fused": True, "capturable": engine == "fbgemm"} if cuda else {}))
        # Under torchrun the MLPs train data-parallel: their gradients summed in buckets that
        # start during the backward (slices of FlatAdam's gradient buffer).
        self.grad_sync = (GradAllReduce(self.dense_opt if engine == "xferlib" else params,
                                        process_group=self.ranks.group)
                          if self.ranks.world > 1 else None)
        self.sparse_opt = None
        if engine == "torch":  # the baseline's tables: torch's sparse Adagrad
            torch.sparse.check_sparse_tensor_invariants.disable()  # COO grads torch built
            self.sparse_opt = torch.optim.Adagrad(self.model.embeddings.parameters(),
                                                  lr=preset.lr_embedding)
        # Under torchrun the step is captured when the collection is sharded (its
        # all_to_alls have fixed sizes); the replicated designs (TT tables) stay eager.
        sharded = sharding is not None and engine == "xferlib"
        self.use_graph = (graph and cuda and engine != "torch"
                          and (self.ranks.world == 1 or sharded))
        self.graph_note = ""
        if self.use_graph and plan.bytes_tt and engine == "xferlib":
            self.use_graph, self.graph_note = False, "eager: TT tables are not captured"
        if not self.use_graph and not self.graph_note:
            self.graph_note = "eager"
            if sharded:
                self.graph_note = f"eager: collection sharded over {self.ranks.world} ranks"
        self.graph, self.static, self._loss = None, None, None
        self.steps_done = 0
        # Sharded under torchrun: each rank makes and trains on its own samples only (its
        # part of the global batch); the replicated TT design looks up the global batch.
        self.part = ((self.ranks.rank, self.ranks.world)
                     if sharded and self.ranks.world > 1 else None)
        self.model.local_batches = self.part is not None

    # ------------------------------------------------------------------ data
    def to_framework(self, batch):
        return (xferlib.to_torch(batch.dense), xferlib.to_torch(batch.cat),
                xferlib.to_torch(batch.label))

    # ------------------------------------------------------------------ step
    def _share(self, dense, label):
        """This rank's samples of the global batch's dense features and labels (the data
        already is this rank's part when ``self.part`` is set)."""
        if self.ranks.world == 1 or self.part is not None:
            return dense, label
        share = label.shape[0] // self.ranks.world
        part = slice(self.ranks.rank * share, (self.ranks.rank + 1) * share)
        return dense[part], label[part]

    def _rank_loss(self, logits, label):
        """This rank's part of the global batch's mean BCE (one process: the mean): the
        ranks' gradients add up to the global mean's."""
        return F.binary_cross_entropy_with_logits(logits, label, reduction="sum") / (
            label.numel() * self.ranks.world)

    def _body(self, dense, cat, label):
        """One training step; the embedding update runs inside backward."""
        self.model.train()
        self.dense_opt.zero_grad(set_to_none=not self.use_graph)
        if self.sparse_opt is not None:
            self.sparse_opt.zero_grad()
        dense, label = self._share(dense, label)
        logits = self.model(dense, cat)
        world = self.ranks.world
        loss = self._rank_loss(logits, label)
        loss.backward()
        if world > 1:
            self.grad_sync.wait()  # the buckets the backward started, and the rest
            loss = loss * world  # the running loss shows this rank's samples' mean
        self.dense_opt.step()
        if self.sparse_opt is not None:
            self.sparse_opt.step()
        self.join_side()
        return loss.detach()

    def join_side(self):
        """The caller's stream waits for the embeddings' stream (``--overlap``): their
        update, queued inside the backward, ends within the step (a captured step's forked
        stream must rejoin before the capture ends)."""
        if self.model.side is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.model.side)

    def warmup_steps(self) -> int:
        """The coming steps that warm up rather than train at speed: the eager warm-up steps
        and the capture when the step is still to be captured, else the first step."""
        if self.use_graph and self.graph is None:
            return max(0, WARMUP_STEPS - self.steps_done) + 1
        return 1

    def step(self, data):
        self.steps_done += 1
        if not self.use_graph:
            return self._body(*data)
        if self.static is None:  # the graph's inputs: every batch is copied into these
            self.static = tuple(t.clone() for t in data)
        for dst, src in zip(self.static, data):
            dst.copy_(src, non_blocking=True)
        if self.graph is not None:
            self.graph.replay()
            return self._loss.clone()
        if self.steps_done <= WARMUP_STEPS:  # warm-up on a side stream, as torch advises
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                loss = self._body(*self.static)
            torch.cuda.current_stream(self.device).wait_stream(side)
            return loss
        failure = None
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._loss = self._body(*self.static)
        except Exception as err:  # train eagerly from here on; say why
            failure = f"eager (no CUDA graph: {err})"[:200]
        if self.ranks.world > 1:  # the ranks replay together or all run eagerly
            ok = torch.tensor([int(failure is None)], dtype=torch.int32, device=self.device)
            torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN,
                                         group=self.ranks.group)
            if failure is None and not ok.item():
                failure = "eager (another rank's CUDA-graph capture failed)"
        if failure is not None:
            self.use_graph, self.graph_note = False, failure
            torch.cuda.synchronize(self.device)
            if self.grad_sync is not None:  # buckets a failed capture may have started
                self.grad_sync.reset()
            return self._body(*data)
        self.graph, self.graph_note = graph, "whole step in one CUDA graph" + (
            f" on each of {self.ranks.world} ranks (sharded collection, NCCL all_to_alls "
            f"captured)" if self.ranks.world > 1 else "")
        graph.replay()  # capturing ran nothing: this step's batch trains now
        return self._loss.clone()

    @torch.no_grad()
    def predict(self, data):
        dense, cat, _ = data
        self.model.eval()
        return self.model(dense, cat)

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.engine == "xferlib":
            self.model.embeddings.check()  # a bad batch would raise here

    # ------------------------------------------------------------------ profile
    def profile(self, batches):
        """Per-phase GPU milliseconds of eager steps on ``batches`` (torch's data), from CUDA
        events around each phase, plus the host time to issue a step. Trains on them."""
        if self.device.type != "cuda":
            return None
        m, names = self.model, ("embedding forward", "dense forward", "dense backward",
                                "embedding update", "optimizer")
        times, host = {n: [] for n in names}, []
        for data in batches:
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(6)]
            t0 = time.perf_counter()
            dense, cat, label = data
            dense, label = self._share(dense, label)  # under torchrun: this rank's samples
            m.train()
            self.dense_opt.zero_grad(set_to_none=False)
            if self.sparse_opt is not None:
                self.sparse_opt.zero_grad()
            ev[0].record()
            pooled = m.embed(cat)
            ev[1].record()
            loss = self._rank_loss(m.interact(m.bottom_mlp(dense), pooled), label)
            ev[2].record()
            if pooled.requires_grad:  # the pooled gradient is ready: the update starts
                pooled.register_hook(lambda g: ev[3].record())
            loss.backward()
            if not pooled.requires_grad:
                ev[3].record()
            if self.grad_sync is not None:
                self.grad_sync.wait()
            ev[4].record()
            self.dense_opt.step()
            if self.sparse_opt is not None:
                self.sparse_opt.step()
            ev[5].record()
            host.append(time.perf_counter() - t0)
            self.steps_done += 1
            torch.cuda.synchronize(self.device)
            for k, n in enumerate(names):
                times[n].append(ev[k].elapsed_time(ev[k + 1]))
        out = {n: float(np.median(v)) for n, v in times.items()}
        out["host (issue an eager step)"] = 1e3 * float(np.median(host))
        return out

    def profile_replays(self, batches):
        """GPU milliseconds per replayed step by kind of kernel (``metrics.KERNEL_KINDS``),
        from torch's profiler over replays of the captured step on ``batches``; None when
        the step is not a CUDA graph. Trains on them."""
        if self.graph is None:
            return None
        from torch.profiler import ProfilerActivity, profile

        self.sync()
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            start.record()
            for data in batches:
                self.step(data)
            end.record()
            self.sync()
        kernels = [(e.name, e.time_range.elapsed_us()) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA]
        out = metrics.kernel_kinds(kernels, len(batches))
        out["replayed step (events, profiler on)"] = start.elapsed_time(end) / len(batches)
        self.top_kernels = metrics.top_kernels(kernels, len(batches))
        return out

    # ------------------------------------------------------------------ figures
    def peak_gpu_bytes(self) -> int:
        if self.device.type != "cuda":
            return 0
        import cupy

        return int(torch.cuda.max_memory_allocated(self.device)
                   + cupy.get_default_memory_pool().total_bytes())

    def cache_hit_rate(self):
        if self.engine != "xferlib" or self.device.type != "cuda":
            return None
        return self.model.embeddings.cache_hit_rate()

    def close(self):
        """Free the run's memory now, in order: queued GPU work finished, the graph and its
        memory pool dropped, pinned host tables unregistered (xferlib.unpin) before their
        pages go back to the allocator. A later run (the baseline) then allocates into a
        clean address space (docs/dlrm.md, "the baseline's crash")."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.graph = self.static = self._loss = None
        if self.engine == "xferlib" and self.model.embeddings.core() is not None:
            release_collection(self.model.embeddings.core())
        self.model = self.dense_opt = self.sparse_opt = None

    # ------------------------------------------------------------------ checkpoint
    def host_tables(self):
        return {}  # the collection's tables travel in state.pt

    def save_state(self, path):
        self.sync()
        m = self.model
        state = {"dense": {"bottom": m.bottom.state_dict(), "top": m.top.state_dict()},
                 "dense_opt": self.dense_opt.state_dict(),
                 "embeddings": m.embeddings.state_dict(), "steps_done": self.steps_done}
        torch.save(state, path)

    def load_state(self, path):
        state = torch.load(path, map_location=self.device, weights_only=False)
        m = self.model
        with torch.no_grad():
            m.bottom.load_state_dict(state["dense"]["bottom"])
            m.top.load_state_dict(state["dense"]["top"])
        m.embeddings.load_state_dict(state["embeddings"])
        self.dense_opt.load_state_dict(state["dense_opt"])
        self.steps_done = state["steps_done"]


def release_collection(coll) -> None:
    """Unregister a core collection's pinned host buffer now (its pages stay readable as
    ordinary memory until the collection is freed): nothing of a finished run stays mapped
    into the GPU's address space while the next run allocates."""
    coll.synchronize()
    host = coll.buffers.get("host")
    if host is not None and xferlib.is_pinned(host):
        xferlib.unpin(host)
