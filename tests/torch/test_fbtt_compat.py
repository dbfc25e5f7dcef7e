"""FBTT-Embedding's own test scenarios, written for xferlib: forward against nn.EmbeddingBag on
the full table, core gradients and the fused SGD / Adagrad steps through the differentiable
``tt_matrix_to_full``, table-batched modules, FBTT checkpoints, the FBGEMM rules, devices."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from xferlib.adapters.torch import (  # noqa: E402
    OptimType, TableBatchedTTEmbeddingBag, TTEmbeddingBag, suggested_tt_shapes,
    tt_matrix_to_full)

P, Q, RANKS = [7, 9, 11, 5], [3, 4, 5, 7], [13, 12, 7]


def _devices():
    out = ["cpu"]
    try:
        from xferlib._backend import cupy_available

        if torch.cuda.is_available() and cupy_available():
            out.append("cuda")
    except ImportError:
        pass
    return out


def _device_param():
    return pytest.mark.parametrize("device", [
        "cpu", pytest.param("cuda", marks=pytest.mark.gpu)])


def _need(device):
    if device not in _devices():
        pytest.skip("needs a CUDA GPU with CuPy; none here")


def _feature(rng, batch, num, pooling=4, std=3):
    lengths = np.maximum(np.round(rng.normal(pooling, std, batch)), 0).astype(np.int64)
    indices = rng.integers(0, num, int(lengths.sum()))
    return lengths, indices, np.concatenate([[0], np.cumsum(lengths)])


def _config(ndims):
    p, q, r = P[:ndims], Q[:ndims], RANKS[:ndims - 1]
    return p, q, r, int(np.prod(p)), int(np.prod(q))


def _fbtt_pair(ndims, device, rng, batch=40, **kw):
    """An FBTT-style module, the nn.EmbeddingBag on its full table, one batch and a gradient."""
    p, q, r, num, dim = _config(ndims)
    tt = TTEmbeddingBag(num_embeddings=num, embedding_dim=dim, tt_p_shapes=p, tt_q_shapes=q,
                        tt_ranks=r, weight_dist="uniform", seed=1, **kw).to(device)
    emb = torch.nn.EmbeddingBag(num, dim, sparse=True, mode="sum", include_last_offset=True,
                                _weight=tt.full_weight().detach()).to(device)
    _, indices, offsets = _feature(rng, batch, num)
    indices = torch.tensor(indices, device=device)
    offsets = torch.tensor(offsets, device=device)
    d_out = torch.rand(batch, dim, device=device, generator=None) * 0.1
    return tt, emb, indices, offsets, d_out


def _reference_core_grads(tt, emb, indices, offsets, d_out):
    """Core gradients through the differentiable tt_matrix_to_full (FBTT's test recipe)."""
    cores = [c.detach().clone().requires_grad_(True) for c in tt.tt_cores]
    full = tt_matrix_to_full(tt.tt_p_shapes, tt.tt_q_shapes, tt.tt_ranks[1:-1], cores,
                             [1, 0, 2, 3])
    emb(indices, offsets).backward(d_out)
    full.backward(emb.weight.grad.to_dense())
    return cores


@_device_param()
@pytest.mark.parametrize("ndims", [2, 3, 4])
def test_forward_matches_embedding_bag_on_the_full_table(ndims, device):
    _need(device)
    tt, emb, indices, offsets, _ = _fbtt_pair(ndims, device, np.random.default_rng(ndims))
    torch.testing.assert_close(tt(indices, offsets), emb(indices, offsets), rtol=1e-4,
                               atol=1e-5)
    # FBTT's third argument is warmup (ignored as in FBTT); weights go by keyword
    torch.testing.assert_close(tt(indices, offsets, True), tt(indices, offsets))
    w = torch.rand(indices.numel(), device=device)
    torch.testing.assert_close(tt(indices, offsets, per_sample_weights=w),
                               emb(indices, offsets, per_sample_weights=w), rtol=1e-4,
                               atol=1e-5)


@_device_param()
@pytest.mark.parametrize("ndims", [2, 3, 4])
def test_dense_backward_through_tt_matrix_to_full(ndims, device):
    _need(device)
    tt, emb, indices, offsets, d_out = _fbtt_pair(ndims, device, np.random.default_rng(10 + ndims),
                                                  sparse=False)
    cores = _reference_core_grads(tt, emb, indices, offsets, d_out)
    tt(indices, offsets).backward(d_out)
    for ours, ref in zip(tt.tt_cores, cores):
        assert ours.grad.device == ref.grad.device
        torch.testing.assert_close(ours.grad, ref.grad, rtol=1e-4, atol=1e-5)


@_device_param()
@pytest.mark.parametrize("ndims", [2, 3, 4])
@pytest.mark.parametrize("optimizer", [OptimType.SGD, OptimType.EXACT_ADAGRAD])
def test_fused_sgd_and_adagrad_through_tt_matrix_to_full(ndims, optimizer, device):
    _need(device)
    lr, eps = 0.1, 1e-4
    tt, emb, indices, offsets, d_out = _fbtt_pair(ndims, device, np.random.default_rng(20 + ndims),
                                                  optimizer=optimizer, learning_rate=lr, eps=eps)
    cores = _reference_core_grads(tt, emb, indices, offsets, d_out)
    tt(indices, offsets).backward(d_out)
    tt.check_inputs()
    for k, (ours, ref) in enumerate(zip(tt.tt_cores, cores)):
        if optimizer == OptimType.SGD:
            expected = ref - lr * ref.grad
        else:
            state = ref.grad * ref.grad
            torch.testing.assert_close(tt.optimizer_state[k], state, rtol=1e-4, atol=1e-7)
            expected = ref - lr * ref.grad / (torch.sqrt(state) + eps)
        torch.testing.assert_close(ours.detach(), expected.detach(), rtol=1e-4, atol=1e-5)


@_device_param()
@pytest.mark.parametrize("ndims", [2, 3, 4])
@pytest.mark.parametrize("num_tables", [1, 3])
def test_table_batched_matches_separate_tables(ndims, num_tables, device):
    _need(device)
    rng = np.random.default_rng(30 + ndims + num_tables)
    p, q, r, num, dim = _config(ndims)
    batch = 25
    batched = TableBatchedTTEmbeddingBag(num_tables, num, dim, r, p, q, sparse=False,
                                         weight_dist="uniform", use_cache=False, seed=2).to(device)
    singles, inputs, lengths_all, indices_all = [], [], [], []
    for t in range(num_tables):
        lengths, indices, offsets = _feature(rng, batch, num)
        lengths_all.extend(lengths)
        indices_all.extend(indices)
        single = TTEmbeddingBag(num, dim, r, p, q, sparse=False, weight_dist="uniform",
                                use_cache=False, seed=100 + t).to(device)
        with torch.no_grad():
            for k, core in enumerate(batched.tt_cores):
                core[t].copy_(single.tt_cores[k][0])
        singles.append(single)
        inputs.append((torch.tensor(indices, device=device), torch.tensor(offsets, device=device)))
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(lengths_all)]), device=device)
    out = batched(torch.tensor(indices_all, device=device), offsets)
    assert out.shape == (num_tables, batch, dim)
    d_out = torch.rand(num_tables, batch, dim, device=device) * 0.1
    out.backward(d_out)
    for t, (single, (idx, off)) in enumerate(zip(singles, inputs)):
        o = single(idx, off)
        torch.testing.assert_close(out[t], o, rtol=1e-4, atol=1e-5)
        o.backward(d_out[t])
        for k, core in enumerate(single.tt_cores):
            torch.testing.assert_close(batched.tt_cores[k].grad[t], core.grad[0], rtol=1e-4,
                                       atol=1e-5)


