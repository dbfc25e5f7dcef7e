import numpy as np
import pytest

torch = pytest.importorskip("torch")

import xferlib  # noqa: E402
from xferlib.adapters.torch import HostEmbedding, HostEmbeddingBag  # noqa: E402
from xferlib.testing import GPU_SKIP_REASON  # noqa: E402

ROWS, DIM = 40, 6


def _reference_step(name, hyper, weights, state, steps, flat_idx, bag_fn, grad_out):
    """Dense float64 autograd through the same bag op, then the lazy sparse update on the
    rows the batch touched."""
    w = torch.tensor(weights, requires_grad=True)
    out = bag_fn(w)
    out.backward(grad_out.double())
    touched = np.unique(flat_idx)
    grads = w.grad.numpy()[touched]
    return xferlib.sparse_update_reference(name, weights, state, steps, touched, grads, hyper)


def _state(module):
    return {n: np.array(module.table.state(n), dtype=np.float64)
            for n in module.table.state_names() if n != "step"}


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("name, hyper", [("sgd", {"lr": 0.1, "momentum": 0.9}),
                                         ("adam", {"lr": 0.01}),
                                         ("adagrad", {"lr": 0.1}),
                                         ("rmsprop", {"lr": 0.01, "centered": True})])
def test_bag_fused_update_matches_reference(device, rng, mode, name, hyper):
    init = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    bag = HostEmbeddingBag(ROWS, DIM, mode=mode, optimizer=name, optimizer_kwargs=hyper,
                           device=device, init=init.copy())
    weights, state, steps = init.astype(np.float64), _state(bag), np.zeros(ROWS)
    for _ in range(4):
        idx = torch.from_numpy(rng.integers(0, ROWS, size=25))
        offsets = torch.tensor([0, 3, 3, 10, 24])
        out = bag(idx.to(device), offsets.to(device))
        grad_out = torch.from_numpy(rng.standard_normal(out.shape).astype(np.float32))
        out.backward(grad_out.to(device))

        def bag_fn(w):
            return torch.nn.functional.embedding_bag(idx, w, offsets, mode=mode)

        expected_out = bag_fn(torch.tensor(weights)).numpy()
        np.testing.assert_allclose(out.detach().cpu().numpy(), expected_out, rtol=1e-5,
                                   atol=1e-6)
        weights, state, steps = _reference_step(name, hyper, weights, state, steps,
                                                idx.numpy(), bag_fn, grad_out)
    np.testing.assert_allclose(bag.table.numpy(), weights, rtol=2e-5, atol=2e-6)


def test_bag_options_match_torch(device, rng):
    """2-D input, include_last_offset, per_sample_weights, padding_idx: outputs equal
    torch.nn.EmbeddingBag's, and SGD equals a dense SGD step on the same gradient."""
    init = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    for kwargs, call in [
        (dict(mode="mean"), lambda m: m(torch.tensor([[1, 2, 2], [0, 5, 9]]))),
        (dict(mode="sum", include_last_offset=True),
         lambda m: m(torch.tensor([4, 4, 7, 8]), torch.tensor([0, 1, 4]))),
        (dict(mode="sum"), lambda m: m(torch.tensor([3, 1, 3]), torch.tensor([0, 1]),
                             per_sample_weights=torch.tensor([0.5, 2.0, -1.0]))),
        (dict(mode="sum", padding_idx=2), lambda m: m(torch.tensor([2, 1, 2, 5]), torch.tensor([0, 2]))),
        (dict(mode="mean", padding_idx=2),
         lambda m: m(torch.tensor([[2, 1], [2, 2]]))),
    ]:
        weights = init.copy()
        if "padding_idx" in kwargs:
            weights[kwargs["padding_idx"]] = 0
        dense = torch.nn.EmbeddingBag(ROWS, DIM, **kwargs, _weight=torch.tensor(weights))
        ours = HostEmbeddingBag(ROWS, DIM, optimizer="sgd", optimizer_kwargs={"lr": 0.5},
                                device=device, init=init.copy(), **kwargs)

        def moved(m, call=call):
            if m is dense:
                return call(m)
            return call(lambda *a, **k: m(*[x.to(device) for x in a],
                                          **{n: v.to(device) for n, v in k.items()}))

        expected, out = moved(dense), moved(ours)
        np.testing.assert_allclose(out.detach().cpu().numpy(), expected.detach().numpy(),
                                   rtol=1e-6, atol=1e-6)
        g = torch.from_numpy(rng.standard_normal(expected.shape).astype(np.float32))
        expected.backward(g)
        out.backward(g.to(device))
        with torch.no_grad():
            dense.weight -= 0.5 * dense.weight.grad
        np.testing.assert_allclose(ours.table.numpy(), dense.weight.detach().numpy(),
                                   rtol=1e-5, atol=1e-6)
        if "padding_idx" in kwargs:
            assert ours.table.state("step")[kwargs["padding_idx"]] == 0


