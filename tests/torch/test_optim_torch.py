"""Flat torch optimizers against torch.optim: training, checkpoints both ways, zero_grad
variants, skipped parameters, schedulers, GradScaler, bad input."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from xferlib.adapters import torch as xt  # noqa: E402

CASES = [
    (xt.FlatSGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    (xt.FlatSGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
    (xt.FlatAdam, torch.optim.Adam, dict(lr=1e-2)),
    (xt.FlatAdam, torch.optim.Adam, dict(lr=1e-2, amsgrad=True, weight_decay=0.1,
                                         maximize=True)),
    (xt.FlatAdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (xt.FlatAdagrad, torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.01)),
    (xt.FlatRMSprop, torch.optim.RMSprop, dict(lr=1e-3, momentum=0.5, centered=True)),
    (xt.FlatAdamax, torch.optim.Adamax, dict(lr=1e-2)),
    (xt.FlatNAdam, torch.optim.NAdam, dict(lr=1e-2, weight_decay=0.01)),
    (xt.FlatRAdam, torch.optim.RAdam, dict(lr=1e-2, decoupled_weight_decay=True,
                                           weight_decay=0.1)),
]
IDS = [f"{c[0].__name__}-{i}" for i, c in enumerate(CASES)]


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3),
                               torch.nn.Linear(3, 2))


def _groups(model, lr):
    layers = list(model)
    return [{"params": list(layers[0].parameters()) + list(layers[3].parameters())},
            {"params": list(layers[2].parameters()), "lr": lr * 0.3}]


def _train_step(model, opt, x, y, zero="optimizer", skip_last=False):
    if zero == "optimizer":
        opt.zero_grad()
    elif zero == "model":
        model.zero_grad()
    elif zero == "keep":
        opt.zero_grad(set_to_none=False)
    h = model[1](model[0](x))
    out = model[2](h)
    if not skip_last:
        out = model[3](out)
    loss = (out ** 2).mean() if skip_last else torch.nn.functional.mse_loss(out, y)
    loss.backward()
    opt.step()


def _assert_same(model_a, model_b, rtol=1e-6, atol=1e-6):
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        np.testing.assert_allclose(a.detach().cpu().numpy(), b.detach().cpu().numpy(),
                                   rtol=rtol, atol=atol)


@pytest.mark.parametrize("flat_cls,torch_cls,kw", CASES, ids=IDS)
def test_training_and_checkpoints_match_torch(flat_cls, torch_cls, kw):
    ref, ours = _model(), _model()
    ref_opt = torch_cls(_groups(ref, kw["lr"]), **kw)
    opt = flat_cls(_groups(ours, kw["lr"]), **kw)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)) for _ in range(100)]
    zero_modes = ["optimizer", "model", "keep"]
    for step, (x, y) in enumerate(data):
        zero = zero_modes[step % 3]
        skip = step % 7 == 3  # the last layer gets no gradient this step
        _train_step(ref, ref_opt, x, y, zero, skip)
        _train_step(ours, opt, x, y, zero, skip)
        if step == 40:  # our checkpoint into a fresh flat optimizer
            saved = copy.deepcopy(opt.state_dict())
            opt = flat_cls(_groups(ours, kw["lr"]), **kw)
            opt.load_state_dict(saved)
        if step == 60:  # torch's checkpoint into ours, ours into torch
            ref_saved = copy.deepcopy(ref_opt.state_dict())
            ours_saved = copy.deepcopy(opt.state_dict())
            opt = flat_cls(_groups(ours, kw["lr"]), **kw)
            opt.load_state_dict(ref_saved)
            ref_opt = torch_cls(_groups(ref, kw["lr"]), **kw)
            ref_opt.load_state_dict(ours_saved)
    _assert_same(ref, ours)


def test_lr_scheduler_drives_the_flat_optimizer():
    ref, ours = _model(), _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = xt.FlatAdamW(ours.parameters(), lr=1e-2)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=5, gamma=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    g = torch.Generator().manual_seed(2)
    for _ in range(30):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)
        _train_step(ref, ref_opt, x, y)
        _train_step(ours, opt, x, y)
        ref_sched.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(ref_opt.param_groups[0]["lr"])
    _assert_same(ref, ours)


def test_grad_scaler_skips_inf_steps_and_keeps_state():
    model = _model()
    opt = xt.FlatAdam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x, y = torch.randn(8, 6), torch.randn(8, 2)
    opt.zero_grad()
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    scaler.step(opt)
    scaler.update()
    before = [p.detach().clone() for p in model.parameters()]
    state_before = copy.deepcopy(opt.state_dict())
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    next(model.parameters()).grad[0, 0] = float("inf")
    scaler.step(opt)  # skipped: inf found
    scaler.update()
    for a, b in zip(before, model.parameters()):
        torch.testing.assert_close(a, b.detach())
    after = opt.state_dict()
    for k, entry in state_before["state"].items():
        for name, value in entry.items():
            torch.testing.assert_close(value, after["state"][k][name])


def test_replaced_parameter_is_detected():
    model = _model()
    opt = xt.FlatSGD(model.parameters(), lr=0.1)
    model[0].weight.data = torch.zeros(16, 6)
    model(torch.randn(2, 6)).sum().backward()
    with pytest.raises(RuntimeError, match="replaced or reshaped"):
        opt.step()


def test_reshaped_parameter_is_detected_at_checkpoints():
    model = _model()
    opt = xt.FlatSGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    model[0].weight.data = model[0].weight.data.view(6, 16)  # same bytes, new shape
    with pytest.raises(RuntimeError, match="replaced or reshaped"):
        opt.state_dict()


@pytest.mark.parametrize("cls,kw,match", [
    (xt.FlatAdam, dict(lr=-1.0), "Invalid learning rate"),
    (xt.FlatAdamW, dict(betas=(0.9, 1.0)), "beta parameter at index 1"),
    (xt.FlatSGD, dict(lr=0.1, nesterov=True), "Nesterov"),
])
def test_bad_hyperparameters(cls, kw, match):
    with pytest.raises(ValueError, match=match):
        cls(_model().parameters(), **kw)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):  # as torch
        cls(_model().parameters(), bogus=3)


def test_params_share_the_flat_buffer():
    model = _model()
    opt = xt.FlatAdam(model.parameters())
    (bucket,) = opt._buckets
    base = bucket.flat_params.data_ptr()
    for p, seg in zip(model.parameters(), bucket.layout.segments):
        assert p.data_ptr() == base + 4 * seg.offset
        assert p.data_ptr() % 16 == 0
    model(torch.randn(2, 6)).sum().backward()
    assert all(p.grad.data_ptr() == bucket.flat_grads.data_ptr() + 4 * s.offset
               for p, s in zip(model.parameters(), bucket.layout.segments))


def test_lion_trains_with_torch_names():
    model = _model()
    opt = xt.FlatLion(model.parameters(), lr=1e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)
    x, y = torch.randn(64, 6), torch.randn(64, 2)
    first = torch.nn.functional.mse_loss(model(x), y).item()
    for _ in range(50):
        _train_step(model, opt, x, y)
        sched.step()
    assert torch.nn.functional.mse_loss(model(x), y).item() < first


def _cuda_training_matches(flat_cls, torch_cls, kw, steps, restore_at, **extra):
    """Train twins on CUDA with every zero_grad variant and skipped layers, restoring our
    optimizer from its checkpoint once; torch's CUDA kernels fuse differently, hence the
    tolerance."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; none here")
    ref, ours = _model().cuda(), _model().cuda()
    ref_opt = torch_cls(_groups(ref, kw["lr"]), **extra, **kw)
    opt = flat_cls(_groups(ours, kw["lr"]), **extra, **kw)
    g = torch.Generator(device="cuda").manual_seed(1)
    for step in range(steps):
        x = torch.randn(8, 6, device="cuda", generator=g)
        y = torch.randn(8, 2, device="cuda", generator=g)
        _train_step(ref, ref_opt, x, y, ["optimizer", "model", "keep"][step % 3], step % 7 == 3)
        _train_step(ours, opt, x, y, ["optimizer", "model", "keep"][step % 3], step % 7 == 3)
        if step == restore_at:
            saved = copy.deepcopy(opt.state_dict())
            opt = flat_cls(_groups(ours, kw["lr"]), **extra, **kw)
            opt.load_state_dict(saved)
    _assert_same(ref, ours, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("flat_cls,torch_cls,kw", CASES, ids=IDS)
def test_cuda_training_matches_torch_cuda(flat_cls, torch_cls, kw):
    _cuda_training_matches(flat_cls, torch_cls, kw, steps=100, restore_at=50)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_norm_matches_torch(norm_type):
    ref, ours = _model(), _model()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = xt.FlatAdam(ours.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(3)
    for _ in range(10):
        x, y = 10 * torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)
        for model, optimizer in ((ref, ref_opt), (ours, opt)):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5, norm_type)
        norm = opt.clip_grad_norm_(0.5, norm_type)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-6)
        ref_opt.step()
        opt.step()
    _assert_same(ref, ours, rtol=1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_train_on_float32_masters(device, dtype):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; none here")
    model = _model().to(device=device, dtype=dtype)
    reference = _model().to(device)  # float32 twin fed the same low-precision gradients
    for p, q in zip(reference.parameters(), model.parameters()):
        p.data.copy_(q.detach().float())
    opt = xt.FlatAdam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(4)
    for step in range(20):
        x = torch.randn(8, 6, generator=g).to(device)
        opt.zero_grad()
        (model(x.to(dtype)) ** 2).mean().backward()
        for p, q in zip(reference.parameters(), model.parameters()):
            p.grad = q.grad.float().clone()
        ref_opt.step()
        opt.step()
        if step == 10:
            saved = copy.deepcopy(opt.state_dict())
            opt = xt.FlatAdam(model.parameters(), lr=1e-2)
            opt.load_state_dict(saved)
    (bucket,) = opt._buckets
    for p, q, seg in zip(reference.parameters(), model.parameters(), bucket.layout.segments):
        master = bucket.master[seg.offset:seg.offset + seg.size].view(seg.shape)
        np.testing.assert_allclose(master.cpu().numpy(), p.detach().cpu().numpy(),
                                   rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(q.detach(), master.to(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("flat_cls,torch_cls,kw", [
    (xt.FlatAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1)),
    (xt.FlatAdam, torch.optim.Adam, dict(lr=1e-2, amsgrad=True, maximize=True)),
    (xt.FlatAdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
])
def test_capturable_matches_torch_capturable(flat_cls, torch_cls, kw):
    _cuda_training_matches(flat_cls, torch_cls, kw, steps=60, restore_at=30, capturable=True)


@pytest.mark.gpu
def test_cuda_graph_replays_the_flat_step():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; none here")
    ref, ours = _model().cuda(), _model().cuda()
    x = torch.randn(8, 6, device="cuda")
    for model in (ref, ours):
        (model(x) ** 2).mean().backward()  # fixed gradients for every step
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, capturable=True)
    opt = xt.FlatAdam(ours.parameters(), lr=1e-2, capturable=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        opt.step()  # warm-up: compiles, uploads the mask and hyperparameters
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for _ in range(9):
        graph.replay()
    for _ in range(10):
        ref_opt.step()
    torch.cuda.synchronize()
    _assert_same(ref, ours, rtol=1e-4, atol=1e-5)
    (bucket,) = opt._buckets
    assert list(bucket.steps()) == [10] * len(bucket.params)


def test_capturable_needs_adam_and_cuda():
    with pytest.raises(ValueError, match="FlatAdam and FlatAdamW"):
        xt.FlatSGD(_model().parameters(), lr=0.1, capturable=True)
    with pytest.raises(ValueError, match="CUDA parameters"):
        xt.FlatAdam(_model().parameters(), capturable=True)


def test_gradients_computed_before_construction_are_kept():
    ref, ours = _model(), _model()
    x = torch.randn(8, 6)
    for model in (ref, ours):
        (model(x) ** 2).mean().backward()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = xt.FlatAdam(ours.parameters(), lr=1e-2)
    ref_opt.step()
    opt.step()
    _assert_same(ref, ours)


@pytest.mark.gpu
@pytest.mark.parametrize("flat_cls, torch_cls", [(xt.FlatAdam, torch.optim.Adam),
                                                 (xt.FlatAdamW, torch.optim.AdamW)])
def test_grad_scaler_unscales_and_skips_inside_the_kernel(flat_cls, torch_cls):
    """capturable=True: GradScaler passes grad_scale and found_inf to the step; the kernel
    unscales, and on an inf step leaves parameters, state and step counts untouched."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; none here")
    ref, ours = _model().cuda(), _model().cuda()
    ref_opt = torch_cls(ref.parameters(), lr=1e-2)
    opt = flat_cls(ours.parameters(), lr=1e-2, capturable=True)
    assert opt._step_supports_amp_scaling
    scalers = [torch.amp.GradScaler("cuda", init_scale=2.0 ** 12) for _ in range(2)]
    x, y = torch.randn(8, 6, device="cuda"), torch.randn(8, 2, device="cuda")
    for step in range(8):
        for model, o, scaler in ((ref, ref_opt, scalers[0]), (ours, opt, scalers[1])):
            o.zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            if step == 3:  # an overflow: the step is skipped and the scale backs off
                next(model.parameters()).grad[0, 0] = float("inf")
            scaler.step(o)
            scaler.update()
        if step == 3:
            (bucket,) = opt._buckets
            assert list(bucket.steps()) == [3] * len(bucket.params)
    assert scalers[0].get_scale() == scalers[1].get_scale()
    _assert_same(ref, ours, rtol=1e-5, atol=1e-6)
    (bucket,) = opt._buckets
    assert list(bucket.steps()) == [7] * len(bucket.params)


@pytest.mark.gpu
def test_fused_clipping_matches_torch_clip_grad_norm():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; none here")
    ref, ours = _model().cuda(), _model().cuda()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = xt.FlatAdam(ours.parameters(), lr=1e-2, capturable=True)
    x, y = torch.randn(8, 6, device="cuda"), torch.randn(8, 2, device="cuda")
    for _ in range(6):
        for model, o in ((ref, ref_opt), (ours, opt)):
            o.zero_grad()
            (100 * torch.nn.functional.mse_loss(model(x), y)).backward()
        expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        total = opt.clip_grad_norm_(0.5, fused=True)
        torch.testing.assert_close(total.reshape(()), expected, rtol=1e-5, atol=1e-6)
        ref_opt.step()
        opt.step()  # the factor is applied inside the update kernel
    _assert_same(ref, ours, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="capturable"):
        xt.FlatAdam(_model().parameters()).clip_grad_norm_(1.0, fused=True)


@pytest.mark.gpu
def test_eager_steps_running_ahead_of_the_gpu_match_torch():
    """Eager steps queued far ahead of the GPU (no synchronization between them): each step's
    scalar table has its own staging slot, so a slot the GPU has yet to read is never
    overwritten, however far ahead the host runs (past the ring's 256 slots too); a learning
    rate changed between steps reaches exactly the steps after it. The result is the same,
    bit for bit, as steps each waited for, and follows torch's Adam."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; none here")
    g = torch.Generator(device="cuda").manual_seed(5)
    shapes = [(1024, 1024), (1000,), (3, 5)] * 4  # large enough that the GPU lags the host
    grads = [[torch.randn(s, device="cuda", generator=g) for s in shapes] for _ in range(3)]
    init = [torch.randn(s, device="cuda", generator=g) for s in shapes]

    def train(make, wait):
        params = [torch.nn.Parameter(t.clone()) for t in init]
        for p in params:
            p.grad = torch.zeros_like(p)  # gradients exist before the optimizer is built
        optimizer = make(params, lr=1e-2, weight_decay=0.01)
        torch.cuda.synchronize()
        for step in range(300):
            for p, grad in zip(params, grads[step % 3]):
                p.grad.copy_(grad)  # in place: the flat optimizer's fast path
            if step == 150:
                optimizer.param_groups[0]["lr"] = 3e-3
            optimizer.step()
            if wait:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        return params, optimizer

    ahead, opt = train(xt.FlatAdam, wait=False)
    waited, _ = train(xt.FlatAdam, wait=True)
    ref, _ = train(torch.optim.Adam, wait=False)
    for a, b, r in zip(ahead, waited, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, r, rtol=1e-3, atol=1e-4)
    (bucket,) = opt._buckets
    assert 1 <= bucket.cuda_step.ring.count <= 256
    assert list(bucket.steps()) == [300] * len(shapes)


def test_nadam_keeps_each_segments_mu_product():
    """Two parameters at one step count with different histories (each stepped alone, betas
    changed between): each keeps its own mu_product, as torch's NAdam does."""
    results = []
    for cls in (torch.optim.NAdam, xt.FlatNAdam):
        a, b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
        opt = cls([a, b], lr=0.1)
        opt.zero_grad()
        (a * 2).sum().backward()
        opt.step()
        opt.param_groups[0]["betas"] = (0.5, 0.999)
        opt.zero_grad()
        (b * 2).sum().backward()
        opt.step()
        opt.zero_grad()
        ((a + b) * 2).sum().backward()
        opt.step()
        results.append(torch.cat([a.detach(), b.detach()]))
    torch.testing.assert_close(results[1], results[0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_frozen_parameters_groups_and_state_made_later(device):
    """A frozen parameter is accepted and never steps; add_param_group after construction is
    refused before anything is added; state the hyperparameters need later (a scheduler
    turning momentum on, a checkpoint of an amsgrad run) starts from zero, as in torch."""
    model = torch.nn.Linear(3, 2).to(device)
    model.bias.requires_grad_(False)
    opt = xt.FlatAdamW(model.parameters(), lr=0.1)
    bias = model.bias.detach().clone()
    model(torch.randn(4, 3, device=device)).sum().backward()
    opt.step()
    torch.testing.assert_close(model.bias.detach(), bias, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="when it is built"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2, device=device))]})
    assert len(opt.param_groups) == 1
    x = torch.randn(4, 3, device=device)
    torch.manual_seed(0)
    ref_model = torch.nn.Linear(3, 2).to(device)
    model = copy.deepcopy(ref_model)
    ref, ours = torch.optim.SGD(ref_model.parameters(), lr=0.1), xt.FlatSGD(model.parameters(),
                                                                          lr=0.1)
    scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=10)
              for o in (ref, ours)]  # momentum 0 -> 0.95: a momentum buffer from now on
    for _ in range(4):
        for m, o, s in ((ref_model, ref, scheds[0]), (model, ours, scheds[1])):
            o.zero_grad()
            m(x).pow(2).sum().backward()
            o.step()
            s.step()
    torch.testing.assert_close(model.weight, ref_model.weight, rtol=1e-5, atol=1e-6)
    source = torch.nn.Linear(3, 2).to(device)
    amsgrad = torch.optim.Adam(source.parameters(), lr=0.1, amsgrad=True)
    source(x).sum().backward()
    amsgrad.step()
    models = [copy.deepcopy(source) for _ in range(2)]
    opts = [torch.optim.Adam(models[0].parameters()), xt.FlatAdam(models[1].parameters())]
    for m, o in zip(models, opts):
        o.load_state_dict(copy.deepcopy(amsgrad.state_dict()))
        m(x).pow(2).sum().backward()
        o.step()
    torch.testing.assert_close(models[1].weight, models[0].weight, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("flat_cls,torch_cls,kw", [
    (xt.FlatAdam, torch.optim.Adam, dict(lr=0.1)),
    (xt.FlatNAdam, torch.optim.NAdam, dict(lr=0.1)),
    (xt.FlatAdagrad, torch.optim.Adagrad, dict(lr=0.1, initial_accumulator_value=0.5)),
])
def test_loading_a_checkpoint_without_a_parameters_state_starts_it_afresh(flat_cls, torch_cls,
                                                                          kw):
    """Loading into an optimizer that has stepped: a parameter the checkpoint holds no state
    for starts from fresh state (zero moments, mu_product 1, Adagrad's initial sum), as in
    torch, not from the moments it had before the load."""
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(6))
    results = []
    for cls in (torch_cls, flat_cls):
        model = _model()
        opt = cls(model.parameters(), **kw)
        fresh = copy.deepcopy(opt.state_dict())
        for _ in range(3):
            opt.zero_grad()
            (model(x) ** 2).mean().backward()
            opt.step()
        opt.load_state_dict(fresh)
        opt.zero_grad()
        (model(x) ** 2).mean().backward()
        opt.step()
        results.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-6)


