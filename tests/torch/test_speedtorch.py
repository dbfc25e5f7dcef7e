import numpy as np
import pytest

torch = pytest.importorskip("torch")

from xferlib.adapters.torch import speedtorch as SpeedTorch  # noqa: E402
from xferlib.adapters.torch.speedtorch._store import gpu_available  # noqa: E402
from xferlib.testing import GPU_SKIP_REASON  # noqa: E402

CLASSES, DIM, BATCH, POS = 30, 5, 4, 3

# name -> (model switcher, optimizer switcher, placement kwargs); placement 'pinned' or not
FAMILIES = {
    "cupy": (SpeedTorch.ModelFactory, SpeedTorch.OptimizerFactory),
    "mm": (SpeedTorch.ModelFactoryMM, SpeedTorch.OptimizerFactoryMM),
    "torch": (SpeedTorch.PytorchModelFactory, SpeedTorch.PytorchOptimizerFactory),
    "torch-gpu": (SpeedTorch.GPUPytorchModelFactory, SpeedTorch.GPUPytorchOptimizerFactory),
    "torch-cpu": (SpeedTorch.CPUPytorchModelFactory, SpeedTorch.CPUPytorchOptimizerFactory),
}


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    if request.param == "cuda" and not gpu_available():
        pytest.skip(GPU_SKIP_REASON)
    return torch.device(request.param)


class SkipGram(torch.nn.Module):
    """The shape of SpeedTorch's word2vec guide: two embedding variables whose rows are
    switched in per batch, indexed by the dummy positions of variableTransformer."""

    def __init__(self, rows, device="cpu"):
        super().__init__()
        self.u_embeddings = torch.nn.Embedding(rows, DIM).to(device)
        self.v_embeddings = torch.nn.Embedding(rows, DIM).to(device)

    def forward(self, pos_u, pos_v):
        score = (self.u_embeddings(pos_u) * self.v_embeddings(pos_v)).sum(-1)
        return torch.nn.functional.logsigmoid(score).sum()


def _switchers(family, model, opt, name, pinned, device, tmp_path):
    model_cls, opt_cls = FAMILIES[family]
    var = getattr(model, name)
    if family in ("cupy", "mm"):
        extra = {"diskname": str(tmp_path / name)} if family == "mm" else {}
        ms = model_cls(var, CLASSES, DIM, CPUPinn=pinned, **extra)
        os_ = opt_cls(opt, CLASSES, DIM, model, name, CPUPinn=pinned)
        if family == "mm":
            os_.diskname = str(tmp_path / os_.diskname)
    elif family == "torch":
        ms = model_cls(var, CLASSES, DIM, deviceType=device.type, pinType=pinned)
        os_ = opt_cls(opt, CLASSES, DIM, model, name, deviceType=device.type, pinType=pinned)
    else:
        ms, os_ = model_cls(var, CLASSES, DIM), opt_cls(opt, CLASSES, DIM, model, name)
    return ms, os_


def _train(family, device, optimizer_cls, kwargs, batches, inits, pinned, tmp_path):
    model = SkipGram(BATCH * POS, device)
    opt = getattr(torch.optim, optimizer_cls)(model.parameters(), **kwargs)
    pairs = []
    for name, init in zip(("u_embeddings", "v_embeddings"), inits):
        ms, os_ = _switchers(family, model, opt, name, pinned, device, tmp_path)
        ms.zerosInit()
        if family == "cupy":
            ms.CUPYcorpus = init  # SpeedTorch's attribute, assigned
        elif family == "mm":
            ms.getCupyMM()[...] = init if not gpu_available() else __import__("cupy").asarray(init)
        else:
            ms.customInit(lambda t, v: t.copy_(torch.from_numpy(v)), init)
        os_.optInit()
        pairs.append((ms, os_))
    dummy = torch.from_numpy(pairs[0][0].variableTransformer(BATCH, POS))
    for idx_pair in batches:
        for (ms, os_), idx in zip(pairs, idx_pair):
            ms.beforeForwardPass(idx)
            os_.beforeForwardPass(idx)
        opt.zero_grad()
        dev = model.u_embeddings.weight.device
        (-model(dummy.to(dev), dummy.to(dev))).backward()
        opt.step()
        for (ms, os_), idx in zip(pairs, idx_pair):
            ms.afterOptimizerStep(idx)
            os_.afterOptimizerStep(idx)
    return [ms.getNumpyVersion() for ms, _ in pairs]


