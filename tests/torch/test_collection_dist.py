"""A collection's tables sharded over ranks (ShardedEmbeddingBagCollection): 2 and 3 gloo
ranks train, with table-wise and row-wise plans and every optimizer tested, exactly what one
process trains on the same global batch (weights and optimizer state, bit for bit; the
pooled outputs bit for bit table-wise, to float32 rounding row-wise); a rank with an empty
batch and per-sample weights and mean pooling take part; bad input on one rank raises on
every rank and changes nothing; a checkpoint written by 2 ranks loads onto 3 ranks of
another plan, and theirs into one process.

Spawning is slow on a small machine, so each spawned run does every check of its size.
"""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from xferlib.adapters.torch import (EmbeddingBagCollection, ShardedEmbeddingBagCollection,  # noqa: E402,E501
                                    leave_process_group, load_sharded, save_sharded)
from xferlib.adapters.torch.collection_exchange import KernelExchange  # noqa: E402
from xferlib.collection import TableConfig, plan_sharding  # noqa: E402
from tests.torch.dist_helpers import free_port, join, require_two_gpus  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="no torch.distributed")

TABLES = [TableConfig(23, 5, name="user"),
          TableConfig(40, 3, name="item", placement="host", init=("uniform", -0.5, 0.5)),
          TableConfig(7, 4, name="ad", lr=0.05)]
B, STEPS, SEED = 6, 3, 11
OPTIMIZERS = {"sgd": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
              "adam": {"lr": 0.01},
              "rowwise_adagrad": {"lr": 0.1},
              "adagrad": {"lr": 0.1}}
# The collection's other rules, table-wise (every optimizer it has: xferlib.SPARSE_OPTIMIZERS)
MORE_OPTIMIZERS = {"adamw": {"lr": 0.01, "weight_decay": 0.1}, "adamax": {"lr": 0.01},
                   "rmsprop": {"lr": 0.01, "centered": True}, "adadelta": {"lr": 1.0}}
# (name, optimizer, plan kind, pooling)
RUNS = [(f"{opt}.{kind}", opt, kind, "sum") for opt in OPTIMIZERS for kind in ("table", "row")]
RUNS += [(f"{opt}.table", opt, "table", "sum") for opt in MORE_OPTIMIZERS]
OPTIMIZERS = {**OPTIMIZERS, **MORE_OPTIMIZERS}
RUNS.append(("rowwise_adagrad.row.mean", "rowwise_adagrad", "row", "mean"))
RUNS.append(("adam.table.mean", "adam", "table", "mean"))


def _plan(kind, world, optimizer):
    row_wise = ("user", "item") if kind == "row" else ()
    return plan_sharding(TABLES, world, optimizer=optimizer, row_wise=row_wise)


def _data():
    """Per step: each table's bags for the B global samples (lengths 0-3, duplicates), the
    per-sample weights (step 2 only) and the gradient of the pooled output."""
    rng = np.random.default_rng(SEED)
    total = sum(t.dim for t in TABLES)
    steps = []
    for k in range(STEPS):
        bags = [[rng.integers(0, t.num_rows, rng.integers(0, 4)) for _ in range(B)]
                for t in TABLES]
        bags[0][0] = np.array([3, 3, 3])  # one row repeated within a bag
        for s in range(B):
            bags[1][s] = np.append(bags[1][s], 17)  # and in every sample (across ranks)
        weights = None
        if k == 2:
            weights = [[rng.standard_normal(len(b)).astype(np.float32) for b in tb]
                       for tb in bags]
        steps.append((bags, weights, rng.standard_normal((B, total)).astype(np.float32)))
    return steps


