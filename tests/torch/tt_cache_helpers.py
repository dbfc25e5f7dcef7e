"""Batches with hot rows and a populated row cache, for the TT row-cache tests."""

import numpy as np


def hot_batch(rows, n, seed, hot=()):
    """``n`` lookups of ``rows`` rows; ``hot``: (row, count) pairs placed at random positions."""
    g = np.random.default_rng(seed)
    idx = g.integers(0, rows, size=n)
    free = g.permutation(n)
    at = 0
    for row, count in hot:
        idx[free[at:at + count]] = row
        at += count
    return idx


def populate(module, rows):
    """Cache exactly the most counted ``rows`` (each counted three times) and end the warmup."""
    import torch

    module.reset_cache()
    module.update_cache(torch.as_tensor(np.repeat(rows, 3), device="cuda"))
    module.cache_populate()
