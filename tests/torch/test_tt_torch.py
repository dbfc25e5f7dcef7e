import numpy as np
import pytest

torch = pytest.importorskip("torch")

from xferlib.adapters.torch import OptimType, TTEmbeddingBag, tt_matrix_to_full  # noqa: E402


def _torch_full(module):
    """The dense table from the cores with differentiable torch ops (the test's reference)."""
    p, q, r = module.tt_p_shapes, module.tt_q_shapes, module.tt_ranks
    res = None
    for k, c in enumerate(module.tt_cores):
        g = c[0].view(p[k], r[k], q[k], r[k + 1])
        if res is None:
            res = g.reshape(p[k], q[k], r[k + 1])  # r[0] == 1
            continue
        res = torch.einsum("aAr,bris->abAis", res, g)
        res = res.reshape(res.shape[0] * res.shape[1], res.shape[2] * res.shape[3], r[k + 1])
    return res[:, :, 0]


def _bag(n=4, per_bag=5, num=600, seed=0):
    g = torch.Generator().manual_seed(seed)
    indices = torch.randint(0, num, (n * per_bag,), generator=g)
    indices[:3] = indices[3]  # repeats
    offsets = torch.arange(0, n * per_bag + 1, per_bag)
    return indices, offsets


# (num_embeddings, ranks, p, q): d = 2, 3, 4, most with a core of more rows than its slice
# width R_k q_k R_{k+1} (rows FBTT's fused update never reached).
CONFIGS = [
    (240, [2], [40, 6], [2, 4]),
    (600, [3, 4], [6, 10, 10], [2, 2, 4]),
    (590, [2, 2], [40, 3, 5], [2, 2, 2]),
    (144, [2, 2, 2], [12, 2, 3, 2], [2, 1, 2, 2]),
]