def _samples(world, rank, step):
    """Rank ``rank``'s samples at ``step``: the last rank has none at step 1."""
    if step == 1 and rank == world - 1:
        return []
    return list(range(rank * B // world, (rank + 1) * B // world))


def _global_samples(world, step):
    return [s for r in range(world) for s in _samples(world, r, step)]


def _batch(step, samples):
    """FBGEMM's layout of ``samples``' bags of every table."""
    bags, weights, grad = step
    idx, offsets, w = [], [0], []
    for t in range(len(TABLES)):
        for s in samples:
            idx.extend(bags[t][s])
            offsets.append(len(idx))
            if weights is not None:
                w.extend(weights[t][s])
    psw = None if weights is None else torch.tensor(np.array(w, np.float32))
    return (torch.tensor(idx, dtype=torch.int64), torch.tensor(offsets, dtype=torch.int64),
            psw, torch.from_numpy(grad[samples]))


def _train(module, steps, samples_of, device):
    outs = []
    for k, step in enumerate(steps):
        idx, off, psw, grad = _batch(step, samples_of(k))
        out = module(idx.to(device), off.to(device),
                     None if psw is None else psw.to(device))
        out.backward(grad.to(device))
        outs.append(out.detach().cpu().numpy())
    return outs


def _state(module):
    return {k: v.numpy().copy() for k, v in module.state_dict().items()}


def _worker(rank, world, port, out_dir, backend, ckpt_in, ckpt_out):
    device = join(rank, world, port, backend)
    steps = _data()
    result = {}
    for name, opt, kind, pooling in RUNS:
        module = ShardedEmbeddingBagCollection(
            TABLES, opt, OPTIMIZERS[opt], plan=_plan(kind, world, opt), pooling=pooling,
            device=device, seed=SEED)
        outs = _train(module, steps, lambda k: _samples(world, rank, k), device)
        result.update({f"{name}.out{k}": o for k, o in enumerate(outs)})
        result.update({f"{name}/{k}": v for k, v in _state(module).items()})
        if name == "adam.table" and ckpt_out:
            save_sharded(module, ckpt_out, tag="step3")
        if name == "adam.table":
            _bad_input(module, rank, world, device, result)
            _dict_form(module, rank, world, device, result)
    if ckpt_in:  # another plan and group size: adam's rows resharded by row ranges
        module = ShardedEmbeddingBagCollection(TABLES, "adam", OPTIMIZERS["adam"],
                                               plan=_plan("row", world, "adam"),
                                               device=device, seed=99)
        load_sharded(module, ckpt_in)
        result.update({f"loaded/{k}": v for k, v in _state(module).items()})
        if ckpt_out:
            save_sharded(module, ckpt_out)
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **result)
    leave_process_group()


def _refusal(module, step, errors):
    """Run ``step`` (a bad batch): ``(its error's message or "", whether every array of the
    module's state is unchanged)``, as arrays to save."""
    before = _state(module)
    message = ""
    try:
        step()
    except errors as err:
        message = str(err)
    after = _state(module)
    return np.array(message), np.array(all(np.array_equal(before[k], after[k])
                                            for k in before))


def _bad_input(module, rank, world, device, result):
    """An index out of range on the last rank: IndexError everywhere, nothing changed."""
    idx, off, _, _ = _batch(_data()[0], _samples(world, rank, 0))
    if rank == world - 1:
        idx[-1] = 40  # the last table, "ad", has 7 rows
    result["bad_error"], result["bad_unchanged"] = _refusal(
        module, lambda: module(idx.to(device), off.to(device)).sum().backward(), IndexError)


# Input one rank alone passes and the module refuses before its exchange: what the rank
# that passed it hears (every other rank hears which rank it was).
ONE_RANK_REFUSALS = {"dict_bags": "same number of bags", "dict_missing": "missing",
                     "dict_offsets": "offsets[0] must be 0", "dict_list": "must be an array",
                     "no_offsets": "offsets are needed", "weights_grad": "detach"}
# what the rank that passed them raises from check() when a GPU refused them on the device
ON_DEVICE_REFUSALS = {"dict_offsets": "bad offsets"}


def _dict_form(module, rank, world, device, result, batch=None):
    """The per-table dict form pools what FBGEMM's layout pools; a dict the collection
    refuses on one rank alone (tables with different numbers of bags, a table missing)
    raises on every rank, none left waiting in the exchange, and changes nothing.
    ``batch``: this rank's ``(indices, offsets)`` (default: step 0 of ``_data``)."""
    idx, off = batch if batch is not None else _batch(_data()[0], _samples(world, rank, 0))[:2]
    B = (off.numel() - 1) // len(TABLES)
    features = {name: (idx[off[t * B]:off[(t + 1) * B]],
                       off[t * B:(t + 1) * B + 1] - off[t * B])
                for t, name in enumerate(module.names)}
    on = lambda f: {n: (i.to(device), o.to(device)) for n, (i, o) in f.items()}  # noqa: E731
    with torch.no_grad():
        packed = module(idx.to(device), off.to(device))
        by_name = module(on(features))
    result["dict_equal"] = bool(torch.equal(packed, by_name))
    first = module.names[0]
    short = dict(features)
    short[first] = (features[first][0][:0], torch.zeros(1, dtype=torch.int64))  # no bags
    missing = {n: v for n, v in features.items() if n != first}
    shifted = dict(features)  # the first table's offsets start at 1: its bags shifted
    shifted[first] = (features[first][0], features[first][1] + 1)
    listed = dict(features)  # a list, not a tensor
    listed[first] = (features[first][0].tolist(), features[first][1])
    flat = (idx.to(device), off.to(device))
    weights = torch.ones(idx.numel(), device=device)
    bad_calls = {
        "dict_bags": lambda: module(on(short)), "dict_missing": lambda: module(on(missing)),
        "dict_offsets": lambda: module(on(shifted)),
        "dict_list": lambda: module({n: (v[0], v[1].to(device)) if n == first else
                                     (v[0].to(device), v[1].to(device))
                                     for n, v in listed.items()}),
        "no_offsets": lambda: module(flat[0]),
        "weights_grad": lambda: module(*flat, weights.clone().requires_grad_())}
    for name, bad in bad_calls.items():  # the last rank's alone
        call = bad if rank == world - 1 else lambda: module(*flat, weights) \
            if name == "weights_grad" else module(on(features))
        result[f"{name}_error"], result[f"{name}_unchanged"] = _refusal(
            module, lambda: _step_and_check(module, call),
            (ValueError, KeyError, TypeError, NotImplementedError))


def _step_and_check(module, call):
    """A training step, then (capturable) ``check()``: a GPU refuses a capturable step's
    bad values on the device and raises them there alone."""
    call().sum().backward()
    if getattr(module, "capturable", False):
        module.check()


def _single(world, name, opt, pooling, device="cpu"):
    module = EmbeddingBagCollection(TABLES, opt, OPTIMIZERS[opt], pooling=pooling,
                                    device=device, seed=SEED)
    outs = _train(module, _data(), lambda k: _global_samples(world, k), device)
    return module, outs


def _assemble(results, prefix, plan):
    """Every table's state, put together from the ranks' shards."""
    full = {}
    for s in plan.shards:
        head = f"{prefix}/embedding_bags.{s.local_name}."
        for key, value in results[s.rank].items():
            if key.startswith(head):
                name = f"embedding_bags.{s.table}.{key[len(head):]}"
                if name not in full:
                    rows = TABLES[s.table_index].num_rows
                    full[name] = np.zeros((rows, *value.shape[1:]), value.dtype)
                full[name][s.row_start:s.row_stop] = value
    return full


def _compare(world, out_dir, device="cpu", exact=True):
    results = [dict(np.load(os.path.join(out_dir, f"rank{r}.npz"))) for r in range(world)]
    single_adam = None
    for name, opt, kind, pooling in RUNS:
        module, outs = _single(world, name, opt, pooling, device)
        if name == "adam.table":
            single_adam = module
        got = _assemble(results, name, _plan(kind, world, opt))
        want = _state(module)
        assert sorted(got) == sorted(want), name
        for key in want:
            if exact:
                np.testing.assert_array_equal(got[key], want[key], err_msg=f"{name} {key}")
            else:
                np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6,
                                           err_msg=f"{name} {key}")
        for k in range(STEPS):
            out = np.concatenate([results[r][f"{name}.out{k}"] for r in range(world)])
            if kind == "table" and exact:
                np.testing.assert_array_equal(out, outs[k], err_msg=f"{name} out{k}")
            else:  # row-wise: partial sums added; equal to float32 rounding
                np.testing.assert_allclose(out, outs[k], rtol=1e-5, atol=1e-5,
                                           err_msg=f"{name} out{k}")
    for r, res in enumerate(results):
        assert "out of range" in str(res["bad_error"]), (r, res["bad_error"])
        assert bool(res["bad_unchanged"]), r
    assert "position" in str(results[-1]["bad_error"])  # the rank that had it names it
    for r, res in enumerate(results):
        assert bool(res["dict_equal"]), r
        for name in ONE_RANK_REFUSALS:
            assert bool(res[f"{name}_unchanged"]), (r, name)
    for name, message in ONE_RANK_REFUSALS.items():  # the rank that passed it, its error
        assert message in str(results[-1][f"{name}_error"]), (name, results[-1])
    for res in results[:-1]:  # the others name the rank whose batch was refused
        for name in ONE_RANK_REFUSALS:
            assert f"rank {len(results) - 1}" in str(res[f"{name}_error"]), (name, res)
    return results, single_adam