@_device_param()
def test_table_batched_fused_sgd_and_bad_index(device):
    _need(device)
    rng = np.random.default_rng(5)
    p, q, r, num, dim = _config(3)
    kw = dict(weight_dist="uniform", use_cache=False, learning_rate=0.2)
    batched = TableBatchedTTEmbeddingBag(2, num, dim, r, p, q, seed=4, **kw).to(device)
    dense = TableBatchedTTEmbeddingBag(2, num, dim, r, p, q, seed=4, sparse=False,
                                       **kw).to(device)
    lengths, indices, _ = _feature(rng, 20, num)
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), device=device)
    indices = torch.tensor(indices, device=device)
    d_out = torch.rand(2, 10, dim, device=device)
    batched(indices, offsets).backward(d_out)
    dense(indices, offsets).backward(d_out)
    for a, b in zip(batched.tt_cores, dense.tt_cores):
        torch.testing.assert_close(a.detach(), (b - 0.2 * b.grad).detach(), rtol=1e-4,
                                   atol=1e-5)
    bad = indices.clone()
    bad[3] = num  # inside the joint TT's range, outside its table
    with pytest.raises(IndexError, match=f"index {num} at position 3"), torch.no_grad():
        dense(bad, offsets)
    before = [c.detach().clone() for c in batched.tt_cores]
    with pytest.raises(IndexError, match=f"index {num} at position 3"):
        batched(bad, offsets).backward(d_out)  # a training step: raised by now or ...
        batched.check_inputs()  # ... here, the step having changed nothing
    for a, b in zip(batched.tt_cores, before):
        torch.testing.assert_close(a.detach(), b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="num_tables"):
        dense(indices, offsets[:-1])


