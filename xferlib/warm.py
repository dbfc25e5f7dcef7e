"""Compiling the kernels ahead: ``xferlib doctor --warm`` and :func:`warm_kernels`.

Each kernel family is one CuPy ``RawModule`` compiled with NVRTC the first time a process
launches one of its kernels (``xferlib/_kernels/_registry.py``). CuPy keeps every compiled
module in its disk cache (``~/.cupy/kernel_cache``, or ``CUPY_CACHE_DIR``), so a module is
compiled once per machine; what remains is the first run on a fresh machine, which would pay
every compile before its first step. :func:`warm_kernels` compiles the families ahead, several
at once (NVRTC runs outside the GIL), either once after installing (``xferlib doctor
--warm``) or in the background while a run builds its tables
(``warm_kernels(..., background=True)``).

TT kernels are specialised per TT shape (their modules are made when a shape is first used)
and are not warmed here.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time

__all__ = ["fixed_modules", "warm_kernels"]


def fixed_modules(rules=None, dtypes=("float32",)) -> tuple:
    """The kernel modules a run may use whatever its shapes: every fixed family and the
    collection's update modules of ``rules`` (names of ``xferlib.SPARSE_OPTIMIZERS``; all
    when None) for ``dtypes``."""
    from xferlib._kernels import collection, collection_update, optim, rows, scattered, table
    from xferlib._kernels.cache import CACHE_MODULE
    from xferlib._kernels.interaction import INTERACTION_MODULE
    from xferlib._kernels.verdict import VERDICT_MODULE
    from xferlib.table.rules import sparse_rule

    # (every batch's verdict copy: its module loaded before any step is captured)
    modules = [collection.COLLECTION_MODULE, optim.OPTIM_MODULE, rows.ROWS_MODULE,
               scattered.SCATTERED_MODULE, CACHE_MODULE, table.TABLE_MODULE,
               INTERACTION_MODULE, VERDICT_MODULE]
    ids = collection.RULE_IDS if rules is None else \
        list(dict.fromkeys(int(sparse_rule(r).kind) for r in rules))
    modules += [collection_update.update_module(rule, d) for rule in ids for d in dtypes]
    return tuple(modules)


def warm_kernels(modules=None, *, device: int | None = None, workers: int | None = None,
                 background: bool = False):
    """Compile ``modules`` (default :func:`fixed_modules`) for GPU ``device`` (default
    CuPy's current one), ``workers`` at a time (default: the CPU count, at most 8).

    Returns ``{module name: seconds}`` (a module already compiled in this process takes
    none; one in CuPy's disk cache only loads); with ``background`` the compiles run in a
    daemon thread and the thread is returned at once (a launch that needs a module still
    being compiled waits for it)."""
    import cupy

    if device is None:
        device = cupy.cuda.runtime.getDevice()
    modules = fixed_modules() if modules is None else tuple(modules)
    workers = workers or min(8, os.cpu_count() or 1)

    def one(module):
        t0 = time.perf_counter()
        # The pool's threads are ours and end with it: make the device current without
        # restoring the thread's previous one. Restoring would make device 0 current, and
        # since CUDA 12 that opens a context there (a rank of a job on GPU 1 then holds
        # one on GPU 0 too).
        cupy.cuda.runtime.setDevice(device)
        module.module()
        return module.name, time.perf_counter() - t0

    def run():
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            return dict(pool.map(one, modules))

    if not background:
        return run()
    thread = threading.Thread(target=run, name="xferlib-warm-kernels", daemon=True)
    thread.start()
    return thread


def warm_command() -> int:
    """``xferlib doctor --warm``: compile every fixed kernel family on this machine's GPU,
    saying how long it took."""
    from xferlib.backend import cupy_available

    if not cupy_available():
        print("xferlib doctor --warm: no GPU with CuPy here, nothing to compile (the NumPy "
              "path needs no kernels)")
        return 0
    modules = fixed_modules(dtypes=("float32", "float64"))
    t0 = time.perf_counter()
    took = warm_kernels(modules)
    total = time.perf_counter() - t0
    for name, seconds in sorted(took.items(), key=lambda kv: -kv[1]):
        print(f"  {seconds:7.2f} s  {name}")
    print(f"compiled or loaded {len(took)} kernel modules in {total:.1f} s; CuPy's disk cache "
          f"(CUPY_CACHE_DIR, default ~/.cupy/kernel_cache) keeps them for every later run "
          f"(TT kernels compile per TT shape, at first use)")
    return 0