def test_a_checkpoint_of_other_shapes_is_refused_before_anything_changes():
    model = _model()
    opt = xt.FlatAdam(model.parameters(), lr=0.1)
    (model(torch.randn(4, 6)) ** 2).mean().backward()
    opt.step()
    before = copy.deepcopy(opt.state_dict())
    bad = copy.deepcopy(before)
    bad["param_groups"][0]["lr"] = 5.0
    bad["state"][1]["exp_avg"] = torch.zeros(2)  # parameter 1 has 16 elements
    with pytest.raises(ValueError, match="exp_avg"):
        opt.load_state_dict(bad)
    assert opt.param_groups[0]["lr"] == 0.1
    after = opt.state_dict()
    for k, entry in before["state"].items():
        for name, value in entry.items():
            torch.testing.assert_close(after["state"][k][name], value, rtol=0, atol=0)


@pytest.mark.parametrize("make", [
    lambda params: xt.FlatAdamW(params),  # float32, then a float64 parameter
    lambda params: xt.FlatAdam(params[:1], capturable=True),  # CPU parameters
])
def test_a_refused_build_leaves_the_parameters_alone(make):
    """A build refused (TypeError, ValueError) leaves every parameter as it was: no .grad
    made for it, its storage not moved into a flat buffer (a torch optimizer built next
    would step zero gradients)."""
    w = torch.nn.Parameter(torch.ones(3, 2))
    b = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    ptr = w.data_ptr()
    with pytest.raises((TypeError, ValueError)):
        make([w, b])
    assert w.grad is None and w.data_ptr() == ptr


