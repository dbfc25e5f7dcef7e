"""compute-sanitizer (memcheck, racecheck) over each kernel family's GPU tests, in parallel.

Run on the GPU machine from the repository root::

    python3 tests/sanitizer_run.py                          # every family, both tools
    python3 tests/sanitizer_run.py rows collection          # some families
    python3 tests/sanitizer_run.py --tools memcheck --select cover --jobs 16
    python3 tests/sanitizer_run.py --tools racecheck --select one --jobs 16

Each family's GPU tests (valid and invalid inputs: every family's bad-index and bad-offset cases
are marked gpu) run under the sanitizer, split into shards that run at once (the sanitizer's
cost is mostly on the CPU, one core per process). ``--select cover`` keeps, of each
parametrized test, the fewest cases that still use every parameter value at least once (so
every dtype, index width, placement and bad-input case reaches the kernels), which makes a
full memcheck + racecheck pass fit in minutes; ``--select all`` runs every case.

One line per family and tool: the sanitizer's error count (``?`` when a shard printed no
summary: it crashed or ran past ``--timeout``), the tests passed / failed. Exit status 0 when
every shard reported zero errors and its tests passed. Logs go to ``--out``.

CuPy's memory pools are switched off inside the run (each array its own allocation), so an
access past an array's end is past an allocation's end, where memcheck sees it; inside a pool
block it would land in a neighbour and go unseen. torch's caching allocator likewise. CUDA-graph
captures need those pools (a plain cudaMalloc is refused while a stream captures, and CuPy
without its pool captures wrong addresses), and a test of the memory a freed table returns
measures them: those run in the plain GPU suite instead.

racecheck is far slower than memcheck (it checks every shared-memory access): on a 16-core
H100 machine, memcheck over every family (``--select cover``) takes about 2 minutes; racecheck
with ``--select cover`` finished the kernel, row, scattered-row and flat-optimizer families in
3 minutes but not the table, TT, collection and reliability families in 9. Shared-memory
hazards are a property of a kernel's code path more than of the data's values: ``--select
one`` (each test's first case) runs every test once at racecheck's pace, but not every
specialisation (a dtype or width only a later case uses): use ``cover`` where time allows.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

FAMILIES = {
    "kernels": ["tests/core/test_kernels.py"],
    "rows": ["tests/core/test_rows.py", "tests/core/test_batch.py", "tests/core/test_run_ids.py"],
    "table": ["tests/core/test_table.py", "tests/core/test_table_cache.py",
              "tests/core/test_table_sums.py"],
    "scattered": ["tests/core/test_bench_kernels.py"],
    "optim": ["tests/core/test_optim.py"],
    "tt": ["tests/core/test_tt.py", "tests/core/test_tt_kernels.py",
           "tests/core/test_tt_reduce_split.py", "tests/torch/test_tt_cache_kernels.py",
           "tests/torch/test_tt_cache_fused.py", "tests/core/test_tt_table.py"],
    "exchange": ["tests/core/test_exchange.py"],
    "interaction": ["tests/core/test_interaction.py"],
    "collection": ["tests/core/test_collection.py", "tests/core/test_collection_gpu.py",
                   "tests/core/test_collection_tt.py",
                   "tests/core/test_collection_pending.py",
                   "tests/torch/test_collection_torch.py", "tests/jax/test_collection_jax.py"],
    "reliability": ["tests/core/test_reliability_fuzz.py",
                    "tests/core/test_reliability_nonfinite.py",
                    "tests/core/test_reliability_determinism.py"],
}
# CUDA-graph tests (graph, replayed, capture in their names) need torch's and CuPy's pools (off here), and a memory-footprint test
# measures the pools: both run in the plain GPU suite.
SELECT_EXPR = "not graph and not replayed and not capture and not tables_are_freed"

RUNNER = """
import sys
import cupy
cupy.cuda.set_allocator(None)
cupy.cuda.set_pinned_memory_allocator(None)
import pytest
ids = open(sys.argv[1]).read().splitlines()
sys.exit(pytest.main(["-q", "-m", "gpu", "-p", "no:cacheprovider", *ids]))
"""


def collect(files: list[str]) -> list[str]:
    """The GPU test ids of ``files`` that the sanitizer runs."""
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", "gpu",
                          "-k", SELECT_EXPR, "-p", "no:cacheprovider", *files],
                         capture_output=True, text=True)
    ids = [line.strip() for line in out.stdout.splitlines() if "::" in line]
    if out.returncode != 0 or not ids:  # a file that fails to import must not drop out
        raise SystemExit(f"collecting {files} failed (pytest exit {out.returncode}):\n"
                         f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return ids


def cover(ids: list[str]) -> list[str]:
    """Of each test function's cases, the fewest that use every parameter value once.

    A greedy set cover over the ``-``-separated parts of the case ids, each part with its
    position: each round keeps the case that adds the most (position, value) pairs not yet
    used.
    """
    by_function: dict[str, list[str]] = {}
    for test_id in ids:
        by_function.setdefault(test_id.split("[", 1)[0], []).append(test_id)
    kept = []
    for cases in by_function.values():
        parts = {c: set(enumerate(c.partition("[")[2].rstrip("]").split("-")))
                 for c in cases}
        missing = set().union(*parts.values())
        while missing:
            best = max(cases, key=lambda c: len(parts[c] & missing))
            kept.append(best)
            missing -= parts[best]
    return kept


def one_each(ids: list[str]) -> list[str]:
    """The first case of each test function: every test once (not every parameter value:
    a kernel specialised for a dtype or width that only a later case uses is not run)."""
    first: dict[str, str] = {}
    for test_id in ids:
        first.setdefault(test_id.split("[", 1)[0], test_id)
    return list(first.values())


SELECTIONS = {"all": lambda ids: ids, "cover": cover, "one": one_each}


def shards(ids: list[str], count: int) -> list[list[str]]:
    """``ids`` dealt into ``count`` shards (dealt, so each shard gets every test function)."""
    return [ids[k::count] for k in range(count) if ids[k::count]]


def summary_errors(text: str) -> int | None:
    """The error count of one sanitizer log, None when it printed no summary."""
    found = re.findall(r"ERROR SUMMARY: (\d+)", text)
    found += re.findall(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?", text)
    return sum(int(n) for n in found) if found else None


def pytest_counts(text: str) -> tuple[int, int, int]:
    """(passed, skipped, failed + errors) from pytest's last summary line."""
    tail = text[-2000:]
    passed = sum(int(n) for n in re.findall(r"(\d+) passed", tail))
    skipped = sum(int(n) for n in re.findall(r"(\d+) skipped", tail))
    failed = sum(int(n) for n in re.findall(r"(\d+) (?:failed|errors?)\b", tail))
    return passed, skipped, failed


