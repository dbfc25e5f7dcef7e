"""The row cache inside the TT step's own kernels (GPU): a cached training step queues exactly
the kernels of an uncached one, counts every lookup (hot rows whose runs cross many blocks of
the sorted batch included), and trains its cached rows as float64 says, on shapes of two,
three and four cores with int32 and int64 indices."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.torch.tt_cache_helpers import hot_batch, populate  # noqa: E402
from xferlib.adapters.torch import OptimType, TTEmbeddingBag  # noqa: E402

SHAPES = {  # name: (rows, dim, ranks, p, q)
    "2 cores": (600, 16, [5], [20, 30], [4, 4]),
    "3 cores": (600, 16, [3, 4], [6, 10, 10], [2, 2, 4]),
    "4 cores": (360, 16, [2, 3, 2], [3, 4, 5, 6], [2, 2, 2, 2]),
}


def _need_gpu():
    import xferlib

    if not (torch.cuda.is_available() and xferlib.cupy_available()):
        pytest.skip("needs a CUDA GPU with CuPy; none here")


def _module(name, use_cache=True, optimizer=OptimType.SGD, cache_size=40):
    rows, dim, ranks, p, q = SHAPES[name]
    return TTEmbeddingBag(rows, dim, ranks, p, q, optimizer=optimizer, learning_rate=0.05,
                          use_cache=use_cache, cache_size=cache_size, hashtbl_size=4 * rows,
                          weight_dist="normal", seed=3).cuda()


def _kernel_names(step):
    """The CUDA activities (kernels, copies) one call of ``step`` queues, by name."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    names = sorted(e.name for e in prof.events() if e.device_type.name == "CUDA")
    if not names:
        pytest.skip("torch.profiler recorded no CUDA activity here (no CUPTI)")
    return names


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(SHAPES))
def test_cached_step_queues_the_uncached_steps_kernels(name):
    """Lookups, counting, gradient sums and update of the cache ride in the step's kernels."""
    _need_gpu()
    rows = SHAPES[name][0]
    plain, cached, warming = _module(name, False), _module(name), _module(name)
    populate(cached, np.arange(0, rows, 7))
    idx = torch.as_tensor(hot_batch(rows, 4000, 0, ((5, 900), (7, 300))), device="cuda")
    offsets = torch.arange(0, 4001, 20, device="cuda")
    grad = torch.randn(200, SHAPES[name][1], device="cuda")
    for module in (plain, cached, warming):  # kernels compiled, working buffers allocated
        for _ in range(2):
            module(idx, offsets).backward(grad)
        module.check_inputs()
    expected = _kernel_names(lambda: plain(idx, offsets).backward(grad))
    assert _kernel_names(lambda: cached(idx, offsets).backward(grad)) == expected
    assert _kernel_names(lambda: warming(idx, offsets).backward(grad)) == expected
    assert not any("cache" in k for k in expected)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
def test_training_forwards_count_every_lookup(name, dtype):
    _need_gpu()
    rows = SHAPES[name][0]
    module = _module(name)  # hashtbl_size = 4 rows: every row finds a slot
    seen = []
    for step in range(3):
        idx = hot_batch(rows, 3000, step, ((11, 1000), (rows - 1, 40)))
        seen.append(idx)
        x = torch.as_tensor(idx, dtype=dtype, device="cuda")
        module(x, torch.arange(0, 3001, 15, device="cuda")).sum().backward()
        if step == 1:
            module.cache_populate()  # counting goes on with an active cache
    module.check_inputs()
    with torch.no_grad():  # an evaluation forward does not count
        module.eval()
        module(torch.as_tensor(seen[0], device="cuda"), torch.arange(0, 3001, 15, device="cuda"))
    got = {k: v for k, v in zip(module.hashtbl.tolist(), module.cache_freq.tolist()) if k >= 0}
    want = dict(zip(*(a.tolist() for a in np.unique(np.concatenate(seen), return_counts=True))))
    assert got == want


def _expected_sgd(weight, cached_rows, idx, offsets, grad, lr):
    out = weight.astype(np.float64).copy()
    slot = {int(r): s for s, r in enumerate(cached_rows)}
    for b in range(len(offsets) - 1):
        for m in range(offsets[b], offsets[b + 1]):
            s = slot.get(int(idx[m]))
            if s is not None:
                out[s] -= lr * grad[b].astype(np.float64)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("n", [1, 17, 4097, 20000])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
