"""Sharding plans (xferlib.collection.sharding): table-wise balance by bytes and expected
lookups, row-wise splits (asked for, or forced by a budget), clear errors, the plan's text and
JSON forms, a shard's initial rows equal to the unsharded collection's, and checkpoints of
shard files read back over other row ranges."""

import dataclasses

import numpy as np
import pytest

from xferlib.collection import EmbeddingCollection, TableConfig, plan_sharding
from xferlib.collection.sharding import (ShardingPlan, fill_shard_weights, read_checkpoint,
                                         read_manifest, read_rows, row_bytes,
                                         save_shard_files, shard_arrays,
                                         write_manifest)

TABLES = [TableConfig(1000, 16, name="user"), TableConfig(10, 4, name="ad"),
          TableConfig(500, 8, name="item", placement="host"), TableConfig(300, 8, name="geo")]


def _covers(plan):
    """Every table's rows covered once by its shards, in order."""
    for t, c in enumerate(plan.tables):
        shards = plan.table_shards(t)
        assert shards[0].row_start == 0 and shards[-1].row_stop == c.num_rows
        for a, b in zip(shards, shards[1:]):
            assert a.row_stop == b.row_start


def test_table_wise_balances_bytes_and_is_deterministic():
    plan = plan_sharding(TABLES, 2, optimizer="adam")
    assert plan.kinds == ("table_wise",) * 4
    assert [(s.table, s.rank) for s in plan.shards] == [
        ("user", 0), ("ad", 1), ("item", 1), ("geo", 1)]
    assert plan == plan_sharding(TABLES, 2, optimizer="adam")
    _covers(plan)
    # bytes include the optimizer state: adam's two slots make rows three times wider
    per_row = row_bytes(TABLES[0], "adam")
    assert per_row >= 3 * 16 * 4 and plan.shards[0].bytes == 1000 * per_row
    total = sum(sum(plan.rank_bytes(r).values()) for r in range(2))
    assert total == sum(s.bytes for s in plan.shards)
    assert plan.rank_bytes(1)["host"] == plan.table_shards("item")[0].bytes
    assert sum(plan.lookup_share(r) for r in range(2)) == pytest.approx(1.0)


def test_expected_lookups_move_tables():
    # "ad" is tiny but looked up 50 times a sample: it gets a rank nearly to itself
    plan = plan_sharding(TABLES, 2, expected_lookups={"ad": 50})
    ad = plan.table_shards("ad")[0].rank
    assert [s.rank for s in plan.shards if s.table != "ad"] == [1 - ad] * 3
    assert plan.lookup_share(ad) == pytest.approx(50 / 53)
    assert plan_sharding(TABLES, 2, expected_lookups=[50, 1, 1, 1]).table_shards(
        "user")[0].rank == 0


def test_row_wise_asked_for_and_forced_by_budget():
    plan = plan_sharding(TABLES, 3, row_wise=["user"])
    user = plan.table_shards("user")
    assert plan.kinds[0] == "row_wise"
    assert [(s.rank, s.row_start, s.row_stop) for s in user] == [
        (0, 0, 333), (1, 333, 666), (2, 666, 1000)]
    assert [s.local_name for s in user] == ["user[0:333]", "user[333:666]", "user[666:1000]"]
    _covers(plan)
    configs = plan.local_configs(1)
    assert configs[0].name == "user[333:666]" and configs[0].num_rows == 333
    # A budget smaller than "user" splits it; smaller tables stay whole.
    size = 1000 * row_bytes(TABLES[0])
    plan = plan_sharding(TABLES, 2, budget_bytes={"hbm": size * 0.9})
    assert plan.kinds == ("row_wise", "table_wise", "table_wise", "table_wise")
    for r in range(2):
        assert plan.rank_bytes(r)["hbm"] <= size * 0.9
    # A table with fewer rows than ranks: one shard per row.
    tiny = plan_sharding([TableConfig(2, 4)], 3, row_wise=["t0"])
    assert [(s.rank, s.row_start, s.row_stop) for s in tiny.shards] == [(0, 0, 1), (1, 1, 2)]


