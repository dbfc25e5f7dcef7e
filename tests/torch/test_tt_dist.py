"""TT embedding bags under data parallelism: N ranks (gloo on the CPU; NCCL on two GPUs), each
training replicated cores on its share of the global batch, end with the cores, optimizer
state, step count and row cache of one process trained on the concatenated global batch, for
every fused optimizer, ``TTEmbeddingBag`` and ``TableBatchedTTEmbeddingBag``; a bad batch on
one rank raises on every rank and changes nothing.

Spawning is slow on a small machine, so each spawned run does every check of its world size.
"""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import xferlib  # noqa: E402
from xferlib.adapters.torch import (  # noqa: E402
    OptimType, TableBatchedTTEmbeddingBag, TTEmbeddingBag, leave_process_group)
from xferlib.testing import GPU_SKIP_REASON  # noqa: E402
from tests.torch.dist_helpers import free_port, join, require_two_gpus  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="no torch.distributed")

BAGS, STEPS, TABLES = 12, 3, 2  # global bags per table (a multiple of 2 and 3)
HYPER = dict(learning_rate=0.05, weight_decay=0.01, eta=0.01, momentum=0.5)
# One table of 2 cores (sum, per-sample weights) and 2 tables of 3 cores (mean).
SINGLE = dict(num_embeddings=88, embedding_dim=4, tt_ranks=[3], tt_p_shapes=[9, 10],
              tt_q_shapes=[2, 2], use_cache=False, weight_dist="normal", seed=5, **HYPER)
BATCHED = dict(num_tables=TABLES, num_embeddings=57, embedding_dim=4, tt_ranks=[2, 3],
               tt_p_shapes=[3, 4, 5], tt_q_shapes=[2, 1, 2], weight_dist="normal", seed=6,
               mode="mean", **HYPER)


def _data(seed, num, tables):
    """Per step: each table's BAGS bags (lists of indices: empty bags, a row looked up by
    every bag of step 0, the last rank's share of step 1 empty for 2 and 3 ranks alike: bags
    8..11), their per-sample weights and the gradient of each bag's output."""
    rng = np.random.default_rng(seed)
    steps = []
    for s in range(STEPS):
        bags = [[list(rng.integers(0, num, rng.integers(0, 5))) for _ in range(BAGS)]
                for _ in range(tables)]
        if s == 0:
            for t in range(tables):
                bags[t] = [b + [7, 7] for b in bags[t]]
        if s == 1:
            for t in range(tables):
                bags[t][8:] = [[] for _ in range(4)]
        weights = [[list(rng.uniform(0.5, 1.5, len(b))) for b in table] for table in bags]
        steps.append((bags, weights, rng.standard_normal((tables, BAGS, 4)).astype(np.float32)))
    return steps


def _inputs(bags, weights, part, device):
    """Flat indices, B+1 offsets and weights of the bags ``part`` of every table."""
    chosen = [b for table in bags for b in table[part]]
    chosen_w = [w for table in weights for w in table[part]]
    flat = [i for b in chosen for i in b]
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in chosen])])
    return (torch.tensor(flat, dtype=torch.int64, device=device),
            torch.tensor(offsets, dtype=torch.int64, device=device),
            torch.tensor([w for ws in chosen_w for w in ws], dtype=torch.float32, device=device))


def _train(module, steps, part, device, weighted, populate_after=None):
    outs = []
    for s, (bags, weights, grad) in enumerate(steps):
        idx, off, w = _inputs(bags, weights, part, device)
        out = module(idx, off, per_sample_weights=w if weighted else None)
        out.backward(torch.from_numpy(grad[:, part]).to(device).reshape(out.shape))
        outs.append(out.detach().cpu().numpy().reshape(len(bags), -1, 4))
        if populate_after == s:
            module.cache_populate()
    return outs


def _snapshot(module):
    """Cores, optimizer state, step count and cache (everything the ranks must agree on)."""
    return {k: v.detach().cpu().numpy().copy() for k, v in module.state_dict().items()
            if k not in ("hashtbl", "cache_freq", "cache_state")}  # each rank counts its own


def _modules(device, **extra):
    """(name, module, steps, weighted, populate_after) of every case."""
    single, batched = _data(1, 88, 1), _data(2, 57, TABLES)
    for opt in OptimType:
        yield (f"one.{opt.name}", TTEmbeddingBag(optimizer=opt, device=device, **SINGLE,
                                                 **extra), single, True, None)
        yield (f"tables.{opt.name}", TableBatchedTTEmbeddingBag(
            optimizer=opt, device=device, **BATCHED, **extra), batched, False, None)
    for opt in (OptimType.EXACT_ADAGRAD, OptimType.ADAM, OptimType.LAMB):
        cached = dict(SINGLE, use_cache=True, cache_size=6)
        yield (f"cache.{opt.name}", TTEmbeddingBag(optimizer=opt, device=device, **cached,
                                                   **extra), single, True, 0)


