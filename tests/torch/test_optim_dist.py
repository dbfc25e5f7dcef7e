"""Flat optimizers on several processes equal one process on the global batch.

For every flat optimizer, N ranks (gloo on the CPU with N = 2 and 3; NCCL on two GPUs) train
the same model on their part of each global batch, with global-norm clipping and a
save/restore in the middle, in four ways:

- ``ddp``: DistributedDataParallel + ``FlatX`` (torch-format checkpoint restored mid-run);
- ``ddp_view``: the same with ``gradient_as_bucket_view=True`` (DDP re-points ``.grad``);
- ``zero``: ``ShardedFlatX`` without DDP (reduce-scatter of the gradients), restored from
  each rank's own shard ``state_dict()``;
- ``zero_ddp``: DDP + ``ShardedFlatX(reduce_grads=False)``, restored from the
  ``consolidated_state_dict()`` broadcast to every rank;

and each must equal ``FlatX`` in one process on the whole batch. The consolidated state
must equal that reference's ``state_dict()``; a sharded rank holds 1/N of the state. One
spawn per group size runs every check (spawning is the slow part).
"""

import copy
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from xferlib.adapters.torch import optim as xo  # noqa: E402
from xferlib.adapters.torch import optim_sharded as xs  # noqa: E402
from xferlib.adapters.torch import leave_process_group  # noqa: E402
from tests.torch.dist_helpers import free_port, join, require_two_gpus  # noqa: E402

CASES = {
    "sgd": dict(lr=0.05, momentum=0.9, weight_decay=0.01),
    "adam": dict(lr=1e-2, amsgrad=True, weight_decay=0.1),
    "adamw": dict(lr=1e-2, weight_decay=0.1),
    "adagrad": dict(lr=0.1, lr_decay=0.01),
    "rmsprop": dict(lr=1e-3, momentum=0.5, centered=True),
    "adamax": dict(lr=1e-2),
    "nadam": dict(lr=1e-2, weight_decay=0.01),
    "radam": dict(lr=1e-2, decoupled_weight_decay=True, weight_decay=0.1),
    "lion": dict(lr=1e-3),
}
FLAT = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW", "adagrad": "Adagrad",
        "rmsprop": "RMSprop", "adamax": "Adamax", "nadam": "NAdam", "radam": "RAdam",
        "lion": "Lion"}
MODES = ["ddp", "ddp_view", "zero", "zero_ddp"]
STEPS, RESTORE, BATCH, CLIP = 8, 4, 12, 0.3  # BATCH: split evenly over 2 and 3 ranks


def _classes(name):
    return getattr(xo, "Flat" + FLAT[name]), getattr(xs, "ShardedFlat" + FLAT[name])


def _model(device, dtype=torch.float32):
    # 91 + 13 + 65 + 5 elements: the slices of 2 and 3 ranks cut through tensors.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5))
    return model.to(device=device, dtype=dtype)


def _groups(model, lr):
    return [{"params": list(model[0].parameters())},
            {"params": list(model[2].parameters()), "lr": lr * 0.3}]


def _batches(device, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 7, generator=g).to(device, dtype),
             torch.randn(BATCH, 5, generator=g).to(device, dtype)) for _ in range(STEPS)]


def _flat_state(sd):
    """A state dict as one vector and its keys, for comparison."""
    parts, keys = [], []
    for k in sorted(sd["state"]):
        for n in sorted(sd["state"][k]):
            parts.append(sd["state"][k][n].detach().float().reshape(-1).cpu())
            keys.append(f"{k}.{n}")
    return torch.cat(parts).numpy(), np.array(keys)


def _params(model):
    return torch.cat([p.detach().float().reshape(-1).cpu() for p in model.parameters()]).numpy()