def _spawn(world, backend, out_dir, ckpt_in=None, ckpt_out=None):
    os.makedirs(out_dir, exist_ok=True)
    mp.spawn(_worker, args=(world, free_port(), str(out_dir), backend, ckpt_in, ckpt_out),
             nprocs=world, join=True)


@pytest.mark.skipif(not dist.is_gloo_available(), reason="torch.distributed without gloo")
@pytest.mark.slow  # spawns 2 then 3 ranks: about 20 s on two cores
def test_two_and_three_ranks_equal_one_process_and_reshard(tmp_path):
    ckpt2, ckpt3 = tmp_path / "ckpt2", tmp_path / "ckpt3"
    _spawn(2, "gloo", tmp_path / "w2", ckpt_out=str(ckpt2))
    _, single_adam = _compare(2, tmp_path / "w2")
    want = _state(single_adam)

    # 2 ranks' table-wise checkpoint onto 3 ranks of a row-wise plan...
    _spawn(3, "gloo", tmp_path / "w3", ckpt_in=str(ckpt2), ckpt_out=str(ckpt3))
    results, _ = _compare(3, tmp_path / "w3")
    loaded = _assemble(results, "loaded", _plan("row", 3, "adam"))
    for key in want:
        np.testing.assert_array_equal(loaded[key], want[key], err_msg=f"3 ranks: {key}")

    # ... and theirs into one process.
    one = EmbeddingBagCollection(TABLES, "adam", OPTIMIZERS["adam"], device="cpu", seed=5)
    load_sharded(one, ckpt3)
    for key, value in _state(one).items():
        np.testing.assert_array_equal(value, want[key], err_msg=f"1 process: {key}")


