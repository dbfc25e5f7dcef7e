"""The benchmark suite behind ``xferlib bench``."""

from xferlib.bench.suite import SUITES, run_suites

__all__ = ["SUITES", "run_suites"]
