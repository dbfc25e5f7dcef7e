"""``ShardedEmbeddingBagCollection``: a collection's tables sharded over a process group.

Model-parallel embeddings (TorchRec's design, written for xferlib's collection): a
:class:`~xferlib.collection.ShardingPlan` puts each table on one rank, or its rows in ranges
over the ranks; each rank holds a core collection of its shards only (a row range is a table
of its rows). A step, on every rank at once:

1. The rank's local batch (FBGEMM's layout: every table's bags for its ``B_local`` samples)
   is routed: each lookup goes to the shard holding its row (its index made local to the
   shard), lookups sorted stably by (owner, shard), so each shard's lookups keep their bag
   order.
2. A fixed-size header goes to every rank by ``all_to_all_single`` (this rank's ``B_local``,
   how many indices it sends there, whether weights follow, whether its input was refused),
   and is read on the host: the one host sync of the step. ``all_to_all`` of variable
   lengths needs its split sizes on the host, so this sync is forced. ``capturable=True``
   trades it for padding: every rank passes the same batch shape, each message has room
   for all of the sender's lookups (the true ones first, their bag lengths in front), the
   owner takes what it received as one padded batch (``EmbeddingCollection.forward(
   padded=True)``), and nothing is read back: a step, its collectives included, can be
   captured in a CUDA graph. Bad input is then refused on the device (only the bad lookups
   travel, and their owner writes nothing) and raised by :meth:`check`.
3. Bag lengths and local indices (one int64 message per pair), and per-sample weights when
   any rank has them (``mean`` pooling sends ``1 / bag length`` as weights, so a row-wise
   shard divides by the whole bag's length), go to the owners by ``all_to_all_single``.
4. Each owner lays its received bags out as one batch (table by table, ranks in order: the
   same order the global batch has in one process) and runs its collection's pooled lookup.
5. The pooled rows go back by a second ``all_to_all_single``; each rank writes them into its
   ``(B_local, total_dim)`` output at its tables' columns (a row-wise table's partial sums
   added, owners in rank order).

Backward reverses 5: each rank sends the pooled gradient of each owner's columns, and each
owner runs its collection's fused backward + update, which sums every row's gradients in
the global batch's order. So ranks train what one process trains on the same global batch:
the same bits for table-wise plans, the same weights and state for row-wise plans when the
gradients are (their pooled outputs add partial sums, equal to float32 rounding).

The dense part of a model stays data-parallel (DistributedDataParallel beside this module:
it has no parameters, so DDP leaves it alone). Gloo on the CPU, NCCL on GPUs (each rank on
its own GPU, ``torch.cuda.set_device(rank)`` before building).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.distributed as dist

from xferlib.adapters.torch.collection import EmbeddingBagCollection, TrainInPlace
from xferlib.adapters.torch.collection_exchange import KernelExchange
from xferlib.adapters.torch.collection_inputs import batch_size, layout_inputs
from xferlib.adapters.torch.collection_layout import (gather_columns, lookup_weights,
                                                      owner_batch, owner_batch_padded,
                                                      place_columns, refusal_of, table_blocks)
from xferlib.adapters.torch.collection_routing import ShardRouting
from xferlib.collection import TableConfig
from xferlib.collection.sharding import (ShardingPlan, fill_shard_weights, plan_sharding,
                                         refuse_tt)

__all__ = ["ShardedEmbeddingBagCollection"]

_STATE = "embedding_bags."
# Input errors travel in the header as codes, so every rank raises (none waits forever in a
# collective for a rank that gave up).
_ERRORS = {1: TypeError, 2: ValueError, 3: IndexError, 4: KeyError, 5: NotImplementedError}
_INPUT_ERRORS = tuple(_ERRORS.values())
_HEADER = 5  # B_local, indices sent, weights follow, input error code, bad values


@dataclasses.dataclass
class _Step:
    """What a forward leaves for its backward: split sizes and the owner's context."""

    batch: int                 # this rank's B_local
    batches: list              # every rank's B_local
    lookup: object             # the local collection's LookupContext (None: no shards)


