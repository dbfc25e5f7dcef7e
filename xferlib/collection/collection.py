"""EmbeddingCollection: every embedding table of a model in one object.

One pooled lookup of every table per step (FBGEMM's layout: ``indices``, ``offsets`` of
``T * B + 1`` bag boundaries, optional ``per_sample_weights``), written once as a
``(B, sum of widths)`` array, and one fused backward + update: each looked-up row receives
the gradients of its lookups, taken from the pooled gradient in a fixed order, and the
collection's optimizer runs on it where it lives (GPU memory or pinned host RAM). No buffer of
one row per lookup is made, and the GPU path queues its kernels without a host sync, so a
whole training step can be captured in a CUDA graph.

Each table has its own rows, width, placement and (optionally) learning rate
(:class:`~xferlib.collection.TableConfig`); all share one optimizer, with the host tables'
sparse rules, names, defaults and lazy semantics (``xferlib.table.rules``): a row that is not
looked up keeps its weights and state, and bias corrections use the row's own step count.
A ``tt`` table's rows are TT cores, an :class:`xferlib.tt.TTTable` that pools its bags and
trains its cores with the same optimizer where TT has it (``tt_tables.py``).

The NumPy path (NumPy indices) runs on any machine; the GPU path (CuPy indices) needs the
collection on the GPU (``device="cuda"``, the default where CuPy sees a GPU), which also takes
NumPy inputs: they are copied to the GPU and the pooled rows come back as NumPy.
"""

from __future__ import annotations

import numbers
import threading
import warnings

import numpy as np

from xferlib._backend import capture_in_progress, cupy_available, is_cupy_array
from xferlib.collection.config import POOLINGS, TableConfig, pack_features
from xferlib.collection.init import fill_rows_gpu, fill_rows_numpy, table_stream
from xferlib.collection.numpy_path import (check_inputs_numpy, pooled_lookup_numpy,
                                           update_numpy)
from xferlib.collection.storage import allocate_host, plan_blocks
from xferlib.collection.table_state import TableState
from xferlib.collection.tt_tables import (build_tt_tables, tt_bytes, tt_hyper,
                                          tt_lookup_numpy, tt_update_numpy)
from xferlib.managed import gpu_view, is_managed
from xferlib.table.layout import RowLayout
from xferlib.table.rules import resolve_hyper, sparse_rule

__all__ = ["EmbeddingCollection", "LookupContext"]

DEVICES = ("cpu", "cuda")
_KEPT_CONTEXTS = 4
# recorded contexts at which (and at each doubling past it) a warning says their memory grows
_RECORDED_WARNING = 64
_UNRECORDED_FORWARD = (
    "a backward is being recorded into a CUDA graph (XLA's command buffers) without a "
    "recording of its forward: a recorded backward reads the plan its recorded forward writes "
    "at each replay, and none was found for the backward's buffers (the forward ran "
    "unrecorded or outside the backward's graph, or the backward's buffers are not the "
    "forward's: residuals copied or stacked, as a gradient taken through lax.scan's loop "
    "makes them, or more than one lookup a step). Planning the batch again inside the "
    "recording would repeat the forward's cache pass and staging at every replay: record "
    "both or neither (record=False)")


class LookupContext:
    """What a forward leaves for its backward (the op's residuals): the checked inputs, on
    the GPU the batch's plan (sorted lookups, runs, staged host rows, the verdict), and the
    tt tables' :class:`xferlib.tt.TTResiduals` by table position (``tt``)."""

    __slots__ = ("indices", "offsets", "per_sample_weights", "batch_size", "plan", "tt",
                 "recorded")

    def __init__(self, indices, offsets, per_sample_weights, batch_size, plan=None, tt=None):
        self.indices, self.offsets = indices, offsets
        self.per_sample_weights, self.batch_size, self.plan = (per_sample_weights,
                                                               batch_size, plan)
        self.tt = {} if tt is None else tt
        self.recorded = False  # made by a forward recorded into a CUDA graph


