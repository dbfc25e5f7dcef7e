"""The flat layout: many tensors (*segments*) in one flat array, each on a 16-byte boundary.

>>> import numpy as np
>>> from xferlib.optim.layout import FlatLayout
>>> layout = FlatLayout.from_shapes([(3, 2), (5,)])
>>> [s.offset for s in layout.segments], layout.total   # 6 floats padded to 8
([0, 8], 16)
>>> flat = layout.pack([np.ones((3, 2), np.float32), np.ones(5, np.float32)])
>>> [v.shape for v in layout.views(flat)]
[(3, 2), (5,)]
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from xferlib._backend import array_module

__all__ = ["ALIGN_BYTES", "Segment", "FlatLayout"]

ALIGN_BYTES = 16  # every segment starts on a 16-byte boundary: whole-vector kernel accesses


@dataclasses.dataclass(frozen=True)
class Segment:
    """One tensor inside the flat buffer."""

    offset: int  # in elements
    size: int
    shape: tuple
    group: int


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """Where each tensor lives in one flat buffer of ``total`` elements of ``dtype``."""

    segments: tuple
    total: int
    dtype: np.dtype
    # What the GPU step derives from the layout alone (chunk tables, scalar-table rings), per
    # name: made once per layout, never part of its value (not compared, not shown).
    _derived: dict = dataclasses.field(default_factory=dict, init=False, repr=False,
                                       compare=False)

    def derived(self, name: str) -> dict:
        """The layout's store for the values called ``name`` derived from it (the caller
        keys them, by device for instance)."""
        return self._derived.setdefault(name, {})

    @classmethod
    def from_shapes(cls, shapes, groups=None, dtype=np.float32) -> "FlatLayout":
        """Lay out tensors of ``shapes`` (with ``groups`` ids, default all 0) in order, each
        padded to a 16-byte boundary."""
        dtype = np.dtype(dtype)
        shapes = [tuple(int(d) for d in s) for s in shapes]
        groups = [0] * len(shapes) if groups is None else [int(g) for g in groups]
        if len(groups) != len(shapes):
            raise ValueError(f"{len(shapes)} shapes but {len(groups)} group ids")
        if any(g < 0 for g in groups):
            raise ValueError(f"group ids must be >= 0, got {min(groups)}")
        align = max(1, ALIGN_BYTES // dtype.itemsize)
        segments, offset = [], 0
        for shape, group in zip(shapes, groups):
            if any(d < 0 for d in shape):
                raise ValueError(f"negative dimension in shape {shape}")
            size = math.prod(shape)
            segments.append(Segment(offset, size, shape, group))
            offset += -(-size // align) * align
        return cls(tuple(segments), offset, dtype)

    @property
    def num_groups(self) -> int:
        cached = self.__dict__.get("_num_groups")
        if cached is None:
            cached = 1 + max((s.group for s in self.segments), default=-1)
            object.__setattr__(self, "_num_groups", cached)
        return cached

    @property
    def group_ids(self) -> np.ndarray:
        """The group of each segment, as an array (cached)."""
        cached = self.__dict__.get("_group_ids")
        if cached is None:
            cached = np.array([s.group for s in self.segments], dtype=np.int64)
            object.__setattr__(self, "_group_ids", cached)
        return cached

    def empty(self, xp=np):
        return xp.empty(self.total, dtype=self.dtype)

    def zeros(self, xp=np):
        return xp.zeros(self.total, dtype=self.dtype)

    def views(self, flat) -> list:
        """One view per segment, shaped as the tensor, sharing memory with ``flat``."""
        self.check(flat, "flat")
        return [flat[s.offset:s.offset + s.size].reshape(s.shape) for s in self.segments]

    def pack(self, arrays, out=None):
        """Copy ``arrays`` (one per segment) into a flat buffer (padding zeroed)."""
        arrays = list(arrays)
        if len(arrays) != len(self.segments):
            raise ValueError(f"{len(arrays)} arrays for {len(self.segments)} segments")
        xp = array_module(arrays[0]) if arrays else np
        flat = self.zeros(xp) if out is None else out
        for seg, a in zip(self.segments, arrays):
            if tuple(a.shape) != seg.shape:
                raise ValueError(f"array of shape {tuple(a.shape)} for a segment of {seg.shape}")
            flat[seg.offset:seg.offset + seg.size] = a.reshape(-1)
        return flat

    def check(self, flat, name: str) -> None:
        if flat.ndim != 1 or flat.shape[0] != self.total:
            raise ValueError(f"{name} must be a flat array of {self.total} elements, got shape "
                             f"{tuple(flat.shape)}")
        if flat.dtype != self.dtype:
            raise TypeError(f"{name} dtype {flat.dtype} does not match the layout's {self.dtype}")
