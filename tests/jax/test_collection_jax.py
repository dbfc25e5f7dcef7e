"""embedding_bag_collection (the core collection inside jax.jit) against the core's float64
references, eager and jitted; torch against JAX on the same data; updates ordered inside a
lax.scan; bad input."""

from __future__ import annotations

import os

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from xferlib.adapters.jax import (collection_anchor, embedding_bag_collection,  # noqa: E402
                                  recording_scratch_bytes, typed_errors)
from xferlib.collection import (EmbeddingCollection, TableConfig,  # noqa: E402
                                collection_step_reference, pooled_lookup_reference)

ROWS, DIMS = (7, 1, 33), (4, 3, 8)
HYPER = {"sgd": {"lr": 0.3, "momentum": 0.9}, "adam": {"lr": 0.05},
         "rowwise_adagrad": {"lr": 0.2}}


def collection(device, optimizer="adam", pooling="sum", seed=4):
    tables = [TableConfig(n, d, placement=p) for n, d, p in zip(ROWS, DIMS,
                                                                ("host", "hbm", "host"))]
    return EmbeddingCollection(tables, optimizer, HYPER[optimizer], pooling=pooling,
                               device="cuda" if device.platform == "gpu" else "cpu",
                               seed=seed)


def batch(rng, B, max_len=4, dtype=np.int32):
    lengths = rng.integers(0, max_len + 1, size=len(ROWS) * B)
    parts = [rng.integers(0, n, int(lengths[t * B:(t + 1) * B].sum()))
             for t, n in enumerate(ROWS)]
    return (np.concatenate(parts).astype(dtype),
            np.concatenate([[0], np.cumsum(lengths)]).astype(dtype))


def snapshot(coll):
    names = [k for k in coll.state_names() if k != "step"]
    return ([coll.weights(t).astype(np.float64) for t in range(coll.num_tables)],
            [{k: coll.state(t, k).astype(np.float64) for k in names}
             for t in range(coll.num_tables)],
            [coll.state(t, "step").copy() for t in range(coll.num_tables)])


def assert_state_equal(a, b, **tol):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        if tol:
            np.testing.assert_allclose(sa[key], sb[key], err_msg=key, **tol)
        else:
            np.testing.assert_array_equal(sa[key], sb[key], err_msg=key)


def _loss(coll, anchor, idx, off, psw, target):
    pooled = embedding_bag_collection(coll, idx, off, psw, anchor=anchor)
    return jnp.sum(pooled * target)  # d loss / d pooled = target


@pytest.mark.parametrize("optimizer", list(HYPER))
@pytest.mark.parametrize("pooling", ["sum", "mean"])
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_training_matches_reference(device, optimizer, pooling, jit):
    rng = np.random.default_rng(sum(map(ord, optimizer + pooling)))  # stable per case
    coll = collection(device, optimizer, pooling)
    grad_fn = jax.value_and_grad(lambda a, i, o, w, t: _loss(coll, a, i, o, w, t))
    if jit:
        grad_fn = jax.jit(grad_fn)
    anchor = jax.device_put(collection_anchor(), device)
    for step in range(3):
        idx, off = batch(rng, B=5, dtype=np.int32 if step % 2 else np.int64)
        psw = rng.uniform(0.5, 2.0, idx.size).astype(np.float32) if step == 2 else None
        target = rng.standard_normal((5, sum(DIMS))).astype(np.float32)
        before = snapshot(coll)
        put = [None if a is None else jax.device_put(a, device) for a in (idx, off, psw, target)]
        loss, g = grad_fn(anchor, *put)
        assert g.shape == (0,)
        pooled = pooled_lookup_reference(before[0], idx, off, psw, pooling)
        np.testing.assert_allclose(float(loss), np.sum(pooled * target), rtol=1e-5,
                                   atol=1e-5)
        new_w, new_s, new_steps = collection_step_reference(
            optimizer, coll.hypers, *before, idx, off, target, psw, pooling)
        for t in range(coll.num_tables):
            np.testing.assert_allclose(coll.weights(t), new_w[t], rtol=2e-5, atol=2e-6)
            for k, v in new_s[t].items():
                np.testing.assert_allclose(coll.state(t, k), v, rtol=2e-5, atol=2e-6)
            np.testing.assert_array_equal(coll.state(t, "step"), new_steps[t])
    pooled = embedding_bag_collection(coll, *put[:3])  # no anchor: a lookup, nothing trains
    before = coll.state_dict()
    np.testing.assert_allclose(np.asarray(pooled), pooled_lookup_reference(
        snapshot(coll)[0], idx, off, psw, pooling), rtol=2e-5, atol=2e-6)
    for key, value in coll.state_dict().items():
        np.testing.assert_array_equal(value, before[key])


