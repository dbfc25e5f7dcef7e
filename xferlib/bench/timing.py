"""Timers for the benchmark suite: CUDA events on the GPU, perf_counter on the CPU.

Each returns the median over ``repeats`` calls after ``warmup`` calls; ``fn(i)`` gets the
repeat number so callers can rotate inputs.
"""

from __future__ import annotations

import statistics
import time


def gpu_time_ms(fn, repeats: int = 20, warmup: int = 3, steps: int = 1) -> float:
    """Milliseconds per call: CUDA events around ``steps`` calls back to back, the median
    over ``repeats`` runs, divided by ``steps``. With ``steps=1`` each call is timed alone
    (the device waits while the host queues it); with more, the host queues ahead as a
    training loop does: one untimed call is queued before the start event, so the timed
    calls find the device busy, as every step past a loop's first does (else the host's
    time to queue the first call would count as device time, once a run)."""
    return gpu_times_ms([fn], repeats, warmup, steps)[0]


def gpu_times_ms(fns, repeats: int = 20, warmup: int = 3, steps: int = 1) -> list:
    """:func:`gpu_time_ms` of each of ``fns``, their runs interleaved (one run of each in
    turn, ``repeats`` times), so that a slow phase of the host weighs on every one alike."""
    import cupy

    stream = cupy.cuda.get_current_stream()
    for fn in fns:
        for i in range(warmup):
            fn(i)
    stream.synchronize()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = [[] for _ in fns]
    lead = 1 if steps > 1 else 0  # the untimed call that keeps the device busy
    for r in range(repeats):
        for fn, runs in zip(fns, times):
            first = r * (steps + lead)
            if lead:
                fn(first)
            start.record(stream)
            for i in range(lead, steps + lead):
                fn(first + i)
            end.record(stream)
            end.synchronize()
            runs.append(cupy.cuda.get_elapsed_time(start, end) / steps)
    return [statistics.median(runs) for runs in times]


def cpu_time_ms(fn, repeats: int = 20, warmup: int = 2) -> float:
    for i in range(warmup):
        fn(i)
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        fn(i)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
