"""xferlib's benchmark suites, beside the adapters because they compare against torch and
JAX: ``transfer``, ``optim``, ``table``, ``tt`` and ``collection``, each a module with
``run(quick=False)``.

``xferlib bench`` finds :data:`SUITES` through the entry point ``xferlib`` of the group
``xferlib.bench`` (``pyproject.toml``); the core never imports this package by name. Timers,
shapes and report output come from the core's ``xferlib.bench``.
"""

import os

# JAX preallocates 75% of the GPU when it first touches it; torch and CuPy share the process
# in these suites, so it must allocate on demand. Set before any suite imports jax.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from xferlib.adapters.bench import collection, optim, table, transfer, tt  # noqa: E402

# Name -> run(quick=False) -> dict, in the order `xferlib bench` lists and runs them.
SUITES = {"transfer": transfer.run, "optim": optim.run, "table": table.run, "tt": tt.run,
          "collection": collection.run}

__all__ = ["SUITES"]
