"""The GPU half of an EmbeddingCollection: the step's launches, and its deferred input checks.

Forward: ``coll_plan`` checks bags and indices and keys every lookup; the batch sort
(:func:`xferlib.batch.radix_sort` on the device, the tile sort for a small batch: no host
sync at any size) orders the keys and ``coll_runs`` numbers their runs (one launch); host
tables' distinct rows are staged into HBM; the pooled lookup writes the pooled output.
Backward: the two-pass gradient sums and ``coll_update`` (uncached host tables whose rows
are staged whole defer their write-back to the next staging: ``host_staging.py``). Kernels in
``xferlib/_kernels/collection.py``, ``collection_pool.py``, ``collection_sums.py`` and
``collection_update.py``.

A ``tt`` table's lookups are planned and checked with the others (its meta row makes every
row of it live nowhere: width 0, no place), then pooled and trained by its TT table on the
same stream (``tt_tables.py``: ``tt_lookup_gpu`` / ``tt_update_gpu``).

Nothing here waits for the device: the plan's verdict goes to this side's
:class:`~xferlib.batch.PendingChecks` and a bad batch raises from a later call or from
``check()`` (the policy of :mod:`xferlib.batch`); allocations depend on the batch's shape
only, so a step at fixed shapes can be captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from xferlib._backend import (as_cupy_stream, changed_constant, device_constant,
                              hyper_constant, is_capturing)
from xferlib._kernels import grid_1d, launch_config
from xferlib._kernels.collection import (META_FIELDS, PLAN, RUN_THREADS, RUNS, SUM_CHUNK,
                                         SUM_CHUNKS, SUM_SPANS, c_type, collection_module,
                                         pool_kernel, run_status_words)
from xferlib._kernels.collection_sums import long_runs_capacity, long_runs_size
from xferlib._kernels.collection_update import UPDATE, update_module
from xferlib.batch import (NO_BAD, PendingChecks, Verdict, radix_sort, radix_takes,
                           radix_work_words, sort_buffers, sort_positions)
from xferlib.checks import host_values
from xferlib.collection.host_staging import NO_CACHE_ARGS, HostStaging, plan_args
from xferlib.collection.tt_tables import tt_lookup_gpu, tt_update_gpu
from xferlib.memory import device_pointer
from xferlib.table.cache import NO_SET_ORDER, DeviceCache, SetOrder
from xferlib.table.rules import HYPER_ROW

__all__ = ["CollectionDevice", "GpuPlan"]


@dataclasses.dataclass(eq=False)
class GpuPlan:
    """A GPU batch, planned by the forward, for its backward."""

    keys: object  # sorted collection-wide keys
    perm: object  # batch position of each sorted position
    run: object   # run id of each sorted position
    starts: object  # first sorted position of each run
    run_off: object  # where each run's row lives in its placement's buffer (-1: nowhere)
    run_tab: object  # each run's table
    bag_of: object  # bag of each lookup
    offsets: object  # int64 bag boundaries
    psw: object  # per-sample weights in the collection's dtype, or None
    staged: object  # host tables' distinct rows staged by the forward (run r at row r)
    writes: int  # the side's write count when staged
    words: object  # the verdict
    n: int
    slots: object = None  # each run's GPU cache slot (-1: not cached), from the forward
    cache_pass: int = 0  # the cache pass that found them
    deferred: bool = False  # its update may hold host rows in the pending buffer
    # the backward's list of long runs (a count, then triples), zeroed with the forward's
    # working array; each update sets the count back to zero (for a next backward)
    long_runs: object = None
    # (staged rows current, slots current) as the first recorded backward found them: later
    # recordings after the recorded forward's replays decide the same (the same launches)
    recorded_choice: object = None


class CollectionReport:
    """Words a collection batch's verdict: word 0 the first lookup out of its table's
    range, word 1 the first bag whose bounds are broken."""

    def __init__(self, coll, indices, offsets, padded=False, total=None):
        self.coll, self.indices, self.offsets = coll, indices, offsets
        self.padded, self.total = padded, total

    def __call__(self, bad: int, bad_bag: int) -> None:
        from xferlib.collection.numpy_path import check_offsets, table_error

        note = " (in an earlier call of the collection on the GPU; nothing was written)"
        offsets = np.asarray(host_values(self.offsets), dtype=np.int64)
        if bad_bag != NO_BAD:
            try:
                n = int(self.indices.shape[0])
                if self.total is not None:
                    n, = host_values(self.total)
                elif self.padded:
                    n = min(int(offsets[-1]), n)
                check_offsets(offsets, int(n))
            except ValueError as err:
                raise ValueError(str(err) + note) from None
            raise ValueError(f"offsets of bag {bad_bag} are out of range{note}")
        value, = host_values(self.indices[bad:bad + 1])
        B = (offsets.size - 1) // self.coll.num_tables
        bag = int(np.searchsorted(offsets, bad, side="right")) - 1
        raise IndexError(str(table_error(self.coll, min(bag // max(B, 1),
                                                        self.coll.num_tables - 1),
                                         bad, value)) + note)


class CollectionDevice:
    """Per-table metadata on the device, launch sizes, the hyperparameter rows, the
    pending input checks."""

    def __init__(self, coll):
        import cupy

        self.coll = coll
        self.dtype_name = coll.dtype.name
        itemsize = coll.dtype.itemsize
        # Keys: host tables first, in their buffer's order (one table of every host row: what
        # the GPU cache keys by), then the HBM tables. With a cache, a host row's key is its
        # set-ordered key (SetOrder), so that the batch sort leaves the distinct host rows
        # grouped by cache set and the cache pass needs no sort of its own; else its place in
        # the host buffer.
        self.host_rows = sum(c.num_rows for c in coll.tables if c.placement == "host")
        cache_rows = min(sum(c.cache_rows for c in coll.tables), self.host_rows)
        self.set_order = (SetOrder.for_cache(self.host_rows, cache_rows)
                          if cache_rows and self.host_rows < 2**31 else None)
        order = sorted(range(coll.num_tables), key=lambda t: coll.tables[t].placement != "host")
        key_bases, next_base = {}, {True: 0,  # host rows, then the rest past every host key
                                    False: self.set_order.span if self.set_order
                                    else self.host_rows}
        for t in order:
            host = coll.tables[t].placement == "host"
            key_bases[t] = next_base[host]
            next_base[host] += coll.tables[t].num_rows
        self.total_rows = next_base[False]
        # the plan's and the run numbering's arguments of the host keys' order
        self.order_args = (dict(n_sets=self.set_order.n_sets, **self.set_order.kernel_args())
                           if self.set_order else dict(n_sets=1, **NO_SET_ORDER))
        rows = []
        for t, (config, block) in enumerate(zip(coll.tables, coll.blocks)):
            # a tt table: indices checked and keyed, rows nowhere (base -1 and row width 0
            # put each at -1: staged, pooled and updated by no kernel)
            fields = dict(num_rows=config.num_rows, dim=0, d_off=coll.dim_offsets[t], host=0,
                          base=-1, row_width=0, state_offset=0, step_off=0,
                          key_base=key_bases[t])
            if block is not None:
                layout = block.layout
                fields.update(dim=config.dim, host=int(config.placement == "host"),
                              base=block.base, row_width=layout.row_width,
                              state_offset=layout.state_offset, step_off=layout.step_offset)
            rows.append([fields[f] for f in META_FIELDS])
        self.meta = device_constant(rows, np.int64)
        self.hbm = coll.buffers.get("hbm")
        host = coll.buffers.get("host")
        self.host_ptr = device_pointer(host, "host tables") if host is not None else 0
        self.has_host = host is not None
        word = 16 // itemsize
        dims = [d for t, d in enumerate(coll.dims) if t not in coll.tt_tables]
        self.has_rows = bool(dims)  # tables whose rows the collection's kernels update
        # Over every table's width, tt tables' too: their columns place the others' in the
        # pooled output, whose vector stores need each table's offset aligned to the width.
        self.vec = next(v for v in (4, 2, 1)
                        if v <= word and all(d % v == 0 for d in coll.dims))
        # The forward stages whole rows (weights, state, step) where the state is a few
        # scalars, or where no cache holds host rows (the update then leaves them for the
        # next staging to write back as it reads: host_staging.py). With a cache and
        # full-width slots (Adam's two, Adagrad's one) only the weights: the update reads the
        # state over the link while its writes go out the other way (an H100, Adam, 8M x
        # 128, 25,500 distinct rows, written through: 1.70 ms a step against 1.95 with whole
        # rows staged).
        host = [(c, b) for c, b in zip(coll.tables, coll.blocks) if c.placement == "host"]
        defers = bool(host) and not cache_rows
        self.stage_state = defers or all(not b.layout.slots for _, b in host)
        # a staged row: the widest host row staged, in whole 16-byte words
        host_widths = [b.layout.row_width if self.stage_state else c.dim for c, b in host]
        self.stage_width = -(-max(host_widths, default=0) // word) * word
        self.width = -(-max(dims, default=1) // self.vec) * self.vec  # summed's row stride
        # Lanes per bag of the pooled lookup (see _lane_group): the widest row the kernels
        # read (tt tables' columns are written by TT's own).
        self.lane_group = _lane_group(self.width, self.vec)
        # Lanes per distinct row in the update: half the pooling's (each lane takes two of a
        # full row's vectors in turn), a quarter where no row holds state beyond its step
        # count (SGD without momentum): more rows in flight, the update being bound by each
        # row's chain of dependent loads (its place, its table, its step, its row). One
        # H200, replayed 8M x 128 steps in HBM: SGD 86.2 -> 82.7 us (32 -> 8 lanes), Adam
        # 112.3 -> 106.9 and row-wise Adagrad 87.9 -> 84.9 (32 -> 16 lanes; with 8, 108.8
        # and 85.9); 26 tables x 64 at batch 16,384, row-wise Adagrad 300.2 -> 295.2 us
        # (16 -> 8 lanes). Where the update writes host rows over the link (a cached
        # collection's: it writes through), the pooling's whole group: a row's store is then
        # one stretch of the row, not a quarter (replayed 8M x 128 SGD steps with the 5%
        # cache: 355.5 -> 332.7 us, the update 131 -> 95; row-wise Adagrad 340 -> 337).
        stateless = all(not layout.slots and not layout.row_scalars for layout in coll.layouts)
        writes_host = self.has_host and not defers
        self.update_group = (self.lane_group if writes_host
                             else max(1, self.lane_group // (4 if stateless else 2)))
        sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
        # Kernels that reach host RAM: four blocks per SM at most (the host tables' measure).
        self.max_blocks = 4 * sms if self.has_host else 65535 * 8
        # The update's grid: a batch's distinct rows are known only on the device, so its
        # groups stride over them from a grid of 16 blocks an SM, not one group per lookup
        # (most of which would find no row: an H200, 26 tables x 64, 425,984 lookups of
        # 86,642 rows, row-wise Adagrad 48.6 -> 33.4 us, Adagrad 66.6 -> 48.3).
        self.update_blocks = min(self.max_blocks, 16 * sms)
        self.hyper = None
        self.captured = False  # a forward or backward was captured into a CUDA graph
        self.writes = 0  # updates queued so far: a staged copy is current only before one
        self.checks = PendingChecks(limit=3)
        self.last_event = None
        self.cache = None
        self.cache_passes = 0  # cache passes queued: a plan's slots are current until the next
        # host rows staged, and their write-back deferred where no cache holds them
        self.staging = HostStaging(self, defers)
        if cache_rows:
            host_layout = next(b.layout for c, b in zip(coll.tables, coll.blocks)
                               if c.placement == "host")
            self.cache = DeviceCache(_HostRows(coll, host_layout, self.host_ptr, self.host_rows,
                                               self.max_blocks),
                                     cache_rows, "lru", "second-sight", self.set_order)

    def _hyper_rows(self) -> np.ndarray:
        return np.stack([self.coll.rule.kernel_row(h) for h in self.coll.hypers])

    def hypers_changed(self) -> None:
        """New hyperparameters for the following steps. Until a step has been captured into
        a CUDA graph (torch's, or XLA's command buffers), the next update uploads them on
        its own stream (no wait). After, replays read the array at the address they
        recorded and never ask for it again: the new values are written there, in place,
        once the queued steps (which keep the old values) are done: a wait for the device
        (``set_hyper`` refuses to run during a capture)."""
        self.hyper = changed_constant(self.hyper, self.captured, self._hyper_rows)

    def _hyper_array(self, stream):
        """The hyperparameter rows on the device, uploaded at the first update and after a
        change made before any capture: on the launch stream (ordered before the update that
        reads it, no wait: a schedule may change it every step), or, inside a capture, on a
        side stream and waited for (a copy recorded into the graph would read the host rows
        again at every replay)."""
        if self.hyper is None:
            self.hyper = hyper_constant(self._hyper_rows(), is_capturing(stream))
        return self.hyper

    def _record(self, stream) -> None:
        import cupy

        if is_capturing(stream):
            self.captured = True  # replays carry no event: waits go to the whole device
            return
        if self.last_event is None:
            self.last_event = cupy.cuda.Event(disable_timing=True)
        self.last_event.record(stream)

    # ---------------------------------------------------------------- forward

    def forward(self, indices, offsets, psw, B, out, stream, for_update: bool = True,
                padded: bool = False, total=None):
        import cupy

        from xferlib.collection.collection import LookupContext

        coll = self.coll
        stream = as_cupy_stream(stream)
        if not is_capturing(stream):  # an event query would invalidate a capture
            self.checks.poll(hold=not coll.raise_in_calls)
        n, bags = int(indices.shape[0]), coll.num_tables * B
        if bags == 0 and n:
            if not padded:
                raise ValueError(f"offsets describe no bag (B = 0) but there are {n} indices")
            n, indices = 0, indices[:0]  # all padding
            psw = None if psw is None else psw[:0]
        module = collection_module()
        self.staging.follow(stream)
        with stream:
            if out is None:
                out = cupy.empty((B, coll.total_dim), dtype=coll.dtype)
            # int64 offsets are read in place; contiguous int32 ones are widened by the plan
            # kernel as it reads them (offsets64 then written there); others copied here
            plain = offsets.flags.c_contiguous and offsets.dtype in (np.int32, np.int64)
            offsets_in = offsets if plain and bags else offsets.astype(np.int64)
            offsets64 = offsets_in if offsets_in.dtype == np.int64 else \
                cupy.empty(offsets.shape[0], dtype=np.int64)
            psw_c = None if psw is None else cupy.ascontiguousarray(psw, dtype=coll.dtype)
            words = cupy.empty(2, dtype=np.uint64)
            words.data.memset_async(0xFF, 16, stream)
            keys = cupy.empty(n, dtype=np.int64)
            bag_of = cupy.empty(n, dtype=np.int64)
            # One working array for the backward's list of long runs, the run numbering's
            # look-back and (a batch the radix sort takes) the sort's counts and look-back,
            # zeroed by the plan kernel (a memset node holds a graph's next kernel back).
            num_keys = self.total_rows + int(padded)
            radix = radix_takes(n, num_keys)
            long_words = 2 * long_runs_size(n)  # int64 words: first, aligned
            status_words = run_status_words(n)  # 64-bit: its tile counter, a word a tile
            run_words = long_words + 2 * status_words
            # (the sort's own verdict word, never read: the plan checked every key, between)
            zeroed, size = radix_work_words(n, num_keys) if radix else (0, 0)
            work = cupy.empty(run_words + 2 + size, dtype=np.uint32)
            sort_words = work.data.ptr + 4 * run_words
            if bags:
                # lanes per bag: the bags' mean length as a power of two, at most a warp
                group = _lane_group(-(-n // bags), 1)
                grid, block = grid_1d(bags * group, 256, 65535)
                # A padded batch's tail gets the key past every row (sorted last, one run
                # that lives nowhere) and no bag.
                PLAN.launch(module, (_key(indices), _key(offsets_in)), grid, block,
                            stream=stream, indices=indices, offsets=offsets_in, n=n, bags=bags,
                            B=B, meta=self.meta, padded=int(padded), total=total,
                            pad_key=self.total_rows, **self.order_args, keys=keys,
                            bag_of=bag_of,
                            offsets64=None if offsets64 is offsets_in else offsets64,
                            words=words, group=group, zero=work,
                            zero_words=run_words + 2 + zeroed if n else 0)
            plan = GpuPlan(None, None, None, None, None, None, bag_of, offsets64, psw_c,
                           None, self.writes, words, n)
            if n:
                plan.long_runs = work[:long_words].view(np.int64)
                if radix:
                    buffers = sort_buffers(work=work[run_words + 2:])
                    plan.keys, plan.perm = radix_sort(keys, num_keys, stream, sort_words,
                                                      buffers, zeroed=True)
                else:
                    plan.keys, plan.perm, _ = sort_positions(keys, num_keys, stream=stream)
                plan.run = cupy.empty(n, dtype=np.int64)
                plan.starts = cupy.empty(n, dtype=np.int64)
                plan.run_off = cupy.empty(n, dtype=np.int64)
                plan.run_tab = cupy.empty(n, dtype=np.int32)
                # each lookup's run (its staged row), for the pooling of host tables' rows
                inv = cupy.empty(n, dtype=np.int64) if self.has_host else None
                RUNS.launch(module, (_key(plan.keys),), (status_words - 1,), (RUN_THREADS,),
                            stream=stream, meta=self.meta, keys=plan.keys, perm=plan.perm,
                            bag_of=bag_of, n=n, B=B, **self.order_args,
                            status=work[long_words:],
                            run=plan.run,
                            starts=plan.starts, run_off=plan.run_off, run_tab=plan.run_tab,
                            inv=inv, verdict=words)
                # room for this batch's deferred rows before anything reads host rows (a
                # buffer grown writes the pending rows back first)
                plan.deferred = for_update and self.staging.room(n, stream)
                if self.cache is not None:  # rows of host tables found, admitted, evicted
                    plan.slots = self.cache.insert(_CachePlan(plan), stream)
                    self.cache_passes += 1
                    plan.cache_pass = self.cache_passes
                if self.has_host:
                    plan.staged = cupy.empty((n, self.stage_width), dtype=coll.dtype)
                    self.staging.stage(stream, n, plan, self._cache_args(plan.slots),
                                       plan.staged, int(for_update and self.stage_state), words,
                                       keep_taken=plan.deferred)
                    if not for_update:
                        plan.writes = -1  # weights only: no update may read this copy
                        self.staging.written(stream)
                # a group of lanes per bag, or per two bags of about one lookup each
                # (collection_pool.py), 32 // lane_group groups per warp
                # (no stride loop: far under the grid's 2**31 - 1 blocks)
                kernel, nb = pool_kernel(n, bags)
                grid, block = grid_1d(-(-bags // nb) * self.lane_group, 256)

                def pool(verdict_host=None):
                    kernel.launch(module, (self.vec, c_type(self.dtype_name), _key(indices)),
                                  grid, block, stream=stream, hbm=self.hbm, meta=self.meta,
                                  indices=indices, offsets=offsets64, psw=psw_c, inv=inv,
                                  staged=plan.staged, stage_width=self.stage_width, n=n,
                                  bags=bags, B=B, mean=int(coll.pooling == "mean"), out=out,
                                  total_dim=coll.total_dim, group=self.lane_group,
                                  verdict=words, verdict_host=verdict_host)
            elif out.size:
                out.fill(0)
            verdict = Verdict(words, CollectionReport(coll, indices, offsets, padded, total))
            if n and not coll.tt_tables:
                # the last kernel to write the verdict ran: the pooling copies it to its
                # pinned slot (no launch of its own, about 1.4 us of a replayed step)
                verdict.defer(self.checks, stream, copy=pool)
                tt = {}
            else:
                if n:
                    pool()
                tt = tt_lookup_gpu(coll, indices, offsets64, psw_c, B, words, out, stream)
                verdict.defer(self.checks, stream)
            self._record(stream)
        return out, LookupContext(indices, offsets, psw, B, plan, tt)

    # ---------------------------------------------------------------- backward

    def backward(self, ctx, grad, stream) -> None:
        import cupy

        coll, plan = self.coll, ctx.plan
        stream = as_cupy_stream(stream)
        if not is_capturing(stream):  # an event query would invalidate a capture
            self.checks.poll(hold=not coll.raise_in_calls)
        n = plan.n
        self.staging.follow(stream)
        if ctx.tt:
            with stream:
                tt_update_gpu(coll, ctx.tt, grad, ctx.batch_size, stream)
                self._record(stream)
        if n == 0 or not self.has_rows:
            return
        module = collection_module()
        T = c_type(self.dtype_name)
        with stream:
            if not _rows_of_columns(grad, coll.dtype):  # else read in place, row by row
                grad = cupy.ascontiguousarray(grad, dtype=coll.dtype)
            width = self.width
            chunks = -(-n // SUM_CHUNK)
            summed = cupy.empty((n, width), dtype=coll.dtype)  # rows past the last run unused
            head = cupy.empty((chunks, width), dtype=coll.dtype)
            tail = cupy.empty((chunks, width), dtype=coll.dtype)
            # the runs across more than LONG_SPAN chunks (a count, then at most one run a
            # LONG_SPAN + 1 chunks)
            long_runs = plan.long_runs  # zeroed by the forward, and again by each update
            cross = cupy.empty((chunks, 2), dtype=np.int64)  # each chunk's short crossing run
            key = _key(plan.keys)
            # V adjacent columns a lane where every gradient row starts on a V-word boundary
            # (a slice of a wider gradient may not)
            v = self.vec if (grad.strides[0] // grad.itemsize % self.vec == 0
                             and grad.data.ptr % (self.vec * grad.itemsize) == 0) else 1
            while v > 1 and 16 * v >= width:  # a warp's lanes over the row, none idle
                v //= 2
            grid, block = launch_config(chunks * -(-width // (32 * v)))  # a warp per slice
            SUM_CHUNKS.launch(module, (v, T, key), grid, block, stream=stream, grad=grad,
                              keys=plan.keys, run=plan.run, perm=plan.perm, bag_of=plan.bag_of,
                              offsets=plan.offsets, meta=self.meta, psw=plan.psw,
                              mean=int(coll.pooling == "mean"), B=ctx.batch_size,
                              grad_stride=grad.strides[0] // grad.itemsize, n=n, width=width,
                              summed=summed, head=head, tail=tail, cross=cross,
                              long_runs=long_runs, verdict=plan.words)
            # a lane group per chunk, and a block per listed long run (a hot row's; a grid
            # of at least as many blocks as the list can hold)
            blocks = max(-(-chunks * self.lane_group // 256),
                         long_runs_capacity(long_runs.size))
            SUM_SPANS.launch(module, (self.vec, T), (blocks,), (256,), stream=stream,
                             run=plan.run, starts=plan.starts, cross=cross, long_runs=long_runs,
                             n=n, width=width, summed=summed, head=head, tail=tail,
                             group=self.lane_group, verdict=plan.words)
            # The forward's staged weights are current only if no update came between; its
            # cache slots only if no cache pass came between (else located again).
            choice = (plan.writes == self.writes,
                      self.cache is None or plan.cache_pass == self.cache_passes)
            if is_capturing(stream):
                if plan.recorded_choice is None:
                    plan.recorded_choice = choice
                choice = plan.recorded_choice
            staged_current, slots_current = choice
            staged = plan.staged if staged_current else None
            deferred = plan.deferred and staged is not None
            if not deferred:  # the update reads or writes host rows itself: current first
                self.staging.write_back(stream)
            self.writes += 1
            slots = plan.slots
            if not slots_current:
                slots = self.cache.probe(_CachePlan(plan), stream)
            kind = int(coll.rule.kind)
            group = self.update_group  # lanes per row
            grid, block = grid_1d(n * group, 256, self.update_blocks)
            UPDATE.launch(update_module(kind, self.dtype_name), (kind, self.vec, T),
                          grid, block, stream=stream, hbm=self.hbm, host=self.host_ptr,
                          meta=self.meta, **plan_args(plan), n=n, summed=summed,
                          width=width, staged=staged, stage_width=self.stage_width,
                          staged_state=int(self.stage_state), **self._cache_args(slots),
                          dirty=self.cache.dirty if slots is not None else None,
                          n_slots=len(coll.layouts[0].slots), hyper=self._hyper_array(stream),
                          hyper_width=HYPER_ROW, **self.staging.pending_args(deferred),
                          long_runs=long_runs, group=group, verdict=plan.words)
            self._record(stream)

    def replayed_lookup(self, plan, stream) -> None:
        """A captured forward of ``plan`` was replayed on ``stream``: with a cache, its cache
        pass moved rows, so the slots earlier forwards found are stale, as after an eager
        pass (located again by their updates); ``plan``'s own staged rows and slots are
        current, as an eager forward's are."""
        if self.cache is not None:
            self.cache_passes += 1
        plan.writes, plan.cache_pass = self.writes, self.cache_passes
        self._record(as_cupy_stream(stream))

    def replayed_update(self, stream) -> None:
        """A captured update was replayed on ``stream``: staged copies of earlier forwards
        are stale, as after an eager one (their updates then write back the pending rows and
        read host RAM)."""
        self.writes += 1
        self._record(as_cupy_stream(stream))

    def _cache_args(self, slots) -> dict:
        if slots is None:
            return NO_CACHE_ARGS
        return dict(cache=self.cache.data, cache_width=self.cache.width, slots=slots)

    # ---------------------------------------------------------------- waiting

    def _wait_queued(self):
        """The current stream, made to wait for this side's last queued work."""
        import cupy

        stream = cupy.cuda.get_current_stream()
        if self.captured:  # graph replays, on any stream, record no event
            with self.meta.device:
                cupy.cuda.runtime.deviceSynchronize()
        elif self.last_event is not None:
            stream.wait_event(self.last_event)
        return stream

    def synchronize(self, drop_cache: bool = False) -> None:
        """Queued work done; pending and cached rows written back to host RAM
        (``drop_cache``: the cache emptied too, before host rows are overwritten)."""
        stream = self._wait_queued()
        self.staging.write_back(stream)
        if self.cache is not None:
            self.cache.flush(stream, drop_cache)
            if drop_cache:
                self.cache_passes += 1  # slots of earlier plans are gone
        stream.synchronize()

    def cache_stats(self) -> dict:
        stats = dict(lookups=0, hits=0, misses=0, admitted=0, evicted=0)
        if self.cache is not None:
            stats.update(self.cache.read_stats())
        return stats

    def check(self) -> None:
        # the verdicts need the queued work done, not the cache written back (a flush of a
        # large cache is a transfer of its every dirty row: readers of host RAM synchronize)
        self._wait_queued().synchronize()
        self.checks.poll(wait=True)