def test_clear_errors():
    with pytest.raises(ValueError, match="does not fit.*'user'|'user'.*does not fit"):
        plan_sharding(TABLES, 2, budget_bytes=1000)
    with pytest.raises(ValueError, match="unknown tables"):
        plan_sharding(TABLES, 2, row_wise=["nope"])
    with pytest.raises(ValueError, match="world_size"):
        plan_sharding(TABLES, 0)
    with pytest.raises(ValueError, match="one value per table"):
        plan_sharding(TABLES, 2, expected_lookups=[1, 2])
    with pytest.raises(ValueError, match="expected_lookups of table 'ad'"):
        plan_sharding(TABLES, 2, expected_lookups={"ad": -1})
    with pytest.raises(ValueError, match="unknown placements"):
        plan_sharding(TABLES, 2, budget_bytes={"disk": 1})


@pytest.mark.parametrize("budget", [{"hbm": None}, "1000", [1000], True, {"host": False}])
def test_a_budget_that_is_no_number_is_refused_naming_it(budget):
    with pytest.raises(ValueError, match="budget_bytes for '(hbm|host)' must be a number"):
        plan_sharding(TABLES, 2, budget_bytes=budget)
    # numbers of any kind are budgets
    plan_sharding(TABLES, 2, budget_bytes={"hbm": np.int64(1 << 30), "host": 1e12})


def test_describe_and_json_round_trip():
    plan = plan_sharding(TABLES, 2, row_wise=["user"], optimizer="rowwise_adagrad")
    text = plan.describe()
    assert "over 2 ranks" in text and "user: 1000 x 16 hbm, row_wise" in text
    assert "rank 0 rows 0:500" in text and "% of lookups" in text
    assert ShardingPlan.from_dict(plan.to_dict()) == plan


@pytest.mark.parametrize("init", [("normal", 0.0, 1.0), ("uniform", -1.0, 2.0), "zeros"])
def test_shard_starts_with_the_unsharded_rows(init):
    tables = [TableConfig(7, 3), TableConfig(11, 5, init=init)]
    whole = EmbeddingCollection(tables, "adagrad", device="cpu", seed=4)
    shard = EmbeddingCollection([dataclasses.replace(tables[1], num_rows=6, init="zeros")],
                                "adagrad", device="cpu", seed=0)
    fill_shard_weights(shard, 0, init, 4, 1, 3)
    np.testing.assert_array_equal(shard.weights(0), whole.weights(1)[3:9])
    np.testing.assert_array_equal(shard.state(0, "sum"), whole.state(1, "sum")[3:9])


def test_checkpoint_reads_rows_across_shard_files(tmp_path):
    tables = [TableConfig(10, 3, name="a"), TableConfig(5, 2, name="b")]
    plan = plan_sharding(tables, 2, row_wise=["a"], optimizer="adam")
    whole = EmbeddingCollection(tables, "adam", device="cpu", seed=1)
    state = whole.state_dict()
    for rank in range(2):
        arrays = {}
        for s in plan.shards_of(rank):
            arrays[s.local_name] = {
                k.split(".", 1)[1]: v[s.row_start:s.row_stop] for k, v in state.items()
                if k.split(".", 1)[0] == s.table}
        assert save_shard_files(tmp_path, plan, rank, arrays, tag="s1")
    with pytest.raises(ValueError, match="no sharded checkpoint"):
        read_manifest(tmp_path)
    write_manifest(tmp_path, plan, dict(optimizer="adam"), tag="s1")
    manifest = read_manifest(tmp_path)
    assert manifest["plan"] == plan and manifest["meta"]["optimizer"] == "adam"
    rows = read_rows(tmp_path, manifest, "a", 2, 9)  # spans both saved shards of "a"
    for key in ("weight", "exp_avg", "exp_avg_sq", "step"):
        np.testing.assert_array_equal(rows[key], state[f"a.{key}"][2:9])
    with pytest.raises(ValueError, match="does not hold rows"):
        read_rows(tmp_path, manifest, "a", 8, 12)