def _dense(optimizer_cls, kwargs, batches, inits):
    model = SkipGram(CLASSES)
    with torch.no_grad():
        model.u_embeddings.weight.copy_(torch.from_numpy(inits[0]))
        model.v_embeddings.weight.copy_(torch.from_numpy(inits[1]))
    opt = getattr(torch.optim, optimizer_cls)(model.parameters(), **kwargs)
    for u_idx, v_idx in batches:
        opt.zero_grad()
        (-model(torch.from_numpy(u_idx), torch.from_numpy(v_idx))).backward()
        opt.step()
    return [model.u_embeddings.weight.detach().numpy(),
            model.v_embeddings.weight.detach().numpy()]


def _family_ok(family, device):
    if family == "torch-gpu" and device.type != "cuda":
        pytest.skip("GPUPytorch* keep their collection on the GPU")
    if family in ("cupy", "mm", "torch-cpu") and device.type == "cuda" and not gpu_available():
        pytest.skip(GPU_SKIP_REASON)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("pinned", [False, True])
def test_sgd_with_repeated_indexes_equals_dense_sgd(family, device, rng, pinned, tmp_path):
    """Repeated indexes within a batch: SpeedTorch keeps one copy's update; here the row
    gets the dense SGD step on its summed gradient, in every family."""
    _family_ok(family, device)
    inits = [rng.standard_normal((CLASSES, DIM)).astype(np.float32) for _ in range(2)]
    batches = [(rng.integers(0, 8, size=(BATCH, POS)), rng.integers(0, 8, size=(BATCH, POS)))
               for _ in range(4)]
    ours = _train(family, device, "SGD", {"lr": 0.1}, batches, inits, pinned, tmp_path)
    dense = _dense("SGD", {"lr": 0.1}, batches, inits)
    for a, b in zip(ours, dense):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer_cls, kwargs", [("Adam", {"lr": 0.05}),
                                                   ("Adamax", {"lr": 0.05}),
                                                   ("RMSprop", {"lr": 0.01, "momentum": 0.5}),
                                                   ("Adagrad", {"lr": 0.1,
                                                                "initial_accumulator_value": 0.3}),
                                                   ("AdamW", {"lr": 0.05, "amsgrad": True})])
@pytest.mark.parametrize("family", ["cupy", "torch"])
def test_every_optimizer_equals_dense_when_batches_cover_the_table(family, device, rng,
                                                                  optimizer_cls, kwargs, tmp_path):
    """Every row in every batch, two of them twice: switched rows and optimizer state
    reproduce dense training with the same torch optimizer."""
    global CLASSES
    saved, CLASSES = CLASSES, 10
    try:
        inits = [rng.standard_normal((CLASSES, DIM)).astype(np.float32) for _ in range(2)]

        def cover():
            idx = np.concatenate([rng.permutation(CLASSES), rng.integers(0, CLASSES, 2)])
            return rng.permutation(idx).reshape(BATCH, POS)

        batches = [(cover(), cover()) for _ in range(4)]
        ours = _train(family, device, optimizer_cls, kwargs, batches, inits, True, tmp_path)
        dense = _dense(optimizer_cls, kwargs, batches, inits)
    finally:
        CLASSES = saved
    for a, b in zip(ours, dense):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("family", ["cupy", "torch"])
