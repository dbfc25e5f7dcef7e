"""EmbeddingBagCollection (the torch module over the core collection) against the core's
float64 references: optimizers, poolings, index widths, per-sample weights, the dict form;
state_dict round trips, moves, bad input, DDP beside it; on a GPU, a whole training step
captured in a CUDA graph."""

from __future__ import annotations

import copy
import io
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from xferlib.adapters.torch import EmbeddingBagCollection, FlatAdam, TableConfig  # noqa: E402
from xferlib.collection import (collection_step_reference,  # noqa: E402
                                pooled_lookup_reference)
from xferlib.testing import GPU_SKIP_REASON  # noqa: E402
from tests.torch.capture_helpers import (  # noqa: E402
    fixed_length_batches, linear_head_step, replay_beside_eager)

HYPER = {"sgd": {"lr": 0.3, "momentum": 0.9}, "adam": {"lr": 0.05},
         "adamw": {"lr": 0.05, "weight_decay": 0.1}, "rowwise_adagrad": {"lr": 0.2},
         "adagrad": {"lr": 0.2}}
ROWS, DIMS = (7, 1, 33), (4, 3, 8)


def tables(placements=("host", "hbm", "host"), init=("normal", 0.0, 1.0)):
    return [TableConfig(n, d, name=f"f{t}", placement=p, init=init)
            for t, (n, d, p) in enumerate(zip(ROWS, DIMS, placements))]


def batch(rng, B, rows=ROWS, max_len=4, dtype=torch.int64):
    """FBGEMM's layout for tables of ``rows`` rows: bags of 0..max_len, repeats likely."""
    lengths = rng.integers(0, max_len + 1, size=len(rows) * B)
    parts = [rng.integers(0, n, int(lengths[t * B:(t + 1) * B].sum()))
             for t, n in enumerate(rows)]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return (torch.as_tensor(np.concatenate(parts), dtype=dtype),
            torch.as_tensor(offsets, dtype=dtype))


def snapshot(coll):
    """Every table's float64 weights, optimizer state and step counts (for the reference)."""
    names = [k for k in coll.state_names() if k != "step"]
    weights = [coll.weights(t).astype(np.float64) for t in range(coll.num_tables)]
    states = [{k: coll.state(t, k).astype(np.float64) for k in names}
              for t in range(coll.num_tables)]
    steps = [coll.state(t, "step").copy() for t in range(coll.num_tables)]
    return weights, states, steps


def assert_trained_as_reference(coll, before, optimizer, idx, off, grad, psw=None,
                                pooling="sum", tol=None):
    tol = tol or dict(rtol=1e-10, atol=1e-12)
    weights, states, steps = before
    new_w, new_s, new_steps = collection_step_reference(
        optimizer, coll.hypers, weights, states, steps, idx.numpy(), off.numpy(),
        grad.detach().numpy(), None if psw is None else psw.numpy(), pooling)
    for t in range(coll.num_tables):
        np.testing.assert_allclose(coll.weights(t), new_w[t], **tol)
        for k, v in new_s[t].items():
            np.testing.assert_allclose(coll.state(t, k), v, **tol)
        np.testing.assert_array_equal(coll.state(t, "step"), new_steps[t])


@pytest.mark.parametrize("optimizer", list(HYPER))
@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_training_matches_reference(optimizer, pooling):
    rng = np.random.default_rng(sum(map(ord, optimizer + pooling)))  # stable per case
    ebc = EmbeddingBagCollection(tables(), optimizer, HYPER[optimizer], pooling=pooling,
                                 dtype=torch.float64, device="cpu", seed=4)
    for step in range(3):
        idx, off = batch(rng, B=5, dtype=torch.int32 if step % 2 else torch.int64)
        before = snapshot(ebc.collection)
        out = ebc(idx, off)
        assert out.dtype == torch.float64 and out.requires_grad
        np.testing.assert_allclose(
            out.detach().numpy(),
            pooled_lookup_reference(before[0], idx.numpy(), off.numpy(), pooling=pooling),
            rtol=1e-12, atol=1e-12)
        target = torch.as_tensor(rng.standard_normal(out.shape))
        loss = (out * target).sum()  # d loss / d out = target
        loss.backward()
        assert_trained_as_reference(ebc.collection, before, optimizer, idx, off, target,
                                    pooling=pooling)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