def test_checkpoint_of_tables_whose_names_hold_dots(tmp_path):
    """Table "a" does not take table "a.b"'s entries (keys built whole, no prefix match),
    and both read back whole; a loader of other tables or another optimizer is refused."""
    tables = [TableConfig(6, 4, name="a"), TableConfig(5, 3, name="a.b"),
              TableConfig(4, 2, name="a.b.weight")]
    plan = plan_sharding(tables, 2, row_wise=["a.b"], optimizer="adagrad")
    whole = EmbeddingCollection(tables, "adagrad", device="cpu", seed=2)
    state = whole.state_dict()
    entries = ("weight", *whole.state_names())
    for rank in range(2):
        local = {f"{s.local_name}.{e}": state[f"{s.table}.{e}"][s.row_start:s.row_stop]
                 for s in plan.shards_of(rank) for e in entries}
        arrays = shard_arrays(local, plan.shards_of(rank), entries)
        assert all(set(a) == set(entries) for a in arrays.values())
        save_shard_files(tmp_path, plan, rank, arrays)
    write_manifest(tmp_path, plan, dict(optimizer="adagrad"))
    manifest = read_checkpoint(tmp_path, tables, "adagrad")
    for c in tables:
        rows = read_rows(tmp_path, manifest, c.name, 0, c.num_rows)
        for e in entries:
            np.testing.assert_array_equal(rows[e], state[f"{c.name}.{e}"])
    with pytest.raises(ValueError, match="holds tables"):
        read_checkpoint(tmp_path, tables[:2], "adagrad")
    with pytest.raises(ValueError, match="'adagrad' optimizer state"):
        read_checkpoint(tmp_path, tables, "sgd")


def test_a_damaged_checkpoint_is_refused_with_value_errors(tmp_path):
    """A missing shard file, or a manifest of the right kind but the wrong shape: ValueError
    naming the checkpoint, not a raw error from inside the reader."""
    import json
    import os

    tables = [TableConfig(10, 3, name="a")]
    plan = plan_sharding(tables, 2, row_wise=["a"], optimizer="sgd")
    whole = EmbeddingCollection(tables, "sgd", device="cpu", seed=1)
    state = whole.state_dict()
    for rank in range(2):
        shards = plan.shards_of(rank)
        local = {f"{s.local_name}.{e}": state[f"{s.table}.{e}"][s.row_start:s.row_stop]
                 for s in shards for e in ("weight", "step")}
        save_shard_files(tmp_path, plan, rank, shard_arrays(local, shards, ("weight", "step")))
    write_manifest(tmp_path, plan, dict(optimizer="sgd"))
    manifest = read_manifest(tmp_path)
    os.remove(tmp_path / manifest["files"][0]["file"])
    with pytest.raises(ValueError, match="lacks its shard file"):
        read_rows(tmp_path, manifest, "a", 0, 10)
    body = json.loads((tmp_path / "manifest.json").read_text())
    for broken in ([], dict(body, plan={"world_size": 2}), {k: v for k, v in body.items()
                                                           if k != "files"}):
        (tmp_path / "manifest.json").write_text(json.dumps(broken))
        with pytest.raises(ValueError, match="not a sharded collection's manifest|corrupt"):
            read_manifest(tmp_path)


def test_a_table_named_like_a_row_range_is_refused():
    tables = [TableConfig(10, 4, name="a"), TableConfig(4, 4, name="a[0:5]")]
    with pytest.raises(ValueError, match="two shards named"):
        plan_sharding(tables, 2, row_wise=["a"])
