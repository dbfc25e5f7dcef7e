"""HostTable: an embedding table and its optimizer state in pinned host RAM.

Each step moves only the rows a batch touches: :meth:`HostTable.lookup` brings their weights
to the GPU (or returns them as NumPy on a CPU machine) and :meth:`HostTable.apply_gradients`
sums the gradients of repeated indices and runs a fused sparse optimizer on the touched rows
where they live. A GPU cache of hot rows (``cache_rows``, ``cache.py``) serves them from HBM,
and :meth:`HostTable.prefetch` (``prefetch.py``) moves the next batch's rows on a side stream.
The row layout is in ``layout.py``, the optimizer rules in ``rules.py``, the GPU launches in
``device.py``, save and load in ``io.py``.

Lazy semantics
--------------
The optimizers apply torch.optim's formulas, names and defaults to the rows present in the
batch only: a row that is not looked up keeps its weights and state (no weight decay, no
momentum), and bias corrections use the row's own step count (how often the row was
updated), as FBGEMM's and TensorFlow's lazy sparse optimizers do. A row updated every step
follows ``torch.optim`` exactly.
"""

from __future__ import annotations

import weakref

import numpy as np

from xferlib._backend import as_cupy_stream, capture_in_progress, is_cupy_array
from xferlib.batch import BatchPlan
from xferlib.memory import is_pinned
from xferlib.perf import warn_cache_thrashing
from xferlib.rows import check_host_indices, check_index_dtype, take_rows
from xferlib.sizes import integral_size
from xferlib.table.device import DeviceSide
from xferlib.table.io import load_table, save_table
from xferlib.table.layout import RowLayout, split_state
from xferlib.table.prefetch import prefetch as _prefetch
from xferlib.table.rules import SPARSE_OPTIMIZERS, resolve_hyper, sparse_rule, sum_duplicates
from xferlib.table.storage import allocate_rows, allocate_shared_rows, shared_header

__all__ = ["HostTable"]


