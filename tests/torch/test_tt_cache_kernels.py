"""The row cache's GPU kernels against float64 references: the two-pass, deterministic sum of
each cached row's gradients (hot rows whose runs cross many chunks of the sorted batch, runs
ending on chunk edges, many short runs per chunk), the forward that skips the cores' product
for cached lookups, and a rejected batch that changes nothing."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.torch.tt_cache_helpers import hot_batch, populate  # noqa: E402
from xferlib.adapters.torch import OptimType, TTEmbeddingBag  # noqa: E402

CHUNK = 64  # xferlib._kernels.tt.CACHE_CHUNK (asserted below)
SHAPE = dict(tt_p_shapes=[6, 10, 10], tt_q_shapes=[2, 2, 4], weight_dist="normal", seed=3)
ROWS, DIM = 600, 16


def _need_gpu():
    import xferlib

    if not (torch.cuda.is_available() and xferlib.cupy_available()):
        pytest.skip("needs a CUDA GPU with CuPy; none here")


def _module(optimizer=OptimType.SGD, cache_size=40, **kw):
    return TTEmbeddingBag(ROWS, DIM, [3, 4], optimizer=optimizer, learning_rate=0.05,
                          use_cache=True, cache_size=cache_size, hashtbl_size=4 * ROWS,
                          **SHAPE, **kw).cuda()


def _batch(n, seed, hot=()):
    """n lookups; ``hot``: (row, count) pairs placed at random positions."""
    return hot_batch(ROWS, n, seed, hot)


def _populate(module, rows):
    populate(module, rows)
    assert set(rows) <= set(module.cache_rows.tolist())


def _bags(n, seed):
    """Offsets (B + 1, include_last_offset) of bags of 0..7 lookups covering n."""
    g = np.random.default_rng(seed + 100)
    cuts = np.sort(g.integers(0, n + 1, size=max(1, n // 4)))
    return np.concatenate([[0], cuts, [n]])


def _expected_sgd(weight, rows_cached, idx, offsets, grad, mode, psw, lr):
    """float64: each cached row minus lr times the sum of its lookups' bag gradients."""
    out = weight.astype(np.float64).copy()
    slot = {int(r): s for s, r in enumerate(rows_cached)}
    for b in range(len(offsets) - 1):
        lo, hi = offsets[b], offsets[b + 1]
        for m in range(lo, hi):
            s = slot.get(int(idx[m]))
            if s is None:
                continue
            w = 1.0 if psw is None else float(psw[m])
            if mode == "mean":
                w /= hi - lo
            out[s] -= lr * w * grad[b].astype(np.float64)
    return out


def test_chunk_constant_matches_kernels():
    from xferlib._kernels.tt import CACHE_CHUNK

    assert CACHE_CHUNK == CHUNK


@pytest.mark.gpu
@pytest.mark.parametrize("n, hot", [
    (1, ((7, 1),)),
    (5, ((7, 3),)),
    (CHUNK, ((7, CHUNK),)),                      # one run filling exactly one chunk
    (2 * CHUNK + 1, ((7, 2 * CHUNK), )),         # a run over a chunk edge
    (4097, ((7, 2500), (11, 700), (13, CHUNK))),  # hot runs over tens of chunks
    (20000, ((7, 9000), (300, 3000), (599, 1))),  # thousands of positions
])
@pytest.mark.parametrize("mode, weighted", [("sum", False), ("mean", False), ("sum", True)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_cached_rows_sgd_step_matches_float64(n, hot, mode, weighted, dtype):
    _need_gpu()
    module = _module(mode=mode, cache_size=60)
    hot_rows = [r for r, _ in hot]
    idx = _batch(n, n, hot)
    _populate(module, np.unique(np.concatenate([hot_rows, idx[: min(n, 40)]])))
    offsets = _bags(n, n)
    g = np.random.default_rng(1)
    grad = g.standard_normal((len(offsets) - 1, DIM)).astype(np.float32)
    psw = g.random(n).astype(np.float32) if weighted else None
    before = module.cache_weight.detach().cpu().numpy().copy()
    cached = module.cache_rows.cpu().numpy()
    expected = _expected_sgd(before, cached, idx, offsets, grad, mode, psw, 0.05)
    module(torch.as_tensor(idx, dtype=dtype, device="cuda"),
           torch.as_tensor(offsets, device="cuda"),
           per_sample_weights=None if psw is None else torch.as_tensor(psw, device="cuda")
           ).backward(torch.as_tensor(grad, device="cuda"))
    module.check_inputs()
    got = module.cache_weight.detach().cpu().numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=2e-5 * max(1.0, n / 1000))
    assert not np.array_equal(got, before)


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", [OptimType.SGD, OptimType.EXACT_ROWWISE_ADAGRAD,
                                       OptimType.ADAM, OptimType.LAMB], ids=str)
