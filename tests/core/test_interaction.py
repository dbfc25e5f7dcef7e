"""DLRM's dot interaction (xferlib.interaction): the NumPy path and the CUDA kernels against
the float64 reference (itself against finite differences), awkward sizes, bitwise
determinism, bad input refused before anything is written, and torch's autograd function."""

import numpy as np
import pytest

from xferlib.interaction import (dot_interaction_bwd, dot_interaction_fwd,
                                 dot_interaction_grad_reference, dot_interaction_reference,
                                 interaction_width)

ON = [pytest.param(False, id="numpy"), pytest.param(True, id="cupy", marks=pytest.mark.gpu)]
# (B, T, d): one sample, no table, one table, widths below, at and past a warp, 26 tables
# (B, T, d): one sample, no table, one table, widths below, at and past a warp, 26 tables,
# more than 32 vectors, widths taking 8, 4, 2 and 1 backward columns a lane
SHAPES = [(1, 3, 4), (7, 0, 5), (5, 1, 33), (0, 4, 8), (33, 5, 70), (64, 26, 64), (3, 2, 1),
          (9, 40, 12), (11, 6, 6), (17, 27, 64)]


def _inputs(rng, B, T, d, dtype):
    x = rng.standard_normal((B, d)).astype(dtype)
    pooled = rng.standard_normal((B, T, d)).astype(dtype)
    g = rng.standard_normal((B, interaction_width(T, d))).astype(dtype)
    return x, pooled, g


def _on(gpu, *arrays):
    if not gpu:
        return arrays
    import cupy

    return tuple(cupy.asarray(a) for a in arrays)


def _host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def test_the_reference_is_the_gradient_of_its_output(rng):
    x, pooled, g = _inputs(rng, 3, 4, 5, np.float64)
    dx, dpooled = dot_interaction_grad_reference(x, pooled, g)
    loss = lambda a, b: float((dot_interaction_reference(a, b) * g).sum())  # noqa: E731
    h = 1e-6
    for (k, i), want in ((("x", (1, 2)), dx[1, 2]), (("p", (2, 3, 0)), dpooled[2, 3, 0])):
        a, b = x.copy(), pooled.copy()
        (a if k == "x" else b)[i] += h
        assert (loss(a, b) - loss(x, pooled)) / h == pytest.approx(want, rel=1e-4, abs=1e-6)
    out = dot_interaction_reference(x, pooled)
    v = np.concatenate([x[:, None], pooled], axis=1)
    assert out.shape == (3, interaction_width(4, 5)) == (3, 15)
    np.testing.assert_array_equal(out[:, :5], x)
    assert out[2, 5 + 1] == pytest.approx(v[2, 0] @ v[2, 2])  # pair (0, 2) is the second
    assert out[2, -1] == pytest.approx(v[2, 3] @ v[2, 4])  # (T - 1, T) the last


@pytest.mark.parametrize("gpu", ON)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_forward_and_backward_match_the_reference(gpu, shape, dtype, rng):
    x, pooled, g = _inputs(rng, *shape, dtype)
    want = dot_interaction_reference(x, pooled)
    want_dx, want_dp = dot_interaction_grad_reference(x, pooled, g)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-12)
    xs, ps, gs = _on(gpu, x, pooled, g)
    out, residuals = dot_interaction_fwd(xs, ps)
    dx, dp = dot_interaction_bwd(residuals, gs)
    assert out.dtype == dx.dtype == dp.dtype == dtype
    np.testing.assert_allclose(_host(out), want, **tol)
    np.testing.assert_allclose(_host(dx), want_dx, **tol)
    np.testing.assert_allclose(_host(dp), want_dp, **tol)


