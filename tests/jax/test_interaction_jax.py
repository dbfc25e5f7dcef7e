"""DLRM's dot interaction in JAX (xferlib.adapters.jax.dot_interaction): inside jit and grad
against the float64 reference, on the CPU and the GPU, awkward shapes, bitwise repeats, the
einsum form for dtypes and shapes the kernels do not take, shard_map, torch against JAX."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, PartitionSpec  # noqa: E402

from xferlib.adapters.jax import dot_interaction  # noqa: E402
from xferlib.interaction import (dot_interaction_grad_reference,  # noqa: E402
                                 dot_interaction_reference, interaction_width)
from xferlib.testing import assert_matches_reference  # noqa: E402

# (B, T, d): one sample, no table, an empty batch, widths past a warp, 26 tables, more than
# 32 vectors, odd widths
SHAPES = [(1, 3, 4), (7, 0, 5), (0, 4, 8), (33, 5, 70), (64, 26, 64), (9, 40, 12), (3, 2, 1)]


def _inputs(device, B, T, d, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, d)).astype(np.float32)
    pooled = rng.standard_normal((B, T, d)).astype(np.float32)
    g = rng.standard_normal((B, interaction_width(T, d))).astype(np.float32)
    return x, pooled, g, tuple(jax.device_put(a, device) for a in (x, pooled, g))


def _forward_and_grads(x, pooled, g):
    def loss(x, pooled):
        return (dot_interaction(x, pooled) * g).sum()

    out = jax.jit(dot_interaction)(x, pooled)
    dx, dpooled = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, pooled)
    return out, dx, dpooled


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_jit_forward_and_grad_match_the_reference(device, shape):
    x, pooled, g, (jx, jp, jg) = _inputs(device, *shape)
    out, dx, dpooled = _forward_and_grads(jx, jp, jg)
    assert out.shape == (shape[0], interaction_width(shape[1], shape[2]))
    assert out.dtype == jnp.float32 and dx.dtype == dpooled.dtype == jnp.float32
    x64, p64, g64 = (a.astype(np.float64) for a in (x, pooled, g))
    scale = shape[2] * (shape[1] + 1)  # a gradient sums n dots' terms of d products each
    assert_matches_reference(out, dot_interaction_reference(x64, p64), "float32",
                             scale=shape[2])
    want_dx, want_dp = dot_interaction_grad_reference(x64, p64, g64)
    assert_matches_reference(dx, want_dx, "float32", scale=scale)
    assert_matches_reference(dpooled, want_dp, "float32", scale=scale)


def test_float64_is_exact_to_the_reference(device):
    jax.config.update("jax_enable_x64", True)
    try:
        rng = np.random.default_rng(3)
        x, pooled = rng.standard_normal((6, 9)), rng.standard_normal((6, 4, 9))
        g = rng.standard_normal((6, interaction_width(4, 9)))
        jx, jp, jg = (jax.device_put(a, device) for a in (x, pooled, g))
        out, dx, dpooled = _forward_and_grads(jx, jp, jg)
        assert out.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(out), dot_interaction_reference(x, pooled),
                                   rtol=1e-12, atol=1e-12)
        want_dx, want_dp = dot_interaction_grad_reference(x, pooled, g)
        np.testing.assert_allclose(np.asarray(dx), want_dx, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(np.asarray(dpooled), want_dp, rtol=1e-12, atol=1e-12)
    finally:
        jax.config.update("jax_enable_x64", False)


def test_two_runs_give_the_same_bits(device):
    *_, (jx, jp, jg) = _inputs(device, 300, 26, 64, seed=4)
    first = [np.asarray(a) for a in _forward_and_grads(jx, jp, jg)]
    second = [np.asarray(a) for a in _forward_and_grads(jx, jp, jg)]
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("case", ["bfloat16", "past the shared memory"])
def test_the_einsum_form_takes_what_the_kernels_do_not(device, case):
    B, T, d = (5, 3, 8) if case == "bfloat16" else (2, 26, 1024)
    x, pooled, g, (jx, jp, jg) = _inputs(device, B, T, d, seed=5)
    dtype = jnp.bfloat16 if case == "bfloat16" else jnp.float32
    jx, jp, jg = jx.astype(dtype), jp.astype(dtype), jg.astype(dtype)
    with jax.default_matmul_precision("highest"):  # float32: a GPU's einsum would take TF32
        out, dx, dpooled = _forward_and_grads(jx, jp, jg)
    assert out.dtype == dtype
    name = jnp.dtype(dtype).name
    x64, p64, g64 = (np.asarray(a).astype(np.float64) for a in (jx, jp, jg))
    assert_matches_reference(out, dot_interaction_reference(x64, p64), name, scale=d)
    want_dx, want_dp = dot_interaction_grad_reference(x64, p64, g64)
    assert_matches_reference(dx, want_dx, name, scale=d * (T + 1))
    assert_matches_reference(dpooled, want_dp, name, scale=d * (T + 1))


def test_bad_shapes_and_dtypes_are_refused():
    x, pooled = jnp.ones((4, 8)), jnp.ones((4, 3, 8))
    with pytest.raises(ValueError, match=r"\(B, d\) and pooled \(B, T, d\)"):
        dot_interaction(x[0], pooled)
    with pytest.raises(ValueError, match="with x's B = 4 and d = 8"):
        dot_interaction(x, pooled[:, :, :7])
    with pytest.raises(TypeError, match="one dtype"):
        dot_interaction(x, pooled.astype(jnp.bfloat16))


def test_inside_shard_map_each_device_gets_its_own_rows(device):
    """A batch sharded over a mesh (one device here; the two-GPU runs use two): outputs and
    gradients typed as the device's own (check_vma on), equal to the plain call."""
    x, pooled, g, (jx, jp, jg) = _inputs(device, 12, 4, 16, seed=6)
    mesh = Mesh(np.array([device]), ("batch",))
    spec = PartitionSpec("batch")

    def loss(x, pooled, g):
        return jax.lax.psum((dot_interaction(x, pooled) * g).sum(), "batch")

    sharded = jax.jit(jax.shard_map(jax.grad(loss, argnums=(0, 1)), mesh=mesh,
                                    in_specs=(spec, spec, spec), out_specs=(spec, spec)))
    dx, dpooled = sharded(jx, jp, jg)
    want_dx, want_dp = dot_interaction_grad_reference(
        *(a.astype(np.float64) for a in (x, pooled, g)))
    assert_matches_reference(dx, want_dx, "float32", scale=80)
    assert_matches_reference(dpooled, want_dp, "float32", scale=80)


