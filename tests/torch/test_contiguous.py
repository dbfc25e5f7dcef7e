import copy

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


@pytest.mark.parametrize("zero", ["optimizer", "model", "optimizer-keep", "model-keep",
                                  "one-tensor"])
@pytest.mark.parametrize("optimizer_cls, kwargs", [("Adam", {"lr": 1e-2}),
                                                   ("SGD", {"lr": 1e-2, "momentum": 0.9}),
                                                   ("AdamW", {"lr": 1e-2, "weight_decay": 0.1})])
def test_zero_grad_variants_and_clipping_train_like_torch(device, zero, optimizer_cls, kwargs):
    """Every zero_grad form (torch 2.x defaults to set_to_none=True; "one-tensor": one
    parameter in the middle of the buffer set to None, as a layer's own zero_grad does) and
    gradient clipping through contiguous(): the model trains exactly as with its own
    parameters."""
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
            elif zero == "one-tensor":
                optimizer.zero_grad(set_to_none=False)
                model[2].weight.grad = None  # neither the buffer's first nor its last
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
    # A tensor, not a Parameter, not requiring grad (the original's torch.zeros buffer);
    # ops on it give plain tensors.
    assert isinstance(flat, torch.Tensor) and not isinstance(flat, nn.Parameter)
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
    # No per-parameter autograd hook: nothing runs per parameter in backward.
    assert all(not p._backward_hooks for p in given)
    assert all(not getattr(p, "_post_accumulate_grad_hooks", None) for p in given)


def test_zero_grad_keeps_the_buffer_attached_and_zeroed():
    """set_to_none=True on the flat buffer zeroes the gradient buffer in place (what the
    original needs set_to_none=False for), so views and pointers stay valid."""
    model = _model()
    params = ContiguousParams(model.parameters())
    opt = torch.optim.SGD(params.contiguous(), lr=0.1)
    model(torch.randn(4, 5)).sum().backward()
    (flat,) = params.contiguous()
    grad = flat.grad
    assert grad.abs().sum() > 0
    opt.zero_grad()
    assert flat.grad is grad and not grad.any()
    assert all(p.grad.data_ptr() == gp for p, gp in zip(model.parameters(), params.grad_pointers))
    flat.grad = torch.ones_like(grad)  # another tensor: its values are copied in
    assert flat.grad is grad and bool((grad == 1).all())
    with pytest.raises(ValueError, match="shape"):
        flat.grad = torch.ones(3)


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
