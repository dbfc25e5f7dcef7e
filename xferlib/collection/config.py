"""Typed configuration of an embedding collection: one :class:`TableConfig` per table.

A table is named, sized, placed and initialized here; the optimizer is the collection's
(one fused update for every table), with an optional per-table learning rate. Options are
grouped in small frozen dataclasses (TorchRec's table configs are the model), validated when
built, so a bad configuration fails before any memory is allocated.
"""

from __future__ import annotations

import dataclasses
import numbers

import numpy as np

from xferlib._backend import array_module
from xferlib.collection.init import init_kind
from xferlib.collection.numpy_path import check_entry_offsets
from xferlib.tt.initializers import WEIGHT_DISTS

__all__ = ["TableConfig", "PLACEMENTS", "POOLINGS"]

# Where a table's rows and optimizer state live:
#   "hbm":  GPU memory (on a machine without a GPU: host RAM, the NumPy path);
#   "host": pinned host RAM, read and written by GPU kernels over the link;
#   "tt":   Tensor-Train cores (an xferlib.tt.TTTable) replace the rows: lookups rebuild
#           only the rows they need, the update trains the cores (xferlib/collection/tt_tables.py).
PLACEMENTS = ("hbm", "host", "tt")
# The cores' initial draws (xferlib.tt.init_tt_cores).
TT_INITS = WEIGHT_DISTS
_DEFAULT_INIT = ("normal", 0.0, 1.0)
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
      placement: ``"hbm"`` (GPU memory), ``"host"`` (pinned host RAM, read and written by
        the step's kernels over the link) or ``"tt"`` (TT cores in GPU memory, an
        :class:`xferlib.tt.TTTable`: lookups rebuild the rows they need from the cores, the
        update trains the cores; see ``xferlib/collection/tt_tables.py``).
      lr: this table's learning rate; None takes the collection optimizer's ``lr``.
      cache_rows: for a ``host`` table on the GPU, rows (with their optimizer state) of it
        kept in the collection's GPU cache of hot rows. The host tables share one cache
        (sized by their sum; least recently used rows go first, a row admitted the second
        time it misses), so its rows go to whichever table is hot; it needs the cached
        tables to share one row layout (the same ``dim``). Unused on the CPU.
      init: ``("normal", mean, std)`` (default ``("normal", 0, 1)``, as
        ``torch.nn.EmbeddingBag``), ``("uniform", low, high)`` or ``"zeros"``. A ``tt``
        table takes the default (its cores drawn by ``tt_init``) or ``"zeros"`` (zero cores).
      tt_ranks: a ``tt`` table's inner TT ranks: one int for every rank, or ``d - 1`` ints
        for ``d`` cores (2 to 4; default 3 cores). Needed for ``tt`` tables, refused for the
        others.
      tt_p_shapes, tt_q_shapes: the factorizations of the rows (product ``>= num_rows``) and
        of ``dim`` (product ``== dim``); None: balanced ones
        (:func:`xferlib.tt.suggest_tt_shapes`). After construction all three hold the
        table's :class:`xferlib.tt.TTShape` as tuples.
      tt_init: the cores' distribution (:func:`xferlib.tt.init_tt_cores`:
        ``"approx-normal"``, FBTT's default, ``"normal"``, ``"uniform"``,
        ``"naive-uniform"``, ``"approx-uniform"``), drawn from the table's stream of the
        collection's seed.

    >>> TableConfig(1000, 16, name="user", placement="host").placement
    'host'
    >>> TableConfig(1000, 16, placement="tt", tt_ranks=8).tt_p_shapes
    (10, 10, 10)
    """

    num_rows: int
    dim: int
    name: str | None = None
    placement: str = "hbm"
    lr: float | None = None
    init: object = ("normal", 0.0, 1.0)
    cache_rows: int = 0
    tt_ranks: object = None
    tt_p_shapes: object = None
    tt_q_shapes: object = None
    tt_init: str = "approx-normal"

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
        if self.placement == "tt":
            self._tt_shape()
        else:
            given = [f for f in ("tt_ranks", "tt_p_shapes", "tt_q_shapes")
                     if getattr(self, f) is not None]
            if given or self.tt_init != "approx-normal":
                raise ValueError(f"{given or ['tt_init']} are for tt tables; table "
                                 f"{self.name!r} is placed in {self.placement!r}")

    def _tt_shape(self) -> None:
        """A tt table's factorization checked and filled in (p, q, ranks as tuples)."""
        from xferlib.tt.shape import TTShape, row_bound, suggest_tt_shapes

        what = f"tt table {self.name!r}" if self.name is not None else "a tt table"
        if self.tt_ranks is None:
            raise ValueError(f"{what} needs tt_ranks (its inner TT ranks)")
        if self.tt_init not in TT_INITS:
            raise ValueError(f"tt_init must be one of {TT_INITS}, got {self.tt_init!r}")
        init = ("zeros",) if self.init in ("zeros", ("zeros",)) else self.init
        if init != ("zeros",) and tuple(init) != _DEFAULT_INIT:
            raise ValueError(f"{what} draws its cores by tt_init; init may only be 'zeros' "
                             f"(zero cores), got {self.init!r}")
        ranks = self.tt_ranks
        if isinstance(ranks, bool) or not isinstance(ranks, (numbers.Integral, tuple, list)):
            raise TypeError(f"tt_ranks must be an int or a sequence of ints, got {ranks!r}")
        given = [x for x in (self.tt_p_shapes, self.tt_q_shapes) if x is not None]
        if given:
            d = len(tuple(given[0]))
        elif isinstance(ranks, numbers.Integral):
            d = 3
        else:
            d = len(tuple(ranks)) + 1
        if isinstance(ranks, numbers.Integral):  # bools were refused above
            ranks = (int(ranks),) * max(d - 1, 0)
        if not 2 <= d <= 4:
            raise ValueError(f"{what} needs 2 to 4 cores, got {d}")
        p = (suggest_tt_shapes(self.num_rows, d) if self.tt_p_shapes is None
             else self.tt_p_shapes)
        q = (suggest_tt_shapes(self.dim, d, allow_round_up=False) if self.tt_q_shapes is None
             else self.tt_q_shapes)
        shape = TTShape(tuple(p), tuple(q), tuple(ranks))
        if shape.dim != self.dim:
            raise ValueError(f"{what}: tt_q_shapes {shape.q_shapes} multiply to {shape.dim}, "
                             f"not its dim {self.dim}")
        try:
            row_bound(shape, self.num_rows)
        except ValueError:
            raise ValueError(f"{what}: tt_p_shapes {shape.p_shapes} hold {shape.num_rows} "
                             f"rows, fewer than its {self.num_rows}") from None
        for field, value in (("tt_ranks", shape.ranks), ("tt_p_shapes", shape.p_shapes),
                             ("tt_q_shapes", shape.q_shapes)):
            object.__setattr__(self, field, value)

    @property
    def tt_shape(self):
        """A tt table's :class:`xferlib.tt.TTShape` (None for the other placements)."""
        if self.placement != "tt":
            return None
        from xferlib.tt.shape import TTShape

        return TTShape(self.tt_p_shapes, self.tt_q_shapes, self.tt_ranks)

    def named(self, k: int) -> "TableConfig":
        """This config with its default name filled in (the k-th table: ``"t{k}"``)."""
        return self if self.name is not None else dataclasses.replace(self, name=f"t{k}")


