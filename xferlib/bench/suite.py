"""Running benchmark suites by name, with JSON and plot output.

Suites register themselves; the core never imports them by name. A package adds suites with
an entry point of the group ``xferlib.bench`` (in its ``pyproject.toml``) naming a mapping
``{suite name: run}``, where ``run(quick: bool = False) -> dict`` returns the suite's report
(``results``, ``targets``, ``environment``, ...)::

    [project.entry-points."xferlib.bench"]
    xferlib = "xferlib.adapters.bench:SUITES"

xferlib's own suites compare against torch and JAX, so they live beside the adapters, in
``xferlib.adapters.bench``. ``xferlib bench`` lists and runs the suites in the order of each
mapping; a name registered twice keeps its first registration.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from importlib import metadata

from xferlib.bench.report import print_table, write_json, write_plot

ENTRY_POINT_GROUP = "xferlib.bench"


def _entry_points(group: str) -> list:
    """Every entry point of ``group`` over all installed distributions. Not
    ``metadata.entry_points``: it keeps one distribution per name, and a stale
    ``xferlib.egg-info`` in a source checkout (first on ``sys.path`` there) would hide the
    installed metadata."""
    found, seen = [], set()
    for dist in metadata.distributions():
        for point in dist.entry_points.select(group=group):
            if (point.name, point.value) not in seen:
                seen.add((point.name, point.value))
                found.append(point)
    return found


class SuiteRegistry(Mapping):
    """The registered suites, name -> ``run`` function, loaded from the entry points of
    ``group`` when first asked for (loading imports the suites' modules, not torch or JAX:
    suites import frameworks inside ``run``).

    >>> from xferlib.bench import SUITES
    >>> list(SUITES)
    ['transfer', 'optim', 'table', 'tt']
    """

    def __init__(self, group: str = ENTRY_POINT_GROUP):
        self.group = group
        self._suites = None

    def _load(self) -> dict:
        if self._suites is None:
            suites = {}
            for point in _entry_points(self.group):
                for name, run in point.load().items():
                    suites.setdefault(name, run)
            self._suites = suites
        return self._suites

    def __getitem__(self, name: str):
        return self._load()[name]

    def __iter__(self):
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._load())


SUITES = SuiteRegistry()


def run_suites(names, *, quick=False, json_path=None, plot_path=None) -> dict:
    # JAX preallocates 75% of the GPU when it first touches it; torch and CuPy share the
    # process here, so it must allocate on demand. Set before any suite is loaded.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    names = list(names) or list(SUITES)
    if not SUITES:
        raise ValueError(f"no benchmark suite is registered (entry point group "
                         f"{ENTRY_POINT_GROUP!r}); reinstall xferlib (pip install -e .) so "
                         f"its metadata lists them")
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
