"""HostEmbeddingBag / HostEmbedding on the collection engine (``host_collection.py``): which
options run there, and the same steps as the HostTable engine (``cache_policy="lfu"`` on the
CPU runs a HostTable with no cache: the same math by the other engine) on awkward batches."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import xferlib  # noqa: E402
from xferlib.adapters.torch import HostEmbedding, HostEmbeddingBag  # noqa: E402
from xferlib.adapters.torch.host_collection import CollectionTable  # noqa: E402

ROWS, DIM = 23, 5


def test_which_options_run_on_the_collection():
    on = [HostEmbeddingBag(ROWS, DIM, device="cpu"),
          HostEmbeddingBag(ROWS, DIM, mode="mean", optimizer="sgd", device="cpu"),
          HostEmbedding(ROWS, DIM, optimizer="rowwise_adagrad", device="cpu")]
    off = [HostEmbeddingBag(ROWS, DIM, mode="max", device="cpu"),
           HostEmbeddingBag(ROWS, DIM, optimizer=None, device="cpu"),
           HostEmbeddingBag(ROWS, DIM, cache_policy="lfu", device="cpu"),
           HostEmbedding(ROWS, DIM, cache_policy="lfu", device="cpu")]
    assert all(isinstance(m.table, CollectionTable) for m in on)
    assert all(isinstance(m.table, xferlib.HostTable) for m in off)
    with pytest.raises(ValueError, match="cache_policy"):
        HostEmbeddingBag(ROWS, DIM, cache_policy="fifo", device="cpu")


def _batches(rng):
    """(call arguments, module options) of awkward batches: empty bags, an empty batch,
    repeated rows, per-sample weights, padding rows, 2-D input, include_last_offset."""
    idx = rng.integers(0, ROWS, 30)
    idx[[3, 4, 5]] = 7  # one row looked up thrice
    return [
        ((torch.from_numpy(idx), torch.tensor([0, 0, 4, 4, 17])), {}),
        ((torch.from_numpy(idx[:0]), torch.tensor([0, 0])), {}),
        ((torch.from_numpy(idx).int(), torch.tensor([0, 9, 9], dtype=torch.int32)),
         dict(mode="mean")),
        ((torch.from_numpy(idx), torch.tensor([0, 12])),
         dict(per_sample_weights=torch.from_numpy(rng.standard_normal(30).astype(np.float32)))),
        ((torch.from_numpy(idx.reshape(6, 5)), None), dict(mode="mean", padding_idx=7)),
        ((torch.from_numpy(idx[:4].reshape(4, 1)), None), {}),
        ((torch.from_numpy(idx), torch.tensor([0, 6, 30])),
         dict(include_last_offset=True, padding_idx=int(idx[0]))),
    ]


@pytest.mark.parametrize("optimizer, hyper", [("sgd", {"lr": 0.3, "momentum": 0.9}),
                                              ("adam", {"lr": 0.05}),
                                              ("rowwise_adagrad", {"lr": 0.2})])
def test_bags_train_as_the_host_table_engine(rng, optimizer, hyper):
    init = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    for (args, options) in _batches(rng):
        psw = options.pop("per_sample_weights", None)
        kw = dict(optimizer=optimizer, optimizer_kwargs=hyper, device="cpu", **options)
        ours = HostEmbeddingBag(ROWS, DIM, init=init.copy(), **kw)
        theirs = HostEmbeddingBag(ROWS, DIM, init=init.copy(), cache_policy="lfu", **kw)
        assert isinstance(ours.table, CollectionTable)
        for _ in range(3):
            extra = {} if psw is None else {"per_sample_weights": psw}
            out, expected = ours(*args, **extra), theirs(*args, **extra)
            torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
            g = torch.from_numpy(rng.standard_normal(out.shape).astype(np.float32))
            out.backward(g)
            expected.backward(g)
        np.testing.assert_allclose(ours.table.numpy(), theirs.table.numpy(), rtol=1e-5,
                                   atol=1e-6)
        for name in ours.table.state_names():
            np.testing.assert_allclose(ours.table.state(name), theirs.table.state(name),
                                       rtol=1e-5, atol=1e-6, err_msg=name)


def test_embedding_with_padding_trains_as_the_host_table_engine(rng):
    init = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    kw = dict(optimizer="adam", optimizer_kwargs={"lr": 0.1}, device="cpu", padding_idx=2)
    ours = HostEmbedding(ROWS, DIM, init=init.copy(), **kw)
    theirs = HostEmbedding(ROWS, DIM, init=init.copy(), cache_policy="lfu", **kw)
    assert not ours.table.numpy()[2].any()
    for _ in range(3):
        idx = torch.from_numpy(rng.integers(0, 4, (3, 4)))
        out, expected = ours(idx), theirs(idx)
        assert out.shape == (3, 4, DIM)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        g = torch.from_numpy(rng.standard_normal(out.shape).astype(np.float32))
        out.backward(g)
        expected.backward(g)
    np.testing.assert_allclose(ours.table.numpy(), theirs.table.numpy(), rtol=1e-5, atol=1e-6)
    assert not ours.table.numpy()[2].any() and ours.table.state("step")[2] == 0


def test_state_dicts_move_between_the_engines(rng):
    """The same keys and arrays: a checkpoint of one engine loads into the other."""
    kw = dict(optimizer="adam", optimizer_kwargs={"lr": 0.1}, device="cpu")
    ours = HostEmbeddingBag(ROWS, DIM, seed=1, **kw)
    ours(torch.tensor([1, 5, 5]), torch.tensor([0])).sum().backward()
    theirs = HostEmbeddingBag(ROWS, DIM, cache_policy="lfu", seed=2, **kw)
    theirs.load_state_dict(ours.state_dict())
    back = HostEmbeddingBag(ROWS, DIM, seed=3, **kw)
    back.load_state_dict(theirs.state_dict())
    for key, value in ours.state_dict().items():
        torch.testing.assert_close(back.state_dict()[key], value, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="size mismatch"):
        back.load_state_dict({**ours.state_dict(), "weight": torch.zeros(ROWS, DIM + 1)})
    for key, value in ours.state_dict().items():
        torch.testing.assert_close(back.state_dict()[key], value, rtol=0, atol=0)


def test_init_array_and_bad_calls_change_nothing(device, rng):
    init = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    bag = HostEmbeddingBag(ROWS, DIM, optimizer="sgd", device=device, init=init.copy())
    np.testing.assert_array_equal(bag.table.numpy(), init)
    with pytest.raises(ValueError, match="init array"):
        HostEmbeddingBag(ROWS, DIM, device=device, init=init[:, :2].copy())
    with pytest.raises(ValueError, match="offsets"):
        HostEmbeddingBag(ROWS, DIM, optimizer="sgd", device=device, padding_idx=0)(
            torch.tensor([1, 2], device=device), torch.tensor([0, 3], device=device))
    np.testing.assert_array_equal(bag.table.numpy(), init)


def test_table_view_follows_the_module(device, rng):
    """``table``: hyperparameters, partial restores and copies act on the module's table."""
    bag = HostEmbeddingBag(ROWS, DIM, optimizer="sgd", optimizer_kwargs={"lr": 1.0},
                           device=device, init="zeros")
    bag.table.set_hyper(lr=0.5)
    assert bag.table.hyper["lr"] == 0.5
    bag(torch.tensor([4], device=device), torch.tensor([0], device=device)).sum().backward()
    np.testing.assert_array_equal(bag.table.numpy()[4], np.full(DIM, -0.5, np.float32))
    import copy

    twin = copy.deepcopy(bag)
    twin(torch.tensor([4], device=device), torch.tensor([0], device=device)).sum().backward()
    assert twin.table.numpy()[4, 0] == -1.0 and bag.table.numpy()[4, 0] == -0.5
    assert "lookups" in bag.table.cache_stats()
    rows = np.array([4, 0, 4])
    np.testing.assert_array_equal(bag.table.lookup(rows), bag.table.numpy()[rows])
    bag.table.flush()


