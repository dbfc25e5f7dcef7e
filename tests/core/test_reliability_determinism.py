"""Determinism (issue 30, item 2): two runs of the same training give bitwise-identical
weights and optimizer state, on the CPU and (marked ``gpu``) on the GPU.

Covered: HostTable (every sparse optimizer on the CPU; on the GPU with the cache on and off
and prefetch on), the embedding collection (mixed placements, per-sample weights, mean
pooling, the host tables' GPU cache), the TT module (the torch ``TTEmbeddingBag`` with its
fused update, and its row cache), and the flat optimizers (every rule). The DLRM example is
left to ``tests/test_dlrm.py`` (its resumed run equals the uninterrupted one). Paths that are
not bitwise deterministic are listed in docs/reliability.md.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import xferlib
from xferlib import optim
from xferlib.collection import EmbeddingCollection, TableConfig
from xferlib.testing import GPU_SKIP_REASON

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def need(device):
    if device == "cuda" and not xferlib.cupy_available():
        pytest.skip(GPU_SKIP_REASON)


def xp_of(device):
    if device == "cpu":
        return np
    import cupy

    return cupy


def assert_bitwise_equal(first: dict, second: dict):
    assert list(first) == list(second)
    for key in first:
        a, b = np.asarray(first[key]), np.asarray(second[key])
        assert a.dtype == b.dtype and a.shape == b.shape, key
        assert a.tobytes() == b.tobytes(), f"{key} differs between two identical runs"


def zipf_indices(rng, n, size):
    """Skewed indices with many repeats (repeats are where summation order could differ)."""
    return (np.minimum(rng.zipf(1.2, size) - 1, n - 1)).astype(np.int64)


# ------------------------------------------------------------------ HostTable


def host_table_run(device, optimizer, cache_rows=0, prefetch=False, steps=12):
    rng = np.random.default_rng(5)
    xp = xp_of(device)
    table = xferlib.HostTable(500, 8, optimizer=optimizer, optimizer_kwargs={"lr": 0.05},
                              cache_rows=cache_rows, seed=3)
    try:
        batches = [xp.asarray(zipf_indices(rng, 500, int(rng.integers(0, 300))))
                   for _ in range(steps)]
        for k, idx in enumerate(batches):
            if prefetch and k + 1 < len(batches):
                table.prefetch(batches[k + 1])
            rows = table.lookup(idx)
            grads = xp.asarray(rng.standard_normal((idx.shape[0], 8)).astype(np.float32))
            table.apply_gradients(idx, grads + 0.01 * rows)
        return {"weights": table.numpy().copy(),
                **{n: table.state(n).copy() for n in table.state_names()}}
    finally:
        table.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", xferlib.SPARSE_OPTIMIZERS)
def test_host_table_two_runs_bitwise_identical(device, optimizer):
    need(device)
    assert_bitwise_equal(host_table_run(device, optimizer), host_table_run(device, optimizer))


@pytest.mark.gpu
@pytest.mark.parametrize("cache_rows", [0, 64])
def test_host_table_gpu_cache_and_prefetch_two_runs_bitwise_identical(cache_rows):
    need("cuda")
    first = host_table_run("cuda", "adam", cache_rows=cache_rows, prefetch=True, steps=40)
    assert_bitwise_equal(first, host_table_run("cuda", "adam", cache_rows=cache_rows,
                                               prefetch=True, steps=40))


# ------------------------------------------------------------------ collection


def collection_run(device, optimizer="adam", cache=False, pooling="mean", steps=10):
    rng = np.random.default_rng(8)
    xp = xp_of(device)
    tables = [TableConfig(300, 8, placement="host", cache_rows=32 if cache else 0),
              TableConfig(40, 4, lr=0.02),
              TableConfig(90, 8, placement="host", cache_rows=16 if cache else 0)]
    coll = EmbeddingCollection(tables, optimizer, {"lr": 0.05}, pooling=pooling,
                               device=device, seed=7)
    B = 64
    for _ in range(steps):
        lengths = rng.integers(0, 9, 3 * B)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        indices = np.concatenate([zipf_indices(rng, c.num_rows, lengths[t * B:(t + 1) * B].sum())
                                  for t, c in enumerate(tables)])
        weights = rng.uniform(0.5, 2.0, indices.size).astype(np.float32)
        out, ctx = coll.forward(xp.asarray(indices), xp.asarray(offsets), xp.asarray(weights))
        coll.backward(ctx, xp.asarray(rng.standard_normal(out.shape).astype(np.float32)))
    return coll.state_dict()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", ["sgd", "adam", "rowwise_adagrad"])
def test_collection_two_runs_bitwise_identical(device, optimizer):
    need(device)
    assert_bitwise_equal(collection_run(device, optimizer), collection_run(device, optimizer))


@pytest.mark.gpu
def test_collection_gpu_cache_two_runs_bitwise_identical():
    need("cuda")
    assert_bitwise_equal(collection_run("cuda", cache=True, steps=30),
                         collection_run("cuda", cache=True, steps=30))


# ------------------------------------------------------------------ TT module


def tt_run(device, optimizer, cache_size=0, steps=8):
    torch = pytest.importorskip("torch")
    from xferlib.adapters.torch import TTEmbeddingBag
    from xferlib.adapters.torch.tt_fbtt_compat import OptimType

    rng = np.random.default_rng(2)
    module = TTEmbeddingBag(num_embeddings=1000, embedding_dim=16, tt_ranks=[4, 4],
                            tt_p_shapes=[10, 10, 10], tt_q_shapes=[2, 2, 4],
                            optimizer=getattr(OptimType, optimizer), learning_rate=0.05,
                            use_cache=bool(cache_size), cache_size=cache_size,
                            weight_dist="normal", seed=1).to(device)
    for _ in range(steps):
        lengths = rng.integers(0, 6, 32)
        offsets = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), device=device)
        indices = torch.tensor(zipf_indices(rng, 1000, lengths.sum()), device=device)
        out = module(indices, offsets)
        out.backward(torch.tensor(rng.standard_normal(tuple(out.shape)).astype(np.float32),
                                  device=device))
    return {k: v.detach().cpu().numpy() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", ["SGD", "EXACT_ADAGRAD", "EXACT_ROWWISE_ADAGRAD", "ADAM"])
def test_tt_module_two_runs_bitwise_identical(device, optimizer):
    need(device)
    assert_bitwise_equal(tt_run(device, optimizer), tt_run(device, optimizer))


def frequency_table_by_row(state: dict) -> dict:
    """A TT row cache's state with its frequency table as what it means: each counted row's
    (row, count, cache slot), sorted by row. Which slot of the hash table a row lands in is
    the GPU's race (two rows probing one empty slot at once: either may take it, as in
    FBTT's table), so the slot layout is not part of a run's result; the counts and the
    training are."""
    keys, counts, slots = state.pop("hashtbl"), state.pop("cache_freq"), state.pop("cache_state")
    used = keys >= 0
    order = np.argsort(keys[used], kind="stable")
    state["frequency_by_row"] = np.stack([keys[used][order], counts[used][order],
                                          slots[used][order].astype(np.int64)])
    return state


@pytest.mark.gpu
def test_tt_module_with_row_cache_two_runs_bitwise_identical():
    need("cuda")
    first = frequency_table_by_row(tt_run("cuda", "EXACT_ADAGRAD", cache_size=64, steps=30))
    second = frequency_table_by_row(tt_run("cuda", "EXACT_ADAGRAD", cache_size=64, steps=30))
    assert first["frequency_by_row"].shape[1] > 64  # more rows counted than cached
    assert_bitwise_equal(first, second)


def test_frequency_table_by_row_ignores_only_the_slot_layout():
    state = {"hashtbl": np.array([5, -1, 2]), "cache_freq": np.array([3, 0, 1]),
             "cache_state": np.array([0, -1, -1], dtype=np.int32), "w": np.ones(2)}
    moved = {"hashtbl": np.array([2, 5, -1]), "cache_freq": np.array([1, 3, 0]),
             "cache_state": np.array([-1, 0, -1], dtype=np.int32), "w": np.ones(2)}
    assert_bitwise_equal(frequency_table_by_row(dict(state)), frequency_table_by_row(moved))
    recounted = dict(state, cache_freq=np.array([4, 0, 1]))
    with pytest.raises(AssertionError):
        assert_bitwise_equal(frequency_table_by_row(dict(state)),
                             frequency_table_by_row(recounted))


# ------------------------------------------------------------------ flat optimizers

SHAPES = [(7,), (33, 5), (1,), (1000,)]


def flat_run(device, name, steps=20):
    rng = np.random.default_rng(4)
    xp = xp_of(device)
    layout = optim.FlatLayout.from_shapes(SHAPES)
    params = xp.asarray(layout.pack([rng.standard_normal(s).astype(np.float32)
                                     for s in SHAPES]))
    opt = getattr(optim, name)(**{"learning_rate" if name == "lion" else "lr": 1e-2})
    state = opt.init(layout, xp=xp)
    for _ in range(steps):
        grads = xp.asarray(layout.pack([rng.standard_normal(s).astype(np.float32)
                                        for s in SHAPES]))
        active = rng.random(len(SHAPES)) < 0.8
        state = opt.update(layout, params, grads, state, active=active)
    host = (lambda a: a.get()) if device == "cuda" else np.asarray
    return {"params": host(params), "steps": np.asarray(state.steps),
            **{f"state.{k}": host(v) for k, v in state.buffers.items()},
            **{f"scalar.{k}": np.asarray(v) for k, v in state.scalars.items()}}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", optim.OPTIMIZERS)
def test_flat_optimizer_two_runs_bitwise_identical(device, name):
    need(device)
    assert_bitwise_equal(flat_run(device, name), flat_run(device, name))


# ------------------------------------------------------------------ across processes


def digest(arrays: dict) -> str:
    h = hashlib.sha256()
    for key, value in arrays.items():
        h.update(key.encode())
        h.update(np.ascontiguousarray(value).tobytes())
    return h.hexdigest()


_RUN_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import test_reliability_determinism as t
    print(t.digest(t.host_table_run("cpu", "adam")), t.digest(t.collection_run("cpu")),
          t.digest(t.flat_run("cpu", "adam")))
""")


def test_two_processes_with_other_hash_seeds_give_the_same_bits():
    """Two fresh interpreters (other ``PYTHONHASHSEED``s, so other set and dict-of-str
    orders) train the same HostTable, collection and flat optimizer to the same bits."""
    here = os.path.dirname(os.path.abspath(__file__))
    outs = [subprocess.run([sys.executable, "-c", _RUN_SCRIPT, here], capture_output=True,
                           text=True, timeout=120, env=dict(os.environ, PYTHONHASHSEED=seed))
            for seed in ("1", "2")]
    for out in outs:
        assert out.returncode == 0, out.stderr
    assert outs[0].stdout == outs[1].stdout
    assert outs[0].stdout.split() == [digest(host_table_run("cpu", "adam")),
                                      digest(collection_run("cpu")),
                                      digest(flat_run("cpu", "adam"))]