def _train(name, mode, rank, world, device, out, dtype=torch.float32):
    flat_cls, sharded_cls = _classes(name)
    kw = CASES[name]
    model = _model(device, dtype)
    ddp = mode in ("ddp", "ddp_view", "zero_ddp")
    net = model
    if ddp:
        net = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=None if device.type == "cpu" else [device.index],
            gradient_as_bucket_view=mode == "ddp_view")

    def build():
        if mode in ("ref", "ddp", "ddp_view"):
            return flat_cls(_groups(model, kw["lr"]), **kw)
        return sharded_cls(_groups(model, kw["lr"]), reduce_grads=mode == "zero", **kw)

    opt = build()
    per = BATCH // world
    rows = slice(None) if mode == "ref" else slice(rank * per, (rank + 1) * per)
    for step, (x, y) in enumerate(_batches(device, dtype)):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x[rows]), y[rows]).backward()
        if mode == "ddp":  # DDP wrote the averaged gradients into the flat buffer's views
            (bucket,) = opt._buckets
            aliased = all(p.grad is v for p, v in zip(bucket.params, bucket.grad_views))
            out[f"{name}/ddp_aliased"] = np.array(aliased and bool(out.get(
                f"{name}/ddp_aliased", True)))
        if step % 2 == 0:  # clipped and unclipped steps: clipping alone hides a wrong scale
            opt.clip_grad_norm_(CLIP)
        opt.step()
        if step + 1 != RESTORE:
            continue
        if mode == "ref":
            out[f"{name}/refstate"], out[f"{name}/refstate_keys"] = _flat_state(opt.state_dict())
            out[f"{name}/ref_bytes"] = np.array(opt.state_nbytes())
        elif mode in ("ddp", "ddp_view"):
            saved = opt.state_dict()
            opt = build()
            opt.load_state_dict(saved)
        elif mode == "zero":
            full = opt.consolidated_state_dict(to=0)
            if rank == 0:
                out[f"{name}/consolidated"], out[f"{name}/consolidated_keys"] = _flat_state(full)
            else:
                assert full is None
            out[f"{name}/zero_bytes"] = np.array(opt.state_nbytes())
            saved = opt.state_dict()
            opt = build()
            opt.load_state_dict(saved)
        else:  # zero_ddp: everyone restores from the consolidated checkpoint
            box = [opt.consolidated_state_dict(to=0)]
            dist.broadcast_object_list(box, src=0)
            opt = build()
            opt.load_state_dict(box[0])
    out[f"{name}/{mode}"] = _params(model)