def _module(config, **kw):
    num, ranks, p, q = config
    return TTEmbeddingBag(num, int(np.prod(q)), ranks, tt_p_shapes=p, tt_q_shapes=q,
                          weight_dist="normal", **kw)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"d{len(c[2])}-{c[0]}")
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_forward_and_dense_gradients_match_a_torch_reference(mode, config):
    bag = _module(config, sparse=False, mode=mode, seed=0)
    indices, offsets = _bag(num=config[0])
    weights = torch.rand(indices.shape) if mode == "sum" else None
    out = bag(indices, offsets, weights)
    full = _torch_full(bag)
    ref = torch.nn.functional.embedding_bag(indices, full, offsets[:-1], mode=mode,
                                            per_sample_weights=weights)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    g = torch.randn(out.shape)
    out.backward(g)
    ours = [c.grad.clone() for c in bag.tt_cores]
    for c in bag.tt_cores:
        c.grad = None
    ref.backward(g)  # into the cores through the differentiable dense reference
    for mine, c in zip(ours, bag.tt_cores):
        torch.testing.assert_close(mine, c.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(bag.full_weight(), _torch_full(bag).detach(), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"d{len(c[2])}-{c[0]}")
def test_sparse_sgd_is_fused_into_backward(config):
    """The fused SGD step equals the cores minus lr times autograd's core gradients, on
    every row of every core (the whole core is compared)."""
    bag = _module(config, optimizer=OptimType.SGD, learning_rate=0.5, seed=1)
    dense = _module(config, sparse=False, seed=1)
    indices, offsets = _bag(n=12, per_bag=8, num=config[0], seed=3)
    g = torch.randn(12, int(np.prod(config[3])))
    before = [c.detach().clone() for c in bag.tt_cores]
    bag(indices, offsets).backward(g)
    dense(indices, offsets).backward(g)
    for c, b, d in zip(bag.tt_cores, before, dense.tt_cores):
        assert c.grad is None
        torch.testing.assert_close(c.detach(), b - 0.5 * d.grad, rtol=1e-5, atol=1e-6)


def test_trains_a_bag_toward_targets():
    bag = TTEmbeddingBag(1000, 8, [4, 4], optimizer=OptimType.EXACT_ROWWISE_ADAGRAD,
                         learning_rate=0.2, seed=2)
    indices, offsets = _bag(n=8, per_bag=3, num=1000, seed=4)
    target = torch.randn(8, 8)
    first = torch.nn.functional.mse_loss(bag(indices, offsets), target).item()
    for _ in range(50):
        torch.nn.functional.mse_loss(bag(indices, offsets), target).backward()
    assert torch.nn.functional.mse_loss(bag(indices, offsets), target).item() < 0.5 * first


def test_shapes_defaults_and_bad_input():
    bag = TTEmbeddingBag(11_000_000, 64, [32, 32], sparse=False, weight_dist="uniform", seed=0,
                         use_cache=False)
    assert np.prod(bag.tt_p_shapes) >= 11_000_000 and bag.tt_q_shapes == [4, 4, 4]
    assert [tuple(c.shape) for c in bag.tt_cores][1][0] == 1
    assert bag.tt_ranks == [1, 32, 32, 1]
    with pytest.raises(ValueError, match="OptimType"):
        TTEmbeddingBag(100, 8, [2, 2], optimizer="lamb")
    # FBTT's cache defaults: use_cache=True, 10% of the rows, one frequency slot per row
    default = TTEmbeddingBag(1000, 8, [2, 2])
    assert default.use_cache and default.warmup and default.cache_weight.shape == (100, 8)
    assert default.hashtbl.shape == (1000,) and default.cache_state.shape == (1000,)
    with pytest.raises(ValueError, match="hashtbl_size"):
        TTEmbeddingBag(100, 8, [2, 2], use_cache=True, cache_size=10, hashtbl_size=5)
    with pytest.raises(RuntimeError, match="use_cache=False"):
        TTEmbeddingBag(100, 8, [2, 2], use_cache=False).cache_populate()
    with pytest.raises(ValueError, match="num_embeddings"):
        TTEmbeddingBag(1000, 8, [2, 2], tt_p_shapes=[2, 2, 2], tt_q_shapes=[2, 2, 2])
    small = TTEmbeddingBag(100, 8, [2, 2], sparse=False)
    with pytest.raises(IndexError, match="index 100 at position 1"):
        small(torch.tensor([0, 100]), torch.tensor([0, 2]))
    with pytest.raises(NotImplementedError, match="detach"):  # no weight gradient, said
        small(torch.tensor([0, 1]), torch.tensor([0, 2]),
              per_sample_weights=torch.ones(2, requires_grad=True))


def test_tt_matrix_to_full_accepts_fbtt_layouts():
    bag = TTEmbeddingBag(60, 8, [2, 3], tt_p_shapes=[3, 4, 5], tt_q_shapes=[2, 2, 2],
                         sparse=False, weight_dist="normal", seed=5)
    full = bag.full_weight()
    # the same cores as 4-D (R, p, q, R) tensors, FBTT's natural order
    natural = [c.detach()[0].view(p, r0, q, r1).permute(1, 0, 2, 3).contiguous()
               for c, p, q, r0, r1 in zip(bag.tt_cores, bag.tt_p_shapes, bag.tt_q_shapes,
                                          bag.tt_ranks[:-1], bag.tt_ranks[1:])]
    again = tt_matrix_to_full(bag.tt_p_shapes, bag.tt_q_shapes, [2, 3], natural, [0, 1, 2, 3])
    torch.testing.assert_close(again, full)


ALL_OPTIMIZERS = [OptimType.SGD, OptimType.EXACT_ADAGRAD, OptimType.EXACT_ROWWISE_ADAGRAD,
                  OptimType.ADAM, OptimType.LAMB, OptimType.LARS_SGD,
                  OptimType.PARTIAL_ROWWISE_ADAM, OptimType.PARTIAL_ROWWISE_LAMB]


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ALL_OPTIMIZERS, ids=str)
def test_cuda_matches_cpu(optimizer):
    """The module on a GPU (CuPy views of the tensors, torch's stream) trains as on the CPU."""
    import xferlib

    if not (torch.cuda.is_available() and xferlib.cupy_available()):
        pytest.skip("needs a CUDA GPU with CuPy; none here")
    kw = dict(tt_p_shapes=[6, 10, 10], tt_q_shapes=[2, 2, 4], optimizer=optimizer,
              learning_rate=0.05, weight_dist="normal", seed=3)
    cpu, gpu = TTEmbeddingBag(600, 16, [3, 4], **kw), TTEmbeddingBag(600, 16, [3, 4], **kw).cuda()
    for seed in range(4):
        indices, offsets = _bag(seed=seed)
        out_cpu = cpu(indices, offsets)
        out_gpu = gpu(indices.cuda(), offsets.cuda())
        np.testing.assert_allclose(out_gpu.detach().cpu().numpy(), out_cpu.detach().numpy(),
                                   rtol=1e-4, atol=1e-5)
        g = torch.randn(out_cpu.shape, generator=torch.Generator().manual_seed(seed))
        out_cpu.backward(g)
        out_gpu.backward(g.cuda())
    assert gpu.iter == cpu.iter == 4  # the device counter, counted by the gradient kernel
    for a, b in zip(cpu.tt_cores, gpu.tt_cores):
        np.testing.assert_allclose(b.detach().cpu().numpy(), a.detach().numpy(), rtol=1e-4,
                                   atol=1e-5)
    assert gpu.full_weight().device.type == "cuda"
    dense = TTEmbeddingBag(600, 16, [3, 4], sparse=False, **kw).cuda()
    dense(*(t.cuda() for t in _bag())).sum().backward()
    assert all(c.grad is not None and c.grad.is_cuda for c in dense.tt_cores)


