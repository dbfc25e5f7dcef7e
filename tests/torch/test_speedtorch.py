import numpy as np
import pytest

torch = pytest.importorskip("torch")

import xferlib  # noqa: E402
from xferlib.adapters.torch import speedtorch as SpeedTorch  # noqa: E402
from xferlib.testing import GPU_SKIP_REASON  # noqa: E402

CLASSES, DIM, BATCH, POS, NEG = 30, 5, 4, 3, 2


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    if request.param == "cuda" and not (torch.cuda.is_available() and xferlib.cupy_available()):
        pytest.skip(GPU_SKIP_REASON)
    return torch.device(request.param)


class SkipGram(torch.nn.Module):
    """The shape of SpeedTorch's word2vec example: two embedding variables whose rows are
    switched in per batch, indexed by the dummy positions of variableTransformer."""

    def __init__(self, rows, device, sparse=False):
        super().__init__()
        self.u_embeddings = torch.nn.Embedding(rows, DIM, sparse=sparse).to(device)
        self.v_embeddings = torch.nn.Embedding(rows, DIM, sparse=sparse).to(device)

    def forward(self, pos_u, pos_v):
        score = (self.u_embeddings(pos_u) * self.v_embeddings(pos_v)).sum(-1)
        return torch.nn.functional.logsigmoid(score).sum()


def _dense_model(init_u, init_v):
    model = SkipGram(init_u.shape[0], "cpu")
    with torch.no_grad():
        model.u_embeddings.weight.copy_(torch.from_numpy(init_u))
        model.v_embeddings.weight.copy_(torch.from_numpy(init_v))
    return model


def _train(device, optimizer_cls, kwargs, batches, init_u, init_v, pinned):
    model = SkipGram(BATCH * POS, device)
    opt = getattr(torch.optim, optimizer_cls)(model.parameters(), **kwargs)
    switchers = []
    for name, init in (("u_embeddings", init_u), ("v_embeddings", init_v)):
        model_switcher = SpeedTorch.ModelFactory(getattr(model, name), init.shape[0], DIM,
                                                 CPUPinn=pinned)
        model_switcher.zerosInit()
        model_switcher._collection.place(init.copy())  # the test's initial rows
        opt_switcher = SpeedTorch.OptimizerFactory(opt, init.shape[0], DIM, model, name,
                                                   CPUPinn=pinned)
        opt_switcher.optInit()
        switchers.append((model_switcher, opt_switcher))
    dummy = model_switcher.variableTransformer(BATCH, POS)
    dummy = torch.from_numpy(dummy).to(device)
    for u_idx, v_idx in batches:
        for (ms, os_), idx in zip(switchers, (u_idx, v_idx)):
            ms.beforeForwardPass(idx)
            os_.beforeForwardPass(idx)
        opt.zero_grad()
        (-model(dummy, dummy)).backward()
        opt.step()
        for (ms, os_), idx in zip(switchers, (u_idx, v_idx)):
            ms.afterOptimizerStep(idx)
            os_.afterOptimizerStep(idx)
    return [ms.getNumpyVersion() for ms, _ in switchers]


def _dense(optimizer_cls, kwargs, batches, init_u, init_v):
    model = _dense_model(init_u, init_v)
    opt = getattr(torch.optim, optimizer_cls)(model.parameters(), **kwargs)
    for u_idx, v_idx in batches:
        opt.zero_grad()
        (-model(torch.from_numpy(u_idx), torch.from_numpy(v_idx))).backward()
        opt.step()
    return [model.u_embeddings.weight.detach().numpy(),
            model.v_embeddings.weight.detach().numpy()]


