"""GradAllReduce: ranks' gradients summed in buckets during the backward equal the gradient
of the global batch computed in one process.

One spawn per backend runs every case (gloo: 2 CPU ranks; NCCL: two GPUs, the step also
captured in a CUDA graph and replayed on new batches); each rank saves what it got and the
one-process reference, the tests compare them.
"""

import contextlib
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from xferlib.adapters.torch import (FlatAdam, FlatSGD, GradAllReduce,  # noqa: E402
                                    leave_process_group)
from tests.torch.dist_helpers import free_port, join, require_two_gpus  # noqa: E402

WORLD, PER_RANK = 2, 5
TINY_MB = 600 / 2**20  # about 600 bytes a bucket: several buckets in the models below


def _model(device, unused=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 17), torch.nn.Tanh(), torch.nn.Linear(17, 9),
                                torch.nn.Tanh(), torch.nn.Linear(9, 3))
    if unused:  # a parameter the forward never reads
        model.register_parameter("spare", torch.nn.Parameter(torch.ones(4)))
    return model.to(device)


def _batch(step, rank, device):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(PER_RANK, 6, generator=g).to(device)


def _loss(model, x):
    return (model(x) ** 2).sum()


def _grads(model):
    return np.concatenate([(p.grad if p.grad is not None else torch.zeros_like(p))
                           .detach().cpu().numpy().ravel() for p in model.parameters()])


def _reference(device, batches, scale=1.0, unused=False):
    """The gradient of every rank's batches in one process."""
    model = _model(device, unused)
    sum(_loss(model, x) for x in batches).mul(scale).backward()
    return _grads(model)