def test_sparse_adam_on_a_sparse_embedding_equals_dense_sparse_adam(family, device, rng,
                                                                   tmp_path):
    """SparseAdam (SpeedTorch's first supported optimizer) with sparse=True embeddings and
    repeated indexes: rows not in a batch are untouched, so the switched training equals
    SparseAdam on the full table even when batches cover few rows."""
    _family_ok(family, device)
    inits = [rng.standard_normal((CLASSES, DIM)).astype(np.float32) for _ in range(2)]
    batches = [(rng.integers(0, 9, size=(BATCH, POS)), rng.integers(0, 9, size=(BATCH, POS)))
               for _ in range(4)]

    def sparse_model(rows, dev):
        model = SkipGram(rows, dev)
        for name in ("u_embeddings", "v_embeddings"):
            getattr(model, name).sparse = True
        return model

    model = sparse_model(BATCH * POS, device)
    opt = torch.optim.SparseAdam(list(model.parameters()), lr=0.05)
    pairs = []
    for name, init in zip(("u_embeddings", "v_embeddings"), inits):
        ms, os_ = _switchers(family, model, opt, name, False, device, tmp_path)
        if family == "cupy":
            ms.zerosInit()
            ms.CUPYcorpus = init
        else:
            ms.customInit(lambda t, v: t.copy_(torch.from_numpy(v)), init)
        os_.optInit()
        assert os_.optVarList == ["exp_avg", "exp_avg_sq"]
        pairs.append((ms, os_))
    dummy = torch.from_numpy(pairs[0][0].variableTransformer(BATCH, POS)).to(device)
    ref = sparse_model(CLASSES, "cpu")
    with torch.no_grad():
        ref.u_embeddings.weight.copy_(torch.from_numpy(inits[0]))
        ref.v_embeddings.weight.copy_(torch.from_numpy(inits[1]))
    ref_opt = torch.optim.SparseAdam(list(ref.parameters()), lr=0.05)
    for idx_pair in batches:
        for (ms, os_), idx in zip(pairs, idx_pair):
            ms.beforeForwardPass(idx)
            os_.beforeForwardPass(idx)
        opt.zero_grad()
        (-model(dummy, dummy)).backward()
        opt.step()
        for (ms, os_), idx in zip(pairs, idx_pair):
            ms.afterOptimizerStep(idx)
            os_.afterOptimizerStep(idx)
        ref_opt.zero_grad()
        (-ref(torch.from_numpy(idx_pair[0]), torch.from_numpy(idx_pair[1]))).backward()
        ref_opt.step()
    for (ms, _), w in zip(pairs, (ref.u_embeddings.weight, ref.v_embeddings.weight)):
        np.testing.assert_allclose(ms.getNumpyVersion(), w.detach().numpy(), rtol=2e-5,
                                   atol=2e-6)