@pytest.mark.parametrize("pinned", [False, True])
def test_sgd_with_repeated_indexes_equals_dense_sgd(device, rng, pinned):
    """Repeated indexes within a batch: SpeedTorch keeps one copy's update; the shim's row
    gets the dense SGD step on the summed gradient."""
    init_u, init_v = (rng.standard_normal((CLASSES, DIM)).astype(np.float32) for _ in range(2))
    batches = [(rng.integers(0, 8, size=(BATCH, POS)), rng.integers(0, 8, size=(BATCH, POS)))
               for _ in range(4)]
    ours = _train(device, "SGD", {"lr": 0.1}, batches, init_u, init_v, pinned)
    dense = _dense("SGD", {"lr": 0.1}, batches, init_u, init_v)
    for a, b in zip(ours, dense):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer_cls, kwargs", [("Adam", {"lr": 0.05}),
                                                   ("Adamax", {"lr": 0.05}),
                                                   ("RMSprop", {"lr": 0.01, "momentum": 0.5}),
                                                   ("Adagrad", {"lr": 0.1})])
def test_every_optimizer_equals_dense_when_batches_cover_the_table(device, rng, optimizer_cls,
                                                                  kwargs):
    """Every row in every batch, two of them twice: the switched rows and optimizer state
    must reproduce dense training with the same torch optimizer."""
    classes = 10
    init_u, init_v = (rng.standard_normal((classes, DIM)).astype(np.float32) for _ in range(2))

    def cover():
        idx = np.concatenate([rng.permutation(classes), rng.integers(0, classes, 2)])
        return rng.permutation(idx).reshape(BATCH, POS)

    batches = [(cover(), cover()) for _ in range(4)]
    ours = _train(device, optimizer_cls, kwargs, batches, init_u, init_v, True)
    dense = _dense(optimizer_cls, kwargs, batches, init_u, init_v)
    for a, b in zip(ours, dense):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def test_data_gadget_and_save_load(device, rng, tmp_path):
    data = rng.standard_normal((50, 3, 2)).astype(np.float32)
    path = tmp_path / "data.npy"
    np.save(path, data)
    gadget = SpeedTorch.DataGadget(str(path), CPUPinn=True)
    gadget.gadgetInit()
    rows = gadget.getData(np.array([4, 4, 10]), np.array([1]))
    np.testing.assert_array_equal(rows.cpu().numpy(), data[[4, 4, 10, 1]])
    gadget.insertData(torch.zeros(2, 3, 2), np.array([0, 49]))
    assert not gadget.getNumpyVersion()[[0, 49]].any()
    with pytest.raises(IndexError, match="index 50"):
        gadget.getData(np.array([50]))

    model = SkipGram(4, device)
    switcher = SpeedTorch.ModelFactory(model.u_embeddings, 20, DIM)
    with pytest.raises(RuntimeError, match="init method"):
        switcher.beforeForwardPass(np.array([1]))
    switcher.uniformDistributionInit(-0.5, 0.5)
    values = switcher.getNumpyVersion()
    assert values.shape == (20, DIM) and values.min() >= -0.5 and values.max() <= 0.5
    switcher.saveCupy(tmp_path / "u.npy")
    other = SpeedTorch.ModelFactory(model.u_embeddings, 20, DIM)
    other.loadCupy(tmp_path / "u.npy")
    np.testing.assert_array_equal(other.getNumpyVersion(), values)
    other.normalDistributionInit(0.0, 1.0)
    assert other.getNumpyVersion().std() > 0.5
    pos, neg = other.variableTransformer(2, 3, 4)
    assert pos.tolist() == [[0, 1, 2], [3, 4, 5]] and neg[0].tolist() == [6, 7, 8, 9]


def test_optimizer_factory_errors(rng):
    model = SkipGram(4, "cpu")
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(ValueError, match="no parameter"):
        SpeedTorch.OptimizerFactory(opt, 10, DIM, model, "w_embeddings")
    factory = SpeedTorch.OptimizerFactory(opt, 10, DIM, model, "u_embeddings")
    with pytest.raises(RuntimeError, match="optInit"):
        factory.beforeForwardPass(np.array([1]))
