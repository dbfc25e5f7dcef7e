import numpy as np
import pytest

torch = pytest.importorskip("torch")

import xferlib  # noqa: E402
from xferlib.adapters.torch import gather_rows  # noqa: E402
from xferlib.testing import assert_matches_reference  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu), pytest.param("pinned",
                                                                                marks=pytest.mark.gpu)]


def _placed(device, shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    host = torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
    if device == "cuda":
        return host.cuda(), "cuda"
    if device == "pinned":
        return host.pin_memory(), "cuda"  # host table, GPU indices: zero-copy gather
    return host, "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("device", DEVICES)
def test_forward_and_backward_match_reference(device, index_dtype, dtype):
    if device != "cpu" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; none here")
    table, idx_device = _placed(device, (37, 19), dtype)
    table.requires_grad_(True)
    idx = torch.randint(0, 37, (500,), dtype=index_dtype, device=idx_device)
    out = gather_rows(table, idx)
    assert out.device.type == idx_device and out.dtype == dtype
    host_table = table.detach().cpu().double().numpy()
    host_idx = idx.cpu().numpy()
    name = str(dtype).split(".")[1]
    assert_matches_reference(out.detach().cpu().double().numpy(), host_table[host_idx], name)
    g = torch.randn(out.shape, dtype=torch.float32, device=out.device).to(dtype)
    out.backward(g)
    expected = xferlib.scatter_add_rows_reference(np.zeros(host_table.shape), host_idx,
                                                  g.cpu().double().numpy())
    assert table.grad.shape == table.shape and table.grad.device == table.device
    assert_matches_reference(table.grad.cpu().double().numpy(), expected, name, scale=40)


def test_gradcheck_float64():
    table = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([0, 5, 5, 2, 0, 0])
    assert torch.autograd.gradcheck(lambda t: gather_rows(t, idx), (table,))


def test_matches_torch_indexing_in_a_model():
    torch.manual_seed(0)
    table = torch.randn(50, 8, requires_grad=True)
    ref = table.detach().clone().requires_grad_(True)
    idx = torch.randint(0, 50, (64,))
    w = torch.randn(8, 1)
    (gather_rows(table, idx) @ w).tanh().sum().backward()
    (ref[idx] @ w).tanh().sum().backward()
    torch.testing.assert_close(table.grad, ref.grad)


def test_bad_index_raises_index_error():
    table = torch.randn(10, 4, requires_grad=True)
    with pytest.raises(IndexError, match="index 10 at position 1"):
        gather_rows(table, torch.tensor([0, 10]))
    with pytest.raises(TypeError):
        gather_rows(table, [0, 1])


def test_empty_batch():
    table = torch.randn(10, 4, requires_grad=True)
    out = gather_rows(table, torch.zeros(0, dtype=torch.int64))
    assert out.shape == (0, 4)
    out.sum().backward()
    assert torch.count_nonzero(table.grad) == 0