def test_float32_index_widths_and_per_sample_weights(index_dtype, weighted):
    rng = np.random.default_rng(3)
    ebc = EmbeddingBagCollection(tables(), "adagrad", {"lr": 0.1}, device="cpu", seed=1)
    idx, off = batch(rng, B=9, max_len=6, dtype=index_dtype)
    psw = (torch.as_tensor(rng.uniform(0.5, 2.0, idx.numel()), dtype=torch.float32)
           if weighted else None)
    before = snapshot(ebc.collection)
    out = ebc(idx, off, psw)
    assert out.dtype == torch.float32
    np.testing.assert_allclose(
        out.detach().numpy(),
        pooled_lookup_reference(before[0], idx.numpy(), off.numpy(),
                                None if psw is None else psw.numpy()),
        rtol=2e-5, atol=2e-6)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    out.backward(grad)
    assert_trained_as_reference(ebc.collection, before, "adagrad", idx, off, grad, psw,
                                tol=dict(rtol=2e-5, atol=2e-6))


def test_dict_form_and_split():
    """{name: (indices, offsets[, weights])} trains as the packed layout; split() gives each
    table's columns by name."""
    rng = np.random.default_rng(5)
    packed, by_dict = (EmbeddingBagCollection(tables(), "adam", {"lr": 0.05}, device="cpu")
                       for _ in range(2))
    B = 4
    idx, off = batch(rng, B)
    psw = torch.as_tensor(rng.uniform(0.5, 2.0, idx.numel()), dtype=torch.float32)
    features = {}
    for t, name in enumerate(packed.names):  # each table's own bags, offsets of B + 1
        lo, hi = int(off[t * B]), int(off[(t + 1) * B])
        features[name] = (idx[lo:hi].to(torch.int32), off[t * B:(t + 1) * B + 1] - lo,
                          psw[lo:hi])
    # the dict in another order than the collection's: pack orders it
    features = dict(reversed(list(features.items())))
    a, b = packed(idx, off, psw), by_dict(features)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    split = by_dict.split(b)
    assert list(split) == ["f0", "f1", "f2"]
    assert [v.shape[1] for v in split.values()] == list(DIMS)
    torch.testing.assert_close(split["f1"], b[:, 4:7], rtol=0, atol=0)
    grad = torch.randn(a.shape, generator=torch.Generator().manual_seed(1))
    a.backward(grad)
    b.backward(grad)
    for key, value in packed.state_dict().items():
        torch.testing.assert_close(by_dict.state_dict()[key], value, rtol=0, atol=0, msg=key)
    with pytest.raises(KeyError, match="missing"):
        by_dict({"f0": features["f0"]})
    with pytest.raises(ValueError, match="pass nothing else"):
        by_dict(features, off)
    # each table's offsets and dtypes checked (packed, a bad table's bags would spill over)
    before = by_dict.state_dict()
    i0, o0, w0 = features["f0"]
    for bad, error, message in (
            ((i0, o0 + 1, w0), ValueError, r"table 'f0': offsets\[0\] must be 0"),
            ((i0, o0[:-1], w0), ValueError, "same number of bags"),
            ((i0[:-1], o0, w0[:-1]), ValueError, r"table 'f0': offsets\[-1\] must equal"),
            ((i0.float(), o0, w0), TypeError, "table 'f0': indices must be integer"),
            ((i0.tolist(), o0, w0), TypeError, "indices must be a torch tensor")):
        with pytest.raises(error, match=message):
            by_dict(dict(features, f0=bad)).sum().backward()
    for key, value in before.items():
        torch.testing.assert_close(by_dict.state_dict()[key], value, rtol=0, atol=0, msg=key)
    with pytest.raises(ValueError, match="pooled must have shape"):
        by_dict.split(b[:, :3])