class _Tiny(torch.nn.Module):
    """Three elements and an empty tensor: most ranks own only padding."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.lin = torch.nn.Linear(2, 1)
        self.empty = torch.nn.Parameter(torch.zeros(0))

    def forward(self, x):
        return self.lin(x) + self.empty.sum()


def _train_tiny(mode, rank, world, device, out):
    model = _Tiny().to(device)
    opt = (xo.FlatAdam if mode == "ref" else xs.ShardedFlatAdam)(model.parameters(), lr=0.1)
    per = BATCH // world
    rows = slice(None) if mode == "ref" else slice(rank * per, (rank + 1) * per)
    g = torch.Generator().manual_seed(2)
    for step in range(4):
        x = torch.randn(BATCH, 2, generator=g).to(device)
        opt.zero_grad()
        (model(x[rows]) ** 2).mean().backward()
        if step % 2:
            opt.clip_grad_norm_(0.1)
        opt.step()
    out[f"tiny/{mode}"] = _params(model)


def _worker(rank, world, backend, port, out_dir):
    device = join(rank, world, port, backend)
    out = {}
    for name in CASES:
        for mode in MODES:
            _train(name, mode, rank, world, device, out)
        if rank == 0:
            _train(name, "ref", rank, world, device, out)
    for mode in ("zero", "ref") if rank == 0 else ("zero",):
        _train_tiny(mode, rank, world, device, out)
    # 16-bit parameters: the float32 masters are sharded too.
    _train("adamw", "zero", rank, world, device, low := {}, torch.bfloat16)
    if rank == 0:
        _train("adamw", "ref", rank, world, device, low, torch.bfloat16)
    out.update({f"bf16/{k}": v for k, v in low.items()})
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **out)
    leave_process_group()


def _spawn(tmp_path_factory, backend, world):
    out_dir = tmp_path_factory.mktemp(f"{backend}{world}")
    mp.spawn(_worker, args=(world, backend, free_port(), str(out_dir)), nprocs=world,
             join=True)
    return [dict(np.load(out_dir / f"rank{r}.npz")) for r in range(world)]


@pytest.fixture(scope="module", params=[
    pytest.param(("gloo", 2), id="gloo2", marks=pytest.mark.slow),
    pytest.param(("gloo", 3), id="gloo3", marks=pytest.mark.slow),
    pytest.param(("nccl", 2), id="nccl2", marks=pytest.mark.gpu)])
def runs(request, tmp_path_factory):
    """``(world, per-rank results)`` of one spawn per backend and size, shared by the tests."""
    backend, world = request.param
    if backend == "gloo" and (not dist.is_available() or not dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    if backend == "nccl":
        require_two_gpus()
    return world, _spawn(tmp_path_factory, backend, world)


def _check_training(runs, name, mode, rtol=1e-5, atol=1e-6):
    world, ranks = runs
    if mode == "ddp":
        assert all(bool(r[f"{name}/ddp_aliased"]) for r in ranks), "DDP re-pointed .grad"
    expected = ranks[0][f"{name}/ref"]
    for rank in range(world):
        np.testing.assert_allclose(ranks[rank][f"{name}/{mode}"], expected, rtol=rtol,
                                   atol=atol, err_msg=f"{name} {mode} rank {rank} of {world}")


def _check_checkpoint(runs, name):
    world, ranks = runs
    first = ranks[0]
    np.testing.assert_array_equal(first[f"{name}/consolidated_keys"],
                                  first[f"{name}/refstate_keys"])
    np.testing.assert_allclose(first[f"{name}/consolidated"], first[f"{name}/refstate"],
                               rtol=1e-5, atol=1e-6)
    # State memory: each rank 1/N of the whole, up to the padding of the last slice.
    full = int(first[f"{name}/ref_bytes"])
    shares = [int(ranks[r][f"{name}/zero_bytes"]) for r in range(world)]
    assert len(set(shares)) == 1, shares
    assert full <= shares[0] * world <= full + world * xs._QUANTUM * 4 * 3, (full, shares)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_ranks_match_one_process(runs, name, mode):
    _check_training(runs, name, mode)


@pytest.mark.parametrize("name", list(CASES))
def test_consolidated_state_matches_and_state_is_sharded(runs, name):
    _check_checkpoint(runs, name)


def test_edge_and_bf16(runs):
    _check_training(runs, "tiny", "zero")
    _check_training(runs, "bf16/adamw", "zero", rtol=1e-2, atol=1e-2)


# -- one process: the slicing, the API and bad input (fast; no spawn) -------------------------


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_shard_layout_pieces_cover_every_element_once(world):
    from xferlib.optim import FlatLayout

    shapes = [(1,), (5,), (0,), (4097,), (3, 7), (2,), (0,)]
    layout = FlatLayout.from_shapes(shapes, groups=[0, 1, 0, 1, 0, 1, 0])
    need = max(layout.total, layout.segments[-1].offset + 1)
    total = -(-need // (world * xs._QUANTUM)) * world * xs._QUANTUM
    layout = FlatLayout(layout.segments, total, layout.dtype)
    seen = [np.zeros(s.size, dtype=int) for s in layout.segments]
    owners = [[] for _ in layout.segments]
    size = total // world
    for rank in range(world):
        local, index, ranges = xs._shard_layout(layout, rank * size, (rank + 1) * size)
        assert local.total == size
        for seg, i, (lo, hi) in zip(local.segments, index, ranges):
            assert seg.offset % 4 == 0 and seg.size == hi - lo and seg.group == \
                layout.segments[i].group
            # The piece sits where its elements sit in the whole buffer.
            assert rank * size + seg.offset == layout.segments[i].offset + lo or seg.size == 0
            seen[i][lo:hi] += 1
            owners[i].append(rank)
    for i, count in enumerate(seen):
        assert (count == 1).all(), (i, count)
        assert owners[i], f"segment {i} has no owner"


@pytest.fixture
def one_rank():
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_sharded_needs_an_initialized_group():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        xs.ShardedFlatAdam(_model(torch.device("cpu")).parameters())


def test_a_clip_without_a_step_leaves_no_stale_gradients(one_rank):
    """clip_grad_norm_ reduces the gradients; a step skipped after it (a non-finite norm,
    say) must not leave them for the next step: zero_grad and a new backward forget them."""
    results = []
    for cls in (torch.optim.SGD, xs.ShardedFlatSGD):
        w = torch.nn.Parameter(torch.zeros(4))
        opt = cls([w], lr=1.0)
        for skip_zero_grad in (False, True):
            if not skip_zero_grad:
                opt.zero_grad()
            (w * 1.0).sum().backward()
            if cls is torch.optim.SGD:
                torch.nn.utils.clip_grad_norm_([w], 100.0)
            else:
                opt.clip_grad_norm_(100.0)
            opt.zero_grad()  # the step skipped
        (w * 5.0).sum().backward()
        opt.step()
        results.append(w.detach().clone())
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)


@pytest.mark.parametrize("name", list(CASES))
def test_one_rank_equals_the_flat_optimizer(one_rank, name):
    flat_cls, sharded_cls = _classes(name)
    kw = CASES[name]
    device = torch.device("cpu")
    models = [_model(device), _model(device)]
    opts = [flat_cls(_groups(models[0], kw["lr"]), **kw),
            sharded_cls(_groups(models[1], kw["lr"]), **kw)]
    for step, (x, y) in enumerate(_batches(device)):
        for model, opt in zip(models, opts):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            if step % 2:
                opt.clip_grad_norm_(CLIP)
            opt.step()
    np.testing.assert_allclose(_params(models[1]), _params(models[0]), rtol=1e-5, atol=1e-6)
    full = opts[1].consolidated_state_dict()
    np.testing.assert_allclose(_flat_state(full)[0], _flat_state(opts[0].state_dict())[0],
                               rtol=1e-5, atol=1e-6)
    assert opts[1].state_nbytes() >= opts[0].state_nbytes()  # one rank: all of it, padded


def test_bad_input_is_rejected_before_anything_changes(one_rank):
    model = _model(torch.device("cpu"))
    with pytest.raises(ValueError, match="capturable"):
        xs.ShardedFlatAdamW(model.parameters(), capturable=True)
    opt = xs.ShardedFlatAdamW(model.parameters(), lr=1e-2)
    x, y = _batches(torch.device("cpu"))[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    with pytest.raises(ValueError, match="fused"):
        opt.clip_grad_norm_(1.0, fused=True)
    with pytest.raises(ValueError, match="to=1"):
        opt.consolidated_state_dict(to=1)
    good = opt.state_dict()
    before = _flat_state(good)[0]
    for bad, match in [
        ({**good, "shard": {**good["shard"], "world_size": 2}}, "rank 0 of 2"),
        ({**good, "shard": {**good["shard"], "ranges": {**good["shard"]["ranges"],
                                                        0: (0, 3)}}}, "piece"),
        ({**good, "param_groups": [{**good["param_groups"][0], "lr": 5.0}],
          "state": {**good["state"], 1: {**good["state"][1],
                                         "exp_avg": torch.zeros(2)}}}, "exp_avg"),
    ]:
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(bad)
        assert opt.param_groups[0]["lr"] == 1e-2
        np.testing.assert_array_equal(_flat_state(opt.state_dict())[0], before)
    full = opt.consolidated_state_dict()
    full["state"][0]["exp_avg_sq"] = torch.zeros(3)
    with pytest.raises(ValueError, match="exp_avg_sq"):
        opt.load_state_dict(full)
    np.testing.assert_array_equal(_flat_state(opt.state_dict())[0], before)


@pytest.mark.parametrize("name", ["adam", "nadam", "adagrad"])
def test_loading_a_checkpoint_without_a_parameters_state_starts_it_afresh(one_rank, name):
    """A sharded optimizer that has stepped, loaded from a checkpoint holding no state for
    its parameters (a fresh optimizer's consolidated one): their state starts afresh, as
    torch's does, not from the moments they had before the load."""
    flat_cls, sharded_cls = _classes(name)
    torch_cls = getattr(torch.optim, FLAT[name])
    kw = dict(CASES[name], initial_accumulator_value=0.5) if name == "adagrad" else CASES[name]
    x, y = _batches(torch.device("cpu"))[0]
    results = []
    for cls in (torch_cls, sharded_cls):
        model = _model(torch.device("cpu"))
        opt = cls(model.parameters(), **kw)
        fresh = (opt.consolidated_state_dict() if cls is sharded_cls
                 else copy.deepcopy(opt.state_dict()))  # torch's holds its live tensors
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        opt.load_state_dict(fresh)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        results.append(_params(model))
    np.testing.assert_allclose(results[1], results[0], rtol=1e-5, atol=1e-6)