def _dtype_kind(array) -> str:
    """NumPy's kind letter of a NumPy, CuPy or torch array's dtype; "f" for the floating
    dtypes NumPy files elsewhere or does not know (bfloat16, float8)."""
    name = str(array.dtype).replace("torch.", "")
    if name.startswith(("bfloat", "float8")):
        return "f"
    try:
        return np.dtype(name).kind
    except TypeError:
        return "?"


def feature_entries(names, features: dict) -> list:
    """The per-table dict form's entries in ``names``' order, checked: ``features`` names
    every table once, each entry is ``(indices, offsets)`` or, for every table alike,
    ``(indices, offsets, per_sample_weights)`` (1-D arrays: integer indices and offsets,
    floating point weights, one per index), and every table has the same number of bags
    (``offsets`` of ``B + 1``). Reads shapes and dtypes only (NumPy, CuPy or torch arrays);
    ``numpy_path.check_entry_offsets`` reads the offsets' values."""
    missing = [n for n in names if n not in features]
    extra = sorted(set(features) - set(names))
    if missing or extra:
        raise KeyError(f"features must name every table once: missing {missing}, "
                       f"unknown {extra}")
    parts = [features[n] for n in names]
    if not all(isinstance(p, (tuple, list)) for p in parts) \
            or len({len(p) for p in parts}) != 1 or len(parts[0]) not in (2, 3):
        raise ValueError("every table's entry must be (indices, offsets) or, for all of "
                         "them, (indices, offsets, per_sample_weights)")
    for name, part in zip(names, parts):
        for what, array in zip(("indices", "offsets", "per_sample_weights"), part):
            if not (hasattr(array, "shape") and hasattr(array, "dtype")):
                raise TypeError(f"table {name!r}: {what} must be an array, got "
                                f"{type(array).__name__}")
            if len(array.shape) != 1:
                raise ValueError(f"table {name!r}: {what} must be 1-D, got shape "
                                 f"{tuple(array.shape)}")
            floating = what == "per_sample_weights"
            if (_dtype_kind(array) == "f") != floating or _dtype_kind(array) not in "iuf":
                raise TypeError(f"table {name!r}: {what} must be "
                                f"{'floating point' if floating else 'integer'}, got "
                                f"{array.dtype}")
        if part[1].shape[0] < 1:
            raise ValueError(f"table {name!r}: offsets need at least one entry (B + 1)")
        if len(part) == 3 and part[2].shape[0] != part[0].shape[0]:
            raise ValueError(f"table {name!r}: per_sample_weights must have one weight per "
                             f"index ({part[0].shape[0]}), got {part[2].shape[0]}")
    bags = [int(p[1].shape[0]) - 1 for p in parts]
    if len(set(bags)) != 1:
        raise ValueError(f"every table needs the same number of bags, got "
                         f"{dict(zip(names, bags))}")
    return parts