def test_eval_and_no_grad_look_up_only():
    ebc = EmbeddingBagCollection(tables(), "sgd", {"lr": 1.0}, device="cpu")
    idx, off = batch(np.random.default_rng(0), B=3)
    before = ebc.state_dict()
    with torch.no_grad():
        out = ebc(idx, off)
    assert not out.requires_grad
    ebc.eval()
    assert not ebc(idx, off).requires_grad
    ebc.train()
    torch.testing.assert_close(ebc(idx, off), out, rtol=0, atol=0)
    for key, value in ebc.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)


class _Model(torch.nn.Module):
    """A DLRM-shaped toy: the collection, then a dense layer over the pooled rows."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.sparse = EmbeddingBagCollection(tables(), "adam", {"lr": 0.05}, device="cpu",
                                             seed=seed)
        self.dense = torch.nn.Linear(sum(DIMS), 1)

    def forward(self, idx, off):
        return self.dense(self.sparse(idx, off))


def _model(seed=0):
    return _Model(seed)


def _step(model, idx, off, opt=None):
    out = model(idx, off).square().mean()
    out.backward()
    if opt is not None:
        opt.step()
        opt.zero_grad()
    return out.detach()


def test_state_dict_round_trip_through_a_model():
    """A model's state_dict holds every table's weights and Adam state under the module's
    prefix; a fresh model (other seed) loaded from it computes and trains identically."""
    rng = np.random.default_rng(8)
    batches = [batch(rng, B=6) for _ in range(4)]
    model = _model(0)
    for idx, off in batches[:2]:
        _step(model, idx, off)
    state = model.state_dict()
    assert {"sparse.embedding_bags.f0.weight", "sparse.embedding_bags.f0.exp_avg",
            "sparse.embedding_bags.f2.exp_avg_sq", "sparse.embedding_bags.f1.step",
            "dense.weight"} <= set(state)
    assert state["sparse.embedding_bags.f2.weight"].shape == (33, 8)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    fresh = _model(7)
    assert not torch.equal(fresh.state_dict()["sparse.embedding_bags.f0.weight"],
                           state["sparse.embedding_bags.f0.weight"])
    fresh.load_state_dict(torch.load(buffer))
    for idx, off in batches[2:]:
        torch.testing.assert_close(_step(fresh, idx, off), _step(model, idx, off), rtol=0,
                                   atol=0)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[key], value, rtol=0, atol=0, msg=key)


def test_load_state_dict_refuses_what_does_not_fit():
    model = _model(0)
    state = model.state_dict()
    before = model.state_dict()
    partial = {k: v for k, v in state.items() if k != "sparse.embedding_bags.f1.exp_avg"}
    with pytest.raises(RuntimeError, match="Missing key.*sparse.embedding_bags.f1.exp_avg"):
        model.load_state_dict(partial)
    extra = {**state, "sparse.embedding_bags.f9.weight": torch.zeros(2, 2)}
    with pytest.raises(RuntimeError, match="Unexpected key.*f9.weight"):
        model.load_state_dict(extra)
    wrong = {**state, "sparse.embedding_bags.f2.weight": torch.zeros(33, 7)}
    with pytest.raises(RuntimeError, match=r"f2.weight must have shape \(33, 8\)"):
        model.load_state_dict(wrong)
    for key, value in model.state_dict().items():  # nothing was written
        torch.testing.assert_close(value, before[key], rtol=0, atol=0, msg=key)
    assert model.load_state_dict(partial, strict=False).missing_keys == [
        "sparse.embedding_bags.f1.exp_avg"]


def test_load_state_dict_not_strict_loads_what_it_is_given():
    """strict=False (torch passes strict=True to _load_from_state_dict whatever the caller
    gave): another optimizer's checkpoint loads its weights and step counts, a checkpoint of
    some of the tables loads those tables; what it lacks keeps its values and is reported
    missing (the module loaded nothing at all, silently, when any key was missing)."""
    source = EmbeddingBagCollection(tables(), "sgd", {"lr": 0.1}, device="cpu", seed=1)
    rng = np.random.default_rng(3)
    source(*batch(rng, B=4)).sum().backward()  # steps of 1 on some rows
    saved = source.state_dict()
    module = EmbeddingBagCollection(tables(), "adam", {"lr": 0.1}, device="cpu", seed=2)
    module(*batch(rng, B=4)).sum().backward()
    before = module.state_dict()
    result = module.load_state_dict(saved, strict=False)
    assert sorted(result.missing_keys) == sorted(k for k in before if "exp_avg" in k)
    after = module.state_dict()
    for key, value in after.items():
        torch.testing.assert_close(value, saved[key] if key in saved else before[key],
                                   rtol=0, atol=0, msg=key)

    fewer = EmbeddingBagCollection(tables()[:2], "adam", {"lr": 0.1}, device="cpu", seed=4)
    module = EmbeddingBagCollection(tables(), "adam", {"lr": 0.1}, device="cpu", seed=5)
    before = module.state_dict()
    result = module.load_state_dict(fewer.state_dict(), strict=False)
    assert result.missing_keys == [k for k in before if k.startswith("embedding_bags.f2.")]
    after = module.state_dict()
    for key, value in after.items():
        want = fewer.state_dict()[key] if ".f2." not in key else before[key]
        torch.testing.assert_close(value, want, rtol=0, atol=0, msg=key)
    wrong = {"embedding_bags.f0.weight": torch.zeros(7, 5)}  # a shape still refuses all
    with pytest.raises(RuntimeError, match=r"f0.weight must have shape \(7, 4\)"):
        module.load_state_dict(wrong, strict=False)
    for key, value in module.state_dict().items():
        torch.testing.assert_close(value, after[key], rtol=0, atol=0, msg=key)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_cuda_device_without_a_gpu_is_refused_clearly():
    """torch.cuda.current_device() raised torch's AssertionError first."""
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        EmbeddingBagCollection(tables(), device="cuda")