def test_fbtt_names_and_attributes():
    bag = TTEmbeddingBag(1000, 16, [4, 4], [10, 10, 10], [2, 2, 4], use_cache=True,
                         optimizer=OptimType.EXACT_ADAGRAD)
    assert bag.num_tables == 1 and bag.tt_ndim == 3 and bag.warmup
    assert bag.L.tolist() == [100, 10, 1]
    assert [tuple(s.shape) for s in bag.optimizer_state] == [(1, 10, 8), (1, 10, 32),
                                                             (1, 10, 16)]
    assert bag.hashtbl.shape == (1000,) and bag.cache_state.dtype == torch.int32
    params = bag.get_params()
    assert len(params) == 4 and params[-1] is bag.cache_weight and len(bag.tt_cores) == 3
    before = bag.tt_cores[0].detach().clone()
    bag.reset_parameters("normal")
    assert not torch.equal(before, bag.tt_cores[0])
    assert suggested_tt_shapes(64, 3) == [4, 4, 4]
    assert np.prod(suggested_tt_shapes(11_000_000, 3)) >= 11_000_000
    sgd = TTEmbeddingBag(100, 8, [2, 2], use_cache=False)
    assert [s.numel() for s in sgd.optimizer_state] == [0, 0, 0]
    assert sgd.hashtbl.numel() == 0 and sgd.cache_weight is None
    with pytest.raises(ValueError, match="num_tables == 1"):
        TableBatchedTTEmbeddingBag(2, 100, 8, [2, 2], use_cache=True)


def test_inputs_on_another_device_raise():
    bag = TTEmbeddingBag(100, 8, [2, 2], use_cache=False)
    indices, offsets = torch.tensor([1, 2]), torch.tensor([0, 2])
    with pytest.raises(RuntimeError, match="same device.*indices"):
        bag(indices.to("meta"), offsets)
    with pytest.raises(RuntimeError, match="same device.*offsets"):
        bag(indices, offsets.to("meta"))


@pytest.mark.gpu
def test_cuda_inputs_to_a_cpu_module_raise():
    _need("cuda")
    bag = TTEmbeddingBag(100, 8, [2, 2], use_cache=False)
    with pytest.raises(RuntimeError, match="same device"):
        bag(torch.tensor([1, 2], device="cuda"), torch.tensor([0, 2], device="cuda"))


# ----------------------------------------------------------------------------- checkpoints


