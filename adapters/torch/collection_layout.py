"""How a sharded collection's owner lays out what it received, and what each lookup weighs:
the tensor arithmetic of ``ShardedEmbeddingBagCollection``'s exchange, with no collective
and no host sync (pure functions of tensors and sizes known on the host), and
``refusal_of``, which reads a refused batch on the host to name its error.

An owner receives, from every rank, the bag lengths of the tables it holds for that rank's
samples and the lookups themselves, rank after rank. Its collection takes one batch in
FBGEMM's layout, table by table, each table's bags rank after rank: the order the global
batch has in one process, so sums run in the same order.
"""

from __future__ import annotations

import numpy as np
import torch

from xferlib.collection.numpy_path import check_offsets

__all__ = ["gather_columns", "lookup_weights", "owner_batch", "owner_batch_padded",
           "place_columns", "refusal_of", "table_blocks"]


def lookup_weights(per_sample_weights, lengths, bag, n: int, pooling: str, dtype, device):
    """Each of the ``n`` lookups' weight: its per-sample weight (ones without), times ``1 /
    bag length`` for mean pooling (``lengths`` per bag, ``bag`` per lookup), in the table
    ``dtype`` and in the order the one-process collection computes it (so the products
    round alike)."""
    w = (torch.ones(n, dtype=dtype, device=device) if per_sample_weights is None
         else per_sample_weights.to(device, dtype))
    if pooling == "mean" and n:
        inv = 1 / torch.clamp(lengths, min=1).to(dtype)
        w = inv[bag] if per_sample_weights is None else w * inv[bag]
    return w


def owner_batch(ids, weights, batches, n_got, T_me: int):
    """The lookups an owner received (``ids``: per rank, its ``T_me x B_rank`` bag lengths
    then its ``n_got[rank]`` indices; ``weights``: the indices' weights or None) as one
    batch ``(indices, offsets, weights)``, the indices permuted from (rank, table) order to
    (table, rank) order. ``(None, None, None)`` for an owner of no shards."""
    if not T_me:
        return None, None, None
    dev, world = ids.device, len(batches)
    lens, idx_parts, at = [], [], 0
    for b, n in zip(batches, n_got):
        lens.append(ids[at:at + T_me * b].view(T_me, b))
        idx_parts.append(ids[at + T_me * b:at + T_me * b + n])
        at += T_me * b + n
    lengths = torch.cat(lens, dim=1)  # (T_me, sum of B)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64, device=dev),
                         torch.cumsum(lengths.reshape(-1), 0)])
    received = torch.cat(idx_parts)
    total = sum(n_got)
    per = torch.stack([x.sum(dim=1) for x in lens])  # (world, T_me) lookups per segment
    rank_base = torch.tensor(np.concatenate([[0], np.cumsum(n_got)[:-1]]),
                             dtype=torch.int64, device=dev)
    src_start = (rank_base[:, None] + torch.cumsum(per, 1) - per).t().reshape(-1)
    seg_len = per.t().reshape(-1)  # segments in (table, rank) order
    dst_start = torch.cumsum(seg_len, 0) - seg_len
    seg = torch.repeat_interleave(torch.arange(T_me * world, device=dev), seg_len,
                                  output_size=total)
    src = src_start[seg] + torch.arange(total, device=dev) - dst_start[seg]
    return received[src], offsets, None if weights is None else weights[src]


def owner_batch_padded(received, w_received, B: int, room: int, T_me: int, max_slots: int):
    """The fixed-size messages an owner received (``received``: per rank a row of
    ``max_slots x B`` bag lengths, then ``room`` lookup slots, the true lookups first;
    ``w_received``: their weights or None) as one padded batch ``(indices, offsets,
    weights)``: the true lookups in (table, rank) order first, the rest of the ``world x
    room`` slots padding. For an owner of shards (``T_me >= 1``)."""
    dev, world = received.device, received.shape[0]
    head = max_slots * B
    lengths = received[:, :head].view(world, max_slots, B)[:, :T_me]
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64, device=dev),
                         torch.cumsum(lengths.permute(1, 0, 2).reshape(-1), 0)])
    per = lengths.sum(dim=2)                                    # (rank, table)
    ends = torch.cumsum(per, 1)                                 # in rank r's message
    src_start = ends - per
    seg_len = per.t().reshape(-1)                               # (table, rank) order
    dst_start = (torch.cumsum(seg_len, 0) - seg_len).view(T_me, world).t()
    p = torch.arange(room, device=dev).expand(world, room).contiguous()
    k = torch.searchsorted(ends, p, right=True)                 # each slot's table
    real = k < T_me
    k = k.clamp_(max=T_me - 1)
    dst = dst_start.gather(1, k) + p - src_start.gather(1, k)
    dst = torch.where(real, dst, world * room).reshape(-1)
    idx = torch.zeros(world * room + 1, dtype=torch.int64, device=dev)
    idx[dst] = received[:, head:].reshape(-1)
    w = None
    if w_received is not None:
        w = torch.zeros(world * room + 1, dtype=w_received.dtype, device=dev)
        w[dst] = w_received.reshape(-1)
        w = w[:world * room]
    return idx[:world * room], offsets, w