def test_moves_and_copies_keep_the_tables():
    """.double() rebuilds the collection in float64 from its state; deepcopy and pickling
    (torch.save of the module) carry tables, state and hyperparameters; float16 is refused
    before anything changes."""
    rng = np.random.default_rng(2)
    idx, off = batch(rng, B=5)
    model = _model(0)
    _step(model, idx, off)
    model.sparse.collection.set_hyper("f1", lr=0.5)
    state = model.state_dict()
    twin = copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other in (twin, loaded):
        assert other.sparse.collection is not model.sparse.collection
        assert other.sparse.collection.hypers[1]["lr"] == 0.5
        for key, value in state.items():
            torch.testing.assert_close(other.state_dict()[key], value, rtol=0, atol=0)
        torch.testing.assert_close(_step(other, idx, off), _step(copy.deepcopy(model), idx,
                                                                off))
    model.double()
    ebc = model.sparse
    assert ebc.dtype == torch.float64 and ebc.collection.dtype == np.float64
    assert ebc.collection.hypers[1]["lr"] == 0.5
    for key, value in state.items():
        np.testing.assert_array_equal(model.state_dict()[key].numpy(), value.numpy())
    assert ebc(idx, off).dtype == torch.float64
    with pytest.raises(TypeError, match="float32 or torch.float64"):
        model.half()
    assert ebc.dtype == torch.float64
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        ebc.to("meta")