class HostTable:
    """An embedding table and its optimizer state in pinned host memory.

    Args:
      num_rows, dim: the table's shape.
      dtype: ``"float32"`` (the GPU path) or ``"float64"``.
      optimizer: one of :data:`SPARSE_OPTIMIZERS` (``"sgd"``, ``"adam"``, ``"adamw"``,
        ``"adagrad"``, ``"rowwise_adagrad"``, ``"adamax"``, ``"rmsprop"``, ``"adadelta"``),
        run by :meth:`apply_gradients`; None for a table that is only looked up and written.
      optimizer_kwargs: hyperparameters, with torch.optim's names and defaults
        (:func:`optimizer_defaults`); unknown names or invalid values raise ValueError.
      cache_rows: rows (with their state) kept in a 32-way set-associative GPU cache; 0: no
        cache. Looked up, filled and evicted by device kernels (``xferlib/table/cache.py``).
      cache_policy: ``"lru"`` (evict the least recently used way of the row's set) or
        ``"lfu"`` (the least often used). Rows of the batch being looked up are never evicted
        by that batch.
      cache_admission: ``"second-sight"`` (default: a miss takes an empty way; in a full set
        a row enters on its second miss, rows seen once stay in host RAM) or ``"always"``.
      init: ``"zeros"``, ``("uniform", low, high)``, ``("normal", mean, std)`` (default
        ``("normal", 0, 1)``, as ``torch.nn.Embedding``), or a ``(num_rows, dim)`` C-contiguous
        NumPy array of the table's dtype, which is pinned in place and becomes the weights
        (no second copy).
      seed: for the random initializers.
      shared: ``False`` (default: private memory), ``True`` (create the table in host memory
        other processes of this host can open, ``xferlib/table/shared.py``; its name is
        :attr:`shared_name`), or a name from another process's table (open that table: same
        configuration, its contents as they are; ``init`` and ``seed`` are not used). Every
        process pins its own mapping and its GPU reads the one copy. A shared table has no
        GPU cache (another process's lookups would miss the cached updates). Processes that
        update one shared table must not update the same row at once: the torch adapter's
        ``process_group=`` gives each row one owner rank (:func:`xferlib.table.shared.owner_of`).

    >>> import numpy as np, xferlib
    >>> table = xferlib.HostTable(1000, 4, optimizer="sgd", optimizer_kwargs={"lr": 0.5},
    ...                           init="zeros")
    >>> idx = np.array([3, 7, 3])
    >>> table.apply_gradients(idx, np.ones((3, 4), np.float32))
    >>> table.lookup(np.array([3, 7]))[:, 0].tolist()
    [-1.0, -0.5]
    """

    def __init__(self, num_rows: int, dim: int, dtype="float32", optimizer=None,
                 optimizer_kwargs=None, cache_rows: int = 0, init=("normal", 0.0, 1.0), *,
                 cache_policy: str = "lru", cache_admission: str = "second-sight", seed=None,
                 shared=False):
        # integers only, as torch's sizes: int(10.7) would build 10 rows without a word
        num_rows, dim, cache_rows = (integral_size(name, value) for name, value in (
            ("num_rows", num_rows), ("dim", dim), ("cache_rows", cache_rows)))
        if num_rows < 0 or dim < 1:
            raise ValueError(f"a table needs num_rows >= 0 and dim >= 1, got ({num_rows}, {dim})")
        try:
            dtype = np.dtype(dtype)
        except TypeError:  # e.g. HostTable(1000, 4, "adam"): the third argument is the dtype
            hint = (f"; name the optimizer by keyword (optimizer={dtype!r})"
                    if isinstance(dtype, str) and dtype in SPARSE_OPTIMIZERS else "")
            raise TypeError(f"HostTable stores float32 or float64 rows, got dtype {dtype!r}"
                            f"{hint}") from None
        if dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise TypeError(f"HostTable stores float32 or float64 rows, got dtype {dtype}")
        if cache_rows < 0:
            raise ValueError(f"cache_rows must be >= 0, got {cache_rows}")
        if cache_policy not in ("lru", "lfu"):
            raise ValueError(f"cache_policy must be 'lru' or 'lfu', got {cache_policy!r}")
        if cache_admission not in ("second-sight", "always"):
            raise ValueError(f"cache_admission must be 'second-sight' or 'always', got "
                             f"{cache_admission!r}")
        if optimizer is None:
            if optimizer_kwargs:
                raise ValueError("optimizer_kwargs given without an optimizer")
            self._rule, self._hyper = None, {}
        else:
            self._rule = sparse_rule(optimizer)
            self._hyper = resolve_hyper(optimizer, optimizer_kwargs)
        self.num_rows, self.dim, self.dtype = num_rows, dim, dtype
        self.optimizer = optimizer
        self.cache_rows = min(cache_rows, num_rows)
        self.cache_policy = cache_policy
        self.cache_admission = cache_admission
        self._layout = RowLayout(dim, dtype.itemsize,
                                 tuple(self._rule.slots(self._hyper)) if self._rule else (),
                                 self._rule.row_scalars if self._rule else ())
        self._shared = None
        if shared is False:
            self._allocate(init, np.random.default_rng(seed))
        else:
            if self.cache_rows:
                raise ValueError(f"a shared table cannot have a GPU cache (cache_rows="
                                 f"{cache_rows}): other processes would read stale rows")
            self._allocate_shared(shared, init, np.random.default_rng(seed))
        self._gpu = None  # device-side state (cache, hyper table, streams), made on first use
        # Writes of rows queued so far (updates, scatters, restores), in a list that device
        # views share: an update may read a batch's weights from its lookup's copy in HBM
        # only when no write came between (xferlib/table/device.py, DeviceSide.apply).
        self._writes = [0]

    def write_stamp(self) -> tuple:
        """The table's write counter (the list itself: its device views share it, and another
        table's stamp never matches) and its count now."""
        return self._writes, self._writes[0]

    def stamp_current(self, stamp) -> bool:
        """Whether no write of rows was queued since :meth:`write_stamp` gave ``stamp``."""
        return stamp is not None and stamp[0] is self._writes and stamp[1] == self._writes[0]

    def note_write(self) -> None:
        """Count a write of rows (an update, a scatter, a restore) about to be queued."""
        self._writes[0] += 1

    # ------------------------------------------------------------------ storage

    def _allocate(self, init, rng) -> None:
        self._storage, self._weights, self._state = allocate_rows(
            self.num_rows, self.dim, self.dtype, self._layout, self._initial(), init, rng,
            f"HostTable(num_rows={self.num_rows}, dim={self.dim}, "
            f"optimizer={self.optimizer!r}) with its optimizer state")

    def _allocate_shared(self, shared, init, rng) -> None:
        header = shared_header(self.num_rows, self.dim, self.dtype, self.optimizer, self._hyper,
                               self._layout.row_width)
        self._shared, self._storage, self._weights, self._state = allocate_shared_rows(
            self.num_rows, self.dim, self.dtype, self._layout, self._initial(), header, shared,
            init, rng)

    def _initial(self) -> float:
        """The value a fresh row's state slots and row scalars start from."""
        return self._rule.initial(self._hyper) if self._rule else 0.0

    @property
    def shared_name(self):
        """The name other processes of this host open this table by (``HostTable(...,
        shared=name)``), or None for a private table."""
        return None if self._shared is None else self._shared.name

    def unlink_shared(self) -> None:
        """Remove a shared table's name: no further process can open it; processes that have
        it open keep it, and its memory returns to the OS when the last one closes it. Nothing
        for a private table. Idempotent."""
        if self._shared is not None:
            self._shared.unlink()

    def close(self) -> None:
        """Finish queued GPU work, then release this process's hold on the table's memory:
        unpinned, and for a shared table unmapped (its name unlinked if this process made
        it; the memory returns to the OS when the last process closes it or exits). The
        table cannot be used afterwards. Idempotent."""
        if getattr(self, "_weights", None) is None:
            return
        self._flush()
        self._gpu = None
        storage = self._storage if self._storage is not None else self._state
        weights = self._weights
        self._weights = self._state = self._storage = None
        if self._shared is not None:
            self._shared.close()
        else:
            from xferlib.memory import unpin

            unpin(storage)
            unpin(weights)

    @property
    def closed(self) -> bool:
        return getattr(self, "_weights", None) is None

    @property
    def layout(self) -> RowLayout:
        """How a row and its optimizer state lie in host memory (``xferlib.table.layout``)."""
        return self._layout

    @property
    def rule(self):
        """The sparse optimizer rule (``xferlib.table.rules``) :meth:`apply_gradients` runs;
        None for a table without an optimizer."""
        return self._rule

    @property
    def hyper(self) -> dict:
        """The optimizer's hyperparameters (a copy; change them with :meth:`set_hyper`)."""
        self._follow()
        return dict(self._hyper)

    def set_hyper(self, **changes) -> None:
        """Change hyperparameters (e.g. ``lr`` from a schedule) for the following steps.
        Hyperparameters that change the state layout (momentum on/off, amsgrad, centered)
        cannot change. On a :meth:`device_view`, changes its table's (which the view follows)."""
        if self._rule is None:
            raise ValueError("this table has no optimizer")
        if self._gpu is not None and capture_in_progress():
            raise RuntimeError("set_hyper cannot run while a CUDA graph is being captured (a "
                               "replay would not run it): change hyperparameters between steps")
        source = self._view_of() if self._view_of is not None else None
        if source is not None:  # a view follows its table's: set here, _follow() undid it
            source.set_hyper(**changes)
            self._follow()
            return
        h = resolve_hyper(self.optimizer, {**self._hyper, **changes})
        if tuple(self._rule.slots(h)) != self._layout.slots:
            raise ValueError(f"{sorted(changes)} would change the optimizer state layout "
                             f"{self._layout.slots}; build a new table")
        self._hyper = h
        if self._gpu is not None:
            self._gpu.hyper_changed()

    # ------------------------------------------------------------------ host views

    def numpy(self) -> np.ndarray:
        """The current weights, a read-only ``(num_rows, dim)`` view (GPU cache and queued
        GPU work flushed first)."""
        self._flush()
        view = self._weights.view(np.ndarray)
        view.flags.writeable = False
        return view

    def state(self, name: str) -> np.ndarray:
        """Optimizer state ``name`` as a read-only view: a slot (``num_rows x dim``), a row
        scalar (``num_rows``), or ``"step"`` (how often each row was updated)."""
        self._flush()
        slots, scalars, steps = split_state(self._layout, self._state.view(np.ndarray))
        found = {**slots, **scalars, "step": steps}
        if name not in found:
            raise KeyError(f"no optimizer state {name!r}; this table has {sorted(found)}")
        view = found[name]
        view.flags.writeable = False
        return view

    def state_names(self) -> tuple:
        return (*self._layout.slots, *self._layout.row_scalars, "step")

    def restore(self, weights, state: dict, *, partial: bool = False) -> None:
        """Overwrite the weights (``(num_rows, dim)``) and every optimizer state array (named
        as :meth:`state_names`, shaped as :meth:`state`), shapes checked before any write, the
        GPU cache written back and emptied first. ``partial``: what is not given (``weights``
        None, names left out of ``state``) keeps its values."""
        self._check_open()
        if weights is not None or not partial:
            weights = np.asarray(weights)
            if weights.shape != (self.num_rows, self.dim):
                raise ValueError(f"weights must have shape {(self.num_rows, self.dim)}, got "
                                 f"{weights.shape}")
        slots, scalars, steps = split_state(self._layout, self._state.view(np.ndarray))
        views = {**slots, **scalars, "step": steps}
        missing = sorted(set(views) - set(state))
        if missing and not partial:
            raise ValueError(f"state is missing {missing}")
        views = {name: view for name, view in views.items() if name in state}
        for name, view in views.items():
            if np.shape(state[name]) != view.shape:
                raise ValueError(f"state {name!r} must have shape {view.shape}, got "
                                 f"{np.shape(state[name])}")
        # Every array checked before the first write (no copies: memory-mapped checkpoints
        # stream in): one that cannot be written (None in "step", strings, a CuPy array)
        # raises with the table as it was, not half restored.
        values = {name: np.asarray(state[name]) for name in views}
        given = (("weights", weights),) if weights is not None else ()
        for what, value in (*given, *((f"state {n!r}", v) for n, v in values.items())):
            if value.dtype.kind not in "biuf":
                raise TypeError(f"{what} must hold real numbers, got dtype {value.dtype}")
        self._flush(drop_cache=True)
        self.note_write()
        if weights is not None:
            self._weights.view(np.ndarray)[...] = weights
        for name, view in views.items():
            view[...] = values[name]

    # ------------------------------------------------------------------ save / load

    def save(self, path) -> None:
        """Write the configuration, weights and every optimizer state array to ``path``
        (exactly that name, whatever its suffix), in xferlib's table format
        (``xferlib/table/io_format.py``: a checksummed header, then the raw arrays; not a
        zip), at disk speed with two small buffers. Atomic: written to a temporary file in
        the same directory, synced, renamed over ``path``, the directory synced; a crash
        leaves the old file or the new one. ``path`` must be a regular file or absent
        (ValueError for a device, FIFO or socket, IsADirectoryError for a directory); the
        file gets the permissions ``open(path, "w")`` would give. Errors name ``path``.
        Cached rows are written back first."""
        self._flush()
        slots, scalars, steps = split_state(self._layout, self._state.view(np.ndarray))
        save_table(self, path, {"weights": self._weights.view(np.ndarray), **slots, **scalars,
                                "step": steps})

    @classmethod
    def load(cls, path, *, cache_rows=None) -> "HostTable":
        """A table saved by :meth:`save` (or a ``.npz`` of earlier versions), streamed into
        the new table's memory in chunks: memory holds the table and two small buffers.
        ``cache_rows`` overrides the saved cache size. ValueError naming ``path`` and what is
        wrong for a truncated, corrupt (checksum) or foreign file."""
        def build(config):
            if cache_rows is not None:
                config["cache_rows"] = cache_rows
            table = cls(**config, init="zeros")
            slots, scalars, steps = split_state(table._layout, table._state.view(np.ndarray))
            return table, {"weights": table._weights.view(np.ndarray), **slots, **scalars,
                           "step": steps}

        return load_table(path, build)

    # ------------------------------------------------------------------ lookup / update

    def lookup(self, idx, out=None, *, stream=None, return_batch: bool = False):
        """The weights of rows ``idx``: ``(len(idx), dim)``, on the GPU for CuPy indices (read
        from the cache or straight from pinned host RAM), as NumPy for NumPy indices.

        With a GPU cache, rows that missed are admitted (evicting rows not in this batch,
        which are written back first). Rows prefetched for this very ``idx`` object by
        :meth:`prefetch` are served from the prefetch buffer. ``return_batch=True`` returns
        ``(rows, batch)``: pass ``batch`` to :meth:`apply_gradients` instead of ``idx`` to
        reuse this lookup's checked, sorted indices.

        GPU indices are checked on the device without a host sync: an index outside the table
        makes the batch's kernels write nothing and raises IndexError from a later call (at
        the latest once the device is two batches behind) or from :meth:`check`."""
        check_index_dtype(idx)
        if is_cupy_array(idx):
            rows, batch = self._gpu_state().lookup(
                idx, out, stream, for_update=return_batch and self._rule is not None)
            return (rows, batch) if return_batch else rows
        self._flush(drop_cache=True)
        check_host_indices(idx, self.num_rows)
        if out is not None and (not isinstance(out, np.ndarray) or out.shape != (
                len(idx), self.dim) or out.dtype != self.dtype):
            raise ValueError(f"out must be a NumPy array of shape {(len(idx), self.dim)} and "
                             f"dtype {self.dtype}")
        rows = take_rows(self._weights.view(np.ndarray), idx, out)
        return (rows, idx) if return_batch else rows

    def apply_gradients(self, idx, grad_rows, *, stream=None) -> None:
        """Sum the gradients of repeated indices and run the table's optimizer on each touched
        row once, where the row lives. ``grad_rows``: ``(len(idx), dim)``, same namespace as
        ``idx``. Bad input raises before anything changes."""
        if self._rule is None:
            raise ValueError("this table has no optimizer; build it with optimizer=... or "
                             "write rows with scatter()")
        if isinstance(idx, BatchPlan):  # a batch from lookup(..., return_batch=True)
            if not is_cupy_array(grad_rows):
                raise TypeError("grad_rows must be a CuPy array for a GPU batch")
            if grad_rows.shape != (idx.n, self.dim):
                raise ValueError(f"grad_rows must have shape {(idx.n, self.dim)}, "
                                 f"got {grad_rows.shape}")
            self._gpu_state().apply(idx, grad_rows, stream)
            return
        check_index_dtype(idx)
        self._check_grads(idx, grad_rows)
        if is_cupy_array(idx):
            if not is_cupy_array(grad_rows):
                raise TypeError("grad_rows must be a CuPy array like idx")
            self._gpu_state().apply(idx, grad_rows, stream)
            return
        if is_cupy_array(grad_rows):
            raise TypeError("grad_rows must be a NumPy array like idx")
        check_host_indices(idx, self.num_rows)
        self._flush(drop_cache=True)
        if idx.size:
            self._update_numpy(idx, grad_rows)

    def _check_grads(self, idx, grads) -> None:
        _check_array("grad_rows", grads)
        if grads.ndim != 2 or grads.shape != (idx.shape[0], self.dim):
            raise ValueError(f"grad_rows must have shape {(idx.shape[0], self.dim)}, "
                             f"got {grads.shape}")
        if grads.dtype.kind != "f":
            raise TypeError(f"grad_rows must be floating point, got {grads.dtype}")

    def _update_numpy(self, idx, grads) -> None:
        self._follow()
        self.note_write()
        rows, g = sum_duplicates(np.asarray(idx), np.asarray(grads, dtype=self.dtype))
        weights = self._weights.view(np.ndarray)
        state = self._state.view(np.ndarray)
        w, s = weights[rows], state[rows]
        slots, scalars, steps = split_state(self._layout, s)
        t = steps + 1
        self._rule.update(self._hyper, w, slots, scalars, g, t[:, None])
        steps[...] = t
        weights[rows] = w
        state[rows] = s

    def scatter(self, idx, rows, *, stream=None) -> None:
        """Overwrite the weights of rows ``idx`` (last write wins for repeats); the optimizer
        state is left as it is. CuPy ``idx`` and ``rows`` write straight to pinned memory."""
        from xferlib.rows import check_rows, scatter_rows

        check_index_dtype(idx)
        _check_array("rows", rows)
        if rows.shape != (idx.shape[0], self.dim):
            raise ValueError(f"rows must have shape {(idx.shape[0], self.dim)}, got {rows.shape}")
        if rows.dtype.kind not in "biuf":  # cast to the table's dtype below
            raise TypeError(f"rows must hold real numbers, got dtype {rows.dtype}")
        if is_cupy_array(idx) and is_cupy_array(rows):
            if self._gpu is not None and self._gpu.cache is not None:
                self._flush(drop_cache=True)
            gpu = self._gpu_state()
            stream = as_cupy_stream(stream)
            gpu.resolve_checks()
            self.note_write()
            with stream:
                gpu.drop_prefetch(stream)
                scatter_rows(self._weights, idx, rows.astype(self.dtype, copy=False),
                             stream=stream)
                gpu.record(stream)
            check_rows()  # a bad index raises from this call, as before
            return
        if is_cupy_array(idx) or is_cupy_array(rows):
            idx = idx.get() if is_cupy_array(idx) else idx
            rows = rows.get() if is_cupy_array(rows) else rows
        check_host_indices(idx, self.num_rows)
        self._flush(drop_cache=True)
        self.note_write()
        self._weights.view(np.ndarray)[idx] = np.asarray(rows, dtype=self.dtype)

    def prefetch(self, idx, *, stream=None) -> None:
        """Start moving rows ``idx`` (CuPy indices) to the GPU on a side stream; the next
        :meth:`lookup` of this same ``idx`` object uses them. Updates queued before the
        matching lookup are folded in (no stale rows), and nothing is written by a
        prefetch (no lost updates).

        With NumPy indices (the CPU path) it checks their dtype and shape as :meth:`lookup`
        does and does nothing more: that lookup reads host RAM directly, so there is nothing
        to move ahead, and a prefetch is a hint that changes no result. A training loop
        that prefetches then runs unchanged on a CPU machine, as the torch adapter's
        ``HostEmbeddingBag.prefetch`` does there."""
        check_index_dtype(idx)
        if not is_cupy_array(idx):
            self._check_open()  # as the GPU path and lookup: a closed table is not used
            return
        _prefetch(self._gpu_state(), idx, stream)

    # ------------------------------------------------------------------ cache

    def cache_stats(self) -> dict:
        """Hit-rate statistics of the GPU cache since construction or the last reset:
        unique rows looked up, hits, misses, admitted and evicted rows, hit rate. Warns
        (``XferlibPerformanceWarning``, once per table) when the cache thrashes: more
        evictions than cache rows while fewer than one lookup in five hits."""
        stats = dict(lookups=0, hits=0, misses=0, admitted=0, evicted=0)
        if self._gpu is not None and self._gpu.cache is not None:
            stats.update(self._gpu.cache.read_stats())
        stats["hit_rate"] = stats["hits"] / stats["lookups"] if stats["lookups"] else 0.0
        if self.cache_rows:  # a cache that evicts about as much as it serves: say so, once
            warn_cache_thrashing(self, stats["hit_rate"], stats["evicted"], stats["lookups"],
                                 self.cache_rows)
        return stats

    def reset_cache_stats(self) -> None:
        if self._gpu is not None and self._gpu.cache is not None:
            self._gpu.cache.reset_stats()

    def check(self) -> None:
        """Wait for the input checks of every GPU batch queued so far (including those
        written by CUDA-graph replays) and raise IndexError for the first bad one. A bad
        batch changes nothing; without this call its error is raised by a later call (once
        the device is two batches behind) or by anything that flushes."""
        if self._gpu is not None:
            import cupy

            cupy.cuda.get_current_stream().synchronize()
            if self._gpu.last_event is not None:
                self._gpu.last_event.synchronize()
            if self._gpu.pending is not None:
                self._gpu.pending.done.synchronize()
            self._gpu.resolve_checks(wait=True)

    def flush(self) -> None:
        """Write every cached row back to host memory and wait for queued GPU work."""
        self._flush()

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("this table is closed")

    def _flush(self, drop_cache: bool = False) -> None:
        self._check_open()
        if self._gpu is not None:
            self._gpu.flush(drop_cache)

    # ------------------------------------------------------------------ device side

    _view_of = None  # a device_view()'s weak reference to the table whose hyper it follows

    def device_view(self) -> "HostTable":
        """A handle on this table's memory with its own GPU side, for another device.

        The view's weights and optimizer state ARE this table's (the same pinned arrays, no
        copy; pinned memory is registered portable, so every GPU reaches it); its GPU side
        (launch sizes, hyperparameter array, pending input checks, events) is its own, made
        on the device current when it first runs on a GPU. It has no GPU cache (a cached row
        would go stale when another device updates it). Its hyperparameters follow this
        table's: after :meth:`set_hyper` here, the view's next GPU call uses the new values.
        The JAX adapter gives each device of a mesh one (``xferlib.adapters.jax``).

        >>> import numpy as np, xferlib
        >>> table = xferlib.HostTable(8, 4, optimizer="sgd", init="zeros")
        >>> view = table.device_view()
        >>> view.scatter(np.array([2]), np.ones((1, 4), np.float32))
        >>> table.lookup(np.array([2])).tolist()
        [[1.0, 1.0, 1.0, 1.0]]
        """
        view = object.__new__(HostTable)
        view.__dict__.update(self.__dict__)  # the same arrays: one table in memory
        # A weak reference: a view (e.g. kept per device by the JAX adapter) never keeps the
        # table alive.
        view._gpu, view.cache_rows, view._view_of = None, 0, weakref.ref(self)
        return view

    @property
    def device_side(self) -> "DeviceSide | None":
        """This table's GPU side (``xferlib.table.device.DeviceSide``: kernels' launch sizes,
        the cache, pending input checks), made on its first GPU call; None until then."""
        return self._gpu

    def prepare_gpu(self) -> None:
        """Make this table's GPU side on the current device now (launch sizes, the pinned
        ring its input checks arrive in), instead of at its first GPU call. The JAX adapter
        calls it for every device of a mesh while tracing: made inside the step's callbacks,
        the ring's pinned allocation waits for every device of the process, one of which may
        be waiting in a collective for the very thread that allocates."""
        self._gpu_state().checks.reserve()

    def _follow(self) -> None:
        """A view takes its table's hyperparameters (set_hyper() on the table reaches it)."""
        source = self._view_of() if self._view_of is not None else None
        if source is not None and self._hyper is not source._hyper:
            self._hyper = source._hyper
            if self._gpu is not None:
                self._gpu.hyper_changed()

    def _gpu_state(self) -> "DeviceSide":
        self._follow()
        if self._gpu is None:
            self._check_open()
            if not is_pinned(self._state.view(np.ndarray)):
                raise ValueError("this table's memory is not pinned (it was built without a "
                                 "GPU); the GPU path needs pinned memory")
            self._gpu = DeviceSide(self, self._weights, self._state)
        return self._gpu

    def __reduce__(self):
        """Pickled (``torch.save`` of a model, ``copy.deepcopy``) as its configuration and
        arrays: the copy allocates its own host memory (pinned where CuPy runs) and makes
        its own GPU side on first use; nothing points into this table's memory."""
        if self._shared is not None:
            raise TypeError("a shared table is not pickled: open it by name in the other "
                            "process (HostTable(..., shared=name))")
        self._flush()
        slots, scalars, steps = split_state(self._layout, self._state.view(np.ndarray))
        config = dict(num_rows=self.num_rows, dim=self.dim, dtype=self.dtype.name,
                      optimizer=self.optimizer,
                      optimizer_kwargs=dict(self._hyper) if self.optimizer else None,
                      cache_rows=self.cache_rows, cache_policy=self.cache_policy,
                      cache_admission=self.cache_admission)
        arrays = {k: np.array(v) for k, v in {**slots, **scalars, "step": steps}.items()}
        return _rebuilt, (config, np.array(self._weights.view(np.ndarray)), arrays)

    def __repr__(self) -> str:
        return (f"HostTable({self.num_rows}, {self.dim}, dtype={self.dtype.name!r}, "
                f"optimizer={self.optimizer!r}, cache_rows={self.cache_rows})")


def _check_array(name: str, x) -> None:
    """TypeError naming the argument for anything but a NumPy or CuPy array (a list, a torch
    tensor), instead of an AttributeError from the shape checks."""
    if not (isinstance(x, np.ndarray) or is_cupy_array(x)):
        raise TypeError(f"{name} must be a NumPy or CuPy array, got {type(x).__module__}."
                        f"{type(x).__name__}; convert torch tensors and JAX arrays with "
                        f"xferlib.to_numpy / xferlib.to_cupy")


def _rebuilt(config: dict, weights, state: dict) -> HostTable:
    """A table from its pickled configuration and arrays (see ``HostTable.__reduce__``)."""
    table = HostTable(**config, init="zeros")
    table.restore(weights, state)
    return table