def run_shard(sanitizer: str, tool: str, ids: list[str], log: Path, timeout: float,
              fuzz: int) -> dict:
    ids_file = log.with_suffix(".ids")
    ids_file.write_text("\n".join(ids))
    extra = (["--leak-check", "no", "--check-device-heap", "yes"] if tool == "memcheck"
             else ["--racecheck-report", "analysis"])
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1",
               XLA_PYTHON_CLIENT_PREALLOCATE="false", XFERLIB_FUZZ_EXAMPLES=str(fuzz))
    start = time.perf_counter()
    with open(log, "w") as out:
        # A session of its own: a timeout ends the sanitizer and the Python under it.
        proc = subprocess.Popen([sanitizer, "--tool", tool, *extra,
                                 "--log-file", f"{log}.sanitizer",
                                 sys.executable, "-c", RUNNER, str(ids_file)],
                                stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
    text = log.read_text(errors="replace")
    sanitizer_log = Path(f"{log}.sanitizer")
    if sanitizer_log.exists():
        text += sanitizer_log.read_text(errors="replace")
    passed, skipped, failed = pytest_counts(log.read_text(errors="replace"))
    return dict(rc=rc, errors=summary_errors(text), passed=passed, skipped=skipped, failed=failed,
                tests=len(ids), seconds=time.perf_counter() - start)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("families", nargs="*", help=f"some of: {', '.join(FAMILIES)}")
    parser.add_argument("--tools", default="memcheck racecheck",
                        help="sanitizer tools, space-separated (default: both)")
    parser.add_argument("--select", choices=tuple(SELECTIONS), default="all",
                        help="every case; the fewest that use every parameter value; or the "
                             "first case of each test (racecheck's pace)")
    parser.add_argument("--fuzz-examples", type=int, default=10,
                        help="examples per property-based test (XFERLIB_FUZZ_EXAMPLES)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="sanitizer processes at once (default: one per CPU)")
    parser.add_argument("--timeout", type=float, default=3600,
                        help="seconds one shard may run")
    parser.add_argument("--out", default="sanitizer-logs", help="folder for the logs")
    args = parser.parse_args(argv)
    unknown = [f for f in args.families if f not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    sanitizer = (os.environ.get("SANITIZER") or shutil.which("compute-sanitizer")
                 or "/usr/local/cuda/bin/compute-sanitizer")
    if not os.access(sanitizer, os.X_OK):
        parser.error("compute-sanitizer not found (set SANITIZER=/path/to/compute-sanitizer)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    families = args.families or list(FAMILIES)
    selected = {}
    for family in families:
        ids = collect(FAMILIES[family])
        selected[family] = SELECTIONS[args.select](ids)
        print(f"{family}: {len(selected[family])} of {len(ids)} GPU tests", flush=True)
    total = sum(len(ids) for ids in selected.values())
    tools = args.tools.split()
    work = []   # (family, tool, shard index, ids): shards per family in proportion to its tests
    for family, ids in selected.items():
        count = max(1, round(args.jobs * len(ids) / total))
        for tool in tools:
            for k, shard in enumerate(shards(ids, count)):
                work.append((family, tool, k, shard))
    # The longest shards first, so the last ones to start are short.
    work.sort(key=lambda w: (w[1] != "memcheck", len(w[3])), reverse=True)  # racecheck first
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(
            lambda w: (w, run_shard(sanitizer, w[1], w[3], out / f"{w[0]}.{w[1]}.{w[2]}.log",
                                    args.timeout, args.fuzz_examples)), work))

    status = 0
    print(f"\n{'family':12s} {'tool':10s} {'errors':>7s} {'passed':>7s} {'skipped':>7s} "
          f"{'failed':>7s} {'tests':>6s} {'slowest':>8s}")
    for family in families:
        for tool in tools:
            mine = [r for w, r in results if w[0] == family and w[1] == tool]
            missing = any(r["errors"] is None for r in mine)
            errors = "?" if missing else str(sum(r["errors"] for r in mine))
            passed = sum(r["passed"] for r in mine)
            failed = sum(r["failed"] for r in mine)
            skipped = sum(r["skipped"] for r in mine)
            tests = sum(r["tests"] for r in mine)
            slowest = max(r["seconds"] for r in mine)
            timeouts = sum(r["rc"] == "timeout" for r in mine)
            note = f"  ({timeouts} shard(s) timed out)" if timeouts else ""
            print(f"{family:12s} {tool:10s} {errors:>7s} {passed:>7d} {skipped:>7d} {failed:>7d} "
                  f"{tests:>6d} {slowest:7.0f}s{note}")
            if errors != "0" or failed or passed + skipped < tests or any(
                    r["rc"] != 0 for r in mine):
                status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