@pytest.mark.parametrize("optimizer", [OptimType.EXACT_ADAGRAD, OptimType.ADAM])
def test_state_dict_carries_the_fused_optimizer_state(optimizer):
    kw = dict(tt_p_shapes=[6, 10, 10], tt_q_shapes=[2, 2, 4], optimizer=optimizer,
              learning_rate=0.05, weight_dist="normal")
    a = TTEmbeddingBag(600, 16, [3, 4], seed=1, **kw)
    for seed in range(3):
        a(*_bag(seed=seed)).sum().backward()
    checkpoint = a.state_dict()
    assert any(key.startswith("optimizer_state.") for key in checkpoint)
    b = TTEmbeddingBag(600, 16, [3, 4], seed=2, **kw)
    b.load_state_dict(checkpoint)
    for module in (a, b):
        module(*_bag(seed=7)).sum().backward()
    for x, y in zip(a.tt_cores, b.tt_cores):
        np.testing.assert_array_equal(x.detach().numpy(), y.detach().numpy())
    # FBTT's keys only (no step, no extra state): loads strictly (tests/torch/test_fbtt_compat.py
    # builds FBTT's checkpoints in full)
    fbtt_keys = {k: v for k, v in checkpoint.items() if k != "optimizer_step"
                 and (k.startswith(("tt_cores.", "L", "hashtbl", "cache_", "optimizer_state."
                                    "optimizer_state")))}
    TTEmbeddingBag(600, 16, [3, 4], **kw).load_state_dict(fbtt_keys)


# ----------------------------------------------------------------------------- row cache

CACHE_KW = dict(tt_p_shapes=[6, 10, 10], tt_q_shapes=[2, 2, 4], weight_dist="normal", seed=3,
                learning_rate=0.05)


def _hot_bag(step, num=600):
    """Bags where rows 5, 17 and 400 are hot."""
    g = torch.Generator().manual_seed(step)
    indices = torch.randint(0, num, (24,), generator=g)
    indices[::3] = torch.tensor([5, 17, 400, 5, 17, 5, 5, 400])
    return indices, torch.arange(0, 25, 6)


def _cached_pair(optimizer, device="cpu", sparse=True):
    plain = TTEmbeddingBag(600, 16, [3, 4], optimizer=optimizer, sparse=sparse, **CACHE_KW)
    cached = TTEmbeddingBag(600, 16, [3, 4], optimizer=optimizer, sparse=sparse,
                            use_cache=True, cache_size=3, hashtbl_size=64, **CACHE_KW)
    return plain.to(device), cached.to(device)


def test_cache_counts_populates_and_serves_cached_rows():
    _, bag = _cached_pair(OptimType.SGD)
    for step in range(3):
        bag(*_hot_bag(step)).sum().backward()
    bag.cache_populate()
    assert bag.cache_rows[:3].tolist() == [5, 17, 400]
    before = bag.full_weight().detach()
    # the cached dense rows start from the cores' rows
    torch.testing.assert_close(bag.cache_weight.detach(), before[[5, 17, 400]])
    indices, offsets = _hot_bag(7)
    bag.train(False)
    out = bag(indices, offsets)
    with torch.no_grad():
        bag.cache_weight[0] += 1.0  # cached row 5 now differs from the cores' row 5
    reference = torch.nn.EmbeddingBag.from_pretrained(bag.full_weight().detach(), mode="sum",
                                                      include_last_offset=True)
    torch.testing.assert_close(bag(indices, offsets), reference(indices, offsets))
    assert not torch.allclose(bag(indices, offsets), out)
    counts = dict(zip(bag.hashtbl.tolist(), bag.cache_freq.tolist()))
    assert counts[5] == 12 and counts[17] == 6 and counts[400] == 6  # 3 training forwards


