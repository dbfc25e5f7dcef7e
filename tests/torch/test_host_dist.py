"""Host tables shared by the ranks of a process group: N ranks (gloo on the CPU; NCCL on two
GPUs) train one table to the same weights and optimizer state as one process on the
concatenated global batch, for every optimizer; bad input raises on every rank; the shared
memory is gone afterwards.

Spawning is slow on a small machine, so each spawned run does every check of its world size.
"""

import glob
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from xferlib.adapters.torch import (HostEmbedding, HostEmbeddingBag,  # noqa: E402
                                    leave_process_group)
from xferlib.table.shared import shared_memory_directory  # noqa: E402
from tests.torch.dist_helpers import free_port, join, require_two_gpus  # noqa: E402

ROWS, DIM, BAGS, BAG, STEPS = 23, 5, 12, 3, 3
OPTIMIZERS = [("sgd", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
              ("adam", {"lr": 0.01, "amsgrad": True}),
              ("adamw", {"lr": 0.01}),
              ("adagrad", {"lr": 0.1, "lr_decay": 0.01}),
              ("rowwise_adagrad", {"lr": 0.1}),
              ("adamax", {"lr": 0.01}),
              ("rmsprop", {"lr": 0.01, "centered": True, "momentum": 0.5}),
              ("adadelta", {"lr": 1.0})]

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="no torch.distributed")


def _data(seed):
    """The global batches: (BAGS, BAG) indices with duplicates within and across ranks, and
    the gradient of the loss with respect to each bag's output."""
    rng = np.random.default_rng(seed)
    init = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    steps = [(rng.integers(0, ROWS, (BAGS, BAG)), rng.standard_normal((BAGS, DIM))
              .astype(np.float32)) for _ in range(STEPS)]
    steps[1][0][:, 0] = 4  # one row in every bag of every rank
    return init, steps


def _train(module, steps, part, device):
    """Forward + backward of this rank's bags of each step; returns the outputs."""
    outs = []
    for idx, grad_out in steps:
        idx, grad_out = torch.from_numpy(idx[part]), torch.from_numpy(grad_out[part])
        out = module(idx.to(device))
        out.backward(grad_out.to(device))
        outs.append(out.detach().cpu().numpy())
    return outs


def _snapshot(table):
    return {"weights": np.array(table.numpy()),
            **{f"state.{n}": np.array(table.state(n)) for n in table.state_names()}}


def _maps_named(name):
    with open("/proc/self/maps") as f:
        return [line for line in f if name in line]


def _worker(rank, world, port, out_dir, backend, checks):
    device = join(rank, world, port, backend)
    init, steps = _data(7)
    part = slice(rank * BAGS // world, (rank + 1) * BAGS // world)
    result = {}
    for name, hyper in OPTIMIZERS:
        bag = HostEmbeddingBag(ROWS, DIM, mode="sum", optimizer=name, optimizer_kwargs=hyper,
                               device=device, init=init.copy())
        assert bag.process_group is not None
        outs = _train(bag, steps, part, device)
        for k, out in enumerate(outs):
            result[f"{name}.out{k}"] = out
        if rank == 0:
            result.update({f"{name}.{k}": v for k, v in _snapshot(bag.table).items()})
        bag.table.close()
    if checks:
        _extra_checks(rank, world, device, init, steps, part, result)
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **result)
    leave_process_group()


