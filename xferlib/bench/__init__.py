"""The benchmark runner behind ``xferlib bench``: the suite registry (entry points of the
group ``xferlib.bench``), timers, shapes and report output; framework-free. The suites that
compare against torch and JAX live beside the adapters, in ``xferlib.adapters.bench``."""

from xferlib.bench.suite import ENTRY_POINT_GROUP, SUITES, SuiteRegistry, run_suites

__all__ = ["ENTRY_POINT_GROUP", "SUITES", "SuiteRegistry", "run_suites"]
