"""EmbeddingBagCollection with tt tables: the module trains as the core collection (bit for
bit on the CPU), state_dict round trips and moves keep the cores, their state and step
counters; on a GPU, the module trains as the CPU one, a bad batch changes nothing, and a
whole training step captured in a CUDA graph trains as eager steps."""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from xferlib.adapters.torch import EmbeddingBagCollection  # noqa: E402
from xferlib.collection import EmbeddingCollection  # noqa: E402
from xferlib.testing import GPU_SKIP_REASON  # noqa: E402
from tests.core.test_collection_tt import mixed_tables  # noqa: E402
from tests.torch.test_collection_torch import batch as batch_of  # noqa: E402
from tests.torch.capture_helpers import (  # noqa: E402
    fixed_length_batches, linear_head_step, replay_beside_eager)

ROWS, DIMS = (7, 60, 33, 20), (4, 6, 8, 4)


def tables():
    """hbm, tt (three cores), host, tt (two cores, its own learning rate)."""
    return mixed_tables(0.05)


def batch(rng, B, max_len=4, dtype=torch.int64):
    return batch_of(rng, B, ROWS, max_len, dtype)


def assert_same_state(a: dict, b: dict, **tol):
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(torch.as_tensor(a[key]), torch.as_tensor(b[key]),
                                   rtol=tol.get("rtol", 0), atol=tol.get("atol", 0), msg=key)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
def test_module_trains_as_the_core_collection(optimizer):
    rng = np.random.default_rng(3)
    module = EmbeddingBagCollection(tables(), optimizer, {"lr": 0.2}, pooling="mean",
                                    device="cpu", seed=5)
    coll = EmbeddingCollection(tables(), optimizer, {"lr": 0.2}, pooling="mean",
                               device="cpu", seed=5)
    for step in range(4):
        idx, off = batch(rng, 5, dtype=torch.int32 if step % 2 else torch.int64)
        psw = (torch.as_tensor(rng.uniform(0.5, 2, idx.numel()), dtype=torch.float32)
               if step == 3 else None)
        grad = torch.randn(5, sum(DIMS), generator=torch.Generator().manual_seed(step))
        if step == 2:  # the dict form
            B = 5
            features = {}
            for t, name in enumerate(module.names):
                lo, hi = int(off[t * B]), int(off[(t + 1) * B])
                features[name] = (idx[lo:hi], off[t * B:(t + 1) * B + 1] - lo)
            pooled = module(features)
        else:
            pooled = module(idx, off, psw)
        out, ctx = coll.forward(idx.numpy(), off.numpy(), None if psw is None else psw.numpy())
        np.testing.assert_array_equal(pooled.detach().numpy(), out)
        pooled.backward(grad)
        coll.backward(ctx, grad.numpy())
    assert_same_state({k[len("embedding_bags."):]: v for k, v in module.state_dict().items()},
                      coll.state_dict())
    assert module.collection.tt_table("ids").step == 4


def test_state_dict_round_trips_and_moves():
    rng = np.random.default_rng(4)
    module = EmbeddingBagCollection(tables(), "adagrad", {"lr": 0.1}, device="cpu", seed=1)
    idx, off = batch(rng, 4)
    module(idx, off).sum().backward()
    state = module.state_dict()
    assert "embedding_bags.ids.core2.sum" in state and "embedding_bags.ids.step" in state
    assert int(state["embedding_bags.small.step"][0]) == 1
    other = EmbeddingBagCollection(tables(), "adagrad", {"lr": 0.1}, device="cpu", seed=7)
    other.load_state_dict(state)
    assert_same_state(other.state_dict(), state)
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=False)
    copied = copy.deepcopy(module)
    doubled = copy.deepcopy(module).double()
    assert doubled.collection.dtype == np.float64
    for m in (restored, copied):
        assert_same_state(m.state_dict(), state)
    assert_same_state({k: v.to(state[k].dtype) for k, v in doubled.state_dict().items()},
                      state)  # float64 rows; the tt tables' arrays as they were
    idx, off = batch(rng, 4)
    want = module(idx, off).detach()
    torch.testing.assert_close(restored(idx, off).detach(), want, rtol=0, atol=0)
    torch.testing.assert_close(doubled(idx, off).detach().float(), want, rtol=1e-6, atol=1e-6)
    missing = {k: v for k, v in state.items() if k != "embedding_bags.ids.core1"}
    with pytest.raises(RuntimeError, match="embedding_bags.ids.core1"):
        other.load_state_dict(missing)