def test_zero_grad_keeping_tensors_after_model_zero_grad_follows_torch():
    """model.zero_grad() (.grad None) then optimizer.zero_grad(set_to_none=False): torch has
    nothing to zero, so a parameter no backward reaches stays without a gradient and is not
    stepped; an assigned gradient is zeroed and steps (weight decay moves it)."""
    x = torch.randn(5, 6)
    results = []
    for cls in (torch.optim.AdamW, xt.FlatAdamW):
        model = _model()
        opt = cls(model.parameters(), lr=0.1)
        (model(x) ** 2).mean().backward()
        opt.step()
        model.zero_grad()
        model[3].bias.grad = torch.ones(2)  # assigned: torch zeroes it and steps it
        opt.zero_grad(set_to_none=False)
        (model[0](x) ** 2).mean().backward()  # only the first layer gets a gradient
        opt.step()
        results.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    torch.testing.assert_close(results[1], results[0], rtol=1e-6, atol=1e-7)


def test_sgd_momentum_turned_on_later_starts_from_the_gradient():
    """torch's first step with a momentum buffer copies the gradient (no dampening), also
    when momentum is turned on after steps without it."""
    x = torch.randn(5, 6)
    results = []
    for cls in (torch.optim.SGD, xt.FlatSGD):
        model = _model()
        opt = cls(model.parameters(), lr=0.1, dampening=0.5)
        for step in range(4):
            if step == 2:
                opt.param_groups[0]["momentum"] = 0.9
            opt.zero_grad()
            (model(x) ** 2).mean().backward()
            opt.step()
        results.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    torch.testing.assert_close(results[1], results[0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("norm_type", [0.0, -1.0, float("-inf"), float("nan")])
def test_clip_grad_norm_refuses_norm_types_that_are_no_norms(norm_type):
    model = _model()
    opt = xt.FlatAdam(model.parameters())
    (model(torch.randn(4, 6)) ** 2).mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="norm_type"):
        opt.clip_grad_norm_(1.0, norm_type)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
