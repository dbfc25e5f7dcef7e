"""Row layout of a host table's storage, and the weight initializers.

One row of storage holds the row's weights, then (on a 16-byte boundary) its optimizer state:
the rule's full-width slots (``dim`` values each), the per-row scalars, and the row's step
count as an 8-byte-aligned int64 at the end; the parts start on 16-byte words, so kernels move
whole 16-byte words, and one sorted fetch brings a row's weights and state together. Rows are
padded to 64 bytes where that costs at most an eighth of the row: every row then starts on a
host cache line, so a 512-byte row crosses the
link as 8 whole lines instead of 9 with a partial line at each end (a partial-line write from
the GPU makes the host merge it into the line). The GPU cache keeps rows in the same layout.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """Where each part of a row sits, in units of the table's dtype. The offsets and widths
    are computed once per layout (every step reads them)."""

    dim: int
    itemsize: int
    slots: tuple
    row_scalars: tuple

    @functools.cached_property
    def state_offset(self) -> int:  # start of the state in an interleaved row
        return _align(self.dim, self.itemsize, 16)

    @functools.cached_property
    def step_offset(self) -> int:  # the int64 step count, relative to the state
        return _align(len(self.slots) * self.dim + len(self.row_scalars), self.itemsize, 8)

    @functools.cached_property
    def state_width(self) -> int:
        return _align(self.step_offset + 8 // self.itemsize, self.itemsize, 16)

    @functools.cached_property
    def used_width(self) -> int:  # weights and state, without the row's padding
        return self.state_offset + self.state_width

    @functools.cached_property
    def row_width(self) -> int:
        """The storage row: padded to a 64-byte line where that costs at most an eighth of
        the row (a 528-byte row becomes 576); small rows stay at 16 bytes."""
        lined = _align(self.used_width, self.itemsize, 64)
        return lined if 8 * (lined - self.used_width) <= self.used_width else self.used_width


def _align(units: int, itemsize: int, boundary: int) -> int:
    """``units`` rounded up so that ``units * itemsize`` is a multiple of ``boundary`` bytes
    (16: rows and their parts start on 16-byte words, so kernels move whole words)."""
    per_word = max(1, boundary // itemsize)
    return -(-units // per_word) * per_word


def split_state(layout: RowLayout, state):
    """Views of a (rows x state_width) block: slots, row scalars and the int64 steps."""
    dim = layout.dim
    slots = {name: state[:, k * dim:(k + 1) * dim] for k, name in enumerate(layout.slots)}
    base = len(layout.slots) * dim
    scalars = {name: state[:, base + k] for k, name in enumerate(layout.row_scalars)}
    step_bytes = slice(layout.step_offset * layout.itemsize,
                       layout.step_offset * layout.itemsize + 8)
    steps = state.view(np.uint8)[:, step_bytes].view(np.int64)[:, 0]
    return slots, scalars, steps


def initial_weights(init, rng):
    """Parse ``init``: ``"zeros"``, ``("uniform", low, high)``, ``("normal", mean, std)``."""
    if isinstance(init, str):
        init = (init,)
    kind = init[0] if isinstance(init, tuple) and init else None
    if kind == "zeros" and len(init) == 1:
        return lambda out: out.fill(0)
    if kind in ("uniform", "normal") and len(init) == 3:
        a, b = float(init[1]), float(init[2])
        if not (np.isfinite(a) and np.isfinite(b)):  # NaN passes the checks below
            raise ValueError(f"{kind} init needs finite parameters, got ({a}, {b})")
        if kind == "uniform":
            if not a <= b:
                raise ValueError(f"uniform init needs low <= high, got ({a}, {b})")
            return lambda out: out.__setitem__(..., rng.uniform(a, b, out.shape))
        if b < 0:
            raise ValueError(f"normal init needs std >= 0, got {b}")
        return lambda out: out.__setitem__(..., rng.normal(a, b, out.shape))
    raise ValueError(f"init must be 'zeros', ('uniform', low, high), ('normal', mean, std) or "
                     f"a (num_rows, dim) NumPy array, got {init!r}")


INIT_CHUNK_ROWS = 1 << 16


