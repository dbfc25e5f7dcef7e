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


# ----------------------------------------------------------------------------- TTTable ops

@pytest.fixture
def cpu_backend(device):
    """The TTTable tests below build NumPy tables: JAX's CPU backend only (a GPU backend
    hands the callbacks CuPy buffers, which need a table built with xp=cupy)."""
    if device.platform != "cpu":
        pytest.skip("NumPy TTTables run on JAX's CPU backend; the GPU path needs a CuPy "
                    "table (not covered here)")


TABLE_HYPER = dict(lr=0.002, eps=1e-8, weight_decay=0.01, eta=0.01, momentum=0.5)


def _table_batches(seed, steps=4, num_bags=4, rows=600):
    """Batches with repeated indices, an empty bag, per-sample weights every other step."""
    rng = np.random.default_rng(seed)
    out = []
    for step in range(steps):
        sizes = rng.integers(1, 6, num_bags)
        sizes[1] = 0
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
        indices = rng.integers(0, rows if step % 2 else 40, int(offsets[-1])).astype(np.int32)
        indices[:2] = indices[0]
        weights = rng.uniform(0.5, 1.5, len(indices)).astype(np.float32) if step % 2 else None
        targets = rng.standard_normal((num_bags, SHAPE.dim)).astype(np.float32)
        out.append((indices, offsets, weights, targets))
    return out


def _jit_step(table, weighted, mode="sum"):
    from xferlib.adapters.jax import tt_lookup, tt_update

    @jax.jit
    def step(indices, offsets, weights, targets):
        w = weights if weighted else None
        bags = tt_lookup(table, indices, offsets, per_sample_weights=w, mode=mode,
                         include_last_offset=True)
        loss, g = jax.value_and_grad(lambda b: jnp.sum((b - targets) ** 2))(bags)
        return loss, bags, tt_update(table, indices, offsets, g, per_sample_weights=w,
                                     mode=mode, include_last_offset=True)

    return step


def _jit_trainer(table):
    """``train(indices, offsets, weights, targets) -> bags``: one jitted step on ``table``
    (the weighted or the plain jit, by ``weights``), waited for."""
    steps = {True: _jit_step(table, True), False: _jit_step(table, False)}

    def train(indices, offsets, weights, targets):
        w = np.ones_like(indices, np.float32) if weights is None else weights
        _, bags, token = steps[weights is not None](
            jnp.asarray(indices), jnp.asarray(offsets), jnp.asarray(w), jnp.asarray(targets))
        jax.block_until_ready(token)
        return bags

    return train


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "rowwise_adam", "lamb",
                                       "partial_rowwise_adam"])
def test_table_jit_training_equals_the_core_and_the_reference(optimizer, cpu_backend):
    """Jitted tt_lookup / tt_update steps equal the core table trained directly, bit for
    bit, and its float64 reference within float32 rounding."""
    from tests.core.test_tt_table import ReferenceTable, bags_reference
    from xferlib.testing import assert_outputs_match

    table = tt.TTTable(SHAPE, optimizer, TABLE_HYPER, seed=9)
    direct = tt.TTTable(SHAPE, optimizer, TABLE_HYPER, seed=9)
    ref = ReferenceTable(direct)
    train = _jit_trainer(table)
    for indices, offsets, weights, targets in _table_batches(1):
        bags = train(indices, offsets, weights, targets)
        expected, res = direct.lookup(indices, offsets, per_sample_weights=weights,
                                      include_last_offset=True)
        np.testing.assert_array_equal(np.asarray(bags), expected)
        grad = 2 * (expected - targets)
        direct.apply_gradients(res, grad)
        assert_outputs_match(np.asarray(bags), bags_reference(ref.cores, SHAPE, indices,
                                                              offsets, weights),
                             rtol=1e-4, atol=1e-5, what="bags")
        ref.train(indices, offsets, grad, weights)
    assert table.step == direct.step == 4
    for got, want, f64 in zip(table.cores, direct.cores, ref.cores):
        np.testing.assert_array_equal(got, want)
        assert_outputs_match(got, f64, rtol=5e-4, atol=5e-6, what="cores")
    for got, want in zip(table.states, direct.states):
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])