def test_readme_documentation_examples(device, tmp_path):
    """The calls SpeedTorch's README documents, with only the import changed."""
    skip_gram_modelSparse = SkipGram(12, device)
    uEmbed_switcher = SpeedTorch.ModelFactory(skip_gram_modelSparse.u_embeddings,
                                              total_classes=50000, embed_dimension=128)
    uEmbed_switcher.zerosInit()
    uEmbed_switcher.uniformDistributionInit(-0.01, 0.01)
    uEmbed_switcher.normalDistributionInit(0.0, 0.02)
    pos, neg = uEmbed_switcher.variableTransformer(4, 2, 1)
    assert pos.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]] and neg.ravel().tolist() == [8, 9, 10, 11]
    uEmbed_switcher.beforeForwardPass(np.array([[1, 2], [3, 4], [5, 6], [7, 49999]]),
                                      np.array([[9], [10], [11], [12]]))
    assert tuple(skip_gram_modelSparse.u_embeddings.weight.shape) == (12, 128)
    uEmbed_switcher.afterOptimizerStep(np.array([[1, 2], [3, 4], [5, 6], [7, 49999]]),
                                       np.array([[9], [10], [11], [12]]))
    uEmbed_switcher.saveCupy(str(tmp_path / "u.npy"))
    uEmbed_switcher.loadCupy(str(tmp_path / "u.npy"))
    assert uEmbed_switcher.getNumpyVersion().shape == (50000, 128)

    given_optimizer = torch.optim.Adam(skip_gram_modelSparse.parameters())
    uAdagrad_switcher = SpeedTorch.OptimizerFactory(
        given_optimizer, 50000, 128, skip_gram_modelSparse, "u_embeddings", dtype="float32",
        CPUPinn=False)
    uAdagrad_switcher.optInit()
    assert uAdagrad_switcher.optVarList == ["exp_avg", "exp_avg_sq"]
    assert len(uAdagrad_switcher.CUPYcorpi) == 2

    kwargs = {} if device.type == "cuda" else {"deviceType": "cpu"}
    p_switcher = SpeedTorch.PytorchModelFactory(skip_gram_modelSparse.u_embeddings,
                                                total_classes=50000, embed_dimension=128, **kwargs)
    p_switcher.customInit(torch.nn.init.constant_, 0.25)
    assert float(p_switcher.getTorchVar()[3, 5]) == 0.25
    p_switcher.saveTorch(str(tmp_path / "p.pt"))
    p_switcher.uniformDistributionInit(-1, 1)
    p_switcher.loadTorch(str(tmp_path / "p.pt"))
    assert bool((p_switcher.pytorchGPUVar == 0.25).all())
    p_opt = SpeedTorch.PytorchOptimizerFactory(given_optimizer, 50000, 128,
                                               skip_gram_modelSparse, "u_embeddings",
                                               dtype="float32", **kwargs)
    p_opt.optInit()
    assert [tuple(t.shape) for t in p_opt.pytorchGPUVar] == [(50000, 128)] * 2


@pytest.mark.parametrize("pinned", [False, True])
def test_data_gadget_keeps_the_index_shape(device, rng, tmp_path, pinned):
    """getData(indexes) is CUPYcorpus[indexes]: any index form, the index shape kept."""
    data = rng.standard_normal((50, 3, 2)).astype(np.float32)
    path = tmp_path / "data.npy"
    np.save(path, data)
    gadget = SpeedTorch.DataGadget(str(path), CPUPinn=pinned)
    gadget.gadgetInit()
    idx2d = np.array([[4, 4, 10], [1, 49, 0]])
    cases = [idx2d, idx2d.astype(np.int32), idx2d.astype(np.uint16), [[1, 2], [3, 4]], 7, -1,
             slice(3, 9, 2), np.array([-2, 5]), torch.tensor([[0], [9]]),
             np.arange(50) % 3 == 0, np.zeros((2, 0), np.int64)]
    for index in cases:
        got = gadget.getData(index)
        assert isinstance(got, torch.Tensor)
        assert got.device.type == ("cuda" if gpu_available() else "cpu")
        ref = index.numpy() if isinstance(index, torch.Tensor) else index
        ref = ref if isinstance(ref, slice) else np.asarray(ref)
        np.testing.assert_array_equal(got.cpu().numpy(), data[ref])
    # insertData: same index forms; a repeated row keeps the last write.
    gadget.insertData(torch.ones(2, 2, 3, 2), np.array([[0, 1], [0, 2]]))
    gadget.insertData(np.full((3, 2), 5.0, np.float32), 3)
    gadget.insertData(torch.arange(12.0).reshape(2, 3, 2), np.array([7, 7]))
    host = gadget.getNumpyVersion()
    expected = data.copy()
    expected[[0, 1, 2]] = 1
    expected[3] = 5
    expected[7] = np.arange(6.0, 12.0).reshape(3, 2)
    np.testing.assert_array_equal(host, expected)
    with pytest.raises(IndexError, match="50"):
        gadget.getData(np.array([3, 50]))
    with pytest.raises(IndexError):
        gadget.getData(np.array([-51]))
    with pytest.raises(TypeError, match="integers"):
        gadget.getData(np.array([1.5]))
    with pytest.raises(ValueError, match="dataObject"):
        gadget.insertData(torch.ones(3, 3, 2), np.array([0, 1]))
    gadget.saveCupy(str(tmp_path / "saved.npy"))
    other = SpeedTorch.DataGadget(str(tmp_path / "saved.npy"))
    other.gadgetInit()
    np.testing.assert_array_equal(other.getNumpyVersion(), host)


