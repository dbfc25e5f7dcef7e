"""Presets, and where each table goes (HBM, pinned host RAM, TT) under a GPU memory budget.

Placement rules (``--placement``):

- ``auto``: the smallest tables go to HBM while they fill at most half of ``--gpu-memory``;
  every other table lives in pinned host RAM (``HostEmbeddingBag`` / ``host_lookup``), and
  the rest of the budget becomes those tables' GPU caches of hot rows, shared by row count.
- ``hbm``: every table in HBM; a budget smaller than the tables is an error.
- ``host``: every table in host RAM (caches from the budget, as ``auto``).
- ``tt``: tables of at least ``tt_min_rows`` rows as TT cores, the others in HBM.

Bytes counted per table: weights plus the Adagrad accumulator (same shape), float32; a cached
host row also carries its state and step count in the cache.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field

GB = 1 << 30

# Criteo Terabyte's 26 cardinalities (as MLPerf's DLRM caps them at 40M rows), the shape of
# the "large" preset.
CRITEO_TB = [39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546, 403346,
             10, 2208, 11938, 155, 4, 976, 14, 39979771, 25641295, 39664984, 585935, 12972,
             108, 36]


@dataclass(frozen=True)
class Preset:
    name: str
    cardinalities: tuple
    dim: int
    batch_size: int
    steps: int
    eval_samples: int
    evals: int                 # evaluation points along a run (for the curves)
    gpu_memory_gb: float       # the budget ``auto`` uses when --gpu-memory is not given
    bottom: tuple = (64,)
    top: tuple = (128, 64)
    lr_dense: float = 1e-3
    lr_embedding: float = 0.05
    init_scale: float = 0.05
    tt_min_rows: int = 1000
    tt_rank: int = 16
    pooling: int = 1
    description: str = ""


def _scaled(cards, cap):
    return tuple(min(int(c), cap) for c in cards)


PRESETS = {
    "tiny": Preset(
        "tiny", (1000, 300, 3000, 50, 800, 4, 120, 60, 10, 2000, 500, 200, 6, 90, 150, 30, 3,
                 70, 8, 1500, 400, 1200, 40, 20, 5, 12),
        dim=16, batch_size=512, steps=400, eval_samples=16384, evals=4,
        gpu_memory_gb=0.0004, bottom=(32,), top=(64, 32), lr_dense=3e-3, lr_embedding=0.2,
        tt_min_rows=1000, tt_rank=8,
        description="CPU-sized: 11.6k rows, dim 16; under 20 s per framework on 2 cores"),
    "medium": Preset(
        "medium", _scaled(CRITEO_TB, 2_000_000), dim=64, batch_size=8192, steps=1000,
        eval_samples=262144, evals=5, gpu_memory_gb=2.0, bottom=(256, 64), top=(256, 128),
        lr_dense=1e-3, lr_embedding=0.05, tt_min_rows=100_000, tt_rank=32,
        description="Criteo-TB-like capped at 2M rows: 6.3 GB of tables + state, fits in HBM"),
    "large": Preset(
        "large", _scaled(CRITEO_TB, 10_000_000), dim=64, batch_size=8192, steps=1000,
        eval_samples=262144, evals=5, gpu_memory_gb=3.0, bottom=(256, 64), top=(256, 128),
        lr_dense=1e-3, lr_embedding=0.05, tt_min_rows=100_000, tt_rank=32,
        description="Criteo-TB-like capped at 10M rows: 25.8 GB of tables + state"),
}

PLACEMENTS = ("auto", "hbm", "host", "tt")


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]


def table_bytes(rows: int, dim: int) -> int:
    """Weights + Adagrad accumulator, float32."""
    return 2 * 4 * rows * dim


def cached_row_bytes(dim: int) -> int:
    """A cached row: weights, accumulator and an 8-byte step count, 16-byte aligned."""
    return 4 * (-(-(2 * dim + 2) // 4) * 4)


@dataclass
class TablePlan:
    index: int
    rows: int
    where: str           # "hbm" | "host" | "tt"
    cache_rows: int = 0
    tt_p: tuple = ()
    tt_q: tuple = ()
    tt_ranks: tuple = ()


@dataclass
class Plan:
    tables: list
    budget_bytes: int
    bytes_hbm: int = 0
    bytes_host: int = 0
    bytes_tt: int = 0
    bytes_cache: int = 0
    notes: list = field(default_factory=list)

    def summary(self) -> dict:
        d = asdict(self)
        d["placement"] = [t.where for t in self.tables]
        d["cache_rows"] = [t.cache_rows for t in self.tables]
        del d["tables"]
        return d


def _tt_shape(rows: int, dim: int, rank: int):
    from xferlib import tt

    p = tt.suggest_tt_shapes(rows, 3)
    q = tt.suggest_tt_shapes(dim, 3, allow_round_up=False)
    return tuple(p), tuple(q), (rank, rank)


def tt_bytes(p, q, ranks) -> int:
    r = (1, *ranks, 1)
    cores = sum(p[k] * r[k] * q[k] * r[k + 1] for k in range(len(p)))
    return 2 * 4 * cores  # cores + Adagrad state


def plan_tables(preset: Preset, placement: str, gpu_memory_gb, cardinalities=None) -> Plan:
    """Where each table lives. ValueError for an unknown placement, a negative budget, or
    ``hbm`` / ``tt`` placements whose HBM tables exceed an explicit budget."""
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; choose one of {PLACEMENTS}")
    explicit = gpu_memory_gb is not None
    budget_gb = preset.gpu_memory_gb if gpu_memory_gb is None else float(gpu_memory_gb)
    if not budget_gb > 0 or not math.isfinite(budget_gb):
        raise ValueError(f"--gpu-memory must be a positive number of GB, got {gpu_memory_gb}")
    budget = int(budget_gb * GB)
    cards = list(preset.cardinalities if cardinalities is None else cardinalities)
    dim = preset.dim
    tables = [TablePlan(i, n, "hbm") for i, n in enumerate(cards)]
    plan = Plan(tables, budget)
    if placement == "hbm":
        pass
    elif placement == "tt":
        for t in tables:
            if t.rows >= preset.tt_min_rows:
                t.where = "tt"
                t.tt_p, t.tt_q, t.tt_ranks = _tt_shape(t.rows, dim, preset.tt_rank)
    else:
        for t in tables:
            t.where = "host"
        if placement == "auto":
            used = 0
            for t in sorted(tables, key=lambda t: t.rows):
                b = table_bytes(t.rows, dim)
                if used + b > budget // 2:
                    break
                t.where, used = "hbm", used + b
    plan.bytes_hbm = sum(table_bytes(t.rows, dim) for t in tables if t.where == "hbm")
    plan.bytes_tt = sum(tt_bytes(t.tt_p, t.tt_q, t.tt_ranks) for t in tables if t.where == "tt")
    plan.bytes_host = sum(table_bytes(t.rows, dim) for t in tables if t.where == "host")
    on_gpu = plan.bytes_hbm + plan.bytes_tt
    if placement in ("hbm", "tt") and explicit and on_gpu > budget:
        raise ValueError(f"--gpu-memory {budget_gb:g} GB is smaller than the tables placed in HBM "
                         f"({on_gpu / GB:.3g} GB with their optimizer state); raise the budget "
                         f"or use --placement auto/host")
    host = [t for t in tables if t.where == "host"]
    left = budget - on_gpu
    if host and left > 0:
        per_row = cached_row_bytes(dim)
        total_rows = sum(t.rows for t in host)
        for t in host:
            t.cache_rows = min(t.rows, int(left * t.rows / total_rows) // per_row)
        plan.bytes_cache = sum(t.cache_rows for t in host) * per_row
    return plan


def host_ram_available() -> int:
    """MemAvailable from /proc/meminfo (bytes); physical memory where that is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_host_ram(plan: Plan, available=None, headroom: float = 0.85) -> None:
    """MemoryError, before anything is allocated, when the host tables (and their state) do
    not fit in ``headroom`` of the available host RAM."""
    available = host_ram_available() if available is None else int(available)
    if plan.bytes_host > headroom * available:
        raise MemoryError(f"the host tables need {plan.bytes_host / GB:.1f} GB of pinned host RAM "
                          f"(weights + optimizer state) but this machine has "
                          f"{available / GB:.1f} GB available; use a smaller preset or a machine "
                          f"with more RAM")