def test_cache_step_is_deterministic(optimizer):
    """The same step from the same state gives bit-identical cache rows and state."""
    _need_gpu()
    idx = _batch(30000, 0, ((7, 12000), (11, 4000), (13, 500)))
    offsets = torch.arange(0, 30001, 20, device="cuda")
    grad = torch.randn(1500, DIM, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    results = []
    for _ in range(2):
        module = _module(optimizer)
        _populate(module, np.array([7, 11, 13] + list(range(100, 130))))
        module(torch.as_tensor(idx, device="cuda"), offsets).backward(grad)
        module.check_inputs()
        results.append([module.cache_weight.detach().clone()] + [
            b.clone() for name, b in module.named_buffers()
            if name.startswith("cache_optimizer_state")])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_cached_forward_skips_cores_with_the_same_results():
    """Lookups of cached rows read the dense rows (the cores' product is skipped for them);
    every other lookup's row is the uncached module's, bit for bit."""
    _need_gpu()
    plain = TTEmbeddingBag(ROWS, DIM, [3, 4], use_cache=False, **SHAPE).cuda()
    module = _module(cache_size=200)
    for a, b in zip(plain.tt_cores, module.tt_cores):  # the same seed: the same cores
        assert torch.equal(a, b)
    cached_rows = np.arange(0, ROWS, 3)[:200]  # whole prefixes and parts of others
    _populate(module, cached_rows)
    with torch.no_grad():
        module.cache_weight += 1.0  # cached rows now differ from the cores'
    idx = _batch(5000, 2, ((0, 800), (3, 300)))
    offsets = torch.arange(0, 5001, 1, device="cuda")  # one lookup per bag: rows themselves
    x = torch.as_tensor(idx, device="cuda")
    with torch.no_grad():
        got = module(x, offsets).cpu()
        want = plain(x, offsets).cpu()
    hit = torch.as_tensor(np.isin(idx, cached_rows))
    assert hit.any() and (~hit).any()
    assert torch.equal(got[~hit], want[~hit])
    slot = torch.searchsorted(module.cache_rows.cpu(), torch.as_tensor(idx))
    torch.testing.assert_close(got[hit], module.cache_weight.detach().cpu()[slot[hit]],
                               rtol=0, atol=0)
    # pooled bags of mixed lookups: against float64 from the same rows
    offsets = torch.as_tensor(_bags(5000, 2), device="cuda")
    with torch.no_grad():
        pooled = module(x, offsets).cpu().double()
    rows = got.double()
    ref = torch.stack([rows[a:b].sum(0) for a, b in zip(offsets[:-1].tolist(),
                                                         offsets[1:].tolist())])
    torch.testing.assert_close(pooled, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_rejected_batch_changes_nothing_in_the_cache():
    _need_gpu()
    module = _module(cache_size=20)
    _populate(module, np.array([7, 11]))
    weight = module.cache_weight.detach().clone()
    freq = module.cache_freq.clone()
    cores = [c.detach().clone() for c in module.tt_cores]
    idx = torch.as_tensor(_batch(4097, 3, ((7, 2000),)), device="cuda")
    idx[100] = ROWS + 5  # out of range
    with pytest.raises(IndexError, match=str(ROWS + 5)):  # at backward or at the check
        module(idx, torch.arange(0, 4098, 17, device="cuda")).sum().backward()
        module.check_inputs()
    assert torch.equal(module.cache_weight.detach(), weight)
    assert torch.equal(module.cache_freq, freq)  # a rejected batch is not counted
    for a, b in zip(module.tt_cores, cores):
        assert torch.equal(a.detach(), b)