def test_data_gadget_mm_takes_positives_then_negatives(tmp_path, rng):
    data = rng.standard_normal((20, 4)).astype(np.float32)
    np.save(tmp_path / "d.npy", data)
    gadget = SpeedTorch.DataGadgetMM(str(tmp_path / "d.npy"))
    gadget.gadgetInit()
    got = gadget.getData(np.array([[1, 2], [3, 3]]), np.array([19]))
    np.testing.assert_array_equal(got.cpu().numpy(), data[[1, 2, 3, 3, 19]])


@pytest.mark.parametrize("family", ["cupy", "mm", "torch", "torch-cpu"])
def test_initializers_are_reproducible_after_seeding(family, tmp_path):
    def draw(seed, kind):
        np.random.seed(seed)
        torch.manual_seed(seed)
        if gpu_available():
            import cupy

            cupy.random.seed(seed)
        emb = torch.nn.Embedding(2, 4)
        if family == "cupy":
            sw = SpeedTorch.ModelFactory(emb, 40, 4, CPUPinn=True)
        elif family == "mm":
            sw = SpeedTorch.ModelFactoryMM(emb, 40, 4, diskname=str(tmp_path / "v"))
        elif family == "torch":
            sw = SpeedTorch.PytorchModelFactory(emb, 40, 4, deviceType="cpu")
        else:
            sw = SpeedTorch.CPUPytorchModelFactory(emb, 40, 4)
        if kind == "uniform":
            sw.uniformDistributionInit(-2.0, 3.0)
        else:
            sw.normalDistributionInit(1.0, 0.5)
        return sw.getNumpyVersion()

    for kind in ("uniform", "normal"):
        a, b, c = draw(3, kind), draw(3, kind), draw(4, kind)
        np.testing.assert_array_equal(a, b)
        assert not np.array_equal(a, c)
        assert a.dtype == np.float32 and a.shape == (40, 4)
    u = draw(5, "uniform")
    assert u.min() >= -2.0 and u.max() < 3.0 and u.std() > 1.0
    n = draw(5, "normal")
    assert abs(n.mean() - 1.0) < 0.2 and 0.35 < n.std() < 0.65


@pytest.mark.parametrize("pinned", [False, True])
def test_get_cupy_var_and_attributes(pinned):
    emb = torch.nn.Embedding(3, 4)
    opt = torch.optim.RMSprop(emb.parameters(), momentum=0.9, centered=True)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = emb

    sw = SpeedTorch.ModelFactory(emb, 10, 4, CPUPinn=pinned)
    sw.zerosInit()
    var = sw.getCupyVar()
    assert sw.CUPYcorpus is var and var.shape == (10, 4)
    assert sw.total_classes == 10 and sw.embed_dimension == 4 and sw.CPUPinn is pinned
    assert sw.datatype == "float32" and sw.model_variable is emb
    if gpu_available():
        import cupy

        assert isinstance(var, cupy.ndarray)
        if pinned:  # a CuPy view of the pinned host memory itself
            attrs = cupy.cuda.runtime.pointerGetAttributes(var.data.ptr)
            assert attrs.type == cupy.cuda.runtime.memoryTypeHost
    else:  # without a GPU: the NumPy array holding the collection
        assert isinstance(var, np.ndarray)
    var[2] = 7.0  # writes through the returned array reach the collection
    assert (sw.getNumpyVersion()[2] == 7).all()

    os_ = SpeedTorch.OptimizerFactory(opt, 10, 4, M(), "emb", CPUPinn=pinned)
    assert os_.optVarList == ["square_avg", "momentum_buffer", "grad_avg"]
    assert os_.optimizerKey == 0 and os_.given_optimizer is opt and os_.variable_name == "emb"
    with pytest.raises(RuntimeError, match="optInit"):
        os_.CUPYcorpi
    os_.optInit()
    assert len(os_.CUPYcorpi) == 3 and os_.getCupyVar().shape == (10, 4)