def test_bad_inputs_raise_the_core_errors_and_change_nothing():
    ebc = EmbeddingBagCollection(tables(), "adam", device="cpu")
    before = ebc.state_dict()
    # B = 2; f0: bags [1], [0]; f1: [0], []; f2: [5], [6]
    idx, off = torch.tensor([1, 0, 0, 5, 6]), torch.tensor([0, 1, 2, 3, 3, 4, 5])
    bad = idx.clone()
    bad[4] = 33
    with pytest.raises(IndexError, match=r"index 33 at position 4 .*table 'f2' of 33 rows"):
        ebc(bad, off)
    with pytest.raises(IndexError, match="index 1 at position 2 .*table 'f1' of 1 rows"):
        ebc(torch.tensor([1, 0, 1, 5, 6]), off)
    with pytest.raises(ValueError, match=r"T \* B \+ 1"):
        ebc(idx, off[:-1])
    with pytest.raises(ValueError, match="must not decrease"):
        ebc(idx, torch.tensor([0, 2, 1, 3, 3, 4, 5]))
    with pytest.raises(TypeError, match="int32 or int64"):
        ebc(idx.float(), off)
    with pytest.raises(TypeError, match="int32 or int64"):
        ebc(idx.to(torch.int16), off)
    with pytest.raises(ValueError, match="per_sample_weights must have shape"):
        ebc(idx, off, torch.ones(3))
    with pytest.raises(NotImplementedError, match="detach"):
        ebc(idx, off, torch.ones(5, requires_grad=True))
    with pytest.raises(ValueError, match="offsets are needed"):
        ebc(idx)
    with pytest.raises(TypeError, match="torch tensor"):
        ebc(idx.numpy(), off)
    with pytest.raises(TypeError, match="float32 or torch.float64"):
        EmbeddingBagCollection(tables(), dtype=torch.bfloat16, device="cpu")
    with pytest.raises(ValueError, match="placement"):
        TableConfig(3, 2, placement="gpu")
    mine = idx.clone()
    out = ebc(mine, off)
    mine[0] = 0  # the lookup read row 1 of f0; the update would train row 0
    with pytest.raises(RuntimeError, match="modified in place"):
        out.sum().backward()
    out = ebc(idx, off)
    with pytest.raises(RuntimeError, match="already ran"):
        out.sum().backward(retain_graph=True)
        out.sum().backward()
    after = ebc.state_dict()
    for key in ("f0.weight", "f1.weight", "f2.exp_avg"):  # one update ran, for the last call
        assert not torch.equal(after[f"embedding_bags.{key}"], before[f"embedding_bags.{key}"])
    for key, value in ebc.state_dict().items():
        if key.endswith(".step"):
            assert int(value.sum()) == {"embedding_bags.f0.step": 2, "embedding_bags.f1.step": 1,
                                        "embedding_bags.f2.step": 2}[key]


# ------------------------------------------------------------------ DDP beside the collection


def _ddp_batches():
    rng = np.random.default_rng(11)
    return [batch(rng, B=8) for _ in range(4)]


def _ddp_worker(rank, world, port, out_dir):
    from xferlib.adapters.torch import leave_process_group
    from tests.torch.dist_helpers import join

    join(rank, world, port, "gloo")
    model = torch.nn.parallel.DistributedDataParallel(_model(0))
    opt = FlatAdam(model.parameters(), lr=1e-2)
    assert sum(p.numel() for p in model.parameters()) == sum(DIMS) + 1  # the dense layer's
    for idx, off in _ddp_batches():  # every rank the same batch: DDP's mean is this batch's
        _step(model, idx, off, opt)
    torch.save({k.replace("module.", ""): v for k, v in model.state_dict().items()},
               os.path.join(out_dir, f"rank{rank}.pt"))
    leave_process_group()