def test_jit_and_eager_train_bitwise_alike_with_a_dense_layer(device):
    """A jitted step (value_and_grad w.r.t. dense parameters and the anchor, optax Adam on the
    dense part) and the same step run eagerly leave the same bits in both collections."""
    optax = pytest.importorskip("optax")
    rng = np.random.default_rng(6)
    batches = [batch(rng, B=8) for _ in range(4)]
    ys = [rng.standard_normal(8).astype(np.float32) for _ in range(4)]

    def run(jit):
        coll = collection(device, "rowwise_adagrad")
        params = {"w": jnp.asarray(np.linspace(-1, 1, sum(DIMS), dtype=np.float32)),
                  "emb": collection_anchor()}
        params = jax.device_put(params, device)
        opt = optax.adam(1e-2)
        opt_state = opt.init(params)

        def loss_fn(params, idx, off, y):
            pooled = embedding_bag_collection(coll, idx, off, anchor=params["emb"])
            return jnp.mean((pooled @ params["w"] - y) ** 2)

        def step(params, opt_state, idx, off, y):
            loss, g = jax.value_and_grad(loss_fn)(params, idx, off, y)
            updates, opt_state = opt.update(g, opt_state)
            return loss, optax.apply_updates(params, updates), opt_state

        if jit:
            step = jax.jit(step)
        losses = []
        for (idx, off), y in zip(batches, ys):
            loss, params, opt_state = step(params, opt_state, *jax.device_put((idx, off, y),
                                                                                device))
            losses.append(float(loss))
        return coll, losses, params

    (a, la, pa), (b, lb, pb) = run(True), run(False)
    np.testing.assert_allclose(la, lb, rtol=1e-6)
    assert len(set(la)) == 4
    np.testing.assert_allclose(np.asarray(pa["w"]), np.asarray(pb["w"]), rtol=1e-6,
                               atol=1e-7)
    # the collections' updates are the core's, on the same pooled gradients
    assert_state_equal(a, b, rtol=1e-6, atol=1e-7)
    assert int(a.state(2, "step").sum()) > 0


def test_scan_sees_every_previous_update(device):
    """The same batch every iteration of a lax.scan: a lookup hoisted out of the loop, or
    run before the previous step's update, would train on stale rows."""
    rng = np.random.default_rng(1)
    coll, reference = collection(device, "sgd"), collection(device, "sgd")
    idx, off = batch(rng, B=4)
    targets = rng.standard_normal((5, 4, sum(DIMS))).astype(np.float32)

    @jax.jit
    def train(anchor, idx, off, targets):
        def body(carry, target):
            loss, _ = jax.value_and_grad(
                lambda a: _loss(coll, a, idx, off, None, target))(anchor)
            return carry, loss
        return jax.lax.scan(body, 0, targets)

    _, losses = train(collection_anchor(), *jax.device_put((idx, off, targets), device))
    expected = []
    for target in targets:  # the core itself, step by step
        xp = np
        if device.platform == "gpu":
            import cupy as xp
        out, ctx = reference.forward(xp.asarray(idx), xp.asarray(off))
        expected.append(float(np.sum(np.asarray(out.get() if hasattr(out, "get") else out)
                                     * target)))
        reference.backward(ctx, xp.asarray(target))
    np.testing.assert_allclose(np.asarray(losses), expected, rtol=1e-5)
    assert len(set(np.asarray(losses).tolist())) == 5
    assert_state_equal(coll, reference)