@pytest.mark.gpu
def test_two_gpus_nccl_equal_one_process(tmp_path):
    require_two_gpus()
    _spawn(2, "nccl", tmp_path / "w2", ckpt_out=str(tmp_path / "ckpt"))
    # The GPU collection sums rows in its own fixed order: equal to float32 rounding.
    _compare(2, tmp_path / "w2", device="cuda", exact=False)


# ------------------------------------------------------------------ capturable

L_FIXED = 3  # every bag's length: each rank passes the same number of indices


def _fixed_data():
    """Like _data, with bags of L_FIXED lookups (repeats within and across bags)."""
    rng = np.random.default_rng(SEED + 1)
    total = sum(t.dim for t in TABLES)
    steps = []
    for k in range(STEPS):
        bags = [[rng.integers(0, t.num_rows, L_FIXED) for _ in range(B)] for t in TABLES]
        bags[1][0][:] = 17
        weights = None
        if k == 1:
            weights = [[rng.standard_normal(L_FIXED).astype(np.float32) for _ in tb]
                       for tb in bags]
        steps.append((bags, weights, rng.standard_normal((B, total)).astype(np.float32)))
    return steps


# name, optimizer, plan, pooling, max_bag_size (None: room for all of a rank's lookups)
FIXED_RUNS = [("adam.table", "adam", "table", "sum", None),
              ("rowwise_adagrad.row", "rowwise_adagrad", "row", "sum", None),
              ("sgd.row.mean", "sgd", "row", "mean", None),
              ("adam.table.bounded", "adam", "table", "sum", L_FIXED),
              ("rowwise_adagrad.row.bounded", "rowwise_adagrad", "row", "mean", L_FIXED + 1)]


