import numpy as np
import pytest

torch = pytest.importorskip("torch")

from xferlib.adapters.torch import ContiguousParams  # noqa: E402


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


@pytest.mark.parametrize("zero", ["optimizer", "model", "optimizer-keep", "model-keep"])
def test_zero_grad_variants_keep_training_like_torch(zero):
    ref, ours = _model(), _model()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    params = ContiguousParams(ours.parameters())
    opt = torch.optim.Adam(params.contiguous(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        x, y = torch.randn(16, 5, generator=g), torch.randn(16, 3, generator=g)
        for model, optimizer in ((ref, ref_opt), (ours, opt)):
            set_to_none = not zero.endswith("keep")
            if zero.startswith("optimizer"):
                optimizer.zero_grad(set_to_none=set_to_none)
            else:
                model.zero_grad(set_to_none=set_to_none)
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        params.assert_buffer_is_valid()
    for a, b in zip(ref.parameters(), ours.parameters()):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_params_live_in_one_buffer():
    model = _model()
    params = ContiguousParams(model.parameters())
    (flat,) = params.contiguous()
    base = flat.data_ptr()
    offset = 0
    for p in params.original():
        assert p.data_ptr() == base + 4 * offset
        offset += p.numel()
    model(torch.randn(2, 5)).sum().backward()
    np.testing.assert_array_equal(
        flat.grad.numpy(), np.concatenate([p.grad.reshape(-1).numpy()
                                           for p in params.original()]))


def test_invalidation_is_detected():
    model = _model()
    params = ContiguousParams(model.parameters())
    assert params.buffer_is_valid()
    model[0].weight.data = torch.zeros(8, 5)
    assert not params.buffer_is_valid()
    with pytest.raises(ValueError, match="replaced"):
        params.assert_buffer_is_valid()


def test_bad_input():
    with pytest.raises(ValueError, match="at least one"):
        ContiguousParams([])
    with pytest.raises(ValueError, match="one device and dtype"):
        ContiguousParams([torch.nn.Parameter(torch.zeros(2)),
                          torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))])