def test_table_jit_training_equals_the_torch_module(cpu_backend):
    """The same cores, batches and gradients: the torch module's fused step and the jitted
    JAX steps over a TTTable train the cores to the same bits."""
    torch = pytest.importorskip("torch")
    from xferlib.adapters.torch import TTEmbeddingBag
    from xferlib.adapters.torch.tt_fbtt_compat import OptimType

    module = TTEmbeddingBag(SHAPE.num_rows, SHAPE.dim, list(SHAPE.ranks),
                            tt_p_shapes=list(SHAPE.p_shapes), tt_q_shapes=list(SHAPE.q_shapes),
                            optimizer=OptimType.PARTIAL_ROWWISE_LAMB, learning_rate=0.05,
                            eps=1e-8, weight_decay=0.01, use_cache=False, seed=4)
    cores = [c.detach()[0].numpy().copy() for c in module.tt_cores]
    table = tt.TTTable.from_arrays(
        SHAPE, cores, tt.tt_sparse_state(SHAPE, "partial_rowwise_lamb"),
        np.zeros(1, np.int64), optimizer="partial_rowwise_lamb",
        optimizer_kwargs=dict(lr=0.05, eps=1e-8, weight_decay=0.01))
    train = _jit_trainer(table)
    for indices, offsets, weights, targets in _table_batches(2):
        bags = train(indices, offsets, weights, targets)
        out = module(torch.as_tensor(indices), torch.as_tensor(offsets),
                     per_sample_weights=None if weights is None else torch.as_tensor(weights))
        np.testing.assert_array_equal(np.asarray(bags), out.detach().numpy())
        ((out - torch.as_tensor(targets)) ** 2).sum().backward()
    assert module.iter == table.step == 4
    for got, c in zip(table.cores, module.tt_cores):
        np.testing.assert_array_equal(got, c.detach()[0].numpy())


def test_table_ops_reject_bad_batches_before_anything_changes(cpu_backend):
    from xferlib.adapters.jax import tt_lookup, tt_update, typed_errors

    table = tt.TTTable(SHAPE, "rowwise_adam", TABLE_HYPER, num_embeddings=500, cache_size=8,
                       seed=3)
    step = _jit_step(table, False, mode="mean")
    idx, off = jnp.array([1, 2, 3], jnp.int32), jnp.array([0, 1, 3], jnp.int32)
    jax.block_until_ready(step(idx, off, jnp.ones(3), jnp.zeros((2, SHAPE.dim)))[2])
    before = [np.array(a) for a in [*table.cores, table.step_array, table.cache.freq_counts,
                                    *[v for s in table.states for v in s.values()]]]

    def unchanged():
        after = [*table.cores, table.step_array, table.cache.freq_counts,
                 *[v for s in table.states for v in s.values()]]
        for a, b in zip(after, before):
            np.testing.assert_array_equal(a, b)

    for bad_idx, bad_off, error, match in (
            ([1, 500, 3], [0, 1, 3], IndexError, "index 500 at position 1"),
            ([1, -2, 3], [0, 1, 3], IndexError, "index -2 at position 1"),
            ([1, 2, 3], [0, 2, 1], ValueError, "offsets must start at 0")):
        args = (jnp.array(bad_idx, jnp.int32), jnp.array(bad_off, jnp.int32))
        with pytest.raises(error, match=match):  # under jit
            with typed_errors():
                jax.block_until_ready(step(*args, jnp.ones(3), jnp.zeros((2, SHAPE.dim)))[2])
        unchanged()
        with pytest.raises(error, match=match):  # eager: checked on the host first
            tt_lookup(table, *args, include_last_offset=True)
        with pytest.raises(error, match=match):
            tt_update(table, *args, jnp.zeros((2, SHAPE.dim)), include_last_offset=True)
        unchanged()
    with pytest.raises(ValueError, match="grad_bags must have shape"):
        tt_update(table, idx, off, jnp.zeros((3, SHAPE.dim)), include_last_offset=True)
    with pytest.raises(TypeError, match="indices must be int32 or int64"):
        tt_lookup(table, jnp.array([0.5]), off, include_last_offset=True)
    with pytest.raises(TypeError, match="TTTable"):
        tt_lookup(object(), idx, off)
    unchanged()


