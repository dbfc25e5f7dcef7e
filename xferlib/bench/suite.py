"""Running benchmark suites by name, with JSON and plot output."""

from __future__ import annotations

import os

# JAX preallocates 75% of the GPU when it first touches it; torch and CuPy share the process
# here, so it must allocate on demand. Set before any suite imports jax.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from xferlib.bench import optim, table, transfer, tt
from xferlib.bench.report import print_table, write_json, write_plot

SUITES = {"transfer": transfer.run, "optim": optim.run, "table": table.run, "tt": tt.run}


def run_suites(names, *, quick=False, json_path=None, plot_path=None) -> dict:
    names = list(names) or list(SUITES)
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        raise ValueError(f"unknown benchmark suite(s) {unknown}; available: {sorted(SUITES)}")
    payload = {}
    for name in names:
        print(f"== xferlib bench {name}{' (quick)' if quick else ''}")
        payload[name] = SUITES[name](quick=quick)
        summary = payload[name].get("summary")
        if summary:
            print("xferlib gather beside the best baseline of this run:")
            print_table(summary, [("row_bytes", "row B", "d"), ("rows", "rows", "d"),
                                  ("order", "order", "s"), ("GB_per_s", "GB/s", ".1f"),
                                  ("pct_of_pinned_memcpy", "% memcpy", ".0f"),
                                  ("baseline_GB_per_s", "baseline", ".1f"),
                                  ("speedup", "speedup", ".2f"),
                                  ("best_baseline", "best baseline", "s")])
        targets = payload[name].get("targets")
        if targets:
            print("targets:")
            print_table(targets, [(k, k, _fmt(v)) for k, v in targets[0].items()])
    if json_path:
        write_json(json_path, payload)
    if plot_path:
        results = [r for suite in payload.values() for r in suite.get("results", [])]
        write_plot(plot_path, results)
    return payload


def _fmt(value) -> str:
    if isinstance(value, bool):
        return ""
    if isinstance(value, int):
        return "d"
    if isinstance(value, float):
        return ".3g"
    return "s"