def _need_gpu():
    if not torch.cuda.is_available():
        pytest.skip(GPU_SKIP_REASON)
    pytest.importorskip("cupy")


@pytest.mark.gpu
def test_gpu_module_trains_as_the_cpu_module():
    """CUDA tensors take the GPU path (tt tables pooled and trained by their TT tables on
    torch's stream): as the NumPy path's outputs and tables; a bad index of a tt table, or
    of an hbm table beside the tt tables, raises from a later call and changes nothing (the
    tt tables' step counters included); .cpu() keeps the cores."""
    _need_gpu()
    rng = np.random.default_rng(9)
    cpu = EmbeddingBagCollection(tables(), "rowwise_adagrad", {"lr": 0.2}, device="cpu",
                                 seed=2)
    gpu = EmbeddingBagCollection(tables(), "rowwise_adagrad", {"lr": 0.2}, device="cuda",
                                 seed=2)
    for step in range(4):
        idx, off = batch(rng, B=7, dtype=torch.int32 if step % 2 else torch.int64)
        psw = torch.as_tensor(rng.uniform(0.5, 2, idx.numel()), dtype=torch.float32)
        grad = torch.randn(7, sum(DIMS), generator=torch.Generator().manual_seed(step))
        a = cpu(idx, off, psw)
        b = gpu(idx.cuda(), off.cuda(), psw.cuda())
        torch.testing.assert_close(b.cpu(), a.detach(), rtol=1e-5, atol=1e-5)
        a.backward(grad)
        b.backward(grad.cuda())
    gpu.check()
    assert_same_state(gpu.state_dict(), cpu.state_dict(), rtol=1e-4, atol=1e-5)
    moved = copy.deepcopy(gpu).cpu()
    assert_same_state(moved.state_dict(), gpu.state_dict())
    idx, off = batch(rng, B=3)
    lo = int(off[3])  # the first lookup of "ids"
    assert int(off[6]) > lo
    before = gpu.state_dict()
    for position, value, table in ((lo, 60, "ids"), (0, 7, "dense")):
        bad = idx.clone()
        bad[position] = value
        assert int(off[3]) > 0  # "dense" has lookups
        with pytest.raises(IndexError, match=f"index {value} at position {position} is out "
                                             f"of range for table '{table}'"):
            gpu(bad.cuda(), off.cuda()).sum().backward()
            gpu.check()
        after = gpu.state_dict()
        for key, value in before.items():
            torch.testing.assert_close(after[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.gpu
def test_training_step_replayed_from_a_cuda_graph_trains_as_eager_steps():
    """hbm, host and tt tables and a Linear: a training step captured in one CUDA graph after
    warm-up on a side stream, replayed on new batches, trains as the same steps run eagerly."""
    _need_gpu()

    def build():
        torch.manual_seed(0)
        ebc = EmbeddingBagCollection(tables(), "adagrad", {"lr": 0.05}, device="cuda", seed=3)
        dense = torch.nn.Linear(sum(DIMS), 1).cuda()
        return ebc, dense, torch.optim.SGD(dense.parameters(), lr=1e-2)

    offsets, batches = fixed_length_batches(ROWS, 16, 6)
    eager, graphed = replay_beside_eager(build, linear_head_step, batches, offsets)
    graphed[0].check()
    assert_same_state(graphed[0].state_dict(), eager[0].state_dict(), rtol=1e-5, atol=1e-6)
    assert graphed[0].collection.tt_table("ids").step == 6  # replays counted