def test_table_ops_in_a_scan_see_every_update(cpu_backend):
    """The same batch every iteration of a lax.scan: a lookup hoisted out of the loop or run
    before the previous update would give the same bags twice. (The update's gradient
    depends on the bags, as a loss's does: that orders the lookup before it.)"""
    from xferlib.adapters.jax import tt_lookup, tt_update

    table = tt.TTTable(SHAPE, "sgd", {"lr": 0.01}, seed=6)
    direct = tt.TTTable(SHAPE, "sgd", {"lr": 0.01}, seed=6)
    idx, off = np.array([4, 4, 9, 300], np.int32), np.array([0, 3, 4], np.int32)

    @jax.jit
    def train(indices, offsets):
        def body(token, _):
            bags = tt_lookup(table, indices, offsets, include_last_offset=True, after=token)
            return tt_update(table, indices, offsets, bags - 1.0,
                             include_last_offset=True), bags
        return jax.lax.scan(body, jnp.zeros((), jnp.int32), None, length=3)

    _, seen = train(jnp.asarray(idx), jnp.asarray(off))
    for bags in np.asarray(seen):
        expected, res = direct.lookup(idx, off, include_last_offset=True)
        np.testing.assert_array_equal(bags, expected)
        direct.apply_gradients(res, expected - np.float32(1.0))
    assert table.step == 3


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "partial_rowwise_adam"])
def test_table_jit_training_on_the_gpu_equals_the_core(optimizer, device):
    """A CuPy TTTable inside jit on JAX's GPU backend (the callbacks launch the TT kernels on
    XLA's stream): the same bits as the same table trained by the core's calls on CuPy's
    stream, and the NumPy table's results within float32 rounding."""
    if device.platform != "gpu":
        pytest.skip("the GPU path: a CuPy table on JAX's GPU backend")
    cupy = pytest.importorskip("cupy")
    from xferlib.testing import assert_outputs_match

    host = tt.TTTable(SHAPE, optimizer, TABLE_HYPER, seed=9)

    def on_gpu():
        states = [{k: cupy.asarray(v) for k, v in s.items()} for s in host.states]
        return tt.TTTable.from_arrays(SHAPE, [cupy.asarray(c) for c in host.cores], states,
                                      cupy.zeros(1, np.int64), optimizer=optimizer,
                                      optimizer_kwargs=TABLE_HYPER)

    table, direct = on_gpu(), on_gpu()
    train = _jit_trainer(table)
    for indices, offsets, weights, targets in _table_batches(3):
        bags = train(indices, offsets, weights, targets)
        gw = None if weights is None else cupy.asarray(weights)
        expected, res = direct.lookup(cupy.asarray(indices), cupy.asarray(offsets),
                                      per_sample_weights=gw, include_last_offset=True)
        np.testing.assert_array_equal(np.asarray(bags), cupy.asnumpy(expected))
        direct.apply_gradients(res, 2 * (expected - cupy.asarray(targets)))
        cpu, cpu_res = host.lookup(indices, offsets, per_sample_weights=weights,
                                   include_last_offset=True)
        assert_outputs_match(np.asarray(bags), cpu, rtol=1e-4, atol=1e-5, what="bags")
        host.apply_gradients(cpu_res, 2 * (cpu - targets))
    cupy.cuda.runtime.deviceSynchronize()
    assert table.step == direct.step == host.step == 4
    for got, want, cpu in zip(table.cores, direct.cores, host.cores):
        np.testing.assert_array_equal(cupy.asnumpy(got), cupy.asnumpy(want))
        assert_outputs_match(cupy.asnumpy(got), cpu, rtol=1e-3, atol=1e-5, what="cores")


def test_table_update_with_a_constant_gradient_waits_for_after(cpu_backend):
    """A loss linear in the bags gives a gradient that does not depend on them: ``after=``
    keeps the update behind the lookup (each step's bags are the cores before its update)."""
    from xferlib.adapters.jax import tt_lookup, tt_update

    table = tt.TTTable(SHAPE, "sgd", TABLE_HYPER, seed=5)
    direct = tt.TTTable(SHAPE, "sgd", TABLE_HYPER, seed=5)

    @jax.jit
    def step(indices, offsets):
        bags = tt_lookup(table, indices, offsets, include_last_offset=True)
        grad = jnp.ones((offsets.shape[0] - 1, SHAPE.dim), jnp.float32)
        return bags, tt_update(table, indices, offsets, grad, include_last_offset=True,
                               after=bags)

    for indices, offsets, _, _ in _table_batches(4):
        bags, token = step(jnp.asarray(indices), jnp.asarray(offsets))
        jax.block_until_ready(token)
        expected, res = direct.lookup(indices, offsets, include_last_offset=True)
        np.testing.assert_array_equal(np.asarray(bags), expected)
        direct.apply_gradients(res, np.ones_like(expected))
    for got, want in zip(table.cores, direct.cores):
        np.testing.assert_array_equal(got, want)
