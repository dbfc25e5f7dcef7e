import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

from xferlib import tt  # noqa: E402
from xferlib.adapters.jax import tt_embedding_bag  # noqa: E402

SHAPE = tt.TTShape([6, 10, 10], [2, 2, 4], [3, 4])


@pytest.fixture(autouse=True)
def on_device(device):
    # Every test once on JAX's CPU backend and once on its GPU backend, where there is one;
    # the jnp references in float32 matmul precision (XLA would use TF32 on the GPU).
    with jax.default_device(device), jax.default_matmul_precision("highest"):
        yield


def _jnp_full(cores):
    """Dense table with differentiable jnp ops (the reference)."""
    p, q, r = SHAPE.p_shapes, SHAPE.q_shapes, SHAPE.padded_ranks
    res = cores[0].reshape(p[0], q[0], r[1])
    for k in range(1, 3):
        g = cores[k].reshape(p[k], r[k], q[k], r[k + 1])
        res = jnp.einsum("aAr,bris->abAis", res, g)
        res = res.reshape(res.shape[0] * res.shape[1], res.shape[2] * res.shape[3], r[k + 1])
    return res[:, :, 0]


def _reference(cores, indices, offsets, mode, weights):
    rows = _jnp_full(cores)[indices] * (1.0 if weights is None else weights[:, None])
    bag = jnp.repeat(jnp.arange(len(offsets) - 1), jnp.diff(offsets),
                     total_repeat_length=len(indices))
    out = jax.ops.segment_sum(rows, bag, num_segments=len(offsets) - 1)
    if mode == "mean":
        out = out / jnp.maximum(jnp.diff(offsets), 1)[:, None]
    return out


@pytest.mark.parametrize("mode,weighted", [("sum", False), ("sum", True), ("mean", False)])
def test_jit_forward_and_grad_match_a_jnp_reference(mode, weighted):
    rng = np.random.default_rng(0)
    cores = [jnp.asarray(c) for c in tt.init_tt_cores(SHAPE, "normal", rng=rng)]
    indices = jnp.asarray(rng.integers(0, 600, 20), jnp.int32)
    offsets = jnp.asarray([0, 5, 5, 12, 20], jnp.int32)
    weights = jnp.asarray(rng.random(20), jnp.float32) if weighted else None
    g = jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)

    def ours(cs):
        return tt_embedding_bag(cs, indices, offsets, p_shapes=SHAPE.p_shapes,
                                q_shapes=SHAPE.q_shapes, ranks=SHAPE.ranks, mode=mode,
                                per_sample_weights=weights)

    out = jax.jit(ours)(cores)
    ref = _reference(cores, indices, offsets, mode, weights)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-6)
    grads = jax.jit(jax.grad(lambda cs: jnp.sum(ours(cs) * g)))(cores)
    ref_grads = jax.grad(lambda cs: jnp.sum(_reference(cs, indices, offsets, mode, weights)
                                            * g))(cores)
    for a, b in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_optax_trains_the_cores():
    rng = np.random.default_rng(1)
    cores = [jnp.asarray(c) for c in tt.init_tt_cores(SHAPE, "normal", rng=rng)]
    indices = jnp.asarray(rng.integers(0, 600, 24), jnp.int32)
    offsets = jnp.arange(0, 25, 3, dtype=jnp.int32)
    target = jnp.asarray(rng.standard_normal((8, 16)), jnp.float32)
    tx = optax.adam(0.05)

    def loss(cs):
        out = tt_embedding_bag(cs, indices, offsets, p_shapes=SHAPE.p_shapes,
                               q_shapes=SHAPE.q_shapes, ranks=SHAPE.ranks)
        return jnp.mean((out - target) ** 2)

    @jax.jit
    def step(cs, state):
        value, grads = jax.value_and_grad(loss)(cs)
        updates, state = tx.update(grads, state, cs)
        return optax.apply_updates(cs, updates), state, value

    state = tx.init(cores)
    first = float(loss(cores))
    for _ in range(60):
        cores, state, value = step(cores, state)
    assert float(value) < 0.5 * first


def test_bad_input():
    cores = [jnp.zeros(SHAPE.core_shape(k)) for k in range(3)]
    with pytest.raises(ValueError, match="core 1 must have shape"):
        tt_embedding_bag([cores[0], cores[0], cores[2]], jnp.array([0]), jnp.array([0, 1]),
                         p_shapes=SHAPE.p_shapes, q_shapes=SHAPE.q_shapes, ranks=SHAPE.ranks)
    with pytest.raises(TypeError, match="integer"):
        tt_embedding_bag(cores, jnp.array([0.5]), jnp.array([0, 1]), p_shapes=SHAPE.p_shapes,
                         q_shapes=SHAPE.q_shapes, ranks=SHAPE.ranks)


@pytest.mark.parametrize("config", [([40, 6], [2, 4], [2]), ([40, 3, 5], [2, 2, 2], [2, 2]),
                                    ([12, 2, 3, 2], [2, 1, 2, 2], [2, 2, 2])],
                         ids=lambda c: f"d{len(c[0])}")
def test_jax_equals_torch(config):
    """The JAX function and the torch module agree on bags and core gradients (same cores)."""
    torch = pytest.importorskip("torch")
    from xferlib.adapters.torch import TTEmbeddingBag

    p, q, ranks = config
    shape = tt.TTShape(p, q, ranks)
    module = TTEmbeddingBag(shape.num_rows, shape.dim, ranks, tt_p_shapes=p, tt_q_shapes=q,
                            sparse=False, weight_dist="normal", seed=5)
    rng = np.random.default_rng(5)
    indices = rng.integers(0, shape.num_rows, 30)
    offsets = np.array([0, 4, 4, 13, 30])
    weights = rng.random(30).astype(np.float32)
    g = rng.standard_normal((4, shape.dim)).astype(np.float32)
    out = module(torch.as_tensor(indices), torch.as_tensor(offsets),
                 torch.as_tensor(weights))
    out.backward(torch.as_tensor(g))
    cores = [c.detach()[0].numpy() for c in module.tt_cores]

    def loss(cs):
        bags = tt_embedding_bag(cs, jnp.asarray(indices), jnp.asarray(offsets), p_shapes=p,
                                q_shapes=q, ranks=ranks,
                                per_sample_weights=jnp.asarray(weights))
        return (bags * g).sum(), bags

    (_, bags), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(
        [jnp.asarray(c) for c in cores])
    np.testing.assert_allclose(np.asarray(bags), out.detach().numpy(), rtol=1e-5, atol=1e-6)
    for grad, c in zip(grads, module.tt_cores):
        np.testing.assert_allclose(np.asarray(grad), c.grad[0].numpy(), rtol=1e-4, atol=1e-6)