@pytest.mark.parametrize("optimizer", [OptimType.SGD, OptimType.EXACT_ADAGRAD,
                                       OptimType.EXACT_ROWWISE_ADAGRAD, OptimType.ADAM])
def test_cache_is_write_through(optimizer, device="cpu"):
    """With the same bag gradients, the cores of a cached module train exactly as without a
    cache (every lookup reaches them), while cached rows take the optimizer's dense steps."""
    plain, cached = _cached_pair(optimizer, device)
    for step in range(2):
        batch = [t.to(device) for t in _hot_bag(step)]
        plain(*batch).sum().backward()
        cached(*batch).sum().backward()
    cached.cache_populate()
    start = cached.cache_weight.detach().clone()
    dense = torch.nn.Parameter(start.clone())
    torch_opt = {OptimType.SGD: lambda p: torch.optim.SGD(p, lr=0.05),
                 OptimType.EXACT_ADAGRAD: lambda p: torch.optim.Adagrad(p, lr=0.05, eps=1e-10)}
    reference = torch_opt.get(optimizer, lambda p: None)([dense])
    for step in range(2, 6):
        indices, offsets = (t.to(device) for t in _hot_bag(step))
        g = torch.randn(4, 16, generator=torch.Generator().manual_seed(step)).to(device)
        plain(indices, offsets).backward(g)
        cached(indices, offsets).backward(g)
        if reference is not None:  # the cached rows' own gradient: their lookups' bag rows
            slot = {5: 0, 17: 1, 400: 2}
            grad = torch.zeros_like(dense)
            for position, row in enumerate(indices.tolist()):
                if row in slot:
                    grad[slot[row]] += g[position // 6]
            dense.grad = grad
            reference.step()
    for a, b in zip(plain.tt_cores, cached.tt_cores):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    if reference is not None:
        torch.testing.assert_close(cached.cache_weight.detach(), dense.detach(), rtol=1e-5,
                                   atol=1e-6)
    assert not torch.allclose(cached.cache_weight.detach(), start)


def test_repopulate_keeps_trained_rows_and_reset_returns_to_the_cores():
    _, bag = _cached_pair(OptimType.SGD)
    for step in range(2):
        bag(*_hot_bag(step)).sum().backward()
    bag.cache_populate()
    for step in range(2, 4):
        bag(*_hot_bag(step)).sum().backward()
    trained = bag.cache_weight.detach().clone()
    # row 250 becomes the hottest: it enters, the least frequent (17 or 400) leaves
    bag.update_cache(torch.full((40,), 250))
    bag.cache_populate()
    rows = bag.cache_rows.tolist()
    assert 250 in rows and 5 in rows
    kept = rows.index(5)
    torch.testing.assert_close(bag.cache_weight.detach()[kept], trained[0])
    cores_only = tt_matrix_to_full(bag.tt_p_shapes, bag.tt_q_shapes, bag.tt_ranks,
                                   list(bag.tt_cores), [1, 0, 2, 3])
    torch.testing.assert_close(bag.cache_weight.detach()[rows.index(250)], cores_only[250])
    bag.reset_cache()
    torch.testing.assert_close(bag.full_weight(), cores_only)
    assert (bag.hashtbl == -1).all() and (bag.cache_freq == 0).all()
    with pytest.raises(IndexError, match="index 600 at position 0"):
        bag.update_cache(torch.tensor([600]))
    # other dtypes were cast with .long() and counted rows nobody looked up
    for bad in (torch.tensor([250.7]), torch.tensor([True, False]),
                torch.tensor([5], dtype=torch.uint8)):
        with pytest.raises(TypeError, match="int32 or int64"):
            bag.update_cache(bad)
    assert (bag.hashtbl == -1).all() and (bag.cache_freq == 0).all()


def test_cache_with_dense_gradients_and_state_dict():
    plain, cached = _cached_pair(OptimType.SGD, sparse=False)
    cached.update_cache(torch.tensor([5, 5, 17, 400, 400, 400]))
    cached.cache_populate()
    indices, offsets = _hot_bag(3)
    g = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    cached(indices, offsets).backward(g)
    plain(indices, offsets).backward(g)
    for a, b in zip(plain.tt_cores, cached.tt_cores):  # write-through: every lookup
        torch.testing.assert_close(b.grad, a.grad)
    expected = torch.zeros(3, 16)
    for position, row in enumerate(indices.tolist()):
        if row in (5, 17, 400):
            expected[[5, 17, 400].index(row)] += g[position // 6]
    torch.testing.assert_close(cached.cache_weight.grad, expected)
    again = TTEmbeddingBag(600, 16, [3, 4], sparse=False, use_cache=True, cache_size=3,
                           hashtbl_size=64, **CACHE_KW)
    again.load_state_dict(cached.state_dict())
    torch.testing.assert_close(again.full_weight(), cached.full_weight())
    assert again.cache_rows.tolist() == cached.cache_rows.tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ALL_OPTIMIZERS, ids=str)
def test_cache_on_cuda(optimizer):
    import xferlib

    if not (torch.cuda.is_available() and xferlib.cupy_available()):
        pytest.skip("needs a CUDA GPU with CuPy; none here")
    test_cache_is_write_through(optimizer, device="cuda")
    cpu = TTEmbeddingBag(600, 16, [3, 4], optimizer=optimizer, use_cache=True, cache_size=3,
                         hashtbl_size=64, **CACHE_KW)
    gpu = TTEmbeddingBag(600, 16, [3, 4], optimizer=optimizer, use_cache=True, cache_size=3,
                         hashtbl_size=64, **CACHE_KW).cuda()
    for step in range(4):
        indices, offsets = _hot_bag(step)
        out_cpu, out_gpu = cpu(indices, offsets), gpu(indices.cuda(), offsets.cuda())
        torch.testing.assert_close(out_gpu.cpu(), out_cpu, rtol=1e-4, atol=1e-5)
        out_cpu.sum().backward()
        out_gpu.sum().backward()
        if step == 1:
            cpu.cache_populate()
            gpu.cache_populate()
    gpu.check_inputs()
    assert gpu.cache_rows.tolist() == cpu.cache_rows.tolist()
    assert gpu.cache_freq.sum().item() == cpu.cache_freq.sum().item()
    torch.testing.assert_close(gpu.cache_weight.detach().cpu(), cpu.cache_weight.detach(),
                               rtol=1e-4, atol=1e-5)
    for name, value in cpu.named_buffers():
        if name.startswith("cache_optimizer_state"):
            torch.testing.assert_close(gpu.get_buffer(name).cpu(), value, rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(gpu.full_weight().cpu(), cpu.full_weight(), rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", [OptimType.SGD, OptimType.EXACT_ROWWISE_ADAGRAD,
                                       OptimType.LAMB], ids=str)
def test_cache_hot_rows_spanning_many_tiles_on_cuda(optimizer):
    """Cached rows looked up hundreds of times in one batch (runs over several tiles of the
    cache kernels' sorted batch) train as on the CPU."""
    import xferlib

    if not (torch.cuda.is_available() and xferlib.cupy_available()):
        pytest.skip("needs a CUDA GPU with CuPy; none here")
    # a frequency table with room for every row: the counts, hence the cached rows, are the
    # same whatever order the GPU's atomic inserts take
    kw = dict(optimizer=optimizer, use_cache=True, cache_size=3, hashtbl_size=4096, **CACHE_KW)
    cpu = TTEmbeddingBag(600, 16, [3, 4], **kw)
    gpu = TTEmbeddingBag(600, 16, [3, 4], **kw).cuda()
    g = torch.Generator().manual_seed(0)
    indices = torch.randint(0, 600, (3000,), generator=g)
    indices[torch.randperm(3000, generator=g)[:1500]] = 5
    indices[torch.randperm(3000, generator=g)[:700]] = 17
    offsets = torch.arange(0, 3001, 30)
    for module, device in ((cpu, "cpu"), (gpu, "cuda")):
        module.update_cache(indices.to(device))
        module.cache_populate()
    assert {5, 17} <= set(cpu.cache_rows.tolist())
    assert gpu.cache_rows.tolist() == cpu.cache_rows.tolist()
    for step in range(2):
        grad = torch.randn(100, 16, generator=torch.Generator().manual_seed(step))
        cpu(indices, offsets).backward(grad)
        gpu(indices.cuda(), offsets.cuda()).backward(grad.cuda())
    gpu.check_inputs()
    torch.testing.assert_close(gpu.cache_weight.detach().cpu(), cpu.cache_weight.detach(),
                               rtol=1e-4, atol=1e-5)
    for a, b in zip(gpu.tt_cores, cpu.tt_cores):
        torch.testing.assert_close(a.detach().cpu(), b.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_cuda_training_step_defers_its_input_check():
    """A GPU training step never waits for its input check: a bad batch changes nothing and
    the error comes with a later call of the module (or check_inputs())."""
    import xferlib

    if not (torch.cuda.is_available() and xferlib.cupy_available()):
        pytest.skip("needs a CUDA GPU with CuPy; none here")
    bag = TTEmbeddingBag(600, 16, [3, 4], tt_p_shapes=[6, 10, 10], tt_q_shapes=[2, 2, 4],
                         optimizer=OptimType.EXACT_ADAGRAD, weight_dist="normal", seed=0).cuda()
    before = [c.detach().clone() for c in bag.tt_cores]
    bad = torch.tensor([1, 600, 2], device="cuda")
    offsets = torch.tensor([0, 1, 3], device="cuda")
    bag(bad, offsets).sum().backward()  # queued without waiting
    for a, b in zip(bag.tt_cores, before):
        torch.testing.assert_close(a.detach(), b, rtol=0, atol=0)
    with pytest.raises(IndexError, match="index 600 at position 1"):
        bag.check_inputs()
    bag.check_inputs()  # reported once
    bag(bad, offsets).sum().backward()
    torch.cuda.synchronize()  # the step is done: the next call reports it
    with pytest.raises(IndexError, match="index 600 at position 1"):
        bag(torch.tensor([1], device="cuda"), torch.tensor([0, 1], device="cuda"))
    good = torch.tensor([1, 2, 3], device="cuda")
    bag(bad, offsets).sum().backward()
    with pytest.raises(IndexError, match="index 600 at position 1"):
        for _ in range(3):  # at the latest the third call after the bad step
            bag(good, offsets).sum().backward()
    # the good steps that ran before the report (while the bad step's verdict was still on
    # its way) trained as they should; from here on nothing may change
    before = [c.detach().clone() for c in bag.tt_cores]
    bag.defer_input_check = False
    with pytest.raises(ValueError, match="offsets"):
        bag(torch.tensor([1, 2], device="cuda"), torch.tensor([0, 2, 1], device="cuda")).sum(
            ).backward()
    for a, b in zip(bag.tt_cores, before):
        torch.testing.assert_close(a.detach(), b, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("use_cache", [False, True], ids=["plain", "cache"])
@pytest.mark.parametrize("optimizer", ALL_OPTIMIZERS, ids=str)
def test_captured_training_step_equals_eager_steps(optimizer, use_cache):
    """A fused training step at a fixed batch size captured in a torch.cuda.CUDAGraph and
    replayed on new data trains exactly as eager steps on the same data."""
    import xferlib

    if not (torch.cuda.is_available() and xferlib.cupy_available()):
        pytest.skip("needs a CUDA GPU with CuPy; none here")
    kw = dict(tt_p_shapes=[6, 10, 10], tt_q_shapes=[2, 2, 4], optimizer=optimizer,
              learning_rate=0.05, weight_dist="normal", seed=3, use_cache=use_cache,
              cache_size=3, hashtbl_size=600)  # the row count: never full
    eager = TTEmbeddingBag(600, 16, [3, 4], **kw).cuda()
    graphed = TTEmbeddingBag(600, 16, [3, 4], **kw).cuda()
    batches = [[t.cuda() for t in _hot_bag(step)] for step in range(8)]
    grads = [torch.randn(4, 16, generator=torch.Generator().manual_seed(step)).cuda()
             for step in range(8)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up steps (kernels compiled), then the cache filled
        for module in (eager, graphed):
            for step in range(2):
                module(*batches[step]).backward(grads[step])
            if use_cache:
                module.cache_populate()
    torch.cuda.current_stream().wait_stream(side)
    static = [t.clone() for t in batches[2]] + [grads[2].clone()]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed(static[0], static[1]).backward(static[2])
    for step in range(2, 8):
        for target, value in zip(static, batches[step] + [grads[step]]):
            target.copy_(value)
        graph.replay()
        eager(*batches[step]).backward(grads[step])
    torch.cuda.synchronize()
    graphed.check_inputs()
    assert graphed.iter == eager.iter == 8
    for a, b in zip(graphed.tt_cores, eager.tt_cores):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
    theirs = dict(eager.named_buffers())
    # the frequency table's layout depends on the order of the atomic inserts: compare counts
    table = ("hashtbl", "cache_freq", "cache_state")
    for name, value in graphed.named_buffers():
        if name not in table:
            torch.testing.assert_close(value, theirs[name], rtol=1e-5, atol=1e-6, msg=name)
    if use_cache:
        counts = [dict(zip(m.hashtbl.tolist(), m.cache_freq.tolist())) for m in (graphed, eager)]
        assert counts[0] == counts[1]
    if use_cache:
        assert (graphed.cache_rows != np.iinfo(np.int64).max).any()
        torch.testing.assert_close(graphed.cache_weight, eager.cache_weight, rtol=1e-5,
                                   atol=1e-6)
    bad = batches[3][0].clone()
    bad[1] = 600
    static[0].copy_(bad)
    before = [c.detach().clone() for c in graphed.tt_cores]
    graph.replay()
    with pytest.raises(IndexError, match="index 600 at position 1"):
        graphed.check_inputs()
    for a, b in zip(graphed.tt_cores, before):
        torch.testing.assert_close(a.detach(), b, rtol=0, atol=0)


def test_module_deep_copies_and_saves_whole():
    """EMA / eval copies and whole-module checkpoints: the copy trains and computes as the
    original (its deferred-check queue starts empty)."""
    import copy
    import io

    module = TTEmbeddingBag(60, 8, [3, 4], [3, 4, 5], [2, 2, 2], seed=0)
    idx, offsets = torch.tensor([1, 5, 59, 5]), torch.tensor([0, 2, 4])
    clone = copy.deepcopy(module)
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other in (clone, loaded):
        torch.testing.assert_close(other(idx, offsets), module(idx, offsets))


def test_double_module_trains_on_the_array_path():
    """``.double()`` on a model holding TT modules: float64 cores and state, trained by
    the fused step (the array path; the kernels take float32)."""
    from xferlib.adapters.torch import TTEmbeddingBag

    module = TTEmbeddingBag(100, 8, [3], [10, 10], [2, 4], use_cache=False, seed=1).double()
    before = [c.detach().clone() for c in module.tt_cores]
    out = module(torch.tensor([1, 2, 99, 5]), torch.tensor([0, 1, 3, 4]))
    out.sum().backward()
    assert module.iter == 1 and module.tt_cores[0].dtype == torch.float64
    assert any(not torch.equal(c, b) for c, b in zip(module.tt_cores, before))


def test_data_parallel_replicas_hold_tables_of_their_own():
    """nn.DataParallel's replicas copy the module's __dict__: each binds a core table of its
    own (replicas run at once, each on its GPU), with the same results."""
    from xferlib.adapters.torch import TTEmbeddingBag

    module = TTEmbeddingBag(100, 8, [3], [10, 10], [2, 4], use_cache=False, sparse=False,
                            seed=2)
    replica = module._replicate_for_data_parallel()
    indices, offsets = torch.tensor([1, 2, 99, 5]), torch.tensor([0, 1, 3, 4])
    torch.testing.assert_close(replica(indices, offsets), module(indices, offsets),
                               rtol=0, atol=0)
    assert replica.__dict__["_tt"] is not module.__dict__["_tt"]


def test_forward_under_a_float64_default_dtype():
    """The bags are float32 whatever torch's default dtype is: the forward allocated them
    with it, and a float64 default made every call fail on an internal ``out`` check."""
    bag = TTEmbeddingBag(12, 4, [2], [3, 4], [2, 2], use_cache=False, seed=0,
                         learning_rate=0.5)
    indices, offsets = torch.tensor([1, 11, 1]), torch.tensor([0, 2, 3])
    expected = _torch_full(bag).detach()[indices].view(-1)
    expected = torch.stack([expected[:4] + expected[4:8], expected[8:]])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out = bag(indices, offsets)
        out.sum().backward()
    finally:
        torch.set_default_dtype(previous)
    assert out.dtype == torch.float32 and bag.iter == 1
    torch.testing.assert_close(out.detach(), expected)
