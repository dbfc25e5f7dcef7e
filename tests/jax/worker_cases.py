"""What the JAX multi-device tests and their fresh-process workers share.

A worker (``mesh_worker.py``, ``collection_dist_worker.py``,
``collection_multiprocess_worker.py``) runs named cases with :func:`run_cases`: each case's
name goes to stderr as it starts, its result (a number, or the error's text) into one JSON
line on stdout, and a worker still running after ``XFERLIB_TEST_WORKER_LIMIT_S`` seconds
prints every thread's stack and exits. The test reads that back with :func:`results_of`,
which names the case a failed worker stood in before anything else.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys

# Under the tests' own subprocess limit (300 s): a stuck worker fails with its stacks.
WORKER_LIMIT_S = int(os.environ.get("XFERLIB_TEST_WORKER_LIMIT_S", "240"))


def run_cases(cases: dict, *, max_text: int = 800) -> None:
    """Run every case (name -> function of no arguments) and print ``{name: result}`` as one
    JSON line; a case that raises reports its error's text, so one failure names itself."""
    faulthandler.dump_traceback_later(WORKER_LIMIT_S, exit=True)
    results = {}
    for name, case in cases.items():
        print(f"case {name}", file=sys.stderr, flush=True)
        try:
            results[name] = case()
        except Exception as err:
            results[name] = f"{type(err).__name__}: {err}"[:max_text]
    faulthandler.cancel_dump_traceback_later()
    print(json.dumps(results), flush=True)


def results_of(returncode: int, stdout: str, stderr: str, cases=None) -> dict:
    """The worker's ``{case: result}``, checked to hold exactly ``cases`` (when given).

    A worker that failed (stopped by its limit, or exited with an error) is described by the
    case it was running, then the ends of its output; with ``cases`` every case's result is
    that text (so a cached result fails each case's test without running the worker again),
    without them it is raised as an AssertionError."""
    if returncode != 0:
        started = [line[5:] for line in stderr.splitlines() if line.startswith("case ")]
        where = f"stopped in case {started[-1]!r}\n" if started else "stopped before any case\n"
        # the end of stderr holds a stuck worker's stacks (every thread's, the main one last)
        failure = where + stdout[-2000:] + stderr[-12000:]
        if cases is None:
            raise AssertionError(failure)
        return {case: failure for case in cases}
    results = json.loads(stdout.strip().splitlines()[-1])
    if cases is not None:
        assert sorted(results) == sorted(cases), "the worker's cases and the test's list differ"
    return results
