"""Timers for the benchmark suite: CUDA events on the GPU, perf_counter on the CPU.

Each returns the median over ``repeats`` calls after ``warmup`` calls; ``fn(i)`` gets the
repeat number so callers can rotate inputs.
"""

from __future__ import annotations

import statistics
import time


def gpu_time_ms(fn, repeats: int = 20, warmup: int = 3) -> float:
    import cupy

    stream = cupy.cuda.get_current_stream()
    for i in range(warmup):
        fn(i)
    stream.synchronize()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for i in range(repeats):
        start.record(stream)
        fn(i)
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def gpu_pipelined_ms(fn, steps: int = 20, repeats: int = 5, warmup: int = 3) -> float:
    """Milliseconds per call when ``steps`` calls run back to back (as in a training loop, the
    host queues the next call while the device works): CUDA events around each run of calls,
    the median over ``repeats`` runs, divided by ``steps``."""
    import cupy

    stream = cupy.cuda.get_current_stream()
    for i in range(warmup):
        fn(i)
    stream.synchronize()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(repeats):
        start.record(stream)
        for i in range(steps):
            fn(i)
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / steps)
    return statistics.median(times)


def cpu_time_ms(fn, repeats: int = 20, warmup: int = 2) -> float:
    for i in range(warmup):
        fn(i)
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        fn(i)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
