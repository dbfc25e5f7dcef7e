"""The sharded collection's placement of pooled rows (whole tables at a time when every table
has one width) against the column-at-a-time form, and its reverse, on random data."""

import numpy as np
import pytest
import torch

from xferlib.adapters.torch.collection_layout import gather_columns, place_columns, table_blocks
from xferlib.collection import TableConfig, plan_sharding

TABLES = [TableConfig(50 + 7 * t, 4, name=f"t{t}") for t in range(5)]


def _routes(plan, dims):
    offsets = np.concatenate([[0], np.cumsum(dims)])
    cols, owner_dims = [], []
    for r in range(plan.world_size):
        mine = [c for s in plan.shards_of(r)
                for c in range(offsets[s.table_index], offsets[s.table_index + 1])]
        cols.append(torch.tensor(mine, dtype=torch.int64))
        owner_dims.append(len(mine))
    return owner_dims, cols, int(offsets[-1])


@pytest.mark.parametrize("world,row_wise", [(2, ()), (3, ()), (2, ("t1", "t3")), (3, ("t0",))])
@pytest.mark.parametrize("B", [0, 1, 9])
def test_whole_tables_place_and_gather_as_columns_do(world, row_wise, B):
    plan = plan_sharding(TABLES, world, row_wise=row_wise)
    dims = [c.dim for c in TABLES]
    owner_dims, cols, total = _routes(plan, dims)
    blocks = table_blocks(plan, dims, "cpu")
    assert blocks is not None and blocks[2] == (not row_wise)
    rng = np.random.default_rng(world * 10 + B)
    back = torch.tensor(rng.standard_normal(B * sum(owner_dims)), dtype=torch.float32)
    want = place_columns(back, B, owner_dims, cols, total)
    got = place_columns(back, B, owner_dims, cols, total, blocks)
    assert torch.equal(got, want)
    # float64 reference: each owner's block added at its columns
    ref, at = np.zeros((B, total)), 0
    for c, d in zip(cols, owner_dims):
        ref[:, c.numpy()] += back[at:at + B * d].double().numpy().reshape(B, d)
        at += B * d
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-6, atol=1e-6)
    grad = torch.tensor(rng.standard_normal((B, total)), dtype=torch.float32)
    assert torch.equal(gather_columns(grad, owner_dims, cols, blocks),
                       gather_columns(grad, owner_dims, cols))
    at = 0
    for c, d in zip(cols, owner_dims):
        np.testing.assert_array_equal(
            gather_columns(grad, owner_dims, cols, blocks)[at:at + B * d].view(B, d).numpy(),
            grad.numpy()[:, c.numpy()])
        at += B * d


def test_tables_of_several_widths_keep_the_column_form():
    tables = [TableConfig(10, 4), TableConfig(10, 3)]
    assert table_blocks(plan_sharding(tables, 2), [4, 3], "cpu") is None