def test_embedding_fused(device, rng):
    init = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    emb = HostEmbedding(ROWS, DIM, optimizer="adamw", optimizer_kwargs={"lr": 0.05},
                        device=device, init=init.copy())
    weights, state, steps = init.astype(np.float64), _state(emb), np.zeros(ROWS)
    for _ in range(3):
        idx = torch.from_numpy(rng.integers(0, ROWS, size=(4, 5)))
        out = emb(idx.to(device))
        assert out.shape == (4, 5, DIM)
        grad_out = torch.from_numpy(rng.standard_normal(out.shape).astype(np.float32))
        out.backward(grad_out.to(device))
        weights, state, steps = _reference_step(
            "adamw", {"lr": 0.05}, weights, state, steps, idx.numpy().ravel(),
            lambda w: torch.nn.functional.embedding(idx, w), grad_out)
    np.testing.assert_allclose(emb.table.numpy(), weights, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("optimizer_cls, kwargs", [
    ("NAdam", {"lr": 0.05}), ("Rprop", {"lr": 0.01}), ("RAdam", {"lr": 0.05}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True}), ("ASGD", {"lr": 0.05}),
    ("AdamW", {"lr": 0.05, "weight_decay": 0.1}),  # a group key its constructor does not take
])
def test_any_torch_optimizer_matches_dense_when_every_row_is_touched(device, rng,
                                                                     optimizer_cls, kwargs):
    """optimizer=None: with every row in every batch, swapping rows and state in and out
    around optimizer.step() must reproduce the dense torch.optim run exactly."""
    rows = 12
    init = rng.standard_normal((rows, DIM)).astype(np.float32)
    dense = torch.nn.EmbeddingBag(rows, DIM, mode="sum", _weight=torch.tensor(init.copy()))
    ours = HostEmbeddingBag(rows, DIM, mode="sum", optimizer=None, device=device,
                            init=init.copy())
    opt_dense = getattr(torch.optim, optimizer_cls)(dense.parameters(), **kwargs)
    opt_ours = getattr(torch.optim, optimizer_cls)(ours.parameters(), **kwargs)
    for step in range(5):
        idx = torch.from_numpy(rng.permutation(np.r_[np.arange(rows),
                                                     rng.integers(0, rows, 8)]))
        offsets = torch.tensor([0, 5, 11])
        g = torch.from_numpy(rng.standard_normal((3, DIM)).astype(np.float32))
        for module, opt, dev in ((dense, opt_dense, "cpu"), (ours, opt_ours, device)):
            opt.zero_grad()
            module(idx.to(dev), offsets.to(dev)).backward(g.to(dev))
            opt.step()
    np.testing.assert_allclose(ours.table.numpy(), dense.weight.detach().numpy(), rtol=2e-5,
                               atol=2e-6)


def test_any_optimizer_leaves_untouched_rows_and_keeps_state(device, rng):
    init = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    ours = HostEmbedding(ROWS, DIM, optimizer=None, device=device, init=init.copy())
    opt = torch.optim.Adam(ours.parameters(), lr=0.1)
    batches = [torch.tensor([1, 2, 2]), torch.tensor([7]), torch.tensor([2, 1])]
    for idx in batches:
        opt.zero_grad()
        ours(idx.to(device)).sum().backward()
        opt.step()
    weights = ours.table.numpy()
    untouched = np.setdiff1d(np.arange(ROWS), [1, 2, 7])
    np.testing.assert_array_equal(weights[untouched], init[untouched])
    # Rows 1 and 2 carry their Adam moments across the batch without them.
    exp_avg = ours.state_dict()["optimizer_state.exp_avg"].numpy()
    assert np.all(exp_avg[[1, 2, 7]] != 0) and not exp_avg[untouched].any()


def test_an_optimizer_whose_state_spans_rows_is_refused(device, rng):
    """optimizer=None with Adafactor: its factored moments (col_var: one value per column
    for all rows) cannot be swapped in and out by row; refused with a ValueError naming it,
    not a shape error from the row copies steps later."""
    ours = HostEmbedding(ROWS, DIM, optimizer=None, device=device)
    opt = torch.optim.Adafactor(ours.parameters(), lr=0.01)
    with pytest.raises(ValueError, match="Adafactor.*not one row per embedding row"):
        for idx in (torch.tensor([1, 2]), torch.tensor([3]), torch.tensor([2, 5])):
            opt.zero_grad()
            ours(idx.to(device)).sum().backward()
            opt.step()