def _cases(rank, device, out):
    everyone = [_batch(0, r, device) for r in range(WORLD)]
    mine = everyone[rank]

    # A flat optimizer's buffer, summed slice by slice; some buckets start in the backward.
    model = _model(device)
    opt = FlatSGD(model.parameters(), lr=0.1)
    sync = GradAllReduce(opt, bucket_mb=TINY_MB)
    _loss(model, mine).backward()
    out["flat_buckets"] = len(sync.buckets)
    out["flat_started_in_backward"] = sum(b.work is not None for b in sync.buckets)
    sync.wait()
    out["flat"], out["flat_ref"] = _grads(model), _reference(device, everyone)

    # Plain parameters, averaged (DDP's convention), one of them unused.
    model = _model(device, unused=True)
    sync = GradAllReduce(model.parameters(), bucket_mb=TINY_MB, op="mean")
    _loss(model, mine).backward()
    sync.wait()
    out["plain_mean"] = _grads(model)
    out["plain_mean_ref"] = _reference(device, everyone, 1 / WORLD, unused=True)

    # Accumulation: the first backward under no_sync, the second syncs both.
    later = [_batch(1, r, device) for r in range(WORLD)]
    model = _model(device)
    opt = FlatAdam(model.parameters(), lr=0.1)
    sync = GradAllReduce(opt, bucket_mb=TINY_MB)
    with sync.no_sync():
        _loss(model, mine).backward()
    assert all(b.work is None for b in sync.buckets)
    _loss(model, later[rank]).backward()
    sync.wait()
    out["accumulated"] = _grads(model)
    out["accumulated_ref"] = _reference(device, everyone + later)

    # Rank 0's loss skips the last layer's bias on purpose: its bucket (the first) starts
    # only at wait() there, after the later ones filled, and the buckets still pair up in
    # order across the ranks; a Flat* optimizer steps that bias on every rank (the other
    # ranks' gradient summed).
    for kind in ("plain", "flat"):
        model = _model(device)
        opt = FlatSGD(model.parameters(), lr=0.5)
        sync = GradAllReduce(opt if kind == "flat" else model.parameters(),
                             bucket_mb=TINY_MB)
        if kind == "plain":
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
        opt.zero_grad()
        skip = rank == 0
        z = model[3](model[2](model[1](model[0](mine))))
        ((z @ model[4].weight.T + (0 if skip else model[4].bias)) ** 2).sum().backward()
        sync.wait()
        opt.step()
        out[f"skip_{kind}"] = torch.cat([p.detach().reshape(-1)
                                         for p in model.parameters()]).cpu()
        ref = _model(device)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
        total = 0
        for r, x in enumerate(everyone):
            z = ref[3](ref[2](ref[1](ref[0](x))))
            total = total + ((z @ ref[4].weight.T + (0 if r == 0 else ref[4].bias)) ** 2).sum()
        total.backward()
        ref_opt.step()
        out[f"skip_{kind}_ref"] = torch.cat([p.detach().reshape(-1)
                                             for p in ref.parameters()]).cpu()

    # model.zero_grad() (torch's default: .grad None) before each backward: autograd makes
    # new .grad tensors outside the flat buffer; they are summed all the same (and a
    # parameter unused on this rank as zeros), over three steps.
    model = _model(device)
    opt = FlatSGD(model.parameters(), lr=0.1)
    sync = GradAllReduce(opt, bucket_mb=TINY_MB)
    ref = _model(device)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        batches = [_batch(step, r, device) for r in range(WORLD)]
        model.zero_grad()
        skip = rank == 0 and step == 1  # rank 0's loss skips the last bias this step
        z = model[3](model[2](model[1](model[0](batches[rank]))))
        ((z @ model[4].weight.T + (0 if skip else model[4].bias)) ** 2).sum().backward()
        sync.wait()
        opt.step()
        ref_opt.zero_grad()
        total = 0
        for r, x in enumerate(batches):
            z = ref[3](ref[2](ref[1](ref[0](x))))
            total = total + ((z @ ref[4].weight.T + (0 if r == 0 and step == 1
                                                       else ref[4].bias)) ** 2).sum()
        total.backward()
        ref_opt.step()
    out["model_zero_grad"] = torch.cat([p.detach().reshape(-1)
                                        for p in model.parameters()]).cpu()
    out["model_zero_grad_ref"] = torch.cat([p.detach().reshape(-1)
                                            for p in ref.parameters()]).cpu()

    # A second backward before wait() is refused (at wait, every rank alike), and so is one
    # under no_sync after a backward that synced (it would add into sums in flight).
    for name, quiet in (("second_backward_refused", False), ("no_sync_after_sync_refused",
                                                              True)):
        model = _model(device)
        sync = GradAllReduce(FlatSGD(model.parameters(), lr=0.1), bucket_mb=TINY_MB)
        _loss(model, mine).backward()
        with sync.no_sync() if quiet else contextlib.nullcontext():
            _loss(model, mine).backward()
        try:
            sync.wait()
            out[name] = False
        except RuntimeError as err:
            out[name] = "no_sync" in str(err)

    # A Flat* optimizer with a frozen parameter: the others summed and stepped, it never
    # (weight decay would move it).
    model = _model(device)
    model[0].bias.requires_grad_(False)
    frozen = model[0].bias.detach().clone()
    opt = FlatSGD(model.parameters(), lr=0.1, weight_decay=0.5)
    sync = GradAllReduce(opt, bucket_mb=TINY_MB)
    _loss(model, mine).backward()
    sync.wait()
    opt.step()
    out["frozen_unchanged"] = bool(torch.equal(model[0].bias.detach(), frozen))
    ref = _model(device)
    ref[0].bias.requires_grad_(False)
    sum(_loss(ref, x) for x in everyone).backward()
    torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1,
                    weight_decay=0.5).step()
    out["frozen"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    out["frozen_ref"] = torch.cat([p.detach().reshape(-1) for p in ref.parameters()]).cpu()


def _captured(rank, device, out):
    """NCCL: forward, backward, the bucketed sums and FlatAdam's step in one CUDA graph."""
    model = _model(device)
    opt = FlatAdam(model.parameters(), lr=0.01, capturable=True)
    sync = GradAllReduce(opt, bucket_mb=TINY_MB)
    ref_model = _model(device)
    ref_opt = FlatAdam(ref_model.parameters(), lr=0.01, capturable=True)
    static = _batch(0, rank, device)

    def step():
        opt.zero_grad(set_to_none=False)
        _loss(model, static).backward()
        sync.wait()
        opt.step()

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for s in range(2):  # warm-up steps, eager
            static.copy_(_batch(s, rank, device))
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for s in range(2, 5):
        static.copy_(_batch(s, rank, device))
        graph.replay()
    torch.cuda.synchronize(device)
    for s in range(5):  # the same five steps in one process on the global batches
        ref_opt.zero_grad(set_to_none=False)
        sum(_loss(ref_model, _batch(s, r, device)) for r in range(WORLD)).backward()
        ref_opt.step()
    out["captured"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    out["captured_ref"] = torch.cat([p.detach().reshape(-1)
                                     for p in ref_model.parameters()]).cpu()


def _worker(rank, backend, port, out_dir):
    device = join(rank, WORLD, port, backend)
    out = {}
    _cases(rank, device, out)
    if backend == "nccl":
        _captured(rank, device, out)
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **out)
    leave_process_group()


@pytest.fixture(scope="module", params=[
    pytest.param("gloo", marks=pytest.mark.slow),
    pytest.param("nccl", marks=pytest.mark.gpu)])
def ranks(request, tmp_path_factory):
    backend = request.param
    if backend == "gloo" and (not dist.is_available() or not dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    if backend == "nccl":
        require_two_gpus()
    out_dir = tmp_path_factory.mktemp(backend)
    mp.spawn(_worker, args=(backend, free_port(), str(out_dir)), nprocs=WORLD, join=True)
    return backend, [dict(np.load(out_dir / f"rank{r}.npz")) for r in range(WORLD)]


@pytest.mark.parametrize("case", ["flat", "plain_mean", "accumulated", "skip_plain",
                                  "skip_flat", "frozen", "model_zero_grad"])
def test_ranks_get_the_global_batchs_gradient(ranks, case):
    _, results = ranks
    for rank, got in enumerate(results):
        np.testing.assert_allclose(got[case], got[f"{case}_ref"], rtol=1e-5, atol=1e-6,
                                   err_msg=f"{case}, rank {rank}")


def test_buckets_start_during_the_backward(ranks):
    _, results = ranks
    for got in results:
        assert int(got["flat_buckets"]) > 2
        # every parameter gets its gradient in this backward: every bucket starts in it
        assert int(got["flat_started_in_backward"]) == int(got["flat_buckets"])


def test_a_second_backward_before_wait_is_refused(ranks):
    _, results = ranks
    assert all(bool(got["second_backward_refused"]) for got in results)
    assert all(bool(got["no_sync_after_sync_refused"]) for got in results)
    assert all(bool(got["frozen_unchanged"]) for got in results)


def test_captured_step_equals_one_process(ranks):
    backend, results = ranks
    if backend != "nccl":
        pytest.skip("CUDA graphs: the NCCL run")
    for got in results:
        np.testing.assert_allclose(got["captured"], got["captured_ref"], rtol=1e-5, atol=1e-6)


def test_one_process_and_bad_arguments():
    model = _model("cpu")
    sync = GradAllReduce(model.parameters(), process_group=None)
    _loss(model, _batch(0, 0, "cpu")).backward()
    before = _grads(model)
    sync.wait()  # one process: nothing to sum
    np.testing.assert_array_equal(_grads(model), before)
    with pytest.raises(ValueError, match="op"):
        GradAllReduce(model.parameters(), process_group=None, op="max")
    with pytest.raises(ValueError, match="bucket_mb"):
        GradAllReduce(model.parameters(), process_group=None, bucket_mb=0)
    sync.reset()  # nothing pending: a no-op