def test_adagrad_state_starts_from_its_initial_accumulator():
    emb = torch.nn.Embedding(3, 2)
    opt = torch.optim.Adagrad(emb.parameters(), initial_accumulator_value=0.7)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = emb

    for cls, kw in ((SpeedTorch.OptimizerFactory, {}), (SpeedTorch.PytorchOptimizerFactory,
                                                        {"deviceType": "cpu"})):
        sw = cls(opt, 6, 2, M(), "emb.weight", **kw)
        sw.optInit()
        assert sw.optVarList == ["sum"]
        np.testing.assert_allclose(sw.getNumpyVersion(), 0.7)


def test_com_classes(tmp_path):
    com = SpeedTorch.COM(5)
    com.comInit()
    assert com.CUPYCom.shape == (5, 5) and com.CUPYCom.dtype == np.uint32
    assert not com.getNumpyVersion().any()
    commm = SpeedTorch.COMMM(4, diskname=str(tmp_path / "COM"))
    commm.comInit()
    assert commm.CUPYmemmap.shape == (4, 4) and (tmp_path / "COM0.memmap.cpy.npy").exists()
    for cls, kw in ((SpeedTorch.PytorchCOM, {"deviceType": "cpu"}),
                    (SpeedTorch.CPUPytorchCOM, {})):
        c = cls(6, **kw)
        c.comInit()
        t = c.getTorchVar()
        assert t.shape == (6, 6) and t.dtype == torch.int32 and not t.any()


def test_mm_files_are_numbered_like_speedtorch(tmp_path):
    emb = torch.nn.Embedding(2, 3)
    sw = SpeedTorch.ModelFactoryMM(emb, 8, 3, diskname=str(tmp_path / "variable"))
    sw.zerosInit()
    assert sw.fileName == str(tmp_path / "variable0.memmap")
    sw.uniformDistributionInit(0.0, 1.0)
    assert sw.fileName == str(tmp_path / "variable1.memmap")
    assert sw.getCupyMM().shape == (8, 3) and sw.getNumpyVersion().min() >= 0


def test_every_exported_name_exists():
    names = ["ModelFactory", "OptimizerFactory", "COM", "DataGadget", "ModelFactoryMM",
             "OptimizerFactoryMM", "COMMM", "DataGadgetMM", "GPUPytorchModelFactory",
             "GPUPytorchOptimizerFactory", "GPUPytorchCOM", "CPUPytorchModelFactory",
             "CPUPytorchOptimizerFactory", "CPUPytorchCOM", "PytorchModelFactory",
             "PytorchOptimizerFactory", "PytorchCOM", "my_pinned_allocator",
             "my_pinned_allocatorMM"]
    for name in names:
        assert callable(getattr(SpeedTorch, name)), name
    pytest.importorskip("cupy")
    assert SpeedTorch.PMemory.__name__ == "PMemory" and SpeedTorch.PMemoryMM is not None


def test_model_factory_takes_the_readmes_diskname():
    """SpeedTorch's README gives ModelFactory a ``diskname`` its code never took: accepted by
    keyword (unused), positional arguments in the code's order."""
    emb = torch.nn.Embedding(3, 4)
    assert SpeedTorch.ModelFactory(emb, 10, 4, diskname="variable").datatype == "float32"
    assert SpeedTorch.ModelFactory(emb, 10, 4, "float64").datatype == "float64"