def test_torch_and_jax_train_alike():
    """The torch module and the JAX function over collections built alike, fed the same
    batches and pooled gradients, leave bitwise-identical tables and optimizer state (both
    run the core's NumPy path on the CPU)."""
    pytest.importorskip("torch")
    from xferlib.adapters.torch import EmbeddingBagCollection

    rng = np.random.default_rng(12)
    tables = [TableConfig(n, d, placement=p) for n, d, p in zip(ROWS, DIMS,
                                                                ("host", "hbm", "host"))]
    module = EmbeddingBagCollection(tables, "adam", {"lr": 0.05}, pooling="mean",
                                    device="cpu", seed=9)
    coll = EmbeddingCollection(tables, "adam", {"lr": 0.05}, pooling="mean", device="cpu",
                               seed=9)
    step = jax.jit(jax.value_and_grad(lambda a, i, o, w, t: _loss(coll, a, i, o, w, t)))
    with jax.default_device(jax.devices("cpu")[0]):  # JAX's CPU backend, also beside a GPU
        _train_both(module, step, rng)
    assert_state_equal(module.collection, coll)


def _train_both(module, step, rng):
    import torch

    for k in range(4):
        idx, off = batch(rng, B=6, dtype=np.int64 if k % 2 else np.int32)
        psw = rng.uniform(0.5, 2, idx.size).astype(np.float32) if k == 3 else None
        target = rng.standard_normal((6, sum(DIMS))).astype(np.float32)
        pooled = module(torch.as_tensor(idx), torch.as_tensor(off),
                        None if psw is None else torch.as_tensor(psw))
        torch_loss = (pooled * torch.as_tensor(target)).sum()
        torch_loss.backward()
        jax_loss, _ = step(collection_anchor(), idx, off, psw, target)
        np.testing.assert_allclose(float(jax_loss), float(torch_loss.detach()), rtol=1e-6)


def test_bad_inputs_raise_the_core_errors_and_change_nothing():
    cpu = jax.devices("cpu")[0]
    coll = collection(cpu)
    with jax.default_device(cpu):  # JAX's CPU backend, also beside a GPU
        _bad_inputs(coll)


def _bad_inputs(coll):
    before = coll.state_dict()
    # B = 2; t0: bags [1], [0]; t1: [0], []; t2: [5], [6]
    idx, off = jnp.array([1, 0, 0, 5, 6]), jnp.array([0, 1, 2, 3, 3, 4, 5])
    bad = idx.at[4].set(33)
    grad = jax.grad(lambda a, i, o: embedding_bag_collection(coll, i, o, anchor=a).sum())
    with pytest.raises(IndexError, match=r"index 33 at position 4 .*table 't2' of 33 rows"):
        grad(collection_anchor(), bad, off)  # eager: the core's IndexError at once
    with pytest.raises(IndexError, match=r"index 33 at position 4 .*table 't2'"):
        with typed_errors():  # jit: from the callback, raised again by type
            jax.block_until_ready(jax.jit(grad)(collection_anchor(), bad, off))
    with pytest.raises(ValueError, match="must not decrease"):
        with typed_errors():
            jax.block_until_ready(jax.jit(grad)(collection_anchor(), idx,
                                                jnp.array([0, 2, 1, 3, 3, 4, 5])))
    with pytest.raises(ValueError, match="must not decrease"):
        embedding_bag_collection(coll, idx, jnp.array([0, 2, 1, 3, 3, 4, 5]))
    with pytest.raises(ValueError, match=r"T \* B \+ 1"):
        embedding_bag_collection(coll, idx, off[:-1])
    with pytest.raises(TypeError, match="int32 or int64"):
        embedding_bag_collection(coll, idx.astype(jnp.float32), off)
    with pytest.raises(ValueError, match="1-D"):
        embedding_bag_collection(coll, idx.reshape(5, 1), off)
    with pytest.raises(ValueError, match="per_sample_weights must have shape"):
        embedding_bag_collection(coll, idx, off, jnp.ones(3))
    with pytest.raises(TypeError, match="floating point"):
        embedding_bag_collection(coll, idx, off, jnp.ones(5, jnp.int32))
    with pytest.raises(TypeError, match="EmbeddingCollection"):
        embedding_bag_collection(object(), idx, off)
    # int64 values as given: without x64 JAX would wrap 2**32 + 1 to row 1
    big = np.array([1, 0, 0, 5, 2**32 + 1], np.int64)
    with pytest.raises(IndexError, match=r"indices\[4\] = 4294967297 does not fit"):
        grad(collection_anchor(), big, np.asarray(off, np.int64))
    for key, value in coll.state_dict().items():
        np.testing.assert_array_equal(value, before[key], err_msg=key)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_per_sample_weights_get_no_gradient_and_train_nothing_alone(dtype):
    """Differentiating with respect to the weights alone gives zeros and leaves the tables;
    with the anchor, weights of any float dtype train (bfloat16 included)."""
    cpu = jax.devices("cpu")[0]
    coll = collection(cpu, optimizer="sgd")
    idx, off = jnp.array([1, 0, 0, 5, 6]), jnp.array([0, 1, 2, 3, 3, 4, 5])
    psw = jnp.linspace(0.5, 1.5, 5).astype(dtype)
    before = coll.state_dict()
    with jax.default_device(cpu):
        g = jax.grad(lambda w: embedding_bag_collection(coll, idx, off, w).astype(
            jnp.float32).sum())(psw)
        assert not np.asarray(g, np.float32).any()
        for key, value in coll.state_dict().items():
            np.testing.assert_array_equal(value, before[key], err_msg=key)
        jax.grad(lambda a: embedding_bag_collection(coll, idx, off, psw, anchor=a).astype(
            jnp.float32).sum())(collection_anchor())
    assert not np.array_equal(coll.state_dict()["t0.weight"], before["t0.weight"])