def _fixed_worker(rank, world, port, out_dir, backend, steps_form="default"):
    device = join(rank, world, port, backend)
    result = {}
    share = B // world

    def make(*args, **kwargs):
        """The sharded collection, with the GPU's exchange steps for "kernel steps" (their
        NumPy reference on the CPU)."""
        module = ShardedEmbeddingBagCollection(*args, **kwargs)
        if steps_form == "kernel steps":
            module._kernels = KernelExchange(module.plan, module.device, module.dtype)
        return module

    for name, opt, kind, pooling, max_bag in FIXED_RUNS:
        module = make(
            TABLES, opt, OPTIMIZERS[opt], plan=_plan(kind, world, opt), pooling=pooling,
            device=device, seed=SEED, capturable=True, max_bag_size=max_bag)
        outs = _train(module, _fixed_data(),
                      lambda k: list(range(rank * share, (rank + 1) * share)), device)
        module.check()
        result.update({f"{name}.out{k}": o for k, o in enumerate(outs)})
        result.update({f"{name}/{k}": v for k, v in _state(module).items()})
    # An index out of range on the last rank: no table changes on any rank; that rank's
    # check() raises (its owner's too, from the collection's pending check).
    idx, off, _, _ = _batch(_fixed_data()[0], list(range(rank * share, (rank + 1) * share)))
    if rank == world - 1:
        idx[-1] = 40  # the last table, "ad", has 7 rows

    def step(module, idx):
        module(idx.to(device), off.to(device)).sum().backward()
        module.check()

    result["bad_error"], result["bad_unchanged"] = _refusal(
        module, lambda: step(module, idx), (IndexError, ValueError))
    # Bags longer than max_bag_size: refused, nothing changes on any rank.
    bounded = make(
        TABLES, "sgd", OPTIMIZERS["sgd"], plan=_plan("table", world, "sgd"), device=device,
        seed=SEED, capturable=True, max_bag_size=L_FIXED - 1)
    idx, off, _, _ = _batch(_fixed_data()[0], list(range(rank * share, (rank + 1) * share)))
    result["long_error"], result["long_unchanged"] = _refusal(
        bounded, lambda: step(bounded, idx), ValueError)
    # A rank passing another batch shape is refused on every rank, before anything is sent.
    try:
        n = L_FIXED * len(TABLES) * (share - (rank == 0))
        module(torch.zeros(n, dtype=torch.int64, device=device),
               torch.arange(0, n + 1, L_FIXED, device=device)[:len(TABLES) * share + 1])
        result["shape_error"] = np.array("")
    except ValueError as err:
        result["shape_error"] = np.array(str(err))
    # Offsets of a wrong length on rank 0 only: every rank raises, none waits.
    idx, off, _, _ = _batch(_fixed_data()[0], list(range(rank * share, (rank + 1) * share)))
    try:
        module(idx.to(device), (off[:-1] if rank == 0 else off).to(device))
        result["type_error"] = np.array("")
    except ValueError as err:
        result["type_error"] = np.array(str(err))
    _dict_form(module, rank, world, device, result, batch=(idx, off))
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **result)
    leave_process_group()