class EmbeddingCollection(TableState):
    """T embedding tables with one pooled lookup and one fused optimizer step.

    Args:
      tables: :class:`TableConfig` per table (or ``(num_rows, dim)`` pairs: tables in HBM).
      optimizer: one of :data:`xferlib.SPARSE_OPTIMIZERS` (``"sgd"``, ``"adam"``,
        ``"adamw"``, ``"adagrad"``, ``"rowwise_adagrad"``, ...), run by :meth:`backward`.
        With ``tt`` tables: one TT runs too (``sgd``, ``adagrad``, ``rowwise_adagrad``:
        :data:`xferlib.collection.tt_tables.TT_COLLECTION_OPTIMIZERS`), with ``lr`` and
        ``eps`` only; anything else is refused here, naming the table.
      optimizer_kwargs: its hyperparameters, torch.optim's names and defaults; a table's
        ``TableConfig.lr`` replaces ``lr`` for that table.
      pooling: ``"sum"`` or ``"mean"`` (an empty bag pools to zeros).
      dtype: ``"float32"`` (the GPU path) or ``"float64"``.
      device: ``"cuda"`` (hbm tables in GPU memory, host tables pinned; the default where
        CuPy sees a GPU) or ``"cpu"`` (every table in host RAM, the NumPy path).
      seed: for the tables' initializers (counter-based: the same values on the CPU and the
        GPU, whatever the placement; ``xferlib/collection/init.py``); None: a fresh seed.

    >>> import numpy as np
    >>> from xferlib.collection import EmbeddingCollection, TableConfig
    >>> coll = EmbeddingCollection([TableConfig(10, 4, init="zeros"),
    ...                             TableConfig(20, 2, init="zeros")],
    ...                            optimizer="sgd", optimizer_kwargs={"lr": 1.0}, device="cpu")
    >>> indices = np.array([1, 1, 3, 5])          # table 0: bags [1, 1], [3]; table 1: [5], []
    >>> offsets = np.array([0, 2, 3, 4, 4])       # T * B + 1 = 2 * 2 + 1
    >>> out, ctx = coll.forward(indices, offsets)
    >>> out.shape
    (2, 6)
    >>> coll.backward(ctx, np.ones((2, 6), np.float32))
    >>> coll.weights(0)[1].tolist()               # row 1 was looked up twice: -2
    [-2.0, -2.0, -2.0, -2.0]
    """

    def __init__(self, tables, optimizer: str = "sgd", optimizer_kwargs=None, *,
                 pooling: str = "sum", dtype="float32", device: str | None = None,
                 seed: int | None = 0):
        configs = [t if isinstance(t, TableConfig) else TableConfig(*t) for t in tables]
        if not configs:
            raise ValueError("a collection needs at least one table")
        configs = [c.named(k) for k, c in enumerate(configs)]
        names = [c.name for c in configs]
        if len(set(names)) != len(names):
            raise ValueError(f"table names must be unique, got {names}")
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        dtype = np.dtype(dtype)
        if dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise TypeError(f"a collection stores float32 or float64 rows, got {dtype}")
        if device is None:
            device = "cuda" if cupy_available() else "cpu"
        if device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
        if device == "cuda" and not cupy_available():
            raise RuntimeError("device='cuda' needs CuPy and a CUDA GPU; none here (use "
                               "device='cpu', the NumPy path)")
        self.rule = sparse_rule(optimizer)
        base_hyper = resolve_hyper(optimizer, optimizer_kwargs)
        self.hypers = [base_hyper if c.lr is None else
                       resolve_hyper(optimizer, {**base_hyper, "lr": c.lr}) for c in configs]
        self.optimizer, self.pooling, self.dtype, self.device = optimizer, pooling, dtype, device
        self.tables = tuple(configs)
        self.names = tuple(names)
        self.dims = tuple(c.dim for c in configs)
        self.dim_offsets = tuple(int(x) for x in np.concatenate([[0], np.cumsum(self.dims)]))
        self.total_dim = self.dim_offsets[-1]
        slots = tuple(self.rule.slots(base_hyper))
        self.layouts = tuple(RowLayout(c.dim, dtype.itemsize, slots, self.rule.row_scalars)
                             for c in configs)
        # refused before anything is allocated
        tt_hypers = {t: tt_hyper(c.name, optimizer, self.hypers[t])
                     for t, c in enumerate(configs) if c.placement == "tt"}
        cached = [t for t, c in enumerate(configs) if c.cache_rows]
        host_dims = {c.dim for c in configs if c.placement == "host"}
        if cached and len(host_dims) > 1:
            raise ValueError(f"a GPU cache of host rows needs every host table to share one "
                             f"width; host tables have widths {sorted(host_dims)}")
        if seed is None:
            seed = int(np.random.SeedSequence().entropy) & ((1 << 63) - 1)
        elif isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"seed must be an integer or None, got {seed!r}")
        self.blocks, self.buffers = self._allocate(seed)
        # The tt tables (xferlib/collection/tt_tables.py): {table position: TTTable}.
        self.tt_tables = build_tt_tables(self, seed, tt_hypers)
        self._refuse_shared_state_keys()
        self._gpu = None  # the GPU side (xferlib/collection/device.py), made on first use
        self._kept = {}  # contexts kept for a later backward (keep_context)
        self._recorded = {}  # contexts of forwards recorded into CUDA graphs, by key: all
        self._contexts_lock = threading.Lock()  # XLA may call back from several threads
        # A GPU batch refused by its deferred input check raises from the next forward or
        # backward, or from check(). Collective callers (a sharded step, where one rank
        # raising alone would leave the others waiting in a collective) set this False:
        # then only check() raises (the verdicts are still read, the queue stays short).
        self.raise_in_calls = True

    @property
    def num_tables(self) -> int:
        return len(self.tables)

    def _placement(self, t: int) -> str:
        return self.tables[t].placement

    # ------------------------------------------------------------------ storage

    def _allocate(self, seed):
        """One flat buffer per placement, tables block after block, each block written whole
        by the counter-based initializer (``init.py``): on the GPU at memory speed (host
        blocks through GPU chunks), else on the host; the gaps between blocks are zeroed.
        (A tt table has no block: its TTTable holds its cores.)"""
        blocks, buffers = [None] * self.num_tables, {}
        gpu = self.device == "cuda"
        for placement in ("hbm", "host"):
            mine = [t for t in range(self.num_tables) if self._placement(t) == placement]
            if not mine:
                continue
            placed, total = plan_blocks([self.layouts[t] for t in mine],
                                        [self.tables[t].num_rows for t in mine],
                                        self.dtype.itemsize)
            if gpu and placement == "hbm":
                import cupy

                buffer = cupy.zeros(total, dtype=self.dtype)
            else:
                what = (f"the {placement} tables {[self.names[t] for t in mine]} of an "
                        f"EmbeddingCollection with {self.optimizer!r} state")
                buffer = allocate_host(total, self.dtype, what, pinned=gpu)
                ends = [b.base + b.size for b in placed]
                for end, nxt in zip(ends, [b.base for b in placed[1:]] + [total]):
                    buffer[end:nxt] = 0
            for t, block in zip(mine, placed):
                blocks[t] = block
                args = (block.rows(buffer), self.layouts[t], self.tables[t].init,
                        table_stream(seed, t), float(self.rule.initial(self.hypers[t])))
                if gpu:
                    if is_managed(buffer):  # filled in place over the GPU's mapping
                        args = (gpu_view(block.rows(buffer)),) + args[1:]
                    fill_rows_gpu(*args, self.dtype.name)
                else:
                    fill_rows_numpy(*args)
            buffers[placement] = buffer
        return blocks, buffers

    def _index(self, table) -> int:
        if isinstance(table, str):
            if table not in self.names:
                raise KeyError(f"no table {table!r}; tables: {list(self.names)}")
            return self.names.index(table)
        if isinstance(table, (bool, np.bool_)) or not isinstance(table, numbers.Integral):
            raise TypeError(f"table must be a name or an integer index, got {table!r}")
        t = int(table)
        if not 0 <= t < self.num_tables:
            raise IndexError(f"table {t} out of range for {self.num_tables} tables")
        return t

    def set_hyper(self, table=None, **changes) -> None:
        """Change hyperparameters (e.g. ``lr`` from a schedule) for the following steps, of
        every table or of ``table`` alone. Changes that alter the state layout are refused."""
        targets = range(self.num_tables) if table is None else [self._index(table)]
        if self._gpu is not None and capture_in_progress():
            raise RuntimeError("set_hyper cannot run while a CUDA graph is being captured "
                               "(a replay would not run it): change hyperparameters between "
                               "steps")
        new, tt = list(self.hypers), {}
        for t in targets:
            h = resolve_hyper(self.optimizer, {**self.hypers[t], **changes})
            if tuple(self.rule.slots(h)) != self.layouts[t].slots:
                raise ValueError(f"{sorted(changes)} would change the optimizer state layout; "
                                 f"build a new collection")
            if t in self.tt_tables:  # checked for every table before any changes
                tt[t] = tt_hyper(self.names[t], self.optimizer, h)
            new[t] = h
        self.hypers = new
        for t, h in tt.items():
            self.tt_tables[t].set_hyper(**h)
        if self._gpu is not None:
            self._gpu.hypers_changed()

    # ------------------------------------------------------------------ inputs

    def pack(self, features: dict):
        """FBGEMM's layout from the per-table dict form: ``{name: (indices, offsets)}`` with
        each table's ``offsets`` of ``B + 1`` bag boundaries (every table the same ``B``);
        returns ``(indices, offsets)`` with ``T * B + 1`` offsets, tables in this
        collection's order. Per-sample weights: ``{name: (indices, offsets, weights)}``
        gives ``(indices, offsets, per_sample_weights)``.

        Each table's offsets must start at 0, never decrease and end at its number of
        indices: on the host a table's bad offsets raise ValueError naming it; GPU arrays
        are not read back, and a table's offsets that do not start at 0 or end at its
        number of indices make the packed offsets start at -1, which the collection
        refuses like other bad offsets (its check names ``offsets[0]``)."""
        return pack_features(self.names, features)

    def check_shapes(self, indices, offsets, per_sample_weights=None) -> int:
        """The input checks that need no values: dtypes and shapes of FBGEMM's layout (any
        array with ``dtype``, ``ndim`` and ``shape``: NumPy, CuPy, or a JAX array an adapter
        checks before tracing); returns the batch size B. The values (offsets, indices
        against their tables) are checked by :meth:`forward`."""
        for name, array in (("indices", indices), ("offsets", offsets)):
            if not hasattr(array, "dtype") or array.dtype not in (np.int32, np.int64):
                raise TypeError(f"{name} must be an int32 or int64 array, got "
                                f"{getattr(array, 'dtype', type(array).__name__)}")
            if array.ndim != 1:
                raise ValueError(f"{name} must be 1-D, got shape {array.shape}")
        if is_cupy_array(indices) != is_cupy_array(offsets):
            raise TypeError("indices and offsets must both be NumPy or both CuPy arrays")
        T = self.num_tables
        if offsets.shape[0] < 1 or (offsets.shape[0] - 1) % T:
            raise ValueError(f"offsets must have T * B + 1 entries for T = {T} tables, got "
                             f"{offsets.shape[0]}")
        if per_sample_weights is not None:
            if not hasattr(per_sample_weights, "dtype") or not hasattr(per_sample_weights,
                                                                        "shape"):
                raise TypeError(f"per_sample_weights must be an array, got "
                                f"{type(per_sample_weights).__name__}")
            if is_cupy_array(per_sample_weights) != is_cupy_array(indices):
                raise TypeError("per_sample_weights must be in the same namespace as indices")
            if not _floating(per_sample_weights.dtype):
                raise TypeError(f"per_sample_weights must be floating point, got "
                                f"{per_sample_weights.dtype}")
            if per_sample_weights.shape != indices.shape:
                raise ValueError(f"per_sample_weights must have shape {indices.shape} (one "
                                 f"per index), got {per_sample_weights.shape}")
        return (offsets.shape[0] - 1) // T

    # ------------------------------------------------------------------ the step

    def forward(self, indices, offsets, per_sample_weights=None, *, out=None, stream=None,
                padded: bool = False, total=None, _for_update: bool = True):
        """The pooled lookup of every table: ``(out, ctx)``, ``out`` of shape
        ``(B, total_dim)`` (table ``t`` at columns ``dim_offsets[t]:dim_offsets[t + 1]``) in
        the indices' namespace, ``ctx`` for :meth:`backward`. Bad input raises before
        anything changes (GPU indices: from a later call or :meth:`check`, see
        ``xferlib.batch``).

        ``padded``: ``indices`` (and ``per_sample_weights``) are a fixed-size buffer whose
        entries from ``offsets[-1]`` on are padding, ignored whatever they hold (FBGEMM's
        contract, ``offsets[-1] == len(indices)``, relaxed to ``<=``): a batch whose true
        size is known only on the GPU runs without reading it back (a CUDA graph, a
        collective's fixed-capacity buffer). ``total`` (with ``padded``): a one-element
        int64 array in the indices' namespace holding the batch's true size, which the last
        bag must end at (as an unpadded batch's ends at ``len(indices)``): a buffer reused
        for batches of several sizes (a CUDA graph's) is then checked as each batch would
        be."""
        B = self.check_shapes(indices, offsets, per_sample_weights)
        if total is not None:
            if not padded:
                raise ValueError("total is for padded batches (padded=True)")
            if (getattr(total, "dtype", None) != np.int64 or total.shape != (1,)
                    or is_cupy_array(total) != is_cupy_array(indices)):
                raise TypeError("total must be a one-element int64 array in the indices' "
                                "namespace")
        if out is not None:
            if not hasattr(out, "dtype") or not hasattr(out, "shape"):
                raise TypeError(f"out must be an array, got {type(out).__name__}")
            if out.shape != (B, self.total_dim):
                raise ValueError(f"out must have shape {(B, self.total_dim)}, got "
                                 f"{out.shape}")
            if out.dtype != self.dtype:  # written as rows are: no silent cast
                raise TypeError(f"out must have the collection's dtype {self.dtype}, got "
                                f"{out.dtype}")
        if is_cupy_array(indices):
            return self._gpu_side().forward(indices, offsets, per_sample_weights, B, out,
                                            stream, _for_update, padded=padded, total=total)
        if padded:  # NumPy: the true size is at hand
            n = int(np.asarray(offsets)[-1]) if len(offsets) else 0
            if not 0 <= n <= indices.shape[0]:
                raise ValueError(f"offsets[-1] = {n} is outside the padded indices "
                                 f"(0..{indices.shape[0]})")
            if total is not None and n != int(total[0]):
                raise ValueError(f"offsets[-1] = {n} must equal the batch's size total = "
                                 f"{int(total[0])}")
            indices = indices[:n]
            per_sample_weights = (None if per_sample_weights is None
                                  else per_sample_weights[:n])
        if self.device == "cuda":
            # NumPy in, NumPy out on a GPU collection: the inputs cross to the GPU and the
            # pooled rows come back (a copy each way and a sync; pass CuPy arrays to stay
            # on the device).
            import cupy

            if out is not None:
                raise TypeError("out= must be a CuPy array on a GPU collection")
            pooled, ctx = self._gpu_side().forward(
                cupy.asarray(indices), cupy.asarray(offsets),
                None if per_sample_weights is None else cupy.asarray(per_sample_weights), B,
                None, stream)
            return pooled.get(), ctx
        check_inputs_numpy(self, indices, offsets)
        pooled = pooled_lookup_numpy(self, indices, offsets, per_sample_weights, B, out)
        tt = tt_lookup_numpy(self, indices, offsets, per_sample_weights, B, pooled)
        return pooled, LookupContext(indices, offsets, per_sample_weights, B, tt=tt)

    def lookup(self, indices, offsets, per_sample_weights=None, *, out=None, stream=None,
               padded: bool = False):
        """The pooled lookup alone (no step will follow: host rows are read without their
        optimizer state)."""
        return self.forward(indices, offsets, per_sample_weights, out=out, stream=stream,
                            padded=padded, _for_update=False)[0]

    def backward(self, ctx: LookupContext, grad_pooled, *, stream=None) -> None:
        """Every looked-up row receives its lookups' gradients from ``grad_pooled``
        (``(B, total_dim)``; repeated rows summed in a fixed order), and the optimizer runs
        on each touched row once, where it lives."""
        if not isinstance(ctx, LookupContext):
            raise TypeError("ctx must be the LookupContext forward() returned")
        if not hasattr(grad_pooled, "dtype") or not hasattr(grad_pooled, "shape"):
            raise TypeError(f"grad_pooled must be an array, got {type(grad_pooled).__name__}")
        shape = (ctx.batch_size, self.total_dim)
        if tuple(grad_pooled.shape) != shape:
            raise ValueError(f"grad_pooled must have shape {shape}, got "
                             f"{tuple(grad_pooled.shape)}")
        if grad_pooled.dtype.kind != "f":
            raise TypeError(f"grad_pooled must be floating point, got {grad_pooled.dtype}")
        if ctx.plan is not None:
            if not is_cupy_array(grad_pooled):  # NumPy in, NumPy out (see forward)
                import cupy

                grad_pooled = cupy.asarray(grad_pooled)
            self._gpu_side().backward(ctx, grad_pooled, stream)
            return
        if is_cupy_array(grad_pooled):
            raise TypeError("grad_pooled must be a NumPy array, as the forward's indices were")
        update_numpy(self, ctx, grad_pooled)
        tt_update_numpy(self, ctx.tt, grad_pooled)

    def keep_context(self, key, ctx: LookupContext, recorded: bool = False) -> None:
        """Keep a forward's context for a backward that cannot carry it (a JAX residual must
        be an array): the backward takes it back by the same ``key`` with
        :meth:`take_context`. The latest few are kept; an unrecorded backward that finds
        none plans its batch again.

        ``recorded``: the forward was recorded into a CUDA graph (XLA's command buffers),
        whose replays write this context's plan where the recording saw it, without
        calling the forward. The context is then also kept for backwards recorded later,
        as long as the collection lives, one per key (``key`` must name every buffer the
        recording saw: a recording at the same key replaces the graph, and the context):
        a backward recorded after a replayed forward finds it, reads what the replay
        wrote, and records the same launches as the first time (XLA updates a recorded
        graph in place, which needs the same launches). None is dropped earlier: XLA
        keeps recordings as long as it likes and replays them without asking, so a
        dropped plan's memory, handed to a later batch, would be written by them, and a
        backward recorded after such a replay would find no plan."""
        with self._contexts_lock:
            self._kept[key] = ctx
            while len(self._kept) > _KEPT_CONTEXTS:
                self._kept.pop(next(iter(self._kept)))
            if not recorded:
                return
            ctx.recorded = True
            self._recorded[key] = ctx
            count = len(self._recorded)
        if count >= _RECORDED_WARNING and count & (count - 1) == 0:  # 64, 128, 256, ...
            warnings.warn(
                f"{count} recorded lookups of this collection keep their plans (one for each "
                f"set of buffer addresses XLA recorded the lookup at): the step's buffers "
                f"move from step to step, and the recordings' memory grows with them. Slice "
                f"each step's batch out of a chunk inside the jitted step, or pass "
                f"record=False (docs/collection.md, \"Replayed from XLA's command "
                f"buffers\")", RuntimeWarning, stacklevel=2)

    def take_context(self, key, recorded: bool = False):
        """The context kept under ``key`` (removed), or None (the caller plans its batch
        again). ``recorded`` (a backward being recorded): a recorded forward's context, the
        one this step's forward recorded or, where it was replayed, the one its recording
        made. Where there is none (this step's forward ran unrecorded, its plan lying in
        memory no replay writes again, or the backward's buffers are not the forward's) a
        RuntimeError, also kept for :meth:`check` (XLA may only log a recording's failure
        and go on without it); with ``raise_in_calls`` off (a collective step, where one
        rank raising alone would strand the others) only kept for :meth:`check`, and None
        returned."""
        with self._contexts_lock:
            ctx = self._kept.pop(key, None)
            if not recorded:
                return ctx
            if ctx is None:  # the forward was replayed: its recording wrote its plan
                ctx = self._recorded.get(key)
            elif not ctx.recorded:
                ctx = None
        if ctx is not None:
            return ctx
        error = RuntimeError(_UNRECORDED_FORWARD)
        if self._gpu is not None:
            self._gpu.checks.fail_at_check(error)
        if not self.raise_in_calls:
            return None
        raise error

    def check(self) -> None:
        """Wait for the input checks of every GPU batch queued so far and raise for the
        first bad one (a bad batch changes nothing)."""
        if self._gpu is not None:
            self._gpu.check()

    def synchronize(self) -> None:
        """Wait for this collection's queued GPU work; rows whose write-back the last step
        deferred, and cached rows, are written back to host RAM (cached rows stay cached)."""
        if self._gpu is not None:
            self._gpu.synchronize()

    def cache_stats(self) -> dict:
        """The host tables' GPU cache since construction: distinct rows of host tables
        looked up, hits, misses, admitted and evicted rows."""
        if self._gpu is None:
            return dict(lookups=0, hits=0, misses=0, admitted=0, evicted=0)
        return self._gpu.cache_stats()

    # ------------------------------------------------------------------ devices

    def prepare_gpu(self) -> None:
        """Make the collection's GPU side on the current device now (its tables' metadata,
        the pinned ring its input checks arrive in), instead of at the first GPU call. The
        JAX adapter calls it for every device's shard when it builds a sharded collection:
        made inside a step's callbacks, the ring's pinned allocation waits for every device
        of the process, one of which may be waiting in a collective for the very thread that
        allocates."""
        self._gpu_side().checks.reserve()

    def _gpu_side(self):
        if self.device != "cuda":
            raise TypeError("this collection lives on the CPU (device='cpu'): pass NumPy "
                            "indices, or build it with device='cuda'")
        if self._gpu is None:
            from xferlib._backend import default_allocator
            from xferlib.collection.device import CollectionDevice

            with default_allocator():  # kept for good: never a recording's scratch memory
                self._gpu = CollectionDevice(self)
        return self._gpu

    def memory_bytes(self) -> dict:
        """Bytes of rows and optimizer state per placement (a tt table's: its cores, their
        optimizer state and its step counter)."""
        out = {p: int(b.nbytes) for p, b in self.buffers.items()}
        if self.tt_tables:
            out["tt"] = tt_bytes(self.tt_tables)
        return out

    def __repr__(self) -> str:
        tables = ", ".join(f"{c.name}: {c.num_rows}x{c.dim} {c.placement}" for c in self.tables)
        return (f"EmbeddingCollection([{tables}], optimizer={self.optimizer!r}, "
                f"pooling={self.pooling!r}, device={self.device!r})")

    # ------------------------------------------------------------------ save / load

    def save(self, path) -> None:
        """Write the configuration, hyperparameters and every table's weights and optimizer
        state to ``path`` in one checksummed file (``xferlib/collection/io.py``), crash-safely
        (:func:`xferlib.atomic_write`); cached rows written back first, GPU rows streamed."""
        from xferlib.collection.io import save_collection

        save_collection(self, path)

    @classmethod
    def load(cls, path, *, device: str | None = None) -> "EmbeddingCollection":
        """A collection saved by :meth:`save`, on ``device`` (default as the constructor's;
        a file saved on the GPU loads on the CPU and back), streamed into its memory.
        ValueError naming ``path`` and what differs for a truncated, corrupt or foreign
        file."""
        from xferlib.collection.io import load_collection

        return load_collection(path, cls, device=device)


def _floating(dtype) -> bool:
    """NumPy's floating kinds, and ml_dtypes' (bfloat16, ...: NumPy files them as kind 'V')."""
    return dtype.kind == "f" or dtype.name.startswith(("bfloat", "float8"))
