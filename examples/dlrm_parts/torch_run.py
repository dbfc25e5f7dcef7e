"""The DLRM in PyTorch: xferlib's placement (HBM / host tables / TT, FlatAdam for the MLPs)
or the plain-torch baseline (every table an ``nn.EmbeddingBag`` in HBM, torch's sparse
Adagrad, fused Adam).

Embedding tables train with Adagrad everywhere (torch's rule; xferlib's host tables and TT
cores run the same rule fused into backward), so every placement learns the same model: a
row the batch does not touch is unchanged by Adagrad, sparse or dense.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

import xferlib
from xferlib.adapters.torch import FlatAdam, HostEmbeddingBag, OptimType, TTEmbeddingBag

from . import dist as ranks_
from . import init as initial


def _mlp(sizes, weights, prefix, device):
    layers = []
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        lin = torch.nn.Linear(fan_in, fan_out, device=device)
        with torch.no_grad():  # the shared initial values, handed over by xferlib
            lin.weight.copy_(xferlib.to_torch(weights[f"{prefix}.{i}.weight"]))
            lin.bias.copy_(xferlib.to_torch(weights[f"{prefix}.{i}.bias"]))
        layers.append(lin)
    return torch.nn.ModuleList(layers)


class DLRM(torch.nn.Module):
    """Bottom MLP on the dense features, one pooled embedding per table, dot products of
    every pair among them (and the bottom output), top MLP to a logit."""

    def __init__(self, preset, plan, seed, device, baseline=False, xp=np, ranks=None):
        super().__init__()
        ranks = ranks or ranks_.Ranks()
        # one table per host shared by the ranks (host, TT): the group sums their gradients
        shared = {"process_group": ranks.group} if ranks.world > 1 else {}
        self.device, self.dim = device, preset.dim
        num_tables = len(plan.tables)
        dense = initial.dense_params(preset, num_tables, seed)
        bottom, top = initial.mlp_sizes(preset, num_tables)
        self.bottom = _mlp(bottom, dense, "bottom", device)
        self.top = _mlp(top, dense, "top", device)
        self.tables = torch.nn.ModuleList()
        self.kinds = []
        lr = preset.lr_embedding
        for t in plan.tables:
            where = "hbm" if baseline else t.where
            if where == "hbm":
                w = xferlib.to_torch(initial.table_init(seed, t.index, t.rows, preset.dim,
                                                        preset.init_scale, xp)).to(device)
                module = torch.nn.EmbeddingBag.from_pretrained(
                    w, freeze=False, mode="sum", sparse=True, include_last_offset=True)
            elif where == "host":
                module = HostEmbeddingBag(t.rows, preset.dim, mode="sum", optimizer="adagrad",
                                          optimizer_kwargs={"lr": lr},
                                          # a table shared by ranks has no GPU cache
                                          cache_rows=t.cache_rows if ranks.world == 1 else 0,
                                          include_last_offset=True, device=device, init="zeros",
                                          **shared)
                if ranks.local_rank == 0:  # the host's one copy, written once
                    initial.fill_host_table(module.table, seed, t.index, preset.init_scale, xp)
            else:
                module = TTEmbeddingBag(t.rows, preset.dim, list(t.tt_ranks), list(t.tt_p),
                                        list(t.tt_q), optimizer=OptimType.EXACT_ADAGRAD,
                                        learning_rate=lr, sparse=True, mode="sum",
                                        include_last_offset=True, **shared)
                with torch.no_grad():
                    for param, value in zip(module.tt_cores, initial.tt_cores(t, seed)):
                        param.copy_(xferlib.to_torch(value)[None])
                module = module.to(device)
            self.tables.append(module)
            self.kinds.append(where)
        n = num_tables + 1
        li, lj = np.triu_indices(n, 1)
        self.register_buffer("li", torch.from_numpy(li).to(device), persistent=False)
        self.register_buffer("lj", torch.from_numpy(lj).to(device), persistent=False)
        self._offsets = {}

    def dense_parameters(self):
        return [*self.bottom.parameters(), *self.top.parameters()]

    def hbm_parameters(self):
        return [m.weight for m, k in zip(self.tables, self.kinds) if k == "hbm"]

    def prefetch(self, cat):
        """Start moving the host-table rows of the next batch ``cat`` (the same tensor the
        next forward gets) to the GPU while this step computes."""
        for f, (table, kind) in enumerate(zip(self.tables, self.kinds)):
            if kind == "host":
                table.prefetch(cat[f].reshape(-1))

    def offsets(self, B, L):
        key = (B, L)
        if key not in self._offsets:
            self._offsets[key] = torch.arange(0, B * L + 1, L, device=self.device)
        return self._offsets[key]

    def forward(self, dense, cat):
        _, B, L = cat.shape
        x = dense
        for lin in self.bottom:
            x = torch.relu(lin(x))
        offsets = self.offsets(B, L)
        vectors = [x] + [table(cat[f].reshape(-1), offsets)
                         for f, table in enumerate(self.tables)]
        T = torch.stack(vectors, dim=1)
        dots = torch.bmm(T, T.transpose(1, 2))[:, self.li, self.lj]
        h = torch.cat([x, dots], dim=1)
        for i, lin in enumerate(self.top):
            h = lin(h)
            if i + 1 < len(self.top):
                h = torch.relu(h)
        return h.squeeze(1)


class TorchRun:
    """One training run: model, optimizers, step, predict, checkpoint."""

    def __init__(self, preset, plan, seed, device, baseline=False, graph=True, xp=np,
                 prefetch=True, ranks=None):
        self.device, self.baseline, self.xp = torch.device(device), baseline, xp
        self.ranks = ranks or ranks_.Ranks()
        self.part = self.ranks.part  # this rank's share of each global batch
        cuda = self.device.type == "cuda"
        # host tables on the GPU move the next batch's rows behind this step's compute
        self.prefetches = prefetch and cuda and not baseline and "host" in [
            t.where for t in plan.tables]
        # torch's sparse Adagrad builds COO gradients it knows to be valid: no invariant checks
        torch.sparse.check_sparse_tensor_invariants.disable()
        if not cuda:  # small CPU batches: one thread beats an OpenMP pool on shared cores
            torch.set_num_threads(1)
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self.model = DLRM(preset, plan, seed, self.device, baseline, xp, self.ranks)
        if self.ranks.world > 1:
            torch.distributed.barrier(group=self.ranks.group)  # shared tables filled
        if baseline:  # what one writes when the tables fit: torch's fused Adam
            self.dense_opt = torch.optim.Adam(self.model.dense_parameters(), lr=preset.lr_dense,
                                              **({"fused": True} if cuda else {}))
        else:
            self.dense_opt = FlatAdam(self.model.dense_parameters(), lr=preset.lr_dense,
                                      capturable=cuda)
        hbm = self.model.hbm_parameters()
        self.sparse_opt = torch.optim.Adagrad(hbm, lr=preset.lr_embedding) if hbm else None
        self.graph, self.use_graph, self.graph_note = None, graph and cuda and not baseline, ""
        self.steps_done = 0

    # ------------------------------------------------------------------ data
    def to_framework(self, batch):
        return (xferlib.to_torch(batch.dense), xferlib.to_torch(batch.cat),
                xferlib.to_torch(batch.label))

    # ------------------------------------------------------------------ step
    def _dense_step(self):
        if self.graph is not None:
            self.graph.replay()
            return
        self.dense_opt.step()
        if self.use_graph and self.steps_done >= 1:
            # After a warm-up step, the flat Adam step (capturable) is captured once and
            # replayed: a few microseconds of host time instead of a launch sequence.
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    self.dense_opt.step()
                self.graph = graph
                self.graph_note = "FlatAdam step in a CUDA graph"
            except Exception as err:  # keep training eagerly; say why
                self.use_graph, self.graph_note = False, f"no CUDA graph: {err}"[:200]

    def step(self, data, next_data=None):
        dense, cat, label = data
        self.model.train()
        self.dense_opt.zero_grad()
        if self.sparse_opt is not None:
            self.sparse_opt.zero_grad()
        logits = self.model(dense, cat)
        if next_data is not None:  # after this step's lookups, before its updates
            self.model.prefetch(next_data[1])
        world = self.ranks.world
        if world == 1:
            loss = F.binary_cross_entropy_with_logits(logits, label)
        else:  # this rank's part of the global batch's mean: the ranks' gradients add up
            loss = F.binary_cross_entropy_with_logits(logits, label, reduction="sum") / (
                label.numel() * world)
        loss.backward()  # host tables and TT cores take their Adagrad step here
        if world > 1:
            ranks_.sum_dense_grads(self.model.dense_parameters(), self.ranks)
            ranks_.gather_sparse_grads(self.model.hbm_parameters(), self.ranks)
            loss = loss * world  # the running loss shows this rank's samples' mean
        self._dense_step()
        if self.sparse_opt is not None:
            self.sparse_opt.step()
        self.steps_done += 1
        return loss.detach()

    @torch.no_grad()
    def predict(self, data):
        dense, cat, _ = data
        self.model.eval()
        return self.model(dense, cat)

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def peak_gpu_bytes(self) -> int:
        if self.device.type != "cuda":
            return 0
        import cupy

        return int(torch.cuda.max_memory_allocated(self.device)
                   + cupy.get_default_memory_pool().total_bytes())

    def cache_hit_rate(self):
        rates = [m.table.cache_stats()["hit_rate"] for m, k in
                 zip(self.model.tables, self.model.kinds) if k == "host" and m.table.cache_rows]
        return float(np.mean(rates)) if rates else None

    # ------------------------------------------------------------------ checkpoint
    def host_tables(self):
        return {f: m.table for f, (m, k) in enumerate(zip(self.model.tables, self.model.kinds))
                if k == "host"}

    def save_state(self, path):
        self.sync()
        m = self.model
        state = {
            "dense": {"bottom": m.bottom.state_dict(), "top": m.top.state_dict()},
            "dense_opt": self.dense_opt.state_dict(),
            "sparse_opt": None if self.sparse_opt is None else self.sparse_opt.state_dict(),
            "hbm": {f: t.weight.detach() for f, (t, k) in enumerate(zip(m.tables, m.kinds))
                    if k == "hbm"},
            "tt": {f: t.state_dict() for f, (t, k) in enumerate(zip(m.tables, m.kinds))
                   if k == "tt"},
            "steps_done": self.steps_done,
        }
        torch.save(state, path)

    def load_state(self, path):
        state = torch.load(path, map_location=self.device, weights_only=False)
        m = self.model
        with torch.no_grad():
            m.bottom.load_state_dict(state["dense"]["bottom"])
            m.top.load_state_dict(state["dense"]["top"])
            for f, w in state["hbm"].items():
                m.tables[f].weight.copy_(w)
            for f, sd in state["tt"].items():
                m.tables[f].load_state_dict(sd)
        self.dense_opt.load_state_dict(state["dense_opt"])
        if self.sparse_opt is not None:
            self.sparse_opt.load_state_dict(state["sparse_opt"])
        self.steps_done = state["steps_done"]