def _fbtt_checkpoint(module, rng, optimizer_state, n_cached):
    """A state_dict laid out as FBTT writes it (its documented buffers): L, tt_cores.k,
    optimizer_state.optimizer_state<k>, hashtbl / cache_freq / cache_state (one slot per row
    under FBTT's own hashing: here, any positions), cache_weight, cache_optimizer_state."""
    sd = {"L": module.L.clone()}
    for k, c in enumerate(module.tt_cores):
        sd[f"tt_cores.{k}"] = torch.randn_like(c.detach())
        sd[f"optimizer_state.optimizer_state{k}"] = optimizer_state(c)
    size, capacity, dim = module.hashtbl_size, module.cache_size, module.embedding_dim
    rows = rng.choice(module.num_embeddings, 3 * capacity, replace=False)
    positions = rng.choice(size, rows.size, replace=False)
    hashtbl = np.full(size, -1, dtype=np.int64)
    hashtbl[positions] = rows
    freq = np.zeros(size, dtype=np.int64)
    freq[positions] = rng.integers(1, 50, rows.size)
    state = np.full(size, -1, dtype=np.int32)
    slots = rng.permutation(capacity)[:n_cached]
    state[positions[:n_cached]] = slots
    sd.update(hashtbl=torch.from_numpy(hashtbl), cache_freq=torch.from_numpy(freq),
              cache_state=torch.from_numpy(state),
              cache_weight=torch.randn(capacity, dim))
    return sd, {int(r): int(s) for r, s in zip(rows[:n_cached], slots)}


@pytest.mark.parametrize("optimizer", [OptimType.SGD, OptimType.EXACT_ADAGRAD,
                                       OptimType.EXACT_ROWWISE_ADAGRAD, OptimType.LAMB])
def test_fbtt_checkpoints_load_strictly(optimizer):
    rng = np.random.default_rng(3)
    kw = dict(tt_p_shapes=[5, 6, 7], tt_q_shapes=[2, 2, 2], optimizer=optimizer,
              weight_dist="normal", cache_size=8)
    module = TTEmbeddingBag(210, 8, [3, 3], **kw)
    fresh = lambda c: torch.zeros(0) if optimizer == OptimType.SGD else torch.rand_like(c)  # noqa
    probe = TTEmbeddingBag(210, 8, [3, 3], **kw)
    sd, slot_of = _fbtt_checkpoint(probe, rng, lambda c: fresh(c.detach()), 5)
    cached = sorted(slot_of)
    if optimizer != OptimType.SGD:
        sd["cache_optimizer_state"] = (torch.rand(8, 8) if optimizer == OptimType.EXACT_ADAGRAD
                                       else torch.rand(8))
    if optimizer == OptimType.LAMB:
        sd.pop("cache_optimizer_state")
    module.load_state_dict(sd)  # strict
    for k, c in enumerate(module.tt_cores):
        torch.testing.assert_close(c.detach(), sd[f"tt_cores.{k}"])
        state, theirs = module.optimizer_state[k], sd[f"optimizer_state.optimizer_state{k}"]
        if optimizer == OptimType.EXACT_ADAGRAD:
            torch.testing.assert_close(state, theirs)
        elif optimizer == OptimType.EXACT_ROWWISE_ADAGRAD:
            torch.testing.assert_close(state, theirs.mean(-1))
        elif optimizer == OptimType.LAMB:  # FBTT ran Adagrad: fresh state
            assert not state.any()
    # the cache: the same rows cached with their dense values, counts kept
    assert not module.warmup
    rows = module.cache_rows[module.cache_rows != np.iinfo(np.int64).max].tolist()
    assert rows == cached
    for slot, row in enumerate(rows):
        torch.testing.assert_close(module.cache_weight[slot], sd["cache_weight"][slot_of[row]])
    theirs = {int(k): int(v) for k, v in zip(sd["hashtbl"], sd["cache_freq"]) if k >= 0}
    ours = {int(k): int(v) for k, v in zip(module.hashtbl, module.cache_freq) if k >= 0}
    assert ours == theirs
    slots = module.cache_state[module.hashtbl >= 0]
    keys = module.hashtbl[module.hashtbl >= 0]
    for key, slot in zip(keys.tolist(), slots.tolist()):
        assert slot == (rows.index(key) if key in rows else -1)
    # the loaded module serves its cached rows and saves / reloads as xferlib
    full = module.full_weight()
    torch.testing.assert_close(full[rows], module.cache_weight[:len(rows)])
    again = TTEmbeddingBag(210, 8, [3, 3], **kw)
    again.load_state_dict(module.state_dict())
    torch.testing.assert_close(again.full_weight(), full)