@pytest.mark.parametrize("optimizer_cls", ["Adagrad", "Adam"])
def test_any_optimizer_resumes_copies_and_refuses_two_forwards(device, rng, optimizer_cls):
    """optimizer=None: Adagrad (its state made in __init__, for no rows yet) trains; a module
    and optimizer rebuilt from their state dicts go on as the uninterrupted run; a deepcopy
    and a pickled copy train too; a backward after a later forward replaced the rows, and a
    forward after an unstepped backward, are refused (the gradient would land elsewhere)."""
    import copy
    import io
    import pickle

    init = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    batches = [torch.tensor([1, 2, 2]), torch.tensor([7, 1]), torch.tensor([3, 2]),
               torch.tensor([9, 7, 0])]

    def build():
        module = HostEmbedding(ROWS, DIM, optimizer=None, device=device, init=init.copy())
        return module, getattr(torch.optim, optimizer_cls)(module.parameters(), lr=0.1)

    def train(module, opt, steps):
        for idx in steps:
            opt.zero_grad()
            (module(idx.to(device)) ** 2).sum().backward()
            opt.step()

    whole, whole_opt = build()
    train(whole, whole_opt, batches)
    first, first_opt = build()
    train(first, first_opt, batches[:2])
    saved = io.BytesIO()
    torch.save({"module": first.state_dict(), "opt": first_opt.state_dict()}, saved)
    saved.seek(0)
    checkpoint = torch.load(saved)
    resumed, resumed_opt = build()
    resumed.load_state_dict(checkpoint["module"])
    resumed_opt.load_state_dict(checkpoint["opt"])
    train(resumed, resumed_opt, batches[2:])
    np.testing.assert_array_equal(resumed.table.numpy(), whole.table.numpy())
    for copied in (copy.deepcopy(first), pickle.loads(pickle.dumps(first))):
        before = np.array(copied.table.numpy())
        train(copied, getattr(torch.optim, optimizer_cls)(copied.parameters(), lr=0.1),
              batches[:1])
        assert not np.array_equal(copied.table.numpy(), before)
    module, opt = build()
    a, b = module(batches[0].to(device)), module(batches[1].to(device))
    with pytest.raises(RuntimeError, match="a later forward replaced the rows"):
        (a.sum() + b.sum()).backward()
    opt.zero_grad()
    module(batches[0].to(device)).sum().backward()
    with pytest.raises(RuntimeError, match="no optimizer.step"):
        module(batches[1].to(device))
    with torch.no_grad():  # a lookup that trains nothing is always fine
        module(batches[1].to(device))
    opt.step()
    module(batches[1].to(device))


def test_any_optimizer_steps_an_empty_batch(device, rng):
    """optimizer=None: a step after an empty batch (no rows, optimizer state already made)
    moves no row and training goes on; it raised a reshape error in the step hook."""
    init = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    ours = HostEmbeddingBag(ROWS, DIM, mode="sum", optimizer=None, device=device,
                            init=init.copy())
    opt = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    for idx, offsets in ((torch.tensor([1, 2, 2]), torch.tensor([0, 1])),
                         (torch.tensor([], dtype=torch.int64), torch.tensor([0, 0]))):
        opt.zero_grad()
        ours(idx.to(device), offsets.to(device)).sum().backward()
        before = np.array(ours.table.numpy())
        opt.step()
    np.testing.assert_array_equal(ours.table.numpy(), before)
    ours(torch.tensor([3]).to(device), torch.tensor([0]).to(device)).sum().backward()
    opt.step()
    assert not np.array_equal(ours.table.numpy()[3], init[3])