@pytest.mark.skipif(not dist.is_gloo_available(), reason="torch.distributed without gloo")
@pytest.mark.slow
@pytest.mark.parametrize("steps_form", ["default", "kernel steps"])
def test_capturable_ranks_equal_one_process(tmp_path, steps_form):
    """capturable=True (fixed-size messages, no host sync in a step): 2 gloo ranks train
    what one process trains on the global batch; bad input changes nothing and check()
    raises on the rank that passed it; ranks passing different shapes are refused. "kernel
    steps": the messages built and unpacked by the GPU's steps (their NumPy reference)."""
    world = 2
    os.makedirs(tmp_path / "w", exist_ok=True)
    mp.spawn(_fixed_worker, args=(world, free_port(), str(tmp_path / "w"), "gloo",
                                  steps_form), nprocs=world, join=True)
    _check_capturable([dict(np.load(tmp_path / "w" / f"rank{r}.npz")) for r in range(world)],
                      world, gpu=False)


@pytest.mark.gpu
def test_two_gpus_capturable_equal_one_process(tmp_path):
    """The same on NCCL, each rank on its own GPU, the messages built and unpacked by the
    exchange kernels: what one process trains (to float32 rounding: the GPU collection sums
    rows in its own order), and the same refusals."""
    require_two_gpus()
    os.makedirs(tmp_path / "w", exist_ok=True)
    mp.spawn(_fixed_worker, args=(2, free_port(), str(tmp_path / "w"), "nccl"), nprocs=2,
             join=True)
    _check_capturable([dict(np.load(tmp_path / "w" / f"rank{r}.npz")) for r in range(2)],
                      2, gpu=True)


def _check_capturable(results, world, gpu):
    """The capturable workers' results against one process's training (table-wise plans:
    the same bits on the CPU), and their refusals."""
    for name, opt, kind, pooling, _ in FIXED_RUNS:
        module = EmbeddingBagCollection(TABLES, opt, OPTIMIZERS[opt], pooling=pooling,
                                        device="cpu", seed=SEED)
        outs = _train(module, _fixed_data(), lambda k: list(range(B)), "cpu")
        got, want = _assemble(results, name, _plan(kind, world, opt)), _state(module)
        assert sorted(got) == sorted(want), name
        for key in want:
            if kind == "table" and not gpu:
                np.testing.assert_array_equal(got[key], want[key], err_msg=f"{name} {key}")
            else:
                np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6,
                                           err_msg=f"{name} {key}")
        for k in range(STEPS):
            out = np.concatenate([results[r][f"{name}.out{k}"] for r in range(world)])
            np.testing.assert_allclose(out, outs[k], rtol=1e-5, atol=1e-5,
                                       err_msg=f"{name} out{k}")
    assert "out of range" in str(results[-1]["bad_error"]), results[-1]["bad_error"]
    for r in range(world):
        assert bool(results[r]["bad_unchanged"]), r
        assert bool(results[r]["long_unchanged"]), r
        assert "longer than max_bag_size" in str(results[r]["long_error"]), r
        assert "same B_local" in str(results[r]["shape_error"]), results[r]["shape_error"]
        assert str(results[r]["type_error"]), r  # rank 0 its own error, rank 1 another's
        assert bool(results[r]["dict_equal"]), r
        for name in ONE_RANK_REFUSALS:
            assert bool(results[r][f"{name}_unchanged"]), (r, name)
            # on GPUs a capturable step's bad offsets are refused on the device: check()
            # raises on the rank that passed them, the others go on
            if not gpu or name not in ON_DEVICE_REFUSALS or r == world - 1:
                assert str(results[r][f"{name}_error"]), (r, name)
    for name, message in ONE_RANK_REFUSALS.items():
        if gpu:
            message = ON_DEVICE_REFUSALS.get(name, message)
        assert message in str(results[-1][f"{name}_error"]), (name, results[-1])