def _worker(rank, world, port, out_dir, backend):
    device = join(rank, world, port, backend)
    part = slice(rank * BAGS // world, (rank + 1) * BAGS // world)
    result = {}
    for name, module, steps, weighted, populate in _modules(device):
        assert module.process_group is not None
        outs = _train(module, steps, part, device, weighted, populate)
        result.update({f"{name}.out{k}": out for k, out in enumerate(outs)})
        result.update({f"{name}.{k}": v for k, v in _snapshot(module).items()})
    _extra_checks(rank, world, device, result)
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **result)
    leave_process_group()


def _extra_checks(rank, world, device, result):
    # No seed: the ranks agree on one, so the replicas start equal.
    free = TTEmbeddingBag(**dict(SINGLE, seed=None), device=device)
    result["unseeded"] = np.concatenate([c.detach().cpu().numpy().ravel()
                                         for c in free.tt_cores])
    # A bad index on the last rank: the same error type on every rank, nothing changed.
    for name, module in (("one", TTEmbeddingBag(**SINGLE, device=device)),
                         ("tables", TableBatchedTTEmbeddingBag(**BATCHED, device=device))):
        module.defer_input_check = False
        before = _snapshot(module)
        rows = module.num_embeddings + 3 if rank == world - 1 else 1
        idx = torch.tensor([0, rows] * module.num_tables, device=device)
        off = torch.arange(0, 2 * module.num_tables + 1, 2, device=device)
        try:
            module(idx, off).sum().backward()
            result[f"{name}.bad"] = np.array("")
        except (IndexError, RuntimeError) as err:
            result[f"{name}.bad"] = np.array(f"{type(err).__name__}: {err}")
        after = _snapshot(module)
        # (on the GPU the step count moves on, as in one process: counted on the device)
        result[f"{name}.bad_unchanged"] = np.array(all(np.array_equal(before[k], after[k])
                                                       for k in before if k != "optimizer_step"))
    if device.type == "cuda":  # deferred: the device verdicts ride the all_reduce
        module = TTEmbeddingBag(**SINGLE, device=device)
        before = _snapshot(module)
        idx = torch.tensor([0, 200 if rank == world - 1 else 1], device=device)
        module(idx, torch.tensor([0, 2], device=device)).sum().backward()  # no raise yet
        try:
            module.check_inputs()
            result["deferred"] = np.array("")
        except IndexError as err:
            result["deferred"] = np.array(f"IndexError: {err}")
        after = _snapshot(module)
        result["deferred_unchanged"] = np.array(all(np.array_equal(before[k], after[k])
                                                    for k in before if k != "optimizer_step"))
    # broadcast_state: rank 0's values everywhere.
    module = TTEmbeddingBag(**SINGLE, device=device)
    with torch.no_grad():
        module.tt_cores[0].add_(rank)
    module.broadcast_state()
    result["broadcast"] = module.tt_cores[0].detach().cpu().numpy()
    # process_group=None: one process, no collectives.
    result["private"] = np.array(TTEmbeddingBag(**SINGLE, process_group=None,
                                                device=device).process_group is None)


def _single_process(device="cpu"):
    expected = {}
    for name, module, steps, weighted, populate in _modules(device, process_group=None):
        outs = _train(module, steps, slice(None), device, weighted, populate)
        expected.update({f"{name}.out{k}": out for k, out in enumerate(outs)})
        expected.update({f"{name}.{k}": v for k, v in _snapshot(module).items()})
    return expected


def _compare(world, out_dir, expected, tol):
    results = [dict(np.load(os.path.join(out_dir, f"rank{r}.npz"))) for r in range(world)]
    for key, want in expected.items():
        if ".out" in key:  # every rank's lookups saw every earlier update
            got = np.concatenate([res[key] for res in results], axis=1)
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=key)
            continue
        for r, res in enumerate(results):
            if want.dtype.kind in "iu":
                np.testing.assert_array_equal(res[key], want, err_msg=f"rank {r} {key}")
            else:
                np.testing.assert_allclose(res[key], want, rtol=tol, atol=tol,
                                           err_msg=f"rank {r} {key}")
    for r, res in enumerate(results):
        np.testing.assert_array_equal(res["unseeded"], results[0]["unseeded"])
        np.testing.assert_array_equal(res["broadcast"], results[0]["broadcast"])
        assert bool(res["private"]), r
        for name in ("one", "tables"):
            message = str(res[f"{name}.bad"])
            assert message.startswith("IndexError"), (r, name, message)
            assert ("out of range" if r == world - 1 else f"rank {world - 1}") in message, (
                r, name, message)
            assert bool(res[f"{name}.bad_unchanged"]), (r, name)
        if "deferred" in res:
            message = str(res["deferred"])
            assert ("out of range" if r == world - 1 else f"rank {world - 1}") in message, (
                r, message)
            assert bool(res["deferred_unchanged"]), r
    # the cache was in use: rows chosen from every rank's counts, some of them trained
    rows = expected["cache.ADAM.cache_rows"]
    assert 7 in rows and (rows != np.iinfo(np.int64).max).all()