def test_docstring_examples_run():
    import doctest

    from xferlib.adapters.jax import collection

    result = doctest.testmod(collection, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_backward_takes_the_forwards_context():
    """A jitted training step plans its batch once: the backward takes the context its
    forward kept, instead of running the forward again."""
    import jax
    import jax.numpy as jnp

    from xferlib.adapters.jax import collection_anchor, embedding_bag_collection
    from xferlib.collection import EmbeddingCollection, TableConfig

    device = "cpu" if jax.default_backend() == "cpu" else "cuda"
    coll = EmbeddingCollection([TableConfig(50, 4), TableConfig(30, 4, placement="host")],
                               "sgd", {"lr": 0.1}, device=device, seed=0)
    calls = []
    forward = coll.forward

    def counting(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    coll.forward = counting

    @jax.jit
    def step(anchor, idx, off):
        return jax.grad(lambda a: embedding_bag_collection(coll, idx, off, anchor=a).sum())(
            anchor)

    idx = jnp.asarray(np.array([1, 2, 3, 4, 5, 6], np.int32))
    off = jnp.asarray(np.array([0, 2, 3, 5, 6], np.int32))
    before = coll.weights(0).copy()
    for _ in range(3):
        jax.block_until_ready(step(collection_anchor(), idx, off))
    assert len(calls) == 3  # one forward per step
    np.testing.assert_allclose(coll.weights(0)[1], before[1] - 0.3, rtol=1e-6)


# ----------------------------------------------------------------------------- tt tables

TT_ROWS, TT_DIMS = (7, 60, 33, 20), (4, 6, 8, 4)


def tt_tables():
    """hbm, tt (three cores), host, tt (two cores, its own learning rate)."""
    from tests.core.test_collection_tt import mixed_tables

    return mixed_tables(0.05)


def tt_batch(rng, B, dtype):
    lengths = rng.integers(0, 5, size=len(TT_ROWS) * B)
    parts = [rng.integers(0, n, int(lengths[t * B:(t + 1) * B].sum()))
             for t, n in enumerate(TT_ROWS)]
    return (np.concatenate(parts).astype(dtype),
            np.concatenate([[0], np.cumsum(lengths)]).astype(dtype))


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_tt_tables_train_as_the_core_collection_and_the_torch_module(jit):
    """A collection with tt tables inside jax.jit (and eagerly) trains bit for bit as the
    core collection fed the same batches and pooled gradients, and as the torch module."""
    torch = pytest.importorskip("torch")
    from xferlib.adapters.torch import EmbeddingBagCollection

    rng = np.random.default_rng(21)
    kwargs = dict(pooling="mean", device="cpu", seed=6)
    coll = EmbeddingCollection(tt_tables(), "rowwise_adagrad", {"lr": 0.2}, **kwargs)
    core = EmbeddingCollection(tt_tables(), "rowwise_adagrad", {"lr": 0.2}, **kwargs)
    module = EmbeddingBagCollection(tt_tables(), "rowwise_adagrad", {"lr": 0.2}, **kwargs)
    step = jax.value_and_grad(lambda a, i, o, w, t: _loss(coll, a, i, o, w, t))
    step = jax.jit(step) if jit else step
    with jax.default_device(jax.devices("cpu")[0]):  # JAX's CPU backend, also beside a GPU
        for k in range(4):
            idx, off = tt_batch(rng, 5, np.int64 if k % 2 else np.int32)
            psw = rng.uniform(0.5, 2, idx.size).astype(np.float32) if k >= 2 else None
            target = rng.standard_normal((5, sum(TT_DIMS))).astype(np.float32)
            loss, _ = step(collection_anchor(), idx, off, psw, target)
            out, ctx = core.forward(idx, off, psw)
            np.testing.assert_allclose(float(loss), np.sum(out * target), rtol=1e-5)
            core.backward(ctx, target)
            pooled = module(torch.as_tensor(idx), torch.as_tensor(off),
                            None if psw is None else torch.as_tensor(psw))
            np.testing.assert_array_equal(pooled.detach().numpy(), out)
            pooled.backward(torch.as_tensor(target))
    assert_state_equal(coll, core)
    assert_state_equal(module.collection, coll)
    assert coll.tt_table("small").step == 4


def test_tt_tables_bad_input_raises_and_changes_nothing():
    cpu = jax.devices("cpu")[0]
    coll = EmbeddingCollection(tt_tables(), "sgd", {"lr": 0.1}, device="cpu", seed=2)
    before = coll.state_dict()
    idx, off = tt_batch(np.random.default_rng(1), 3, np.int32)
    lo = int(off[3])  # the first lookup of "ids"
    bad = idx.copy()
    bad[lo] = 60
    grad = jax.grad(lambda a, i, o: embedding_bag_collection(coll, i, o, anchor=a).sum())
    with jax.default_device(cpu):
        with pytest.raises(IndexError, match=f"index 60 at position {lo} .*table 'ids'"):
            grad(collection_anchor(), bad, off)
        with pytest.raises(IndexError, match=f"index 60 at position {lo} .*table 'ids'"):
            with typed_errors():
                jax.block_until_ready(jax.jit(grad)(collection_anchor(), bad, off))
    for key, value in coll.state_dict().items():
        np.testing.assert_array_equal(value, before[key], err_msg=key)


def test_tt_tables_on_every_backend_train_as_the_cpu_core(device):
    """Inside jax.jit on each backend (on a GPU the collection's GPU path: the tt tables'
    batches reach their TT tables without a host sync), as the core's NumPy path."""
    rng = np.random.default_rng(23)
    coll = EmbeddingCollection(tt_tables(), "adagrad", {"lr": 0.1}, seed=8,
                               device="cuda" if device.platform == "gpu" else "cpu")
    core = EmbeddingCollection(tt_tables(), "adagrad", {"lr": 0.1}, device="cpu", seed=8)
    step = jax.jit(jax.value_and_grad(lambda a, i, o, w, t: _loss(coll, a, i, o, w, t)))
    anchor = jax.device_put(collection_anchor(), device)
    for k in range(3):
        idx, off = tt_batch(rng, 6, np.int32 if k % 2 else np.int64)
        psw = rng.uniform(0.5, 2, idx.size).astype(np.float32) if k == 2 else None
        target = rng.standard_normal((6, sum(TT_DIMS))).astype(np.float32)
        put = [None if a is None else jax.device_put(a, device) for a in (idx, off, psw, target)]
        loss, _ = step(anchor, *put)
        out, ctx = core.forward(idx, off, psw)
        np.testing.assert_allclose(float(loss), np.sum(out * target), rtol=1e-4, atol=1e-4)
        core.backward(ctx, target)
    coll.check()
    assert_state_equal(coll, core, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("moving_gradient", [False, True], ids=["fixed", "moving-gradient"])
def test_steps_replayed_from_command_buffers_train_as_the_core_and_follow_set_hyper(
        monkeypatch, moving_gradient):
    """XLA records the collection's callbacks into its command buffers and replays them
    when a step's buffers stay where they were (here the batch is sliced out of a chunk
    inside the step): the tables and state after the replays are those of the core's own
    calls, bitwise; an lr set between steps reaches the replays; and the callbacks ran
    fewer times than there were steps. ``moving_gradient``: the pooled gradient is a new
    argument every step, so XLA replays the lookup and records the update again each time
    (it finds the recorded lookup's plan and records the same launches: XLA updates the
    recorded graph in place). The batches are past one tile of the sort: its radix launches
    are recorded too."""
    import cupy

    tables = [TableConfig(1000, 16, placement="hbm"),
              TableConfig(5000, 32, placement="host", cache_rows=256),
              TableConfig(77, 8, placement="hbm")]
    replayed, eager = (EmbeddingCollection(tables, "adam", {"lr": 0.05}, device="cuda",
                                           seed=3) for _ in range(2))
    calls = []
    forward = replayed.forward
    monkeypatch.setattr(replayed, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    rng = np.random.default_rng(0)
    B, L, steps = 200, 5, 8
    offsets = np.arange(0, 3 * B * L + 1, L, dtype=np.int32)
    chunks = [np.stack([np.concatenate([rng.zipf(1.2, B * L) % c.num_rows for c in tables])
                        for _ in range(steps)]).astype(np.int32) for _ in range(3)]
    target = rng.standard_normal((B, replayed.total_dim)).astype(np.float32)

    @jax.jit
    def step(anchor, chunk, k, target):
        indices = jax.lax.dynamic_index_in_dim(chunk, k, keepdims=False)
        return jax.grad(lambda a: jnp.sum(target * embedding_bag_collection(
            replayed, indices, jnp.asarray(offsets), anchor=a, record=True)))(anchor)

    numbers = [jnp.int32(k) for k in range(steps)]
    anchor = collection_anchor()
    for c, chunk in enumerate(chunks):
        if c == 2:  # a schedule's change between steps
            jax.block_until_ready(anchor)
            replayed.set_hyper(lr=0.01)
            eager.set_hyper(lr=0.01)
        on_gpu, fixed = jnp.asarray(chunk), jnp.asarray(target)
        for k in numbers:
            anchor = step(anchor, on_gpu, k, jnp.asarray(target) if moving_gradient else fixed)
        for k in range(steps):
            _, ctx = eager.forward(cupy.asarray(chunk[k]), cupy.asarray(offsets))
            eager.backward(ctx, cupy.asarray(target))
    jax.block_until_ready(anchor)
    replayed.check()
    eager.check()
    assert_state_equal(replayed, eager)
    assert recording_scratch_bytes(replayed) > 0 and recording_scratch_bytes(eager) == 0
    if "command_buffer" not in os.environ.get("XLA_FLAGS", ""):  # XLA's defaults record them
        assert len(calls) < len(chunks) * steps, "XLA replayed no step"


@pytest.mark.gpu
def test_a_recordings_pool_keeps_its_blocks_when_cuda_runs_out():
    """Recorded graphs write their scratch at every replay: the recordings' pool never gives
    a block back to CUDA, not even when an allocation fails (CuPy's pool would free its
    cached blocks and try again): the failure is raised and the cached block stays."""
    import cupy

    from xferlib.adapters.jax._callback import private_pool

    pool = private_pool({}, cupy.cuda.runtime.getDevice())
    block = pool.malloc(1 << 20)
    address = block.ptr
    del block  # cached by the pool, free for its next allocation
    held = pool.total_bytes()
    with pytest.raises(cupy.cuda.memory.OutOfMemoryError):
        pool.malloc(1 << 60)  # more than any GPU has
    assert pool.total_bytes() == held
    assert pool.malloc(1 << 20).ptr == address


@pytest.mark.gpu
def test_an_update_recorded_after_its_replayed_lookup_trains_on_its_plan_or_raises():
    """Each step's pooled gradient lies at a new address and each step waits for the one
    before (XLA's own buffers then stay put): XLA replays the recorded lookup and records
    the update again, which finds the plan the replay writes; the tables after the steps
    are those of the core's own calls, bitwise. With no recording of the lookup to be
    found (the collection's recorded plans forgotten), the update being recorded raises,
    and ``check()`` raises it too, rather than plan the batch again inside its
    recording."""
    import cupy

    tables = [TableConfig(300, 8, placement="hbm"),
              TableConfig(500, 16, placement="host", cache_rows=64)]
    replayed, eager = (EmbeddingCollection(tables, "adam", {"lr": 0.05}, device="cuda",
                                           seed=5) for _ in range(2))
    rng = np.random.default_rng(2)
    B, L, steps = 64, 3, 6
    offsets = np.arange(0, 2 * B * L + 1, L, dtype=np.int32)
    chunk = np.stack([np.concatenate([rng.integers(0, c.num_rows, B * L) for c in tables])
                      for _ in range(steps)]).astype(np.int32)
    targets = [rng.standard_normal((B, replayed.total_dim)).astype(np.float32)
               for _ in range(steps)]

    @jax.jit
    def step(anchor, chunk, k, target):
        indices = jax.lax.dynamic_index_in_dim(chunk, k, keepdims=False)
        return jax.grad(lambda a: jnp.sum(target * embedding_bag_collection(
            replayed, indices, jnp.asarray(offsets), anchor=a, record=True)))(anchor)

    numbers, on_gpu = [jnp.int32(k) for k in range(steps)], jnp.asarray(chunk)
    gradients = [jnp.asarray(t) for t in targets]  # made first: each at its own address
    anchor = collection_anchor()
    for k in range(steps - 1):
        anchor = jax.block_until_ready(step(anchor, on_gpu, numbers[k], gradients[k]))
        _, ctx = eager.forward(cupy.asarray(chunk[k]), cupy.asarray(offsets))
        eager.backward(ctx, cupy.asarray(targets[k]))
    replayed.check()
    assert_state_equal(replayed, eager)
    replayed._recorded.clear()  # the plans the recorded lookups write, forgotten
    try:  # XLA raises the callback's error, or logs it and goes on without the update
        jax.block_until_ready(step(anchor, on_gpu, numbers[-1], gradients[-1]))
    except Exception as err:  # noqa: BLE001 - JaxRuntimeError or, from jit's fast path, not
        assert "without a recording of its forward" in str(err)
    with pytest.raises(RuntimeError, match="without a recording of its forward"):
        replayed.check()  # kept for check() either way


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_record_trains_as_without_it(device, optimizer):
    """``record=True`` changes only how XLA may run the op (recorded and replayed on a GPU,
    as it is on the CPU): the same outputs, tables and state, bit for bit."""
    rng = np.random.default_rng(11)
    colls = [collection(device, optimizer) for _ in range(2)]
    steps = [jax.jit(jax.value_and_grad(
        lambda a, i, o, t, c=c, r=r: jnp.sum(embedding_bag_collection(
            c, i, o, anchor=a, record=r) * t))) for c, r in zip(colls, (False, True))]
    for _ in range(3):
        idx, off = batch(rng, B=5)
        target = jnp.asarray(rng.standard_normal((5, colls[0].total_dim)), jnp.float32)
        losses = [float(step(collection_anchor(), idx, off, target)[0]) for step in steps]
        assert losses[0] == losses[1]
    for c in colls:
        c.check()
    assert_state_equal(*colls)
    if device.platform == "cpu":  # no recording there: no scratch of its own
        assert recording_scratch_bytes(colls[1]) == 0