def _graph_worker(rank, world, port, out_dir):
    """Two modules from one seed on this rank's GPU: one trained eagerly, the other by a
    CUDA graph of its whole step (forward, the all_to_alls, backward + update) replayed on
    the same batches. Both end with the same state."""
    device = join(rank, world, port, "nccl")
    share = B // world
    steps = _fixed_data()
    batches = [_batch(step, list(range(rank * share, (rank + 1) * share))) for step in steps]
    batches = [(i.to(device), o.to(device), g.to(device)) for i, o, _, g in batches]
    states = []
    for graphed in (False, True):
        module = ShardedEmbeddingBagCollection(
            TABLES, "adam", OPTIMIZERS["adam"], plan=_plan("row", world, "adam"),
            device=device, seed=SEED, capturable=True, max_bag_size=L_FIXED)
        if not graphed:
            for idx, off, grad in batches * 2:
                module(idx, off).backward(grad)
        else:
            static = [t.clone() for t in batches[0]]
            # warm-up on a side stream, as torch advises before capturing NCCL collectives:
            # shapes agreed, kernels built
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                module(*static[:2]).backward(static[2])
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                module(*static[:2]).backward(static[2])
            # capturing ran nothing: the warm-up was step 0; replay steps 1, 2, then 0-2
            for idx, off, grad in batches[1:] + batches:
                for dst, src in zip(static, (idx, off, grad)):
                    dst.copy_(src)
                graph.replay()
            # a live graph holding NCCL collectives makes ncclCommDestroy (in
            # leave_process_group) wait forever: release it first
            del graph
        torch.cuda.synchronize(device)
        module.check()
        states.append(_state(module))
    same = all(np.array_equal(states[0][k], states[1][k]) for k in states[0])
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), same=np.array(same))
    leave_process_group()


@pytest.mark.gpu
def test_two_gpus_capturable_step_in_a_cuda_graph(tmp_path):
    """capturable=True on NCCL: the whole training step (with its all_to_alls) captured in
    a CUDA graph and replayed trains what eager steps train, bit for bit."""
    require_two_gpus()
    os.makedirs(tmp_path / "g", exist_ok=True)
    mp.spawn(_graph_worker, args=(2, free_port(), str(tmp_path / "g")), nprocs=2, join=True)
    for r in range(2):
        assert bool(np.load(tmp_path / "g" / f"rank{r}.npz")["same"]), r


@pytest.mark.skipif(not dist.is_gloo_available(), reason="torch.distributed without gloo")
def test_checkpoint_of_tables_whose_names_hold_dots(tmp_path):
    """A table named "a.b" beside "a" (a state_dict key of one starts with the other's
    name): each saves and loads its own rows and state, one rank to one process."""
    tables = [TableConfig(6, 4, name="a"), TableConfig(5, 4, name="a.b")]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sharded = ShardedEmbeddingBagCollection(tables, "adagrad", {"lr": 0.1}, seed=3)
        idx = torch.tensor([0, 5, 5, 1, 4, 2])
        sharded(idx, torch.tensor([0, 2, 3, 5, 6])).sum().backward()
        save_sharded(sharded, tmp_path)
        saved = {k: v.clone() for k, v in sharded.state_dict().items()}
        leave_process_group()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    whole = EmbeddingBagCollection(tables, "adagrad", {"lr": 0.1}, seed=99)
    load_sharded(whole, tmp_path)
    loaded = whole.state_dict()
    assert set(saved) == set(loaded)
    for key, value in saved.items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.skipif(not dist.is_gloo_available(), reason="torch.distributed without gloo")
