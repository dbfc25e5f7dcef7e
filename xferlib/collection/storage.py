"""Where a collection's rows live: one buffer per placement, each table a block of it.

Every table keeps the host tables' row layout (``xferlib.table.layout.RowLayout``: the
weights, then on a 16-byte boundary the optimizer state and the int64 step count), so one
fetch of a row brings its weights and state together and the table kernels' row update
applies unchanged. The tables of one placement lie one after another in one flat buffer
(``hbm``: GPU memory; ``host``: host RAM the GPU maps), each starting on a 64-byte boundary;
kernels find table ``t`` at ``base[t]`` (in elements) with rows ``row_width[t]`` apart.
On a machine without a GPU both buffers are NumPy arrays (the NumPy path).
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np

from xferlib import managed
from xferlib.memory import check_host_memory, pinned_empty
from xferlib.table.layout import RowLayout, split_state

__all__ = ["TableBlock", "plan_blocks", "allocate_host"]


@dataclasses.dataclass(frozen=True)
class TableBlock:
    """Table ``t``'s place in its placement's buffer: ``base`` (elements from the buffer's
    start), its ``layout`` and ``num_rows``."""

    base: int
    num_rows: int
    layout: RowLayout

    @property
    def size(self) -> int:
        return self.num_rows * self.layout.row_width

    def rows(self, buffer):
        """The table's ``(num_rows, row_width)`` block of ``buffer`` (a view)."""
        return buffer[self.base:self.base + self.size].reshape(self.num_rows,
                                                                 self.layout.row_width)

    def weights(self, buffer):
        return self.rows(buffer)[:, :self.layout.dim]

    def state(self, buffer):
        layout = self.layout
        return self.rows(buffer)[:, layout.state_offset:layout.state_offset
                                 + layout.state_width]

    def split(self, buffer):
        """``(slots, row scalars, steps)`` views of the table's state (NumPy buffers)."""
        return split_state(self.layout, self.state(buffer))


def plan_blocks(layouts, num_rows, itemsize: int):
    """Blocks for tables of ``layouts`` / ``num_rows`` laid one after another; returns
    ``(blocks, total elements)``. Tables of one row layout lie back to back, so the buffer is
    one table of their rows together (a row's place is ``base / row_width + row`` rows in:
    the host tables' GPU cache keys rows so); otherwise each starts on a 64-byte line."""
    per_line = max(1, 64 // itemsize)
    uniform = len({layout.row_width for layout in layouts}) == 1
    blocks, base = [], 0
    for layout, rows in zip(layouts, num_rows):
        blocks.append(TableBlock(base, rows, layout))
        base += rows * layout.row_width
        if not uniform:
            base = -(-base // per_line) * per_line
    return blocks, base


def allocate_host(elements: int, dtype, what: str, pinned: bool):
    """A flat host buffer of ``elements``, refused with both sizes before anything is
    allocated when the host cannot hold it. Where a GPU will reach it (``pinned``): managed
    memory kept in host RAM where the GPU supports it (scattered rows cross the link at
    twice the rate of registered pages: ``xferlib.managed``), else pinned."""
    dtype = np.dtype(dtype)
    check_host_memory(elements * dtype.itemsize, what)
    return host_buffer_empty(elements, dtype) if pinned else np.empty(elements, dtype)


def host_buffer_empty(elements: int, dtype):
    """A flat buffer a GPU reaches: managed memory where ``managed_available()``, else (or
    when the driver refuses the allocation or its advice, with a warning) pinned memory."""
    if managed.managed_available():
        try:
            return managed.managed_empty((elements,), dtype)
        except (RuntimeError, MemoryError) as err:  # CuPy's CUDA errors are RuntimeErrors
            warnings.warn(f"managed host memory failed ({type(err).__name__}: {err}); "
                          "pinning the host tables instead", RuntimeWarning, stacklevel=2)
    return pinned_empty((elements,), dtype)