def _extra_checks(rank, world, device, init, steps, part, result):
    # HostEmbedding with a padding row, and a rank with an empty batch in one step.
    emb = HostEmbedding(ROWS, DIM, optimizer="adagrad", optimizer_kwargs={"lr": 0.5},
                        padding_idx=2, device=device, init=init.copy())
    for k, (idx, grad_out) in enumerate(steps):
        mine, g = idx[part], np.repeat(grad_out[part][:, None], BAG, 1)
        if k == 1 and rank == world - 1:
            mine, g = mine[:0], g[:0]
        out = emb(torch.from_numpy(mine).to(device))
        out.backward(torch.from_numpy(g).to(device))
    if rank == 0:
        result.update({f"emb.{k}": v for k, v in _snapshot(emb.table).items()})

    # A bad index on the last rank: IndexError on every rank, nothing changed.
    before = _snapshot(emb.table)
    bad = np.array([[1, 2, 3]]) if rank != world - 1 else np.array([[1, ROWS, 3]])
    try:
        emb(torch.from_numpy(bad).to(device)).sum().backward()
        result["bad_index_error"] = np.array("")
    except IndexError as err:
        result["bad_index_error"] = np.array(str(err))
    if device.type == "cpu":  # float indices on the last rank: its forward refuses them
        bad = torch.tensor([[1.0, 2.0, 3.0]]) if rank == world - 1 else torch.tensor([[1, 2, 3]])
        try:
            emb(bad.to(device)).sum().backward()
            result["bad_dtype_error"] = np.array("")
        except TypeError as err:
            result["bad_dtype_error"] = np.array(str(err))
    after = _snapshot(emb.table)
    result["bad_index_unchanged"] = np.array(all(np.array_equal(before[k], after[k])
                                                 for k in before))

    # load_state_dict writes the shared table once (rank 0) and every rank sees it.
    fresh = HostEmbedding(ROWS, DIM, optimizer="adagrad", optimizer_kwargs={"lr": 0.5},
                          padding_idx=2, device=device)
    fresh.load_state_dict(emb.state_dict())
    _wait_for_fence(device)
    loaded = _snapshot(fresh.table)
    result["load_state_dict_ok"] = np.array(all(np.array_equal(after[k], loaded[k])
                                                for k in after))
    # A state dict the last rank alone refuses: every rank raises, nobody waits, the shared
    # table stays as it was.
    state = {k: v + 1 if k == "weight" else v for k, v in emb.state_dict().items()}
    if rank == world - 1:
        del state["weight"]
    try:
        fresh.load_state_dict(state)
        result["one_rank_refusal"] = np.array("")
    except RuntimeError as err:
        result["one_rank_refusal"] = np.array(str(err))
    _wait_for_fence(device)
    result["refusal_unchanged"] = np.array(all(
        np.array_equal(loaded[k], v) for k, v in _snapshot(fresh.table).items()))
    # A state array of another shape on rank 0 alone (the rank that writes): every rank
    # raises before the write (rank 0's restore raised while the others went on alone).
    state = {k: v + 1 for k, v in emb.state_dict().items()}
    if rank == 0:
        state["table_state.step"] = torch.zeros(ROWS + 1, dtype=state["table_state.step"].dtype)
    try:
        fresh.load_state_dict(state)
        result["state_shape_refusal"] = np.array("")
    except (RuntimeError, ValueError) as err:
        result["state_shape_refusal"] = np.array(str(err))
    _wait_for_fence(device)
    result["state_shape_unchanged"] = np.array(all(
        np.array_equal(loaded[k], v) for k, v in _snapshot(fresh.table).items()))
    fresh.table.close()

    # The name is unlinked once every rank has the table; close() unmaps it here.
    name = emb.table.shared_name
    result["name_gone"] = np.array(not os.path.exists(
        os.path.join(shared_memory_directory(), name)))
    result["mapped_before_close"] = np.array(bool(_maps_named(name)))
    emb.table.close()
    result["mapped_after_close"] = np.array(bool(_maps_named(name)))

    # Ranks that disagree on the table: ValueError on every rank, naming the field.
    try:
        HostEmbeddingBag(ROWS, DIM + (rank == 1), optimizer="sgd", device=device)
        result["mismatch_error"] = np.array("")
    except ValueError as err:
        result["mismatch_error"] = np.array(str(err))
    # A bad hyperparameter on one rank: every rank raises, none hangs.
    try:
        HostEmbeddingBag(ROWS, DIM, optimizer="sgd", device=device,
                         optimizer_kwargs={"lr": -1.0 if rank == 0 else 0.1})
        result["hyper_error"] = np.array("")
    except (ValueError, RuntimeError) as err:
        result["hyper_error"] = np.array(f"{type(err).__name__}: {err}")
    # process_group=None: a private table, no collectives.
    private = HostEmbeddingBag(ROWS, DIM, optimizer="sgd", device=device, process_group=None)
    result["private_has_no_group"] = np.array(private.process_group is None
                                              and private.table.shared_name is None)


