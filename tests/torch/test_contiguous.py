import copy
import gc
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from xferlib.adapters.torch import ContiguousParams  # noqa: E402
from xferlib.testing import GPU_SKIP_REASON  # noqa: E402

nn = torch.nn


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip(GPU_SKIP_REASON)
    return torch.device(request.param)


def _model(device="cpu", seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3)).to(device)


def _close(ref, ours, rtol=1e-5, atol=1e-6):
    for a, b in zip(ref.parameters(), ours.parameters()):
        np.testing.assert_allclose(a.detach().cpu().numpy(), b.detach().cpu().numpy(),
                                   rtol=rtol, atol=atol)


@pytest.mark.parametrize("zero", ["optimizer", "model", "optimizer-keep", "model-keep"])
@pytest.mark.parametrize("optimizer_cls, kwargs", [("Adam", {"lr": 1e-2}),
                                                   ("SGD", {"lr": 1e-2, "momentum": 0.9}),
                                                   ("AdamW", {"lr": 1e-2, "weight_decay": 0.1})])
def test_zero_grad_variants_and_clipping_train_like_torch(device, zero, optimizer_cls, kwargs):
    """Every zero_grad form (torch 2.x defaults to set_to_none=True) and gradient clipping
    through contiguous(): the model trains exactly as with its own parameters."""
    ref, ours = _model(device), _model(device)
    ref_opt = getattr(torch.optim, optimizer_cls)(ref.parameters(), **kwargs)
    params = ContiguousParams(ours.parameters())
    opt = getattr(torch.optim, optimizer_cls)(params.contiguous(), **kwargs)
    g = torch.Generator().manual_seed(0)
    set_to_none = not zero.endswith("keep")
    for _ in range(12):
        x, y = torch.randn(16, 5, generator=g), torch.randn(16, 3, generator=g)
        for model, optimizer, clip in ((ref, ref_opt, list(ref.parameters())),
                                       (ours, opt, params.contiguous())):
            if zero.startswith("optimizer"):
                optimizer.zero_grad(set_to_none=set_to_none)
            else:
                model.zero_grad(set_to_none=set_to_none)
            nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
            nn.utils.clip_grad_norm_(clip, 0.5)
            optimizer.step()
        params.assert_buffer_is_valid()
    _close(ref, ours)


def test_original_packages_own_test():
    """contiguous_params' own test: ten Linear(8, 8), SGD, five steps of backward, step,
    zero_grad() (set_to_none=True on torch 2.x, where the original stops training)."""
    x = torch.randn(1, 8)
    model_ref = nn.Sequential(*[nn.Linear(8, 8) for _ in range(10)])
    optimizer = torch.optim.SGD(model_ref.parameters(), lr=1e-3)
    model_c = copy.deepcopy(model_ref)
    parameters_c = ContiguousParams(model_c.parameters())
    optimizer_c = torch.optim.SGD(parameters_c.contiguous(), lr=1e-3)
    start = [p.detach().clone() for p in model_c.parameters()]
    for model, opt in ((model_ref, optimizer), (model_c, optimizer_c)):
        for _ in range(5):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    parameters_c.assert_buffer_is_valid()
    _close(model_ref, model_c, atol=1e-6)
    assert all(not torch.equal(a, b) for a, b in zip(start, model_c.parameters()))


def test_original_readme_example_runs_and_trains_like_torch():
    """The original README's loop with only the import changed."""
    data = torch.randn(5, 1, 8)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    ref = copy.deepcopy(model)
    parameters = ContiguousParams(model.parameters())
    optimizer = torch.optim.Adam(parameters.contiguous())
    ref_opt = torch.optim.Adam(ref.parameters())
    for x in data:
        loss = model(x).sum()
        loss.backward()
        nn.utils.clip_grad_norm_(parameters.contiguous(), 0.1)
        optimizer.step()
        optimizer.zero_grad()
        parameters.assert_buffer_is_valid()
        ref(x).sum().backward()
        nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        ref_opt.step()
        ref_opt.zero_grad()
    _close(ref, model)