def test_jax_equals_torch(device):
    torch = pytest.importorskip("torch")
    from xferlib.adapters.torch import dot_interaction as torch_interaction

    x, pooled, g, (jx, jp, jg) = _inputs(device, 40, 26, 64, seed=7)
    out, dx, dpooled = _forward_and_grads(jx, jp, jg)
    where = "cuda" if device.platform == "gpu" else "cpu"
    tx, tp = (torch.tensor(a, device=where, requires_grad=True) for a in (x, pooled))
    t_out = torch_interaction(tx, tp)
    t_out.backward(torch.tensor(g, device=where))
    # the same core op underneath: the same bits
    np.testing.assert_array_equal(np.asarray(out), t_out.detach().cpu().numpy())
    np.testing.assert_array_equal(np.asarray(dx), tx.grad.cpu().numpy())
    np.testing.assert_array_equal(np.asarray(dpooled), tp.grad.cpu().numpy())


def test_vmap_over_a_leading_axis(device):
    """vmap runs the op once per element (buffer_callback's sequential method)."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((3, 5, 7)).astype(np.float32)
    pooled = rng.standard_normal((3, 5, 4, 7)).astype(np.float32)
    jx, jp = jax.device_put(x, device), jax.device_put(pooled, device)
    out = jax.jit(jax.vmap(dot_interaction))(jx, jp)
    dx, dpooled = jax.jit(jax.grad(lambda a, b: jax.vmap(dot_interaction)(a, b).sum(),
                                   argnums=(0, 1)))(jx, jp)
    for k in range(3):
        x64, p64 = x[k].astype(np.float64), pooled[k].astype(np.float64)
        assert_matches_reference(out[k], dot_interaction_reference(x64, p64), "float32",
                                 scale=7)
        want_dx, want_dp = dot_interaction_grad_reference(
            x64, p64, np.ones((5, interaction_width(4, 7))))
        assert_matches_reference(dx[k], want_dx, "float32", scale=35)
        assert_matches_reference(dpooled[k], want_dp, "float32", scale=35)