def _run(world, backend, tmp_path):
    mp.spawn(_worker, args=(world, free_port(), str(tmp_path), backend), nprocs=world,
             join=True)


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                    reason="torch.distributed with gloo is not available")
@pytest.mark.slow  # spawns its ranks
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_equal_one_process_every_fused_optimizer(world, tmp_path):
    _run(world, "gloo", tmp_path)
    _compare(world, tmp_path, _single_process(), tol=1e-5)


def _split_steps_match_fused(xp, optimizer):
    """The two halves on two shares of each batch (gradients added, flags summed) equal the
    fused update on the whole batch: cores, state and an active cache."""
    from xferlib import tt as core

    shape = core.TTShape([4, 5, 3], [2, 2, 2], [3, 2])
    rng = np.random.default_rng(0)
    cores = [xp.asarray(c) for c in core.init_tt_cores(shape, "normal",
                                                        rng=np.random.default_rng(1))]
    runs = []
    for _ in range(2):
        cache = core.TTRowCache(shape, 5, 60, optimizer, xp)
        cache.count(xp.arange(20))
        cache.populate(cores)
        runs.append(([c.copy() for c in cores], core.tt_sparse_state(shape, optimizer, xp),
                     cache))
    (c1, s1, k1), (c2, s2, k2) = runs
    for step in range(1, 4):
        idx = rng.integers(0, 60, 12)
        idx[:3] = idx[3]
        idx[4] = 2  # a cached row
        off = np.arange(0, 13, 3)
        g = xp.asarray(rng.standard_normal((4, 8)).astype(np.float32))
        hyper = dict(lr=0.05, step=step, weight_decay=0.01)
        _, res = core.tt_embedding_bag_fwd(c1, shape, xp.asarray(idx), xp.asarray(off),
                                           cache=k1, check=True)
        core.tt_fused_update(c1, shape, res, g, s1, optimizer, cache=k1, **hyper)
        total, flags, cgrad, cflags = 0, 0, 0, 0
        for lo, hi in ((0, 1), (1, 4)):
            _, r = core.tt_embedding_bag_fwd(
                c2, shape, xp.asarray(idx[off[lo]:off[hi]]), xp.asarray(off[lo:hi + 1] - off[lo]),
                cache=k2, check=True)
            grad, touched = core.tt_core_grads(c2, shape, r, g[lo:hi])
            cg, ct = core.tt_cache_grad(k2, shape, r, g[lo:hi])
            total, flags, cgrad, cflags = total + grad, flags + touched, cgrad + cg, cflags + ct
        core.tt_apply_core_grads(c2, shape, total, flags, s2, optimizer, **hyper)
        core.tt_cache_apply(k2, cgrad, cflags, optimizer, **hyper)
    get = (lambda a: a.get()) if xp is not np else np.asarray
    states = lambda s, k: [v for st in s + [k.state] for v in st.values()]  # noqa: E731
    for a, b in zip(c1 + [k1.weight] + states(s1, k1), c2 + [k2.weight] + states(s2, k2)):
        np.testing.assert_allclose(get(b), get(a), rtol=1e-5, atol=1e-6, err_msg=optimizer)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad", "rowwise_adam",
                                       "lamb", "lars_sgd", "partial_rowwise_adam",
                                       "partial_rowwise_lamb"])
def test_core_halves_on_split_batches_equal_the_fused_update(optimizer):
    _split_steps_match_fused(np, optimizer)


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adam", "lamb", "lars_sgd"])
def test_core_halves_on_split_batches_equal_the_fused_update_cuda(optimizer):
    if not xferlib.cupy_available():
        pytest.skip(GPU_SKIP_REASON)
    import cupy

    _split_steps_match_fused(cupy, optimizer)


def test_single_process_defaults():
    """Without torch.distributed initialized the default group is none: one process."""
    bag = TTEmbeddingBag(**SINGLE)
    assert bag.process_group is None
    bag.broadcast_state()  # nothing to do
    with pytest.raises(ValueError, match="process_group"):
        TTEmbeddingBag(**SINGLE, process_group="world")
    if not dist.is_initialized():
        with pytest.raises(ValueError, match="not initialized"):
            TTEmbeddingBag(**SINGLE, process_group=object())


@pytest.mark.gpu
def test_two_gpus_nccl_equal_one_process_every_fused_optimizer(tmp_path):
    require_two_gpus()
    _run(2, "nccl", tmp_path)
    # the kernel path sums in another order than the CPU's: one process on one GPU
    _compare(2, tmp_path, _single_process("cuda:0"), tol=1e-4)