def test_any_optimizer_load_state_dict_takes_the_checkpoints_row_state(device, rng):
    """optimizer=None: loading a checkpoint of a module that never stepped (no
    optimizer_state) starts the rows' torch.optim state afresh, as that module would (the
    old moments stayed); an optimizer_state of another shape is refused before anything is
    written (the weights were restored, then a broadcast error)."""
    init = rng.standard_normal((ROWS, DIM)).astype(np.float32)

    def build():
        module = HostEmbedding(ROWS, DIM, optimizer=None, device=device, init=init.copy())
        return module, torch.optim.Adam(module.parameters(), lr=0.1)

    def train(module, opt, steps):
        for idx in steps:
            opt.zero_grad()
            (module(idx.to(device)) ** 2).sum().backward()
            opt.step()

    checkpoint = build()[0].state_dict()
    used, used_opt = build()
    train(used, used_opt, [torch.tensor([1, 2]), torch.tensor([3])])
    used.load_state_dict(checkpoint)
    fresh, fresh_opt = build()
    batches = [torch.tensor([3]), torch.tensor([1, 2])]
    train(used, torch.optim.Adam(used.parameters(), lr=0.1), batches)
    train(fresh, fresh_opt, batches)
    np.testing.assert_array_equal(used.table.numpy(), fresh.table.numpy())

    before = np.array(used.table.numpy())
    bad = {"weight": torch.zeros(ROWS, DIM), **{k: v for k, v in checkpoint.items()
                                                if k != "weight"},
           "optimizer_state.exp_avg": torch.zeros(ROWS + 1, DIM)}
    with pytest.raises(RuntimeError, match="size mismatch for optimizer_state.exp_avg"):
        used.load_state_dict(bad)
    np.testing.assert_array_equal(used.table.numpy(), before)
    train(used, torch.optim.Adam(used.parameters(), lr=0.1), batches[:1])  # still trains

def test_state_dict_round_trip(device, rng):
    init = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    a = HostEmbeddingBag(ROWS, DIM, optimizer="adam", device=device, init=init.copy())
    idx, offsets = torch.tensor([1, 5, 5, 9]), torch.tensor([0, 2])
    a(idx.to(device), offsets.to(device)).sum().backward()
    b = HostEmbeddingBag(ROWS, DIM, optimizer="adam", device=device, init="zeros")
    b.load_state_dict(a.state_dict())
    for m in (a, b):
        m(idx.to(device), offsets.to(device)).sum().backward()
    np.testing.assert_array_equal(b.table.numpy(), a.table.numpy())
    np.testing.assert_array_equal(b.table.state("exp_avg_sq"), a.table.state("exp_avg_sq"))
    with pytest.raises(RuntimeError, match="size mismatch"):
        HostEmbeddingBag(ROWS + 1, DIM, device=device).load_state_dict(a.state_dict())
    # A state array of another shape: load_state_dict's error, the table unchanged.
    state = dict(a.state_dict(), weight=torch.zeros(ROWS, DIM))
    state["table_state.exp_avg"] = torch.zeros(ROWS + 1, DIM)
    with pytest.raises(RuntimeError, match="size mismatch for table_state.exp_avg"):
        b.load_state_dict(state)
    np.testing.assert_array_equal(b.table.numpy(), a.table.numpy())



def test_strict_false_loads_the_arrays_given(device, rng):
    """torch's rule: a plain nn.EmbeddingBag's state dict (weights only) loads its weights
    with strict=False and the optimizer state keeps its values; strict=True reports the
    missing state arrays."""
    a = HostEmbeddingBag(ROWS, DIM, optimizer="adam", device=device)
    idx, offsets = torch.tensor([1, 5, 5, 9]), torch.tensor([0, 2])
    a(idx.to(device), offsets.to(device)).sum().backward()
    moments = np.array(a.table.state("exp_avg"))
    plain = torch.nn.EmbeddingBag(ROWS, DIM, mode="sum")
    result = a.load_state_dict(plain.state_dict(), strict=False)
    assert sorted(result.missing_keys) == ["table_state.exp_avg", "table_state.exp_avg_sq",
                                          "table_state.step"]
    np.testing.assert_array_equal(a.table.numpy(), plain.weight.detach().numpy())
    np.testing.assert_array_equal(a.table.state("exp_avg"), moments)
    with pytest.raises(RuntimeError, match="Missing key"):
        a.load_state_dict(plain.state_dict())
    other = HostEmbeddingBag(ROWS, DIM, optimizer="adam", device=device)
    result = other.load_state_dict({"unrelated": torch.zeros(1)}, strict=False)
    assert "weight" in result.missing_keys  # none of its arrays given: nothing loaded

