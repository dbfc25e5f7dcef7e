"""``xferlib bench collection``: the embedding collection's training step.

The table and batches of FBGEMM's table-batched-embedding comparison (docs/benchmarks.md):
one 8M x 128 fp32 table, 4,096 bags of 16 Zipf(1.05) lookups per step (hot rows spread over
the table), fresh batches in turn, forward + backward with the fused update, steps queued
back to back; SGD, Adam and row-wise Adagrad, the table in pinned host RAM or in HBM. Also
the time to build the table with its optimizer state, and the step's host time per call (on
the GPU machines a launch costs about 10 us of host time: an eager step is host-bound when
its kernels take less than its launches). On a machine without a GPU: a small table on the
NumPy path, so the suite runs everywhere.
"""

from __future__ import annotations

import gc
import time

import numpy as np

from xferlib.adapters.bench.table import zipf_indices
from xferlib.bench.timing import cpu_time_ms, gpu_time_ms

ROWS, DIM, BAGS, POOLING = 8_000_000, 128, 4096, 16
BATCHES = 8
OPTIMIZERS = {"sgd": {"lr": 0.01}, "adam": {"lr": 0.001}, "rowwise_adagrad": {"lr": 0.01}}
TARGETS = dict(build_s=3.0)


def run(quick: bool = False) -> dict:
    from xferlib.backend import cupy_available

    gpu = cupy_available()
    rows = ROWS if gpu else 1 << 18
    print(f"collection step: {rows:,} x {DIM} fp32, {BAGS:,} bags x {POOLING} Zipf lookups, "
          f"{'GPU' if gpu else 'NumPy path (no GPU)'}")
    rng = np.random.default_rng(0)
    permutation = rng.permutation(rows)
    batches = [zipf_indices(rng, rows, BAGS * POOLING, permutation=permutation)
               for _ in range(2 if quick else BATCHES)]
    offsets = np.arange(0, BAGS * POOLING + 1, POOLING, dtype=np.int64)
    unique = float(np.mean([np.unique(b).size for b in batches]))
    records = []
    placements = ("host", "hbm") if gpu else ("hbm",)
    for name, hyper in OPTIMIZERS.items():
        for placement in placements:
            records.append(_one(name, hyper, placement, rows, batches, offsets, gpu, quick))
            _print(records[-1])
    checks = [dict(target=f"build <= {TARGETS['build_s']} s ({r['impl']})",
                   value=r["build_s"], met=r["build_s"] <= TARGETS["build_s"])
              for r in records] if gpu else []
    for c in checks:
        print(f"  target {c['target']}: {c['value']:.2f} s  {'met' if c['met'] else 'MISSED'}")
    return {"rows": records, "unique_rows_per_batch": unique, "targets": checks}


def _one(name, hyper, placement, rows, batches, offsets, gpu, quick) -> dict:
    from xferlib.collection import EmbeddingCollection, TableConfig

    start = time.perf_counter()
    coll = EmbeddingCollection([TableConfig(rows, DIM, placement=placement,
                                            init=("uniform", -0.01, 0.01))], name, hyper,
                               device="cuda" if gpu else "cpu", seed=0)
    if gpu:
        import cupy

        cupy.cuda.Device().synchronize()
        xp = cupy
    else:
        xp = np
    build = time.perf_counter() - start
    idx = [xp.asarray(b) for b in batches]
    off = xp.asarray(offsets)
    grad = xp.asarray(np.random.default_rng(1).standard_normal((BAGS, DIM), np.float32))

    def step(i):
        _, ctx = coll.forward(idx[i % len(idx)], off)
        coll.backward(ctx, grad)

    repeats = 5 if quick else 20
    if gpu:
        ms = gpu_time_ms(step, repeats=repeats, steps=4)
        cupy.cuda.Device().synchronize()
        begin = time.perf_counter()
        for i in range(20):
            step(i)
        host_us = (time.perf_counter() - begin) / 20 * 1e6
        cupy.cuda.Device().synchronize()
    else:
        ms = cpu_time_ms(step, repeats=3 if quick else 10)
        host_us = ms * 1e3
    record = {"impl": f"collection {name} {placement}", "optimizer": name,
              "placement": placement, "ms": ms, "build_s": build, "host_us_per_step": host_us,
              "lookups": BAGS * POOLING, "Mlookups_per_s": BAGS * POOLING / ms / 1e3}
    del coll, idx
    gc.collect()
    if gpu:
        cupy.get_default_memory_pool().free_all_blocks()
    return record


def _print(r) -> None:
    print(f"  {r['ms']:9.3f} ms  {r['Mlookups_per_s']:8.1f} M lookups/s  {r['impl']}  "
          f"(build {r['build_s']:.2f} s, host {r['host_us_per_step']:.0f} us per step)")