@pytest.mark.parametrize("gpu", ON)
def test_outputs_land_in_given_arrays_and_two_runs_agree_bit_for_bit(gpu, rng):
    x, pooled, g = _on(gpu, *_inputs(rng, 50, 26, 64, np.float32))
    xp = type(x).__module__.split(".")[0] == "cupy" and __import__("cupy") or np
    out = xp.full((50, interaction_width(26, 64)), np.nan, dtype=np.float32)
    dx, dp = xp.full(x.shape, np.nan, np.float32), xp.full(pooled.shape, np.nan, np.float32)
    got, residuals = dot_interaction_fwd(x, pooled, out=out)
    assert got is out
    assert dot_interaction_bwd(residuals, g, dx=dx, dpooled=dp) == (dx, dp)
    again, _ = dot_interaction_fwd(x, pooled)
    dx2, dp2 = dot_interaction_bwd(residuals, g)
    for a, b in ((out, again), (dx, dx2), (dp, dp2)):
        np.testing.assert_array_equal(_host(a), _host(b))


@pytest.mark.gpu
def test_blocks_stride_over_more_samples_than_the_grid_holds(rng, monkeypatch):
    import cupy

    from xferlib import interaction

    monkeypatch.setattr(interaction, "_MAX_BLOCKS", 3)  # 3 blocks of 8 samples for 101
    x, pooled, g = _inputs(rng, 101, 26, 16, np.float32)
    out, residuals = dot_interaction_fwd(cupy.asarray(x), cupy.asarray(pooled))
    dx, dp = dot_interaction_bwd(residuals, cupy.asarray(g))
    want_dx, want_dp = dot_interaction_grad_reference(x, pooled, g)
    tol = dict(rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.get(), dot_interaction_reference(x, pooled), **tol)
    np.testing.assert_allclose(dx.get(), want_dx, **tol)
    np.testing.assert_allclose(dp.get(), want_dp, **tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_inputs_off_a_16_byte_boundary_load_one_value_at_a_time(rng, dtype):
    import cupy

    x, pooled, g = _inputs(rng, 19, 26, 16, dtype)
    aligned = dot_interaction_fwd(cupy.asarray(x), cupy.asarray(pooled))
    shifted = []
    for a in (x, pooled):  # contiguous, one value past an aligned start
        buffer = cupy.empty(a.size + 1, dtype)
        view = buffer[1:].reshape(a.shape)
        view[...] = cupy.asarray(a)
        shifted.append(view)
    assert shifted[0].data.ptr % 16
    out, residuals = dot_interaction_fwd(*shifted)
    np.testing.assert_array_equal(out.get(), aligned[0].get())
    dx, dp = dot_interaction_bwd(residuals, cupy.asarray(g))
    want_dx, want_dp = dot_interaction_bwd(aligned[1], cupy.asarray(g))
    np.testing.assert_array_equal(dx.get(), want_dx.get())
    np.testing.assert_array_equal(dp.get(), want_dp.get())


@pytest.mark.gpu
def test_a_sample_past_the_shared_memory_is_refused_on_the_gpu(rng):
    import cupy

    x, pooled = (cupy.zeros((2, 512), np.float32), cupy.zeros((2, 26, 512), np.float32))
    out = cupy.full((2, interaction_width(26, 512)), 7.0, np.float32)
    with pytest.raises(ValueError, match="bytes of shared memory a sample"):
        dot_interaction_fwd(x, pooled, out=out)
    assert bool((out == 7.0).all())


@pytest.mark.gpu
def test_torch_function_runs_torch_ops_for_shapes_past_the_kernels(rng):
    torch = pytest.importorskip("torch")
    from xferlib.adapters.torch import dot_interaction
    from xferlib.interaction import fits_gpu_kernels

    assert not fits_gpu_kernels(26, 512)
    x0, p0, g0 = _inputs(rng, 3, 26, 512, np.float64)
    x = torch.tensor(x0, device="cuda", requires_grad=True)
    p = torch.tensor(p0, device="cuda", requires_grad=True)
    out = dot_interaction(x, p)
    out.backward(torch.tensor(g0, device="cuda"))
    np.testing.assert_allclose(out.detach().cpu().numpy(), dot_interaction_reference(x0, p0),
                               rtol=1e-10)
    want_dx, want_dp = dot_interaction_grad_reference(x0, p0, g0)
    np.testing.assert_allclose(p.grad.cpu().numpy(), want_dp, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(x.grad.cpu().numpy(), want_dx, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("gpu", ON)
def test_bad_input_is_refused_before_anything_is_written(gpu, rng):
    x, pooled, g = _on(gpu, *_inputs(rng, 4, 3, 8, np.float32))
    xp = np if not gpu else __import__("cupy")
    out = xp.zeros((4, interaction_width(3, 8)), np.float32)
    with pytest.raises(TypeError, match="float32 or float64"):
        dot_interaction_fwd(x.astype(np.int32), pooled.astype(np.int32))
    with pytest.raises(TypeError, match="both be float32 or float64"):
        dot_interaction_fwd(x, pooled.astype(np.float64), out=out)
    with pytest.raises(ValueError, match=r"must be \(B, T, d\)"):
        dot_interaction_fwd(x, pooled[:3], out=out)
    with pytest.raises(ValueError, match=r"x must be \(B, d\)"):
        dot_interaction_fwd(x[None], pooled, out=out)
    with pytest.raises(ValueError, match="out must be C-contiguous of shape"):
        dot_interaction_fwd(x, pooled, out=out[:, :-1])
    with pytest.raises(TypeError, match="out must be a"):
        dot_interaction_fwd(x, pooled, out=out.astype(np.float64))
    with pytest.raises(TypeError, match="NumPy or CuPy arrays of one kind"):
        dot_interaction_fwd([[1.0]], pooled)
    _, residuals = dot_interaction_fwd(x, pooled)
    with pytest.raises(ValueError, match="the gradient must be of shape"):
        dot_interaction_bwd(residuals, g[:, :-1])
    dx = xp.zeros((4, 8), np.float32)
    with pytest.raises(ValueError, match="dpooled must be C-contiguous"):
        dot_interaction_bwd(residuals, g, dx=dx, dpooled=xp.zeros((4, 3, 7), np.float32))
    assert not _host(out).any() and not _host(dx).any()  # nothing written by a refused call
    if gpu:
        with pytest.raises(TypeError, match="one kind"):
            dot_interaction_fwd(x, _host(pooled))


@pytest.mark.parametrize("gpu", ON)
def test_torch_function_trains_as_the_plain_torch_interaction(gpu, rng):
    torch = pytest.importorskip("torch")
    from xferlib.adapters.torch import DotInteraction

    device = "cuda" if gpu else "cpu"
    x0, p0, g0 = _inputs(rng, 37, 26, 64, np.float64)
    x = torch.tensor(x0, device=device, requires_grad=True)
    p = torch.tensor(p0, device=device, requires_grad=True)
    out = DotInteraction()(x, p)
    out.backward(torch.tensor(g0, device=device))
    np.testing.assert_allclose(out.detach().cpu().numpy(), dot_interaction_reference(x0, p0),
                               rtol=1e-12)
    want_dx, want_dp = dot_interaction_grad_reference(x0, p0, g0)
    np.testing.assert_allclose(x.grad.cpu().numpy(), want_dx, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(p.grad.cpu().numpy(), want_dp, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match=r"x must be \(B, d\)"):
        DotInteraction()(x[None], p)


@pytest.mark.gpu
def test_torch_function_is_captured_in_a_cuda_graph(rng):
    torch = pytest.importorskip("torch")
    from xferlib.adapters.torch import dot_interaction

    x0, p0, _ = _inputs(rng, 64, 26, 64, np.float32)
    x = torch.tensor(x0, device="cuda", requires_grad=True)
    p = torch.tensor(p0, device="cuda", requires_grad=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: the kernels compiled
        dot_interaction(x, p).square().sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    eager_out = dot_interaction(x, p).detach().clone()
    x.grad = p.grad = None
    dot_interaction(x, p).square().sum().backward()
    eager_dx, eager_dp = x.grad.clone(), p.grad.clone()
    graph = torch.cuda.CUDAGraph()
    x.grad = p.grad = None
    # thread_local: only this thread's calls may invalidate the capture (in the suite's
    # shared workers, threads that earlier tests left, XLA's among them, run beside it)
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = dot_interaction(x, p)
        out.square().sum().backward()
    x.grad.zero_(), p.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager_out)
    assert torch.equal(x.grad, eager_dx) and torch.equal(p.grad, eager_dp)