def test_the_tables_configs_win_over_the_plans():
    """A plan made from configs of the same names and shapes but another learning rate
    places the tables; the module's own tables (here "a"'s lr) are what train."""
    tables = [TableConfig(10, 3, name="a", lr=0.5), TableConfig(7, 2, name="b")]
    plan = plan_sharding([TableConfig(10, 3, name="a"), TableConfig(7, 2, name="b")], 1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sharded = ShardedEmbeddingBagCollection(tables, "sgd", {"lr": 0.01}, plan=plan,
                                                seed=4)
        one = EmbeddingBagCollection(tables, "sgd", {"lr": 0.01}, seed=4)
        idx, off = torch.tensor([1, 2, 2]), torch.tensor([0, 2, 3])
        for module in (sharded, one):
            module(idx, off).sum().backward()
        assert sharded.plan.tables[0].lr == 0.5
        got, want = sharded.state_dict(), one.state_dict()
        leave_process_group()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert set(got) == set(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)


def _manifest_worker(rank, world, port, ckpt, out_dir):
    import datetime

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    module = ShardedEmbeddingBagCollection(TABLES, "sgd", {"lr": 0.1}, seed=SEED)
    message = ""
    try:
        save_sharded(module, ckpt)
    except (OSError, RuntimeError) as err:
        message = f"{type(err).__name__}: {err}"
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), message=np.array(message))
    leave_process_group()


@pytest.mark.skipif(not dist.is_gloo_available(), reason="torch.distributed without gloo")
def test_a_manifest_rank_0_cannot_write_raises_on_every_rank(tmp_path):
    """Rank 0 fails to write the manifest (its path is a directory): every rank raises,
    none returns as if the checkpoint were complete."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "manifest.json").mkdir(parents=True)
    mp.spawn(_manifest_worker, args=(2, free_port(), str(ckpt), str(tmp_path)), nprocs=2,
             join=True)
    messages = [str(np.load(tmp_path / f"rank{r}.npz")["message"]) for r in range(2)]
    assert "IsADirectoryError" in messages[0], messages
    assert "manifest" in messages[1], messages


def _load_worker(rank, world, port, ckpt, out_dir):
    import datetime

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    module = ShardedEmbeddingBagCollection(TABLES, "sgd", {"lr": 0.1}, seed=SEED + 1)
    before = _state(module)
    message = ""
    try:  # rank 1 is pointed at a directory that holds no checkpoint
        load_sharded(module, ckpt if rank == 0 else os.path.join(out_dir, "nothing"))
    except (OSError, RuntimeError, ValueError) as err:
        message = f"{type(err).__name__}: {err}"
    after = _state(module)
    unchanged = all(np.array_equal(before[k], after[k]) for k in before)
    np.savez(os.path.join(out_dir, f"load{rank}.npz"), message=np.array(message),
             unchanged=np.array(unchanged))
    leave_process_group()


@pytest.mark.skipif(not dist.is_gloo_available(), reason="torch.distributed without gloo")
def test_a_checkpoint_one_rank_cannot_read_raises_on_every_rank(tmp_path):
    """load_sharded is collective: rank 1 cannot read its rows, so rank 1 raises its own
    error, rank 0 a RuntimeError, and neither rank's tables change."""
    ckpt = tmp_path / "ckpt"
    mp.spawn(_manifest_worker, args=(2, free_port(), str(ckpt), str(tmp_path)), nprocs=2,
             join=True)
    mp.spawn(_load_worker, args=(2, free_port(), str(ckpt), str(tmp_path)), nprocs=2,
             join=True)
    results = [np.load(tmp_path / f"load{r}.npz") for r in range(2)]
    messages = [str(r["message"]) for r in results]
    assert "another rank" in messages[0] and "RuntimeError" in messages[0], messages
    assert messages[1].startswith("ValueError") and "no sharded checkpoint" in messages[1]
    assert all(bool(r["unchanged"]) for r in results), messages