class ShardedEmbeddingBagCollection(ShardRouting, torch.nn.Module):
    """The tables of an :class:`EmbeddingBagCollection`, sharded over a process group.

    Args:
      tables: :class:`~xferlib.collection.TableConfig` per table, the same on every rank.
      optimizer, optimizer_kwargs: the collection's optimizer, fused into the backward.
      plan: a :class:`~xferlib.collection.ShardingPlan` for the group's size; default
        ``plan_sharding(tables, world_size, optimizer=..., ...)`` (table-wise, balanced).
      process_group: the group (default: the default group; torch.distributed must be
        initialized).
      pooling, dtype, device: as :class:`EmbeddingBagCollection`'s (``device`` default:
        this rank's current GPU with NCCL, else the CPU).
      seed: the tables' initializer seed: each shard starts with the rows an unsharded
        collection of the same seed starts with. None: rank 0 draws one for all.
      capturable: fixed-size messages and no host read in a step (CUDA graphs, NCCL
        collectives inside them). Every rank must pass the same ``B_local``, number of
        indices and presence of weights (checked outside a capture, with a small
        all_reduce); messages carry room for every lookup of the sender, so the owners
        see ``world_size`` times the lookups as padded slots. Bad input changes nothing
        and raises from :meth:`check` (the rank that passed it, and the owner its bad
        index went to) instead of at once on every rank.
      max_bag_size: with ``capturable``, a bound on every bag's length: each owner's room
        from a sender is then ``B_local x max_bag_size`` per table it holds (no padding
        when every bag has that many lookups). A longer bag is refused like bad offsets.

    ``forward(indices, offsets, per_sample_weights=None)`` takes this rank's batch in
    FBGEMM's layout (every table's bags for its ``B_local`` samples; ranks may have
    different ``B_local``, 0 included) or the dict form ``{name: (indices, offsets[,
    weights])}``, and returns ``(B_local, total_dim)`` pooled rows, tables at the columns an
    unsharded collection gives them. Every rank of the group must call forward (and, when
    training, backward) together: they are collectives. Bad input on any rank raises on
    every rank (its own error there; the same type elsewhere) before any table changes.

    ``state_dict()`` holds this rank's shards (``embedding_bags.<shard>.weight`` and its
    optimizer state; a row range is named ``"<table>[start:stop]"``);
    :func:`~xferlib.adapters.torch.save_sharded` and
    :func:`~xferlib.adapters.torch.load_sharded` write and read checkpoints that load onto
    any plan and group size, or into one process.
    """

    def __init__(self, tables, optimizer: str = "sgd", optimizer_kwargs=None, *,
                 plan: ShardingPlan | None = None, process_group=None, pooling: str = "sum",
                 dtype=torch.float32, device=None, seed: int | None = 0,
                 capturable: bool = False, max_bag_size: int | None = None):
        super().__init__()
        self.capturable = bool(capturable)
        if max_bag_size is not None:
            if not capturable:
                raise ValueError("max_bag_size sizes capturable=True's fixed messages; "
                                 "without capturable the messages are sized per batch")
            if isinstance(max_bag_size, bool) or not isinstance(max_bag_size, int) \
                    or max_bag_size < 1:
                raise ValueError(f"max_bag_size must be a positive int, got {max_bag_size!r}")
        self._max_bag_size = max_bag_size
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("a ShardedEmbeddingBagCollection needs torch.distributed "
                               "initialized (init_process_group); in one process use "
                               "EmbeddingBagCollection")
        self.group = process_group if process_group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        configs = [t if isinstance(t, TableConfig) else TableConfig(*t) for t in tables]
        configs = [c.named(k) for k, c in enumerate(configs)]
        refuse_tt(configs)
        if plan is None:
            plan = plan_sharding(configs, self.world_size, optimizer=optimizer,
                                 optimizer_kwargs=optimizer_kwargs,
                                 dtype=str(dtype).replace("torch.", ""))
        if plan.world_size != self.world_size:
            raise ValueError(f"the plan is for {plan.world_size} ranks; the group has "
                             f"{self.world_size}")
        if [(c.name, c.num_rows, c.dim) for c in plan.tables] != \
                [(c.name, c.num_rows, c.dim) for c in configs]:
            raise ValueError("the plan was made for other tables (names, rows or widths "
                             "differ)")
        # The plan says where each table lives; the tables' own configs (learning rate,
        # placement, cache) are the module's: a plan made from other configs must not
        # silently train them.
        self.tables = tuple(configs)
        self.plan = dataclasses.replace(plan, tables=self.tables)
        self.pooling, self.dtype = pooling, dtype
        self.optimizer, self.optimizer_kwargs = optimizer, dict(optimizer_kwargs or {})
        backend = dist.get_backend(self.group)
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device())
                      if backend == "nccl" else torch.device("cpu"))
        self.device = torch.device(device)
        if seed is None:  # every rank must initialize its shards from one seed
            box = [int(np.random.SeedSequence().entropy) & ((1 << 63) - 1)]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0),
                                       group=self.group)
            seed = box[0]
        self.names = tuple(c.name for c in configs)
        self.dims = tuple(c.dim for c in configs)
        self.dim_offsets = tuple(int(x) for x in np.concatenate([[0], np.cumsum(self.dims)]))
        self.total_dim = self.dim_offsets[-1]
        self._build_local(seed)
        self._build_routes()
        # pooled rows placed and gathered by whole tables (when all are one width)
        self._table_blocks = table_blocks(self.plan, self.dims, self.device)
        # capturable on a GPU: the core's exchange kernels build and unpack the messages
        self._kernels = None
        if self.capturable and self.device.type == "cuda":
            self._kernels = KernelExchange(self.plan, self.device, self.dtype)
        self._refused = torch.zeros(2, dtype=torch.int64, device=self.device)
        self._room_cache = {}  # (B, n) -> each owner's room in a capturable message
        self._owner_error = None  # capturable, CPU: a refused batch's error, for check()
        self._pack_error = None  # the dict form's error, raised inside the step (every rank)

    # ------------------------------------------------------------------ construction

    def _build_local(self, seed: int) -> None:
        """This rank's collection of its shards, zero-built, then filled with the rows an
        unsharded collection seeded ``seed`` starts with. Mean pooling is done by weights
        (``1 / bag length``, from the requesting rank), so the shards pool by sums."""
        self.shards = self.plan.shards_of(self.rank)
        local = None
        if self.shards:
            configs = [dataclasses.replace(c, init="zeros")
                       for c in self.plan.local_configs(self.rank)]
            local = EmbeddingBagCollection(
                configs, self.optimizer, self.optimizer_kwargs,
                pooling="sum", dtype=self.dtype, device=self.device, seed=0)
            with local._on_device():
                for k, s in enumerate(self.shards):
                    fill_shard_weights(local.collection, k, self.tables[s.table_index].init,
                                       seed, s.table_index, s.row_start)
            # capturable: a refused GPU batch is held for check() (raised by one rank's call
            # alone, it would leave the others waiting in the step's next collective)
            local.collection.raise_in_calls = not self.capturable
        # Not a registered submodule: this module's state_dict names the shards itself.
        object.__setattr__(self, "local", local)

    # ------------------------------------------------------------------ forward

    def forward(self, indices, offsets=None, per_sample_weights=None) -> torch.Tensor:
        try:
            indices, offsets, per_sample_weights = self._inputs(indices, offsets,
                                                                per_sample_weights)
        except _INPUT_ERRORS as err:
            # raised inside the step, where every rank learns of it: a rank that raised here
            # alone would leave the others waiting in the exchange
            indices = offsets = per_sample_weights = None
            self._pack_error = err
        if not (torch.is_grad_enabled() and self.training):
            return self._forward(indices, offsets, per_sample_weights, train=False)[0]
        anchor = torch.empty(0, device=self.device, requires_grad=True)
        return TrainInPlace.apply(anchor, self, indices, offsets, per_sample_weights)

    def _inputs(self, indices, offsets, per_sample_weights):
        return layout_inputs(self.names, self.device, indices, offsets, per_sample_weights)

    def _check_types(self, indices, offsets, per_sample_weights) -> int:
        """B_local, after the checks that read no values; raises the input error this rank
        had before the step (kept for the step, where every rank learns of it) first."""
        error, self._pack_error = self._pack_error, None
        if error is not None:
            raise error
        return batch_size(len(self.tables), indices, offsets, per_sample_weights)

    def _forward(self, indices, offsets, per_sample_weights, train: bool):
        if self.capturable:
            return self._exchange_fixed(indices, offsets, per_sample_weights, train)
        return self._exchange(indices, offsets, per_sample_weights, train)

    def check(self) -> None:
        """Raise for a batch refused since the last check: this rank's collection's pending
        GPU input checks (an index out of range sent here), and, ``capturable``, bad
        offsets or indices this rank passed (recorded on the device, read here)."""
        if self.local is not None:
            self.local.check()
        error, self._owner_error = self._owner_error, None
        if error is not None:
            raise error
        if self.capturable:
            bad_offsets, bad_indices = (int(v) for v in self._refused.tolist())
            if bad_offsets or bad_indices:
                self._refused.zero_()
                kind = ValueError if bad_offsets else IndexError
                longer = "" if self.max_bag_size is None else \
                    f" (or a bag longer than max_bag_size={self.max_bag_size})"
                raise kind(f"rank {self.rank} passed {bad_offsets} batch(es) with bad offsets"
                           f"{longer} and {bad_indices} with an index out of range since the "
                           f"last check (refused: no table changed on any rank)")

    def _agree(self, B: int, n: int, weighted: bool, own_error=None) -> None:
        """``capturable``: every rank must pass the same batch shape (the messages have fixed
        sizes). Checked on every call outside a CUDA-graph capture (one small all_reduce,
        read on the host, on every rank alike); a captured step replays shapes checked
        when it was captured."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            if own_error is not None:
                raise own_error
            return
        # A rank whose input was refused on the host still takes part (its flag in the
        # reduce), so every rank raises together and none waits in a collective.
        mine = torch.tensor([B, n, int(weighted), self.max_bag_size or 0,
                             int(own_error is not None)], dtype=torch.int64, device=self.device)
        both = torch.cat([mine, -mine])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        high, low = both[:5].tolist(), (-both[5:]).tolist()
        if own_error is not None:
            raise own_error
        if high[4]:
            raise ValueError("another rank of the group passed a batch the sharded collection "
                             "refused; no table changed on any rank")
        if high[:4] != low[:4]:
            raise ValueError(f"capturable ShardedEmbeddingBagCollection: every rank must pass "
                             f"the same B_local, number of indices and weights, and be built "
                             f"with the same max_bag_size; this rank passed B = {B}, {n} "
                             f"indices, weights {weighted}, max_bag_size {self.max_bag_size}; "
                             f"the group's range is {low[:4]} to {high[:4]}")

    def _exchange_fixed(self, indices, offsets, per_sample_weights, train: bool):
        """The forward without a host sync (``capturable``): every message has a size known
        beforehand. Each rank sends every owner the bag lengths of the owner's shards for
        its B samples and room for its lookups there (all n of them, or what
        ``max_bag_size`` bounds; the true ones first), and the owner
        takes what it received as one padded batch (``EmbeddingCollection.forward(
        padded=True)``). A bad offset or index on any rank (learned by a small all_reduce)
        sends only the bad lookups, which their owner refuses: nothing changes, and
        :meth:`check` raises (the owner's collection holds a refused GPU batch for
        :meth:`check`: ``raise_in_calls`` is off, so no rank raises alone)."""
        dev, world, me, S = self.device, self.world_size, self.rank, self._max_slots
        B, own_error = 0, None
        try:
            B = self._check_types(indices, offsets, per_sample_weights)
        except _INPUT_ERRORS as err:
            own_error = err
        n = int(getattr(indices, "shape", (0,))[0]) if own_error is None else 0
        weighted = per_sample_weights is not None or self.pooling == "mean"
        self._agree(B, n, weighted, own_error)
        # Each owner's room: all n lookups, or (max_bag_size) its tables' bags at most that
        # long; an owner without shards gets none. The same on every rank (same B and n).
        caps, starts, cap, base, layout = self._rooms(B, n)
        head = S * B
        if self._kernels is not None:
            message, w_message = self._send_kernels(indices, offsets, per_sample_weights, B,
                                                    weighted, layout)
        else:
            message, w_message = self._send_tensors(indices, offsets, per_sample_weights, B,
                                                    n, weighted, caps, starts, cap, base)
        received = self._a2a(message, [head + caps[me]] * world,
                             [head + c for c in caps], torch.int64).view(world,
                                                                         head + caps[me])
        w_received = None
        if weighted:
            w_received = self._a2a(w_message, [caps[me]] * world, caps,
                                   self.dtype).view(world, caps[me])
        ctx = None
        T_me = len(self.shards)
        if self.local is not None:
            if self._kernels is not None:
                idx_own, off_own, w_own = self._kernels.unpack(received, w_received, B,
                                                               caps[me], T_me)
            else:
                idx_own, off_own, w_own = owner_batch_padded(received, w_received, B,
                                                             caps[me], T_me, S)
            core = lambda t: self.local._core(t, "x")  # noqa: E731
            try:
                pooled, ctx = self.local._lookup(core(idx_own), core(off_own),
                                                 None if w_own is None else core(w_own),
                                                 train=train, padded=True)
            except IndexError as err:  # the NumPy path refuses at once: keep in step
                self._owner_error = err  # with the other ranks, raise from check()
                pooled = torch.zeros((world * B, self._owner_dim[me]), dtype=self.dtype,
                                     device=dev)
        else:
            pooled = torch.zeros((world * B, 0), dtype=self.dtype, device=dev)
        d_me = self._owner_dim[me]
        back = self._a2a(pooled.reshape(-1), [B * d for d in self._owner_dim],
                         [B * d_me] * world, self.dtype)
        out = place_columns(back, B, self._owner_dim, self._owner_cols,
                            self.total_dim, self._table_blocks)
        return out, _Step(B, [B] * world, ctx)

    def _count_refused(self, refused):
        """Add this batch's ``[bad offsets, an index out of range]`` (device flags) to the
        counts :meth:`check` reads, and return how many the group had (the step's one small
        all_reduce, no host read)."""
        self._refused += refused
        any_bad = refused.sum().reshape(1)
        dist.all_reduce(any_bad, group=self.group)
        return any_bad

    def _send_kernels(self, indices, offsets, per_sample_weights, B: int, weighted: bool,
                      layout):
        """This rank's messages by the core's exchange kernels (CUDA): ``(lookups,
        weights)``, the checks' flags summed over the group by the one all_reduce."""
        dev = self.device
        idx = indices.to(dev, torch.int64).contiguous()
        off = offsets.to(dev, torch.int64).contiguous()
        refused = self._kernels.check(idx, off, B, self.max_bag_size or 0)
        any_bad = self._count_refused(refused)
        w = (None if per_sample_weights is None
             else per_sample_weights.to(dev, self.dtype).contiguous())
        return self._kernels.pack(idx, off, w, B, refused, any_bad, layout,
                                  self.pooling == "mean", weighted)

    def _send_tensors(self, indices, offsets, per_sample_weights, B: int, n: int,
                      weighted: bool, caps, starts, cap, base):
        """This rank's messages by torch tensor arithmetic (the CPU's form, and the
        kernels' reference): ``(lookups, weights)``."""
        dev, world, S = self.device, self.world_size, self._max_slots
        local, owner, slot, sample, bad_each, bad_off, lengths, bag = self._locate(
            indices, offsets, B)
        if self.max_bag_size is not None and lengths.numel():  # the owners' room assumes it
            bad_off = bad_off | (lengths > self.max_bag_size).any()
        any_bad = self._count_refused(torch.stack([bad_off.to(torch.int64),
                                                   bad_each.any().to(torch.int64)]))
        # Bad anywhere: only the bad lookups travel (bad offsets: none of this rank's).
        send = torch.where(any_bad > 0, bad_each & ~bad_off, torch.ones_like(bad_each))
        head = S * B
        # Bag lengths per (owner, slot, sample), the header of each owner's message.
        counts = torch.zeros(world * head + 1, dtype=torch.int64, device=dev)
        counts.index_add_(0, torch.where(send, slot * B + sample, world * head),
                          send.to(torch.int64))
        # Lookups in (owner, slot) order, bag order kept; each at its place in its owner's
        # n slots (the unsent ones to a spill slot past the end).
        order = torch.sort(torch.where(send, slot, world * S), stable=True).indices
        s_send, s_owner = send[order], owner[order]
        taken = torch.cumsum(s_send.to(torch.int64), 0) - s_send.to(torch.int64)
        per_owner = torch.zeros(world, dtype=torch.int64, device=dev).index_add_(
            0, s_owner, s_send.to(torch.int64))
        first = torch.cumsum(per_owner, 0) - per_owner
        place = taken - first[s_owner]
        fits = s_send & (place < cap[s_owner])  # all of them when the bags are in bounds
        dst = torch.where(fits, base[s_owner] + place, sum(caps))
        spill = torch.zeros(sum(caps) + 1, dtype=torch.int64, device=dev)
        spill[dst] = local[order]
        # Owner after owner: the bag lengths of its slots, then its room of lookups.
        header = counts[:world * head].view(world, head)
        message = torch.cat([part for o in range(world) for part in (
            header[o], spill[starts[o]:starts[o] + caps[o]])])
        w_message = None
        if weighted:
            w = lookup_weights(per_sample_weights, lengths, bag, n, self.pooling, self.dtype,
                               dev)
            w_spill = torch.zeros(sum(caps) + 1, dtype=self.dtype, device=dev)
            w_spill[dst] = w[order]
            w_message = w_spill[:sum(caps)]
        return message, w_message

    @property
    def max_bag_size(self):
        """The bound on every bag's length the capturable messages are sized by (None: no
        bound, room for every lookup); fixed when the module is built."""
        return self._max_bag_size

    def _rooms(self, B: int, n: int):
        """Lookup slots per owner in a ``capturable`` message: ``n`` (every lookup of the
        sender may go to one owner), at most ``B x max_bag_size`` per table the owner holds
        a shard of when ``max_bag_size`` is set; none for an owner without shards. ``(rooms,
        starts)`` as host ints and as device tensors, and the exchange kernels' layout, made
        once per batch shape, eagerly (the warm-up's): no host-to-device copy inside a
        CUDA-graph capture."""
        key = (B, n)
        if key not in self._room_cache:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                # a capture only records the fills: the cached values would be unset
                raise RuntimeError("capturable ShardedEmbeddingBagCollection: run one "
                                   "eager step of this batch shape before capturing it")
            if self.max_bag_size is None:
                rooms = [n if t else 0 for t in self._owner_tables]
            else:
                rooms = [min(n, B * self.max_bag_size * t) for t in self._owner_tables]
            starts = [int(v) for v in np.cumsum(rooms) - rooms]
            on_device = lambda v: torch.tensor(v, dtype=torch.int64,  # noqa: E731
                                               device=self.device)
            head = self._max_slots * B
            # the exchange kernels': rooms, each owner's message start, its room's start
            # among the weights, and the two messages' sizes
            rooms_t, starts_t = on_device(rooms), on_device(starts)
            layout = (rooms_t, on_device([o * head + s for o, s in enumerate(starts)]), starts_t,
                      self.world_size * head + sum(rooms), sum(rooms))
            self._room_cache[key] = (rooms, starts, rooms_t, starts_t, layout)
        return self._room_cache[key]

    def _a2a(self, send, out_splits, in_splits, dtype):
        out = torch.empty(sum(out_splits), dtype=dtype, device=self.device)
        dist.all_to_all_single(out, send.contiguous(), out_splits, in_splits,
                               group=self.group)
        return out

    def _exchange(self, indices, offsets, per_sample_weights, train: bool):
        """The forward's collectives (header, lookups, pooled rows) and the owner's lookup:
        ``(out, step)``."""
        dev, world, me = self.device, self.world_size, self.rank
        own_error, routed, B = None, None, 0
        try:
            B = self._check_types(indices, offsets, per_sample_weights)
            routed = self._route(indices, offsets, B)
        except _INPUT_ERRORS as err:
            own_error = err
        weighted = per_sample_weights is not None or self.pooling == "mean"
        header = torch.zeros((world, _HEADER), dtype=torch.int64, device=dev)
        header[:, 0] = B
        header[:, 2] = int(weighted)
        if own_error is not None:
            header[:, 3] = next(c for c, kind in _ERRORS.items() if isinstance(own_error, kind))
        else:
            header[:, 1] = routed[3]
            header[:, 4] = routed[4].to(torch.int64)
        received = self._a2a(header.reshape(-1), [_HEADER] * world, [_HEADER] * world,
                             torch.int64).reshape(world, _HEADER)
        # The step's one host sync: all_to_all needs its split sizes on the host.
        both = torch.stack([header, received]).cpu().numpy()
        sent, got = both[0], both[1]
        self._raise_refused(got, own_error, indices, offsets)
        send_idx, order, counts, per_owner, _, lengths, bag = routed
        batches = [int(b) for b in got[:, 0]]
        n_send, n_got = [int(v) for v in sent[:, 1]], [int(v) for v in got[:, 1]]
        T_me = len(self.shards)

        # Bag lengths and local indices, one int64 message per owner.
        table_counts = counts[:world * self._max_slots * B].view(world * self._max_slots, B)
        pieces, at = [], 0
        for o in range(world):
            pieces.append(table_counts[self._owner_slots[o]].reshape(-1))
            pieces.append(send_idx[at:at + n_send[o]])
            at += n_send[o]
        ids = self._a2a(torch.cat(pieces),
                        [T_me * b + n for b, n in zip(batches, n_got)],
                        [len(self.plan.shards_of(o)) * B + n_send[o] for o in range(world)],
                        torch.int64)
        weights = None
        if got[:, 2].any():  # every rank sends weights when any rank has them
            w = lookup_weights(per_sample_weights, lengths, bag, send_idx.shape[0],
                               self.pooling, self.dtype, dev)
            weights = self._a2a(w[order], n_got, n_send, self.dtype)
        idx_own, off_own, w_own = owner_batch(ids, weights, batches, n_got, T_me)

        # The owner's pooled lookup, rows in rank order: rank r's bags are one row block.
        ctx = None
        if self.local is not None:
            local = self.local
            core = lambda t: local._core(t, "x")  # noqa: E731
            pooled, ctx = local._lookup(core(idx_own), core(off_own),
                                        None if w_own is None else core(w_own), train=train)
        else:
            pooled = torch.zeros((sum(batches), 0), dtype=self.dtype, device=dev)
        d_me = self._owner_dim[me]
        back = self._a2a(pooled.reshape(-1), [B * d for d in self._owner_dim],
                         [b * d_me for b in batches], self.dtype)
        out = place_columns(back, B, self._owner_dim, self._owner_cols,
                            self.total_dim, self._table_blocks)
        return out, _Step(B, batches, ctx)

    def _raise_refused(self, got, own_error, indices, offsets) -> None:
        """Raise on every rank when any rank's input was refused (nothing was sent yet)."""
        refused = [r for r in range(self.world_size) if got[r, 3] or got[r, 4]]
        if not refused:
            return
        if own_error is not None:
            raise own_error
        if self.rank in refused:
            raise refusal_of(self.tables, indices, offsets)
        r = refused[0]
        if got[r, 4]:  # bad values: the type that rank raises (bad offsets first)
            kind, why = ((ValueError, "bad offsets") if got[r, 4] == 2
                         else (IndexError, "an index out of range"))
        else:  # refused before its values were read: its error's type travelled
            kind = _ERRORS.get(int(got[r, 3]), ValueError)
            why = f"{kind.__name__} there"
        raise kind(f"rank {r} of the group passed a batch the sharded collection refused "
                   f"({why}); no table changed on any rank")

    # ------------------------------------------------------------------ backward

    def _train_forward(self, indices, offsets, per_sample_weights):
        return self._forward(indices, offsets, per_sample_weights, train=True)

    def _train_backward(self, step: _Step, grad: torch.Tensor) -> None:
        self._backward(step, grad)

    def _backward(self, step: _Step, grad: torch.Tensor) -> None:
        """The pooled gradients of each owner's columns to the owner, whose collection runs
        its fused backward + update on them (rank order: the forward's batch)."""
        grad = grad.to(self.device, self.dtype)
        B = step.batch
        pieces = gather_columns(grad, self._owner_dim, self._owner_cols, self._table_blocks)
        d_me = self._owner_dim[self.rank]
        mine = self._a2a(pieces, [b * d_me for b in step.batches],
                         [B * d for d in self._owner_dim], self.dtype)
        if self.local is not None and step.lookup is not None:
            self.local._update(step.lookup, mine.view(sum(step.batches), d_me))

    # ------------------------------------------------------------------ state_dict

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if self.local is not None:
            self.local._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        if self.local is not None:
            self.local._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                             missing_keys, unexpected_keys, error_msgs)
        else:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix + _STATE))

    def _apply(self, fn, recurse=True):
        probe = fn(torch.empty(0, dtype=self.dtype, device=self.device))
        if probe.device != self.device or probe.dtype != self.dtype:
            raise NotImplementedError("a ShardedEmbeddingBagCollection stays on the device "
                                      "and dtype it was built with; build another (and "
                                      "load_sharded a checkpoint) to move it")
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        mine = ", ".join(s.local_name for s in self.shards)
        return (f"rank {self.rank} of {self.world_size}: [{mine}], "
                f"optimizer={self.optimizer!r}, pooling={self.pooling!r}, "
                f"device={self.device}")