class _CachePlan:
    """A collection plan as the cache's passes read it (sorted keys, runs, the verdict)."""

    def __init__(self, plan):
        self.keys, self.run, self.n = plan.keys, plan.run, plan.n
        self.verdict = Verdict(plan.words, None)


class _HostRows:
    """The host tables seen as one table of every host row, for the GPU cache
    (``xferlib.table.cache.DeviceCache`` reads a table's layout, dtype and row count, the
    host rows' addresses and its launch sizes from this)."""

    def __init__(self, coll, layout, host_ptr, host_rows, max_blocks):
        import types

        self.table = types.SimpleNamespace(layout=layout, dtype=coll.dtype,
                                           num_rows=host_rows)
        self.dtype_name = coll.dtype.name
        word = 16 // coll.dtype.itemsize
        # The cache kernels are built for whole 16-byte words or single elements.
        self.vec = word if layout.dim % word == 0 else 1
        self.host_ptr, self.host_rows, self.max_blocks = host_ptr, host_rows, max_blocks
        self.row_width = layout.row_width
        self.state_ptr = host_ptr + layout.state_offset * coll.dtype.itemsize

    def host_args(self):
        return (np.uint64(self.host_ptr), np.int64(self.row_width), np.uint64(self.state_ptr),
                np.int64(self.row_width), np.int64(self.host_rows))

    def launch_size(self, n_warps: int, prefetch: bool = False):
        return launch_config(max(1, n_warps), max_blocks=self.max_blocks)


def _rows_of_columns(grad, dtype) -> bool:
    """Whether the kernels read ``grad`` in place: the collection's dtype, each row's
    columns adjacent, rows a whole number of elements apart (a slice of a wider gradient,
    as autograd hands a concatenation's part back, needs no copy)."""
    item = grad.itemsize
    return (grad.dtype == dtype and grad.ndim == 2 and grad.strides[1] == item
            and grad.strides[0] >= 0 and grad.strides[0] % item == 0)


def _lane_group(width: int, vec: int) -> int:
    """Lanes given to one row of ``width`` elements read ``vec`` at a time: enough for the
    row's vectors, a power of two, at most a warp (so a warp takes 32 // group rows and no
    lane idles on a narrow row)."""
    vectors = -(-max(int(width), 1) // vec)
    return min(32, 1 << max(0, vectors - 1).bit_length())


def _key(array) -> str:
    """The kernels' C type for an index or key array."""
    return "int" if array.dtype.itemsize == 4 else "long long"