def pack_features(names, features: dict):
    """FBGEMM's layout from the per-table dict form, tables in ``names``' order (see
    :meth:`EmbeddingCollection.pack <xferlib.collection.EmbeddingCollection.pack>`):
    NumPy arrays checked on the host, CuPy arrays refused on the device."""
    parts = feature_entries(names, features)
    xp = array_module(parts[0][0])
    if xp is np:
        for name, p in zip(names, parts):
            check_entry_offsets(name, p[1], int(p[0].shape[0]))
    starts, total = [], 0
    for p in parts:
        starts.append(total)
        total += int(p[0].shape[0])
    indices = xp.concatenate([xp.asarray(p[0]).astype(np.int64, copy=False) for p in parts])
    offsets = xp.concatenate(
        [xp.asarray(p[1][:-1]).astype(np.int64) + s for p, s in zip(parts, starts)]
        + [xp.asarray([total], dtype=np.int64)])
    if xp is not np:  # refused on the device: no host read
        bad = sum((xp.asarray(p[1][0]) != 0) | (xp.asarray(p[1][-1]) != p[0].shape[0])
                  for p in parts)
        offsets[:1] = xp.where(bad > 0, -1, offsets[:1])
    if len(parts[0]) == 3:
        return indices, offsets, xp.concatenate([xp.asarray(p[2]) for p in parts])
    return indices, offsets