def test_api_details_match_the_original():
    model = _model()
    given = list(model.parameters())
    params = ContiguousParams(iter(given))
    (flat,) = params.contiguous()
    # Exactly a torch.Tensor (the original's torch.zeros buffer), the type torch's foreach and
    # fused optimizer paths require; not a Parameter, not requiring grad.
    assert type(flat) is torch.Tensor and type(flat.grad) is torch.Tensor
    assert not flat.requires_grad and flat.is_leaf
    assert type(flat * 2) is torch.Tensor and type(flat[:3]) is torch.Tensor
    assert repr(flat).startswith("tensor(")
    assert flat.shape == (sum(p.numel() for p in given),)
    # original(): the parameters given, the same list object each call.
    assert params.original() is params.original()
    assert all(a is b for a, b in zip(params.original(), given))
    # data_pointers / grad_pointers: lists of each parameter's place in the buffers.
    assert params.data_pointers == [p.data_ptr() for p in given]
    assert params.grad_pointers == [p.grad.data_ptr() for p in given]
    offset = 0
    for p, dp, gp in zip(given, params.data_pointers, params.grad_pointers):
        assert dp == flat.data_ptr() + 4 * offset
        assert gp == flat.grad.data_ptr() + 4 * offset
        offset += p.numel()
    model(torch.randn(2, 5)).sum().backward()
    np.testing.assert_array_equal(
        flat.grad.numpy(), np.concatenate([p.grad.reshape(-1).numpy() for p in given]))


def test_set_to_none_then_backward_lands_fresh_gradients_in_the_same_buffer():
    """optimizer.zero_grad() (set_to_none=True) leaves the flat gradient None, as torch does;
    the next backward zeroes the gradient buffer before accumulating and re-attaches the same
    buffer, so it holds only the new gradients and every pointer stays valid."""
    model = _model()
    params = ContiguousParams(model.parameters())
    opt = torch.optim.SGD(params.contiguous(), lr=0.1)
    (flat,) = params.contiguous()
    grad = flat.grad
    model(torch.randn(4, 5)).sum().backward()
    assert grad.abs().sum() > 0
    opt.zero_grad()
    assert flat.grad is None
    x = torch.randn(4, 5)
    model(x).sum().backward()
    assert flat.grad is grad
    assert all(p.grad.data_ptr() == gp for p, gp in zip(model.parameters(), params.grad_pointers))
    fresh = _model()
    fresh.load_state_dict(model.state_dict())
    fresh(x).sum().backward()
    np.testing.assert_allclose(
        grad.numpy(), np.concatenate([p.grad.reshape(-1).numpy() for p in fresh.parameters()]),
        rtol=1e-6, atol=1e-7)


