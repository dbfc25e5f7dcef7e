"""Typed configuration of an embedding collection: one :class:`TableConfig` per table.

A table is named, sized, placed and initialized here; the optimizer is the collection's
(one fused update for every table), with an optional per-table learning rate. Options are
grouped in small frozen dataclasses (TorchRec's table configs are the model), validated when
built, so a bad configuration fails before any memory is allocated.
"""

from __future__ import annotations

import dataclasses
import numbers

from xferlib.collection.init import init_kind

__all__ = ["TableConfig", "PLACEMENTS", "POOLINGS"]

# Where a table's rows and optimizer state live:
#   "hbm":  GPU memory (on a machine without a GPU: host RAM, the NumPy path);
#   "host": pinned host RAM, read and written by GPU kernels over the link.
PLACEMENTS = ("hbm", "host")
POOLINGS = ("sum", "mean")


def _integral(name: str, value, minimum: int) -> int:
    """``value`` as an int, refusing floats, strings and bools as torch refuses them for
    sizes (``nn.EmbeddingBag(10.7, 4)`` is a TypeError)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r} "
                        f"({type(value).__name__})")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


@dataclasses.dataclass(frozen=True)
class TableConfig:
    """One table of a collection.

    Args:
      num_rows, dim: the table's shape (``dim`` may differ between tables).
      name: the table's key in the per-table dict form and in ``state_dict``; default
        ``"t{k}"`` for the k-th table.
      placement: ``"hbm"`` (GPU memory) or ``"host"`` (pinned host RAM, read and written by
        the step's kernels over the link).
      lr: this table's learning rate; None takes the collection optimizer's ``lr``.
      cache_rows: for a ``host`` table on the GPU, rows (with their optimizer state) of it
        kept in the collection's GPU cache of hot rows. The host tables share one cache
        (sized by their sum; least recently used rows go first, a row admitted the second
        time it misses), so its rows go to whichever table is hot; it needs the cached
        tables to share one row layout (the same ``dim``). Unused on the CPU.
      init: ``("normal", mean, std)`` (default ``("normal", 0, 1)``, as
        ``torch.nn.EmbeddingBag``), ``("uniform", low, high)`` or ``"zeros"``.

    >>> TableConfig(1000, 16, name="user", placement="host").placement
    'host'
    """

    num_rows: int
    dim: int
    name: str | None = None
    placement: str = "hbm"
    lr: float | None = None
    init: object = ("normal", 0.0, 1.0)
    cache_rows: int = 0

    def __post_init__(self):
        object.__setattr__(self, "num_rows", _integral("num_rows", self.num_rows, 1))
        object.__setattr__(self, "dim", _integral("dim", self.dim, 1))
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.name is not None and not isinstance(self.name, str):
            raise TypeError(f"name must be a string, got {self.name!r}")
        if self.lr is not None:
            if isinstance(self.lr, bool) or not isinstance(self.lr, numbers.Real):
                raise TypeError(f"lr must be a number, got {self.lr!r}")
            if not self.lr >= 0:
                raise ValueError(f"lr must be >= 0, got {self.lr}")
            object.__setattr__(self, "lr", float(self.lr))
        init_kind(self.init)  # a bad initializer fails here, before anything is allocated
        object.__setattr__(self, "cache_rows", _integral("cache_rows", self.cache_rows, 0))
        if self.cache_rows and self.placement != "host":
            raise ValueError(f"cache_rows is for host tables (a cache of their hot rows in "
                             f"HBM); table {self.name!r} is placed in {self.placement!r}")

    def named(self, k: int) -> "TableConfig":
        """This config with its default name filled in (the k-th table: ``"t{k}"``)."""
        return self if self.name is not None else dataclasses.replace(self, name=f"t{k}")


def feature_entries(names, features: dict) -> list:
    """The per-table dict form's entries in ``names``' order, checked: ``features`` names
    every table once, each entry is ``(indices, offsets)`` or, for every table alike,
    ``(indices, offsets, per_sample_weights)``, and every table has the same number of bags
    (``offsets`` of ``B + 1``). Reads shapes only (NumPy, CuPy or torch arrays)."""
    missing = [n for n in names if n not in features]
    extra = sorted(set(features) - set(names))
    if missing or extra:
        raise KeyError(f"features must name every table once: missing {missing}, "
                       f"unknown {extra}")
    parts = [features[n] for n in names]
    if len({len(p) for p in parts}) != 1 or len(parts[0]) not in (2, 3):
        raise ValueError("every table's entry must be (indices, offsets) or, for all of "
                         "them, (indices, offsets, per_sample_weights)")
    bags = [int(p[1].shape[0]) - 1 for p in parts]
    if len(set(bags)) != 1:
        raise ValueError(f"every table needs the same number of bags, got "
                         f"{dict(zip(names, bags))}")
    return parts