def test_errors(tmp_path):
    model = SkipGram(4)
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(ValueError, match="no parameter"):
        SpeedTorch.OptimizerFactory(opt, 10, DIM, model, "w_embeddings")
    factory = SpeedTorch.OptimizerFactory(opt, 10, DIM, model, "u_embeddings")
    with pytest.raises(RuntimeError, match="optInit"):
        factory.beforeForwardPass(np.array([1]))
    switcher = SpeedTorch.ModelFactory(model.u_embeddings, 20, DIM)
    with pytest.raises(RuntimeError, match="init method"):
        switcher.beforeForwardPass(np.array([1]))
    with pytest.raises(TypeError, match="weight"):
        SpeedTorch.ModelFactory(torch.nn.ReLU(), 20, DIM)
    with pytest.raises(ValueError, match="LBFGS"):
        SpeedTorch.OptimizerFactory(torch.optim.LBFGS(model.parameters()), 10, DIM, model,
                                    "u_embeddings")
    # Adafactor's factored moments span rows (row_var, col_var): refused when built, not a
    # reshape error deep in afterOptimizerStep after the first step.
    with pytest.raises(ValueError, match="Adafactor.*not one row per embedding row"):
        SpeedTorch.OptimizerFactory(torch.optim.Adafactor(model.parameters()), 10, DIM, model,
                                    "u_embeddings")
    switcher.zerosInit()
    with pytest.raises(IndexError, match="20"):
        switcher.beforeForwardPass(np.array([0, 20]))
    if not gpu_available():
        with pytest.raises(RuntimeError, match="deviceType='cpu'"):
            SpeedTorch.PytorchModelFactory(model.u_embeddings, 20, DIM)
        # GPUPytorch* take no deviceType: the error names the classes to use instead
        for make in (lambda: SpeedTorch.GPUPytorchModelFactory(model.u_embeddings, 20, DIM),
                     lambda: SpeedTorch.GPUPytorchOptimizerFactory(opt, 20, DIM, model,
                                                                   "u_embeddings"),
                     lambda: SpeedTorch.GPUPytorchCOM(20)):
            with pytest.raises(RuntimeError, match="CUDA") as err:
                make()
            assert "CPUPytorch*" in str(err.value) and "pass deviceType" not in str(err.value)


@pytest.mark.gpu
def test_gpu_readme_defaults_and_cupy_seed_matches_speedtorchs_draw():
    """On a GPU: the README's default call forms (deviceType='cuda'), rows landing on the GPU,
    and ModelFactory's uniform init equal to cupy.random.uniform after the same seed (the
    numbers SpeedTorch 0.1.6 draws)."""
    if not gpu_available():
        pytest.skip(GPU_SKIP_REASON)
    import cupy

    model = SkipGram(6, "cuda")
    sw = SpeedTorch.PytorchModelFactory(model.u_embeddings, 100, DIM)
    sw.normalDistributionInit(0.0, 1.0)
    sw.beforeForwardPass(np.array([1, 2, 3, 4, 5, 99]))
    assert model.u_embeddings.weight.is_cuda and sw.pytorchGPUVar.is_cuda
    g = SpeedTorch.GPUPytorchModelFactory(model.v_embeddings, 100, DIM)
    g.zerosInit()
    g.beforeForwardPass(np.arange(6))
    c = SpeedTorch.CPUPytorchModelFactory(model.v_embeddings, 100, DIM)
    c.zerosInit()
    assert c.pytorchCPUVar.is_pinned()
    cupy.random.seed(11)
    expected = cupy.random.uniform(low=-1, high=1, size=(100, DIM), dtype="float32").get()
    cupy.random.seed(11)
    m = SpeedTorch.ModelFactory(model.u_embeddings, 100, DIM)
    m.uniformDistributionInit(-1, 1)
    np.testing.assert_array_equal(m.getNumpyVersion(), expected)
    assert isinstance(m.getCupyVar(), cupy.ndarray)