def test_cached_rows_step_matches_float64(name, n, dtype):
    """Hot rows over many 16-position blocks and 64-position chunks, single lookups, runs
    that end on block edges: each cached row moves by its lookups' summed gradient."""
    _need_gpu()
    rows, dim = SHAPES[name][:2]
    module = _module(name, cache_size=60)
    hot = ((7, min(n, n * 9 // 20 + 1)), (rows - 1, n // 10), (3, min(16, n // 4)))
    idx = hot_batch(rows, n, n, hot)
    populate(module, np.unique(np.concatenate([[7, rows - 1, 3], idx[:40]])))
    g = np.random.default_rng(n)
    offsets = np.concatenate([[0], np.sort(g.integers(0, n + 1, size=max(1, n // 5))), [n]])
    grad = g.standard_normal((len(offsets) - 1, dim)).astype(np.float32)
    before = module.cache_weight.detach().cpu().numpy().copy()
    expected = _expected_sgd(before, module.cache_rows.cpu().numpy(), idx, offsets, grad, 0.05)
    module(torch.as_tensor(idx, dtype=dtype, device="cuda"),
           torch.as_tensor(offsets, device="cuda")).backward(torch.as_tensor(grad, device="cuda"))
    module.check_inputs()
    got = module.cache_weight.detach().cpu().numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=2e-5 * max(1.0, n / 1000))
    assert not np.array_equal(got, before)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(SHAPES))
def test_cached_module_trains_as_on_the_cpu(name):
    """Forward bags, cores, cached rows and their Adam state after steps with and without an
    active cache: the GPU module against the same module on the CPU."""
    _need_gpu()
    rows = SHAPES[name][0]
    gpu = _module(name, optimizer=OptimType.ADAM)
    cpu = _module(name, optimizer=OptimType.ADAM).cpu()
    for step in range(5):
        idx = torch.as_tensor(hot_batch(rows, 240, step, ((5, 60), (9, 20))))
        offsets = torch.arange(0, 241, 12)
        grad = torch.randn(20, SHAPES[name][1], generator=torch.Generator().manual_seed(step))
        out_gpu = gpu(idx.cuda(), offsets.cuda())
        out_cpu = cpu(idx, offsets)
        torch.testing.assert_close(out_gpu.cpu(), out_cpu, rtol=1e-4, atol=1e-5)
        out_gpu.backward(grad.cuda())
        out_cpu.backward(grad)
        if step == 1:
            gpu.cache_populate()
            cpu.cache_populate()
    gpu.check_inputs()
    assert gpu.cache_rows.tolist() == cpu.cache_rows.tolist()
    for a, b in zip(gpu.tt_cores, cpu.tt_cores):
        torch.testing.assert_close(a.detach().cpu(), b.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gpu.cache_weight.detach().cpu(), cpu.cache_weight.detach(),
                               rtol=1e-4, atol=1e-5)
    for key, value in cpu.named_buffers():
        if key.startswith("cache_optimizer_state"):
            torch.testing.assert_close(gpu.get_buffer(key).cpu(), value, rtol=1e-3, atol=1e-6)


@pytest.mark.gpu
def test_dense_cache_gradient_matches_the_cpu():
    """sparse=False: the cached rows' gradient (tt_cache_grad, built on the GPU without
    compacting the hits) equals the CPU module's."""
    _need_gpu()
    kw = dict(tt_p_shapes=[6, 10, 10], tt_q_shapes=[2, 2, 4], weight_dist="normal", seed=3,
              sparse=False, use_cache=True, cache_size=3, hashtbl_size=64)
    gpu = TTEmbeddingBag(600, 16, [3, 4], **kw).cuda()
    cpu = TTEmbeddingBag(600, 16, [3, 4], **kw)
    for m in (gpu, cpu):
        m.update_cache(torch.tensor([5, 5, 17, 400, 400, 400]))
        m.cache_populate()
    idx = torch.as_tensor(hot_batch(600, 300, 0, ((5, 50), (400, 20))))
    offsets = torch.arange(0, 301, 10)
    grad = torch.randn(30, 16, generator=torch.Generator().manual_seed(0))
    grad[3] = float("inf")  # a bag without cached rows: its inf stays out of their gradient
    idx[30:40] = 100  # bag 3: no cached row
    cpu(idx, offsets).backward(grad)
    gpu(idx.cuda(), offsets.cuda()).backward(grad.cuda())
    torch.testing.assert_close(gpu.cache_weight.grad.cpu(), cpu.cache_weight.grad, rtol=1e-5,
                               atol=1e-5)
    assert torch.isfinite(gpu.cache_weight.grad).all()


def _counts(module):
    """The access counts, row -> count (threads racing to insert place keys in any order)."""
    keys, counts = module.hashtbl.tolist(), module.cache_freq.tolist()
    return {k: c for k, c in zip(keys, counts) if k >= 0}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(SHAPES))
def test_cached_step_replayed_from_a_cuda_graph_trains_as_eager_steps(name):
    """A cached Adam step captured in a CUDA graph: its replays train the cores, the cached rows
    and their state and count the lookups exactly as the same steps run eagerly (the step
    count the bias correction reads is the device's, advanced by every replay)."""
    _need_gpu()
    rows, dim = SHAPES[name][:2]
    eager, graphed, fresh = (_module(name, optimizer=OptimType.ADAM) for _ in range(3))
    for module in (eager, graphed, fresh):
        populate(module, np.arange(0, rows, 7))
    idx = torch.as_tensor(hot_batch(rows, 4000, 1, ((7, 900), (5, 300))), device="cuda")
    offsets = torch.arange(0, 4001, 20, device="cuda")
    grad = torch.randn(200, dim, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the first step outside the capture, as torch advises
        graphed(idx, offsets).backward(grad)
    torch.cuda.current_stream().wait_stream(side)
    eager(idx, offsets).backward(grad)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed(idx, offsets).backward(grad)
    for _ in range(3):
        graph.replay()
        eager(idx, offsets).backward(grad)
    torch.cuda.synchronize()
    eager.check_inputs()
    graphed.check_inputs()
    for a, b in zip(graphed.tt_cores, eager.tt_cores):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(graphed.cache_weight.detach(), eager.cache_weight.detach(),
                               rtol=1e-6, atol=1e-7)
    for key, value in eager.named_buffers():
        if key.startswith("cache_optimizer_state"):
            torch.testing.assert_close(graphed.get_buffer(key), value, rtol=1e-6, atol=1e-7)
    assert _counts(graphed) == _counts(eager)  # (the hash table's layout may differ)
    assert not torch.equal(graphed.cache_weight, fresh.cache_weight)  # the cached rows trained