def test_fbtt_checkpoint_without_cache_loads_strictly():
    module = TTEmbeddingBag(210, 8, [3, 3], [5, 6, 7], [2, 2, 2], use_cache=False)
    sd = {"L": module.L.clone(), "hashtbl": torch.empty(0, dtype=torch.int64),
          "cache_state": torch.empty(0, dtype=torch.int32)}
    for k, c in enumerate(module.tt_cores):
        sd[f"tt_cores.{k}"] = torch.randn_like(c.detach())
        sd[f"optimizer_state.optimizer_state{k}"] = torch.zeros(0)
    module.load_state_dict(sd)
    with pytest.raises(RuntimeError, match="Missing key"):
        module.load_state_dict({k: v for k, v in sd.items() if k != "tt_cores.1"})


# ----------------------------------------------------------------------------- FBGEMM rules


@_device_param()
@pytest.mark.parametrize("optimizer", [OptimType.LAMB, OptimType.LARS_SGD,
                                       OptimType.PARTIAL_ROWWISE_ADAM,
                                       OptimType.PARTIAL_ROWWISE_LAMB])
def test_fbgemm_rules_in_the_module_match_a_float64_reference(optimizer, device):
    _need(device)
    from tests.core.test_tt import fbgemm_row_update

    rng = np.random.default_rng(6)
    kw = dict(tt_p_shapes=[6, 5, 4], tt_q_shapes=[2, 2, 2], weight_dist="normal", seed=8,
              learning_rate=0.05, eps=1e-8, use_cache=False, weight_decay=0.01)
    fused = TTEmbeddingBag(120, 8, [3, 3], optimizer=optimizer, **kw).to(device)
    dense = TTEmbeddingBag(120, 8, [3, 3], sparse=False, **kw).to(device)
    name = {OptimType.LAMB: "lamb", OptimType.LARS_SGD: "lars_sgd",
            OptimType.PARTIAL_ROWWISE_ADAM: "partial_rowwise_adam",
            OptimType.PARTIAL_ROWWISE_LAMB: "partial_rowwise_lamb"}[optimizer]
    from xferlib import tt as core
    from xferlib.tt.rules import row_state

    ref_w = [c.detach().cpu().double().numpy()[0].copy() for c in dense.tt_cores]
    ref_state = [[{k: np.zeros(v.shape[1:]) for k, v in
                   row_state(c.shape[0], c.shape[1], name).items()}
                  for _ in range(c.shape[0])] for c in ref_w]
    for step in range(1, 4):
        _, indices, offsets = _feature(rng, 6, 120)
        indices, offsets = torch.tensor(indices, device=device), torch.tensor(offsets,
                                                                               device=device)
        d_out = torch.rand(6, 8, device=device)
        with torch.no_grad():
            for c, w in zip(dense.tt_cores, ref_w):
                c.copy_(torch.from_numpy(w[None]).float())
                c.grad = None
        dense(indices, offsets).backward(d_out)
        fused(indices, offsets).backward(d_out)
        touched = [np.unique(core.TTShape([6, 5, 4], [2, 2, 2], [3, 3]).digits(
            indices.cpu().numpy())[:, k]) for k in range(3)]
        for k, c in enumerate(dense.tt_cores):
            g = c.grad.cpu().double().numpy()[0]
            for row in touched[k]:
                ref_w[k][row] = fbgemm_row_update(name, ref_w[k][row], g[row],
                                                  ref_state[k][row], step, 0.05, wd=0.01)
        fused.check_inputs()
        for c, w in zip(fused.tt_cores, ref_w):
            np.testing.assert_allclose(c.detach().cpu().numpy()[0], w, rtol=1e-4, atol=1e-5)