def test_beside_ddp_for_the_dense_part(tmp_path):
    """A model holding the collection and a dense layer, wrapped whole in
    DistributedDataParallel (2 CPU processes, gloo): DDP syncs the dense gradients and never
    sees the collection (it has no parameters or buffers); each rank trains as one process on
    the same batches."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    import torch.multiprocessing as mp

    from tests.torch.dist_helpers import free_port

    mp.spawn(_ddp_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    model = _model(0)
    opt = FlatAdam(model.parameters(), lr=1e-2)
    for idx, off in _ddp_batches():
        _step(model, idx, off, opt)
    for rank in range(2):
        theirs = torch.load(tmp_path / f"rank{rank}.pt")
        for key, value in model.state_dict().items():
            torch.testing.assert_close(theirs[key], value, rtol=1e-6, atol=1e-7, msg=key)


# ------------------------------------------------------------------ GPU


def _need_gpu():
    import xferlib

    if not (torch.cuda.is_available() and xferlib.cupy_available()):
        pytest.skip(GPU_SKIP_REASON)


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["sgd", "adam", "rowwise_adagrad"])
def test_gpu_module_trains_as_the_cpu_module(optimizer):
    """CUDA tensors take the GPU path: outputs and trained tables as the NumPy path's, int32
    and int64 indices, per-sample weights, the dict form; .cpu() and .cuda() move the tables."""
    _need_gpu()
    rng = np.random.default_rng(9)
    cpu = EmbeddingBagCollection(tables(), optimizer, HYPER[optimizer], device="cpu", seed=2)
    gpu = EmbeddingBagCollection(tables(), optimizer, HYPER[optimizer], device="cuda", seed=2)
    assert gpu.device.type == "cuda" and gpu.collection.device == "cuda"
    for step in range(4):
        idx, off = batch(rng, B=7, dtype=torch.int32 if step % 2 else torch.int64)
        psw = torch.as_tensor(rng.uniform(0.5, 2, idx.numel()), dtype=torch.float32)
        wide = torch.randn(7, sum(DIMS) + 5, generator=torch.Generator().manual_seed(step))
        # odd steps: the gradient a slice of wider rows (as a concatenation's backward gives
        # it), which the GPU reads in place
        cols = slice(3, 3 + sum(DIMS)) if step % 2 else slice(0, sum(DIMS))
        a = cpu(idx, off, psw)
        b = gpu(idx.cuda(), off.cuda(), psw.cuda())
        assert b.is_cuda
        torch.testing.assert_close(b.cpu(), a.detach(), rtol=1e-5, atol=1e-6)
        a.backward(wide[:, cols])
        b.backward(wide.cuda()[:, cols])
    gpu.check()
    for key, value in cpu.state_dict().items():
        torch.testing.assert_close(gpu.state_dict()[key], value, rtol=1e-5, atol=1e-6, msg=key)
    moved = copy.deepcopy(gpu).cpu()
    assert moved.collection.device == "cpu"
    for key, value in gpu.state_dict().items():
        torch.testing.assert_close(moved.state_dict()[key], value, rtol=0, atol=0)
    back = moved.cuda()
    assert back.collection.device == "cuda" and back.device.type == "cuda"
    idx, off = batch(rng, B=3)
    torch.testing.assert_close(back(idx.cuda(), off.cuda()), gpu(idx.cuda(), off.cuda()),
                               rtol=0, atol=0)
    bad = idx.clone().cuda()
    bad[0] = 10_000
    before = gpu.state_dict()
    # read without a host sync: raised by a later call of the collection (here its
    # backward, or the check)
    with pytest.raises(IndexError, match="index 10000 at position 0"):
        gpu(bad, off.cuda()).sum().backward()
        gpu.check()
    for key, value in gpu.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)


@pytest.mark.gpu
def test_training_step_replayed_from_a_cuda_graph_trains_as_eager_steps():
    """The collection (host and HBM tables), a Linear and a capturable FlatAdam: a whole
    training step captured in one CUDA graph after warm-up on a side stream, then replayed
    on new batches (copied into the static inputs), trains as the same steps run eagerly."""
    _need_gpu()

    def build():
        torch.manual_seed(0)
        ebc = EmbeddingBagCollection(tables(), "adam", {"lr": 0.05}, device="cuda", seed=3)
        dense = torch.nn.Linear(sum(DIMS), 1).cuda()
        return ebc, dense, FlatAdam(dense.parameters(), lr=1e-2, capturable=True)

    offsets, batches = fixed_length_batches(ROWS, 16, 8)
    eager, graphed = replay_beside_eager(build, linear_head_step, batches, offsets)
    assert int(offsets[-1]) == batches[0][0].numel()
    for a, b in zip(graphed, eager):
        if isinstance(a, torch.nn.Module):
            for key, value in b.state_dict().items():
                torch.testing.assert_close(a.state_dict()[key], value, rtol=1e-5, atol=1e-6,
                                           msg=key)
    fresh = build()[0]
    assert not torch.equal(graphed[0].state_dict()["embedding_bags.f2.weight"],
                           fresh.state_dict()["embedding_bags.f2.weight"])
    steps = graphed[0].state_dict()["embedding_bags.f2.step"]
    assert int(steps.max()) >= 6  # replays advanced the rows' own step counts


def test_docstring_examples_run():
    import doctest

    from xferlib.adapters.torch import collection

    result = doctest.testmod(collection, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


@pytest.mark.gpu
def test_a_cached_step_past_the_small_sort_replayed_from_a_cuda_graph_trains_as_eager_steps():
    """A host table with a GPU cache, batches of more lookups than one tile of the sort
    (the radix sort's size): the cache pass sorts without a host sync, so the whole step is
    captured in one CUDA graph, and replays train as eager steps (rows admitted, evicted and
    written back in both)."""
    from xferlib._kernels.rows import SMALL_SORT_TILE

    _need_gpu()
    rows = (5000, 300)

    def build():
        torch.manual_seed(0)
        configs = [TableConfig(5000, 8, name="cached", placement="host", cache_rows=512,
                               init=("uniform", -0.5, 0.5)),
                   TableConfig(300, 4, name="dense", placement="hbm")]
        ebc = EmbeddingBagCollection(configs, "sgd", {"lr": 0.1}, device="cuda", seed=3)
        head = torch.nn.Linear(12, 1).cuda()
        return ebc, head, FlatAdam(head.parameters(), lr=1e-2, capturable=True)

    offsets, batches = fixed_length_batches(rows, 40_000, 6)
    assert batches[0][0].numel() > SMALL_SORT_TILE
    eager, graphed = replay_beside_eager(build, linear_head_step, batches, offsets)
    for key, value in eager[0].state_dict().items():
        torch.testing.assert_close(graphed[0].state_dict()[key], value, rtol=1e-5, atol=1e-6,
                                   msg=key)
    stats = graphed[0].collection.cache_stats()
    assert stats["admitted"] > 0 and stats["hits"] > 0


@pytest.mark.gpu
def test_set_hyper_reaches_replays_of_a_captured_step_and_is_refused_inside_a_capture():
    """A captured step reads the hyperparameters where they were when it was captured:
    set_hyper writes them there, so an lr of 0 set after the capture stops the replays'
    updates; inside a capture (which a replay would not run) it raises and changes
    nothing."""
    _need_gpu()
    ebc = EmbeddingBagCollection(tables(), "sgd", {"lr": 0.5}, device="cuda", seed=3)
    offsets, batches = fixed_length_batches(ROWS, 16, 1)
    idx = batches[0][0]

    def step():
        ebc(idx, offsets).sum().backward()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
        with pytest.raises(RuntimeError, match="captured"):
            ebc.collection.set_hyper(lr=0.0)
    assert all(h["lr"] == 0.5 for h in ebc.collection.hypers)

    def weights():
        torch.cuda.synchronize()
        return [ebc.collection.weights(t).copy() for t in range(len(ROWS))]

    before = weights()
    graph.replay()
    assert any(not np.array_equal(a, b) for a, b in zip(before, weights()))
    ebc.collection.set_hyper(lr=0.0)
    before = weights()
    graph.replay()
    for a, b in zip(before, weights()):
        np.testing.assert_array_equal(a, b)