def test_an_assigned_flat_gradient_is_accumulated_onto():
    """Assigning another tensor to the flat gradient: the next backward adds onto its values,
    in the gradient buffer (as torch accumulates onto an assigned .grad)."""
    model = _model()
    params = ContiguousParams(model.parameters())
    (flat,) = params.contiguous()
    grad = flat.grad
    flat.grad = torch.ones_like(grad)
    x = torch.randn(3, 5)
    model(x).sum().backward()
    assert flat.grad is grad
    fresh = _model()
    fresh(x).sum().backward()
    expected = 1 + np.concatenate([p.grad.reshape(-1).numpy() for p in fresh.parameters()])
    np.testing.assert_allclose(grad.numpy(), expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("zero", ["optimizer", "model"])
def test_gradient_accumulation_over_micro_batches(device, zero):
    """zero_grad once, several backwards, one step: the sum of the micro-batch gradients."""
    ref, ours = _model(device), _model(device)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    params = ContiguousParams(ours.parameters())
    opt = torch.optim.Adam(params.contiguous(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        xs = [torch.randn(3, 5, generator=g).to(device) for _ in range(3)]
        for model, optimizer in ((ref, ref_opt), (ours, opt)):
            (optimizer if zero == "optimizer" else model).zero_grad()
            for x in xs:
                model(x).pow(2).sum().backward()
            optimizer.step()
    _close(ref, ours)


def test_step_after_set_to_none_without_backward_changes_nothing():
    """As for torch's own parameters: a parameter whose gradient is None is skipped."""
    model = _model()
    params = ContiguousParams(model.parameters())
    opt = torch.optim.Adam(params.contiguous(), lr=0.1)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    opt.zero_grad()
    before = params.contiguous()[0].clone()
    state = opt.state[params.contiguous()[0]]["exp_avg"].clone()
    opt.step()
    assert torch.equal(params.contiguous()[0], before)
    assert torch.equal(opt.state[params.contiguous()[0]]["exp_avg"], state)


def test_model_zero_grad_then_a_partial_backward():
    """model.zero_grad() (None per parameter), then a loss that reaches only the first layer:
    the first layer's gradients land in the buffer, the other layers' slices read zero (torch
    leaves them None; one flat tensor cannot, so plain SGD steps them by zero)."""
    ref, ours = _model(), _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    params = ContiguousParams(ours.parameters())
    opt = torch.optim.SGD(params.contiguous(), lr=0.1)
    x = torch.randn(4, 5)
    for model, optimizer in ((ref, ref_opt), (ours, opt)):
        model(x).sum().backward()
        optimizer.step()
        model.zero_grad()
        model[0](x).sum().backward()
        optimizer.step()
    _close(ref, ours)
    (flat,) = params.contiguous()
    first = ours[0].weight.numel() + ours[0].bias.numel()
    assert flat.grad[:first].abs().sum() > 0 and not flat.grad[first:].any()
    assert all(p.grad.data_ptr() == gp for p, gp in zip(ours.parameters(), params.grad_pointers))


def test_gradients_are_in_place_when_backward_returns():
    """Code that reads the optimizer's gradients right after backward (a gradient scaler's
    unscale_, clipping a list kept from the first contiguous() call) sees the new gradient."""
    ref, ours = _model(), _model()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    params = ContiguousParams(ours.parameters())
    kept = params.contiguous()
    opt = torch.optim.Adam(kept, lr=1e-2)
    g = torch.Generator().manual_seed(2)
    for _ in range(5):
        x = torch.randn(6, 5, generator=g)
        for model, optimizer in ((ref, ref_opt), (ours, opt)):
            model(x).sum().mul(64.0).backward()
            for group in optimizer.param_groups:  # what GradScaler.unscale_ does
                for p in group["params"]:
                    assert p.grad is not None
                    p.grad.mul_(1 / 64.0)
            nn.utils.clip_grad_norm_(kept if model is ours else list(ref.parameters()), 0.3)
            optimizer.step()
            optimizer.zero_grad()
    _close(ref, ours)


def test_the_optimizer_keeps_training_after_the_wrapper_is_dropped():
    ref, ours = _model(), _model()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = torch.optim.Adam(ContiguousParams(ours.parameters()).contiguous(), lr=1e-2)
    gc.collect()
    x = torch.randn(4, 5)
    for _ in range(3):
        for model, optimizer in ((ref, ref_opt), (ours, opt)):
            model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    _close(ref, ours)


def test_no_reference_cycle_keeps_the_buffers_alive():
    """Dropping the model, wrapper and optimizer frees the buffers by reference counting
    alone (GPU memory comes back at once, not at the next garbage collection)."""
    model = _model()
    params = ContiguousParams(model.parameters())
    opt = torch.optim.Adam(params.contiguous())
    model(torch.randn(2, 5)).sum().backward()
    opt.step()
    flat = weakref.ref(params.contiguous()[0])
    weight = weakref.ref(model[0].weight)
    gc.disable()
    try:
        del model, params, opt
        assert flat() is None and weight() is None
    finally:
        gc.enable()


def test_frozen_parameters_stay_put():
    model = _model()
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    params = ContiguousParams(model.parameters())
    opt = torch.optim.Adam(params.contiguous(), lr=0.1)
    for _ in range(3):
        model(torch.randn(4, 5)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert torch.equal(model[0].weight, frozen)
    assert not torch.equal(model[2].weight, _model()[2].weight)
    params.assert_buffer_is_valid()


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
def test_torch_adam_takes_its_multi_tensor_path_on_the_gpu(monkeypatch, fused):
    """The flat buffer is of the exact type torch.optim wants: Adam's default foreach path and
    fused=True both run on it (a tensor subclass would drop to the per-tensor loop)."""
    if not torch.cuda.is_available():
        pytest.skip(GPU_SKIP_REASON)
    import torch.optim.adam as adam_module
    name = "_fused_adam" if fused else "_multi_tensor_adam"
    calls = []
    real = getattr(adam_module, name)

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(adam_module, name, spy)
    model = _model("cuda")
    params = ContiguousParams(model.parameters())
    opt = torch.optim.Adam(params.contiguous(), lr=1e-2, **({"fused": True} if fused else {}))
    model(torch.randn(4, 5, device="cuda")).sum().backward()
    nn.utils.clip_grad_norm_(params.contiguous(), 1.0)
    opt.step()
    assert calls == [1]


def test_the_flat_buffer_saves_and_copies_as_a_plain_tensor(tmp_path):
    model = _model()
    params = ContiguousParams(model.parameters())
    model(torch.randn(3, 5)).sum().backward()
    (flat,) = params.contiguous()
    torch.save(flat, tmp_path / "flat.pt")
    loaded = torch.load(tmp_path / "flat.pt")  # weights_only: plain tensors only
    assert type(loaded) is torch.Tensor and torch.equal(loaded, flat)
    twin = copy.deepcopy(flat)
    assert type(twin) is torch.Tensor and torch.equal(twin, flat)
    assert torch.equal(twin.grad, flat.grad) and twin.data_ptr() != flat.data_ptr()
    opt = torch.optim.Adam(params.contiguous())
    opt.step()
    opt_copy = copy.deepcopy(opt)
    assert type(opt_copy.param_groups[0]["params"][0]) is torch.Tensor


def test_replaced_parameter_grads_are_copied_back():
    model = _model()
    params = ContiguousParams(model.parameters())
    replacement = torch.full_like(model[0].bias, 3.0)
    model[0].bias.grad = replacement
    assert params.buffer_is_valid()
    assert model[0].bias.grad is not replacement
    assert model[0].bias.grad.data_ptr() == params.grad_pointers[1]
    assert bool((model[0].bias.grad == 3).all())


def test_invalidation_is_detected():
    """The original's own invalidation test: replacing a parameter's .data."""
    model = nn.Linear(8, 8)
    params = ContiguousParams(model.parameters())
    assert params.buffer_is_valid()
    model.weight.data = model.weight + 4
    assert not params.buffer_is_valid()
    with pytest.raises(ValueError, match="parameter 0"):
        params.assert_buffer_is_valid()


def test_bad_input():
    with pytest.raises(ValueError, match="at least one"):
        ContiguousParams([])
    with pytest.raises(ValueError, match="dtype"):
        ContiguousParams([nn.Parameter(torch.zeros(2)),
                          nn.Parameter(torch.zeros(2, dtype=torch.float64))])
    with pytest.raises(TypeError, match=r"parameters\[1\]"):
        ContiguousParams([nn.Parameter(torch.zeros(2)), np.zeros(2)])
    shared = nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match=r"parameters\[2\] is parameters\[0\]"):
        ContiguousParams([shared, nn.Parameter(torch.zeros(2)), shared])
    assert shared.data_ptr() != 0 and shared.grad is None  # refused before any change


def test_the_original_package_is_wrong_under_set_to_none_and_we_are_not():
    """Where contiguous_params 1.0.0 is installed (the GPU benchmark machine): with torch 2.x's
    default zero_grad() it stops training after the first step; ContiguousParams does not."""
    original = pytest.importorskip("contiguous_params")
    x = torch.randn(4, 5)
    results = {}
    for name, cls in (("original", original.ContiguousParams), ("ours", ContiguousParams)):
        model = _model()
        params = cls(model.parameters())
        opt = torch.optim.SGD(params.contiguous(), lr=0.1)
        for _ in range(3):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        results[name] = [p.detach().clone() for p in model.parameters()]
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        ref(x).sum().backward()
        opt.step()
        opt.zero_grad()
    for a, b in zip(ref.parameters(), results["ours"]):
        torch.testing.assert_close(a.detach(), b)
    assert not all(torch.allclose(a.detach(), b) for a, b in zip(ref.parameters(),
                                                                 results["original"]))
