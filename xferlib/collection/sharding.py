"""Sharding plans: which rank of a process group holds which table (or rows) of a collection.

Embeddings are model-parallel (TorchRec's design): each table of a collection lives on one
rank (*table-wise*), or its rows are split into contiguous ranges over the ranks
(*row-wise*: a table too big for one rank's budget, or one named in ``row_wise``). The plan
balances the ranks greedily, largest table first, by two normalized costs added together:
bytes (rows with their optimizer state, as the collection stores them) and expected lookups
(each table's lookups per sample; a row-wise shard expects its share of the rows).

A plan is data: :class:`ShardingPlan` lists every :class:`Shard` (table, rank, row range,
bytes, expected lookups); the framework adapters build each rank's collection of its shards
from it (:meth:`ShardingPlan.local_configs`) and route lookups by it. Every rank computes the
same plan from the same arguments (no randomness, ties go to the lowest rank).

Also here, framework-free: the initial weights of a shard (the rows the unsharded collection
would start with, :func:`fill_shard_weights`) and checkpoints written one file per shard and
read back for any other plan (:func:`shard_arrays`, :func:`save_shard_files`,
:func:`write_manifest`, :func:`read_checkpoint`, :func:`read_rows`).

>>> from xferlib.collection import TableConfig, plan_sharding
>>> plan = plan_sharding([TableConfig(1000, 16, name="user"), TableConfig(10, 4, name="ad"),
...                       TableConfig(500, 8, name="item")], world_size=2, optimizer="adam")
>>> [(s.table, s.rank) for s in plan.shards]
[('user', 0), ('ad', 1), ('item', 1)]
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os

import numpy as np

from xferlib.collection.config import TableConfig
from xferlib.collection.init import fill_rows_gpu, fill_rows_numpy, table_stream
from xferlib.table.layout import RowLayout
from xferlib.table.rules import resolve_hyper, sparse_rule

__all__ = ["Shard", "ShardingPlan", "plan_sharding", "refuse_tt", "row_bytes",
           "fill_shard_weights", "shard_arrays", "save_shard_files", "write_manifest",
           "read_manifest", "read_checkpoint", "read_rows", "MANIFEST", "KINDS"]

KINDS = ("table_wise", "row_wise")
MANIFEST = "manifest.json"  # names the files of the checkpoint it completes; written last
_CHECKPOINT_KIND = "xferlib.ShardedCollection"
_SHARD_KIND = "xferlib.CollectionShard"
_MASK64 = (1 << 64) - 1
# The placements a sharded collection holds: tt tables are not sharded (refuse_tt).
SHARDED_PLACEMENTS = ("hbm", "host")


def refuse_tt(configs, what: str = "a sharded collection") -> None:
    """ValueError naming the tt tables among ``configs``: sharded collections hold hbm and
    host tables only (a tt table trains in an unsharded EmbeddingCollection)."""
    tt = [c.name for c in configs if isinstance(c, TableConfig) and c.placement == "tt"]
    if tt:
        raise ValueError(f"{what} cannot hold tt tables ({tt}): its shards are hbm or host "
                         f"tables; train tt tables in an unsharded EmbeddingCollection, or "
                         f"place them in 'hbm' or 'host'")


@dataclasses.dataclass(frozen=True)
class Shard:
    """Rows ``row_start:row_stop`` of table ``table`` (position ``table_index`` in the
    collection), held by ``rank``: ``bytes`` of rows and optimizer state, ``lookups``
    expected per sample."""

    table: str
    table_index: int
    rank: int
    row_start: int
    row_stop: int
    whole: bool
    bytes: int
    lookups: float

    @property
    def num_rows(self) -> int:
        return self.row_stop - self.row_start

    @property
    def local_name(self) -> str:
        """The shard's table name in its rank's collection: the table's name for a whole
        table, ``"name[start:stop]"`` for a row range."""
        return self.table if self.whole else f"{self.table}[{self.row_start}:{self.row_stop}]"


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """Where every table of a collection lives on ``world_size`` ranks.

    ``tables`` are the collection's configs (names filled in), ``kinds[t]`` is
    ``"table_wise"`` or ``"row_wise"`` for table ``t``, ``shards`` lists every shard, by
    table then row start. A rank's collection holds :meth:`shards_of` its rank, in that
    order."""

    world_size: int
    tables: tuple
    kinds: tuple
    shards: tuple

    def __post_init__(self):
        refuse_tt(self.tables, "a sharding plan")
        for rank in {s.rank for s in self.shards}:  # a rank's collection keys its shards
            names = [s.local_name for s in self.shards_of(rank)]
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise ValueError(f"rank {rank} would hold two shards named {twice} (a table "
                                 f"named like another's row range): rename the table")

    def shards_of(self, rank: int) -> tuple:
        """``rank``'s shards, in its collection's order (by table, then row start)."""
        return tuple(s for s in self.shards if s.rank == rank)

    def tables_of(self, rank: int) -> int:
        """How many tables ``rank`` holds a shard of (a bag of each reaches it at most once
        per sample: what bounds its share of a batch's lookups)."""
        return len({s.table_index for s in self.shards_of(rank)})

    def table_shards(self, table) -> tuple:
        """The shards of ``table`` (name or index), by row start."""
        t = table if isinstance(table, int) else [c.name for c in self.tables].index(table)
        return tuple(s for s in self.shards if s.table_index == t)

    def local_configs(self, rank: int) -> list:
        """The :class:`TableConfig` of each of ``rank``'s shards (a row range keeps its
        table's width, placement, learning rate, initializer and cache)."""
        out = []
        for s in self.shards_of(rank):
            config = self.tables[s.table_index]
            cache = min(config.cache_rows, s.num_rows)
            out.append(dataclasses.replace(config, name=s.local_name, num_rows=s.num_rows,
                                           cache_rows=cache))
        return out

    def rank_bytes(self, rank: int) -> dict:
        """``{placement: bytes}`` of ``rank``'s shards (rows and optimizer state)."""
        out = {p: 0 for p in SHARDED_PLACEMENTS}
        for s in self.shards_of(rank):
            out[self.tables[s.table_index].placement] += s.bytes
        return out

    def lookup_share(self, rank: int) -> float:
        """The fraction of a batch's expected lookups that ``rank`` serves."""
        total = sum(s.lookups for s in self.shards)
        return sum(s.lookups for s in self.shards_of(rank)) / total if total else 0.0

    def describe(self) -> str:
        """The plan as text: each table's kind, ranks and row ranges, then each rank's
        bytes per placement and share of the expected lookups."""
        lines = [f"sharding plan over {self.world_size} ranks"]
        for t, config in enumerate(self.tables):
            where = ", ".join(
                f"rank {s.rank}" + ("" if s.whole else f" rows {s.row_start}:{s.row_stop}")
                for s in self.table_shards(t))
            size = sum(s.bytes for s in self.table_shards(t))
            lines.append(f"  {config.name}: {config.num_rows} x {config.dim} "
                         f"{config.placement}, {self.kinds[t]}, {_human(size)} -> {where}")
        for r in range(self.world_size):
            b = self.rank_bytes(r)
            names = [s.local_name for s in self.shards_of(r)]
            lines.append(f"  rank {r}: hbm {_human(b['hbm'])}, host {_human(b['host'])}, "
                         f"{100 * self.lookup_share(r):.1f}% of lookups; "
                         f"{len(names)} shards {names}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """JSON's form (the checkpoint manifest keeps the plan it was written with)."""
        return dict(world_size=self.world_size,
                    tables=[_plain(dataclasses.asdict(c)) for c in self.tables],
                    kinds=list(self.kinds), shards=[dataclasses.asdict(s) for s in self.shards])

    @classmethod
    def from_dict(cls, data: dict) -> "ShardingPlan":
        tables = tuple(TableConfig(**{k: _tuples(v) for k, v in c.items()})
                       for c in data["tables"])
        return cls(int(data["world_size"]), tables, tuple(data["kinds"]),
                   tuple(Shard(**s) for s in data["shards"]))


def row_bytes(config: TableConfig, optimizer: str = "sgd", optimizer_kwargs=None,
              dtype="float32") -> int:
    """Bytes one row of ``config`` takes in a collection: weights, optimizer state, step
    count and padding (the row layout the collection stores)."""
    rule = sparse_rule(optimizer)
    hyper = resolve_hyper(optimizer, optimizer_kwargs)
    itemsize = np.dtype(dtype).itemsize
    layout = RowLayout(config.dim, itemsize, tuple(rule.slots(hyper)), rule.row_scalars)
    return layout.row_width * itemsize


def plan_sharding(tables, world_size: int, *, optimizer: str = "sgd", optimizer_kwargs=None,
                  dtype="float32", expected_lookups=None, row_wise=(),
                  budget_bytes=None) -> ShardingPlan:
    """A plan placing every table of a collection on ``world_size`` ranks.

    Args:
      tables: :class:`TableConfig` per table (or ``(num_rows, dim)`` pairs), as the
        collection takes them.
      world_size: ranks in the group (>= 1).
      optimizer, optimizer_kwargs, dtype: the collection's; they size each row's state.
      expected_lookups: lookups per sample of each table (a sequence in table order or a
        ``{name: lookups}`` dict; a missing name counts 1); default 1 per table.
      row_wise: names of tables to split by rows over the ranks whatever their size.
      budget_bytes: the most bytes one rank may hold, an int for every placement or a
        ``{"hbm": ..., "host": ...}`` dict (a missing placement is unlimited); a table over
        its placement's budget is split by rows. None: unlimited.

    Table-wise tables go largest cost first to the rank whose cost stays lowest (ties: the
    lowest rank), where a rank's cost is its share of all bytes plus its share of all
    expected lookups; a table that fits no rank's remaining budget is split by rows.
    Row-wise tables are split into ``world_size`` contiguous, nearly equal row ranges
    (fewer when the table has fewer rows than ranks). ValueError when a shard cannot fit.
    """
    configs = [t if isinstance(t, TableConfig) else TableConfig(*t) for t in tables]
    configs = tuple(c.named(k) for k, c in enumerate(configs))
    if not configs:
        raise ValueError("a sharding plan needs at least one table")
    refuse_tt(configs, "a sharding plan")
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise ValueError(f"table names must be unique, got {names}")
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) \
            or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    unknown = sorted(set(row_wise) - set(names))
    if unknown:
        raise ValueError(f"row_wise names unknown tables {unknown}; tables: {names}")
    lookups = _lookups(expected_lookups, names)
    budget = _budget(budget_bytes)
    per_row = [row_bytes(c, optimizer, optimizer_kwargs, dtype) for c in configs]
    sizes = [c.num_rows * b for c, b in zip(configs, per_row)]
    total_bytes, total_lookups = max(sum(sizes), 1), max(sum(lookups), 1e-30)
    cost = [s / total_bytes + n / total_lookups for s, n in zip(sizes, lookups)]

    kinds = ["table_wise"] * len(configs)
    used = {p: [0] * world_size for p in SHARDED_PLACEMENTS}
    load = [0.0] * world_size
    shards = []

    def split(t):
        """Table ``t`` in ``world_size`` contiguous, nearly equal row ranges."""
        c = configs[t]
        kinds[t] = "row_wise"
        parts = min(world_size, c.num_rows)
        bounds = [r * c.num_rows // parts for r in range(parts + 1)]
        for r in range(parts):
            rows = bounds[r + 1] - bounds[r]
            size = rows * per_row[t]
            if used[c.placement][r] + size > budget[c.placement]:
                raise ValueError(
                    f"table {c.name!r} ({c.num_rows} rows, {_human(sizes[t])} with "
                    f"{optimizer!r} state) does not fit: rows {bounds[r]}:{bounds[r + 1]} "
                    f"need {_human(size)} on rank {r}, which has "
                    f"{_human(budget[c.placement] - used[c.placement][r])} of its "
                    f"{c.placement} budget left")
            used[c.placement][r] += size
            load[r] += cost[t] * rows / c.num_rows
            shards.append(Shard(c.name, t, r, bounds[r], bounds[r + 1],
                                rows == c.num_rows, size, lookups[t] * rows / c.num_rows))

    # Row-wise tables first: they load every rank, and the greedy pass sees that load.
    for t, c in enumerate(configs):
        if c.name in row_wise or sizes[t] > budget[c.placement]:
            split(t)
    for t in sorted(range(len(configs)), key=lambda t: (-cost[t], t)):
        if kinds[t] == "row_wise":
            continue
        place = configs[t].placement
        fits = [r for r in range(world_size) if used[place][r] + sizes[t] <= budget[place]]
        if not fits:  # no rank has room left for the whole table: its rows are split
            split(t)
            continue
        r = min(fits, key=lambda r: (load[r] + cost[t], r))
        used[place][r] += sizes[t]
        load[r] += cost[t]
        shards.append(Shard(configs[t].name, t, r, 0, configs[t].num_rows, True, sizes[t],
                            float(lookups[t])))
    shards.sort(key=lambda s: (s.table_index, s.row_start))
    return ShardingPlan(int(world_size), configs, tuple(kinds), tuple(shards))


def _lookups(expected, names) -> list:
    if expected is None:
        return [1.0] * len(names)
    if isinstance(expected, dict):
        unknown = sorted(set(expected) - set(names))
        if unknown:
            raise ValueError(f"expected_lookups names unknown tables {unknown}")
        values = [expected.get(n, 1.0) for n in names]
    else:
        values = list(expected)
        if len(values) != len(names):
            raise ValueError(f"expected_lookups needs one value per table ({len(names)}), "
                             f"got {len(values)}")
    for n, v in zip(names, values):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0 <= v < math.inf:
            raise ValueError(f"expected_lookups of table {n!r} must be a finite number >= 0, "
                             f"got {v!r}")
    return [float(v) for v in values]


def _budget(budget) -> dict:
    if budget is None:
        return {p: float("inf") for p in SHARDED_PLACEMENTS}
    if isinstance(budget, dict):
        unknown = sorted(set(budget) - set(SHARDED_PLACEMENTS))
        if unknown:
            raise ValueError(f"budget_bytes names unknown placements {unknown}; "
                             f"placements: {SHARDED_PLACEMENTS}")
        out = {p: budget.get(p, float("inf")) for p in SHARDED_PLACEMENTS}
    else:
        out = {p: budget for p in SHARDED_PLACEMENTS}
    for placement, value in out.items():  # a number of bytes, not a string, None or flag
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"budget_bytes for {placement!r} must be a number >= 0, got "
                             f"{value!r}")
    out = {p: float(v) for p, v in out.items()}
    for placement, value in out.items():
        if math.isnan(value) or value < 0:  # NaN compares false: every table would split
            raise ValueError(f"budget_bytes for {placement!r} must be a number >= 0, got "
                             f"{value}")
    return out


def _human(n) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _plain(value):
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


# ------------------------------------------------------------------ initial weights


def fill_shard_weights(coll, k: int, init, seed: int, table_index: int,
                       first_row: int) -> None:
    """Write into table ``k`` of ``coll`` (a shard) the initial rows that rows
    ``first_row:`` of table ``table_index`` get in an unsharded collection seeded ``seed``.

    The initializer is counter-based (``init.py``): weight ``(row, col)`` is a function of
    ``stream + row * dim + col`` (wrapping at 2**64), so a shard's rows are the unsharded
    table's when its block is filled from row 0 with the stream moved on by
    ``first_row * dim``. On the GPU the fill runs as the collection's own does (a kernel)."""
    block = coll.blocks[k]
    stream = (table_stream(seed, table_index) + first_row * block.layout.dim) & _MASK64
    rows = block.rows(coll.buffers[coll.tables[k].placement])
    initial = float(coll.rule.initial(coll.hypers[k]))
    if coll.device == "cuda":
        fill_rows_gpu(rows, block.layout, init, stream, initial, coll.dtype.name)
    else:
        fill_rows_numpy(rows, block.layout, init, stream, initial)


# ------------------------------------------------------------------ checkpoints


def _shard_file(tag: str, shard: Shard) -> str:
    # Table positions, not names, in file names: a name may hold any character.
    prefix = f"shard-{tag}-" if tag else "shard-"
    return f"{prefix}t{shard.table_index}-rows{shard.row_start}-{shard.row_stop}.xft"


def shard_arrays(state: dict, shards, entries) -> dict:
    """A rank's collection state dict (``"<local name>.<entry>"`` keys) as
    :func:`save_shard_files` takes it: ``{local_name: {entry: array}}`` for ``shards``, each
    key built whole (a table's name may hold dots, so no prefix match: table ``"a"`` must not
    take table ``"a.b"``'s entries). ``entries``: ``("weight", *state_names)``."""
    return {s.local_name: {e: state[f"{s.local_name}.{e}"] for e in entries} for s in shards}


def read_checkpoint(directory, tables, optimizer: str) -> dict:
    """:func:`read_manifest`, checked against the loading collection: ValueError when the
    checkpoint's tables (names, rows, widths) or optimizer differ from ``tables`` and
    ``optimizer`` (hyperparameters are the loader's own)."""
    manifest = read_manifest(directory)
    theirs = [(c.name, c.num_rows, c.dim) for c in manifest["plan"].tables]
    ours = [(c.name, c.num_rows, c.dim) for c in tables]
    if theirs != ours:
        raise ValueError(f"the checkpoint in {directory} holds tables {theirs}; this "
                         f"collection has {ours}")
    if manifest["meta"]["optimizer"] != optimizer:
        raise ValueError(f"the checkpoint in {directory} holds "
                         f"{manifest['meta']['optimizer']!r} optimizer state; this "
                         f"collection runs {optimizer!r}")
    return manifest


def save_shard_files(directory, plan: ShardingPlan, rank: int, arrays: dict,
                     tag: str = "") -> list:
    """Write each of ``rank``'s shards to its own file in ``directory`` (the table file
    format, crash-safe: :func:`xferlib.atomic_write`). ``arrays`` maps each shard's
    :attr:`Shard.local_name` to ``{"weight": ..., <state>: ...}`` (its collection's
    state_dict entries). Returns the file names written."""
    from xferlib.atomic import atomic_write
    from xferlib.table.io_format import write_table_file

    written = []
    for shard in plan.shards_of(rank):
        mine = arrays[shard.local_name]
        config = dict(kind=_SHARD_KIND, table=shard.table, table_index=shard.table_index,
                      row_start=shard.row_start, row_stop=shard.row_stop)
        name = _shard_file(tag, shard)
        atomic_write(os.path.join(os.fspath(directory), name),
                     lambda f, c=config, a=mine: write_table_file(f.fileno(), c, a),
                     what=f"shard {shard.local_name}")
        written.append(name)
    return written


def write_manifest(directory, plan: ShardingPlan, meta: dict, tag: str = "") -> None:
    """Write the manifest that completes a checkpoint: the plan it was saved with, ``meta``
    (optimizer, hyperparameters, pooling, dtype) and the name of every shard file. Written
    last, after every rank's shard files, so a crash mid-save leaves the previous manifest
    naming the previous (complete) files."""
    from xferlib.atomic import atomic_write

    files = [dict(table=s.table, table_index=s.table_index, row_start=s.row_start,
                  row_stop=s.row_stop, file=_shard_file(tag, s)) for s in plan.shards]
    body = dict(kind=_CHECKPOINT_KIND, plan=plan.to_dict(), meta=_plain_tree(meta),
                files=files)
    text = json.dumps(body, indent=1).encode()
    atomic_write(os.path.join(os.fspath(directory), MANIFEST), lambda f: f.write(text),
                 what="the checkpoint manifest")


def _plain_tree(value):
    if isinstance(value, dict):
        return {k: _plain_tree(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_plain_tree(v) for v in value]
    return value


def read_manifest(directory) -> dict:
    """The manifest of the checkpoint in ``directory``: ``plan`` (a :class:`ShardingPlan`),
    ``meta`` and ``files``. ValueError naming the directory when there is none or it is not
    a sharded collection's."""
    path = os.path.join(os.fspath(directory), MANIFEST)
    if not os.path.exists(path):
        raise ValueError(f"{directory} holds no sharded checkpoint (no {MANIFEST}; an "
                         f"interrupted first save leaves none)")
    with open(path, "rb") as f:
        try:
            body = json.loads(f.read().decode())
        except ValueError as err:
            raise ValueError(f"{path} is corrupt: {err}") from None
    kind = body.get("kind") if isinstance(body, dict) else None
    if kind != _CHECKPOINT_KIND:
        raise ValueError(f"{path} is not a sharded collection's manifest (kind {kind!r})")
    try:
        body["plan"] = ShardingPlan.from_dict(body["plan"])
        body["meta"] = {k: _tuples(v) if isinstance(v, list) and k != "hypers" else v
                        for k, v in body["meta"].items()}
        if not all(isinstance(f, dict) and {"table", "row_start", "row_stop", "file"} <= set(f)
                   for f in body["files"]):
            raise ValueError("a shard file entry lacks a field")
    except (KeyError, TypeError, AttributeError, ValueError) as err:
        raise ValueError(f"{path} is corrupt: its manifest is incomplete "
                         f"({type(err).__name__}: {err})") from None
    return body


def _read_file(path: str) -> dict:
    from xferlib.table.io_format import check_arrays, read_header, read_table_file

    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        meta = read_header(fd, path)
        if meta["config"].get("kind") != _SHARD_KIND:
            raise ValueError(f"{path} is not a collection shard file")
        arrays = {s["name"]: np.empty(s["shape"], np.dtype(s["dtype"]))
                  for s in meta["arrays"]}
        check_arrays(meta, arrays, path)
        read_table_file(fd, meta, arrays, path)
        return arrays
    finally:
        os.close(fd)


def read_rows(directory, manifest: dict, table: str, start: int, stop: int) -> dict:
    """Rows ``start:stop`` of ``table``'s weights and optimizer state (``{"weight": ...,
    <state>: ...}``), gathered from whichever saved shards hold them: how a checkpoint
    reshards onto another plan. ValueError when the saved shards do not cover the rows."""
    parts = [f for f in manifest["files"] if f["table"] == table
             and f["row_start"] < stop and f["row_stop"] > start]
    out, covered = None, np.zeros(stop - start, bool)
    for entry in parts:
        try:
            arrays = _read_file(os.path.join(os.fspath(directory), entry["file"]))
        except FileNotFoundError:
            raise ValueError(f"the checkpoint in {directory} lacks its shard file "
                             f"{entry['file']} (rows {entry['row_start']}:{entry['row_stop']} "
                             f"of table {table!r})") from None
        lo, hi = max(start, entry["row_start"]), min(stop, entry["row_stop"])
        if out is None:
            out = {k: np.empty((stop - start, *v.shape[1:]), v.dtype)
                   for k, v in arrays.items()}
        for key, value in arrays.items():
            out[key][lo - start:hi - start] = value[lo - entry["row_start"]:
                                                    hi - entry["row_start"]]
        covered[lo - start:hi - start] = True
    if out is None or not covered.all():
        raise ValueError(f"the checkpoint in {directory} does not hold rows {start}:{stop} of "
                         f"table {table!r}")
    return out