def _wait_for_fence(device):
    """Wait on the host for the fence that ended load_state_dict.

    On NCCL the fence is an all_reduce that orders this rank's stream after rank 0's write
    (rank 0 issues it once ``restore`` has returned) but does not block the host. A rank
    whose table never ran a GPU lookup (``fresh`` here) reads it with ``table.numpy()``,
    which then synchronizes nothing, so it could read the rows before rank 0 had written
    them: the two-GPU run's one ``load_state_dict_ok`` failure (a race, gone when the test
    ran alone). Gloo's fence is a host barrier: nothing to wait for there."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _single_process(device="cpu"):
    """The same modules trained by one process on the global batches."""
    init, steps = _data(7)
    expected = {}
    for name, hyper in OPTIMIZERS:
        bag = HostEmbeddingBag(ROWS, DIM, mode="sum", optimizer=name, optimizer_kwargs=hyper,
                               device=device, init=init.copy(), process_group=None)
        outs = _train(bag, steps, slice(None), device)
        expected.update({f"{name}.out{k}": out for k, out in enumerate(outs)})
        expected.update({f"{name}.{k}": v for k, v in _snapshot(bag.table).items()})
    emb = HostEmbedding(ROWS, DIM, optimizer="adagrad", optimizer_kwargs={"lr": 0.5},
                        padding_idx=2, device=device, init=init.copy(), process_group=None)
    return expected, emb, steps


def _check_emb(world, emb, steps, got, device="cpu"):
    for k, (idx, grad_out) in enumerate(steps):
        g = np.repeat(grad_out[:, None], BAG, 1)
        if k == 1:  # the last rank's bags sat this step out
            keep = slice(0, (world - 1) * BAGS // world)
            idx, g = idx[keep], g[keep]
        emb(torch.from_numpy(idx).to(device)).backward(torch.from_numpy(g).to(device))
    for key, value in _snapshot(emb.table).items():
        np.testing.assert_allclose(got[f"emb.{key}"], value, rtol=1e-5, atol=1e-6,
                                   err_msg=f"HostEmbedding {key}")


def _compare(world, out_dir, expected, emb=None, steps=None, device="cpu"):
    results = [dict(np.load(os.path.join(out_dir, f"rank{r}.npz"))) for r in range(world)]
    for name, _ in OPTIMIZERS:
        for key in ["weights", *(k.split(".", 1)[1] for k in expected
                                 if k.startswith(f"{name}.state."))]:
            want, got = expected[f"{name}.{key}"], results[0][f"{name}.{key}"]
            if key == "state.step":
                np.testing.assert_array_equal(got, want, err_msg=f"{name} {key}")
            else:
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6,
                                           err_msg=f"{name} {key}")
        for k in range(STEPS):  # every rank's lookups saw every earlier update
            got = np.concatenate([results[r][f"{name}.out{k}"] for r in range(world)])
            np.testing.assert_allclose(got, expected[f"{name}.out{k}"], rtol=1e-5, atol=1e-5,
                                       err_msg=f"{name} outputs of step {k}")
    if emb is None:
        return
    _check_emb(world, emb, steps, results[0], device)
    for r, res in enumerate(results):
        assert "out of range" in str(res["bad_index_error"]), (r, res["bad_index_error"])
        assert bool(res["bad_index_unchanged"]), r
        assert bool(res["name_gone"]) and bool(res["mapped_before_close"]), r
        assert not bool(res["mapped_after_close"]), r
        assert "disagree" in str(res["mismatch_error"]) and "dim" in str(
            res["mismatch_error"]), (r, res["mismatch_error"])
        assert "learning rate" in str(res["hyper_error"]), (r, res["hyper_error"])
        assert bool(res["private_has_no_group"]), r
        assert bool(res["load_state_dict_ok"]), r
        assert bool(res["refusal_unchanged"]), r
        if "bad_dtype_error" in res:  # every rank raises, none waits in the backward
            assert ("int32 or int64" if r == len(results) - 1 else "rank") in str(
                res["bad_dtype_error"]), (r, res["bad_dtype_error"])
        assert ("Missing key" if r == len(results) - 1 else "another rank") in str(
            res["one_rank_refusal"]), (r, res["one_rank_refusal"])
        assert ("size mismatch for table_state.step" if r == 0 else "another rank") in str(
            res["state_shape_refusal"]), (r, res["state_shape_refusal"])
        assert bool(res["state_shape_unchanged"]), r
    assert "position 1" in str(results[-1]["bad_index_error"])  # the rank that had it


def _leftovers():
    return set(glob.glob(os.path.join(shared_memory_directory(), "xferlib-*")))


def _run(world, backend, tmp_path, checks):
    before = _leftovers()
    mp.spawn(_worker, args=(world, free_port(), str(tmp_path), backend, checks),
             nprocs=world, join=True)
    assert _leftovers() <= before, "shared memory left behind"


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                    reason="torch.distributed with gloo is not available")
@pytest.mark.slow  # spawns its ranks: about 10 s on two cores
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_equal_one_process_every_optimizer(tmp_path, world):
    _run(world, "gloo", tmp_path, checks=True)
    expected, emb, steps = _single_process()
    _compare(world, tmp_path, expected, emb, steps)


@pytest.mark.gpu
def test_two_gpus_nccl_equal_one_process_every_optimizer(tmp_path):
    require_two_gpus()
    _run(2, "nccl", tmp_path, checks=True)
    expected, emb, steps = _single_process("cuda")
    _compare(2, tmp_path, expected, emb, steps, "cuda")


def test_default_group_rule_without_distributed():
    """One process, torch.distributed not initialized: a private table, as before."""
    assert not dist.is_initialized()
    bag = HostEmbeddingBag(ROWS, DIM, optimizer="sgd", device="cpu")
    assert bag.process_group is None and bag.table.shared_name is None
    with pytest.raises(ValueError, match="process_group"):
        HostEmbeddingBag(ROWS, DIM, optimizer="sgd", device="cpu", process_group="world")
    with pytest.raises(ValueError, match="not initialized"):
        HostEmbeddingBag(ROWS, DIM, optimizer="sgd", device="cpu", process_group=object())