def test_bad_input(device):
    bag = HostEmbeddingBag(ROWS, DIM, optimizer="sgd", device=device)
    before = np.array(bag.table.numpy())
    with pytest.raises(IndexError, match=f"index {ROWS} at position 1"):
        bag(torch.tensor([0, ROWS]).to(device), torch.tensor([0]).to(device))
        bag.check()  # on the GPU the input check is deferred (no host sync)
    with pytest.raises(ValueError, match="offsets"):
        bag(torch.tensor([0, 1]).to(device))
    with pytest.raises(ValueError, match="2-D, offsets must be None"):
        bag(torch.tensor([[0, 1]]).to(device), torch.tensor([0]).to(device))
    with pytest.raises(ValueError, match="mode"):
        HostEmbeddingBag(ROWS, DIM, mode="median")
    with pytest.raises(ValueError, match="unknown optimizer"):
        HostEmbeddingBag(ROWS, DIM, optimizer="lamb")
    with pytest.raises(TypeError, match="int32 or int64"):
        HostEmbedding(ROWS, DIM, optimizer=None, device=device)(torch.tensor([0.5]).to(device))
    np.testing.assert_array_equal(bag.table.numpy(), before)


def test_no_update_without_grad(device):
    bag = HostEmbeddingBag(ROWS, DIM, optimizer="sgd", device=device, init="zeros")
    with torch.no_grad():
        bag(torch.tensor([1, 2]).to(device), torch.tensor([0]).to(device))
    bag.eval()
    bag(torch.tensor([1, 2]).to(device), torch.tensor([0]).to(device))
    assert not bag.table.state("step").any()


@pytest.mark.gpu
def test_results_do_not_depend_on_the_current_stream(rng):
    if not (torch.cuda.is_available() and xferlib.cupy_available()):
        pytest.skip(GPU_SKIP_REASON)
    init = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    modules = [HostEmbeddingBag(ROWS, DIM, optimizer="adam", device="cuda", init=init.copy(),
                                cache_rows=cache) for cache in (0, 0, 8)]
    side = torch.cuda.Stream()
    for _ in range(4):
        idx = torch.from_numpy(rng.integers(0, ROWS, size=30)).cuda()
        offsets = torch.tensor([0, 7, 19], device="cuda")
        g = torch.randn(3, DIM, device="cuda")
        modules[0](idx, offsets).backward(g)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the same work queued on a non-default stream
            for m in modules[1:]:
                m(idx, offsets).backward(g)
        torch.cuda.current_stream().wait_stream(side)
    for m in modules[1:]:
        np.testing.assert_allclose(m.table.numpy(), modules[0].table.numpy(), rtol=1e-6,
                                   atol=1e-7)


def test_nan_gradients_propagate_as_in_torch(rng):
    bag = HostEmbeddingBag(ROWS, DIM, optimizer="adam", device="cpu", init="zeros")
    out = bag(torch.tensor([3, 4]), torch.tensor([0]))
    out.backward(torch.full_like(out, float("nan")))
    dense = torch.nn.Parameter(torch.zeros(2, DIM))
    opt = torch.optim.Adam([dense])
    dense.grad = torch.full_like(dense, float("nan"))
    opt.step()
    np.testing.assert_array_equal(np.isnan(bag.table.numpy()[[3, 4]]),
                                  torch.isnan(dense).numpy())
    assert not np.isnan(bag.table.numpy()[[0, 1, 2, 5]]).any()


def test_per_sample_weights_follow_torch_modes():
    """torch defines per-sample weights for mode='sum' only and raises NotImplementedError
    otherwise; the module answers the same, before any row moves."""
    for mode in ("mean", "max"):
        ours = HostEmbeddingBag(ROWS, DIM, mode=mode, optimizer="sgd", device="cpu")
        theirs = torch.nn.EmbeddingBag(ROWS, DIM, mode=mode)
        args = (torch.tensor([1, 2]), torch.tensor([0]), torch.ones(2))
        for module in (ours, theirs):
            with pytest.raises(NotImplementedError, match="mode='sum'"):
                module(*args)


@pytest.mark.gpu
def test_prefetch_then_forward_matches_plain(rng=None):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU for torch")
    gen = np.random.default_rng(5)
    kw = dict(optimizer="adam", optimizer_kwargs={"lr": 0.1}, device="cuda", seed=3,
              cache_rows=16)
    a, b = HostEmbeddingBag(ROWS, DIM, **kw), HostEmbeddingBag(ROWS, DIM, **kw)
    batches = [torch.from_numpy(gen.integers(0, ROWS, size=24)).cuda() for _ in range(5)]
    offsets = torch.arange(0, 24, 4).cuda()
    for step, idx in enumerate(batches):
        out_a = a(idx, offsets)
        if step + 1 < len(batches):
            a.prefetch(batches[step + 1], offsets)
        out_a.sum().backward()
        out_b = b(idx, offsets)
        out_b.sum().backward()
        torch.testing.assert_close(out_a, out_b, rtol=0, atol=0)
    np.testing.assert_array_equal(a.table.numpy(), b.table.numpy())