def place_columns(back, B: int, owner_dims, owner_cols, total_dim: int,
                  table_blocks=None) -> torch.Tensor:
    """The pooled rows the owners sent back (``back``: owner after owner, ``B`` rows of its
    ``owner_dims[o]`` columns each) at their tables' columns (``owner_cols[o]``) of a ``(B,
    total_dim)`` output; a row-wise table's partial sums add up, owners in rank order.

    ``table_blocks`` (:func:`table_blocks`; tables of one width): the same by whole tables,
    ``(B, tables, dim)`` views whose rows are ``dim`` contiguous values, instead of one
    strided column at a time; every table held whole by one owner is copied (no zero fill,
    no add)."""
    if table_blocks is not None:
        dim, owner_tables, whole = table_blocks
        make = torch.empty if whole else torch.zeros
        out = make((B, total_dim // dim, dim), dtype=back.dtype, device=back.device)
        at = 0
        for tables, d in zip(owner_tables, owner_dims):
            if d:
                block = back[at:at + B * d].view(B, d // dim, dim)
                if whole:
                    out.index_copy_(1, tables, block)
                else:
                    out.index_add_(1, tables, block)
            at += B * d
        return out.view(B, total_dim)
    out = torch.zeros((B, total_dim), dtype=back.dtype, device=back.device)
    at = 0
    for cols, d in zip(owner_cols, owner_dims):
        if d:
            out.index_add_(1, cols, back[at:at + B * d].view(B, d))
        at += B * d
    return out


def gather_columns(grad, owner_dims, owner_cols, table_blocks=None) -> torch.Tensor:
    """The reverse of :func:`place_columns`: each owner's columns of ``grad`` (``(B,
    total_dim)``), owner after owner, each a ``(B, owner_dims[o])`` block, as one flat
    tensor (whole tables at a time with ``table_blocks``)."""
    B = grad.shape[0]
    out = torch.empty(B * sum(owner_dims), dtype=grad.dtype, device=grad.device)
    if table_blocks is not None:
        dim = table_blocks[0]
        grad = grad.reshape(B, grad.shape[1] // dim, dim)
    at = 0
    for o, d in enumerate(owner_dims):
        if d:
            if table_blocks is not None:
                torch.index_select(grad, 1, table_blocks[1][o],
                                   out=out[at:at + B * d].view(B, d // dim, dim))
            else:
                torch.index_select(grad, 1, owner_cols[o], out=out[at:at + B * d].view(B, d))
        at += B * d
    return out


def table_blocks(plan, dims, device):
    """``(dim, per owner its shards' table positions (int64 tensors), every table whole on
    one owner)`` when every table has the same width, else None: the whole-table form of
    :func:`place_columns` and :func:`gather_columns`."""
    if len(set(dims)) != 1:
        return None
    owners = [torch.tensor([s.table_index for s in plan.shards_of(r)], dtype=torch.int64,
                           device=device) for r in range(plan.world_size)]
    return dims[0], owners, len(plan.shards) == len(dims)


def refusal_of(tables, indices, offsets) -> Exception:
    """The error the one-process collection raises for this batch of ``tables`` (bad
    offsets: ValueError; an index out of range: IndexError naming the table), read on the
    host: for a rank whose own batch the exchange refused."""
    idx = indices.detach().cpu().numpy().astype(np.int64)
    off = offsets.detach().cpu().numpy().astype(np.int64)
    try:
        check_offsets(off, idx.shape[0])
    except ValueError as err:
        return err
    B = (off.shape[0] - 1) // len(tables)
    for t, c in enumerate(tables):
        lo, hi = int(off[t * B]), int(off[(t + 1) * B])
        bad = np.flatnonzero((idx[lo:hi] < 0) | (idx[lo:hi] >= c.num_rows))
        if bad.size:
            k = lo + int(bad[0])
            return IndexError(f"index {int(idx[k])} at position {k} is out of range for "
                              f"table {c.name!r} of {c.num_rows} rows (valid: 0 <= "
                              f"index < {c.num_rows})")
    return ValueError("the batch was refused")