def test_cuda_graphs_replay_the_same_steps(device, rng):
    """``cuda_graphs=True``: the same outputs and tables bit for bit (graphs replay from
    each shape's second call on a GPU; ignored on the CPU); refused off the engine."""
    kw = dict(optimizer="adam", optimizer_kwargs={"lr": 0.05}, device=device, seed=4,
              cache_rows=6)
    plain, graphed = HostEmbeddingBag(ROWS, DIM, **kw), HostEmbeddingBag(ROWS, DIM,
                                                                          cuda_graphs=True, **kw)
    offsets = torch.tensor([0, 3, 3, 9], device=device)
    for _ in range(5):
        idx = torch.from_numpy(rng.integers(0, ROWS, 16)).to(device)
        out_p, out_g = plain(idx, offsets), graphed(idx, offsets)
        torch.testing.assert_close(out_g, out_p, rtol=0, atol=0)
        g = torch.randn(out_p.shape, device=device)
        out_p.backward(g)
        out_g.backward(g)
    np.testing.assert_array_equal(graphed.table.numpy(), plain.table.numpy())
    with pytest.raises(ValueError, match="cuda_graphs"):
        HostEmbeddingBag(ROWS, DIM, mode="max", device=device, cuda_graphs=True)


def test_per_sample_weights_that_learn_get_torchs_gradient(device, rng):
    """Weights that require grad: the same outputs, the same table update, and the gradient
    torch.nn.EmbeddingBag gives them (each: its bag's gradient dot its row as read)."""
    init = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    dense = torch.nn.EmbeddingBag(ROWS, DIM, mode="sum", padding_idx=4,
                                  _weight=torch.tensor(init))
    with torch.no_grad():
        dense.weight[4] = 0
    bag = HostEmbeddingBag(ROWS, DIM, optimizer="sgd", optimizer_kwargs={"lr": 0.5},
                           device=device, init=init.copy(), padding_idx=4)
    idx = torch.from_numpy(rng.integers(0, 8, 20))
    offsets = torch.tensor([0, 0, 7, 12])
    psw = torch.from_numpy(rng.standard_normal(20).astype(np.float32))
    ours_w = psw.clone().to(device).requires_grad_()
    theirs_w = psw.clone().requires_grad_()
    out = bag(idx.to(device), offsets.to(device), per_sample_weights=ours_w)
    expected = dense(idx, offsets, per_sample_weights=theirs_w)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-6, atol=1e-6)
    g = torch.from_numpy(rng.standard_normal(expected.shape).astype(np.float32))
    out.backward(g.to(device))
    expected.backward(g)
    torch.testing.assert_close(ours_w.grad.cpu(), theirs_w.grad, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        dense.weight -= 0.5 * dense.weight.grad
    np.testing.assert_allclose(bag.table.numpy(), dense.weight.detach().numpy(), rtol=1e-5,
                               atol=1e-6)
    before = np.array(bag.table.numpy())
    with pytest.raises(ValueError, match="offsets"):
        bag(idx.to(device), torch.tensor([0, 9, 7]).to(device), per_sample_weights=ours_w)
    bag.check()
    np.testing.assert_array_equal(bag.table.numpy(), before)
