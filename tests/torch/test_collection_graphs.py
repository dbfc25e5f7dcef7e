"""EmbeddingBagCollection(cuda_graphs=True): eagerly called training steps replayed from
per-shape CUDA graphs train bit for bit as the eager module, fall back to eager steps where
a replay would not be exact, and report bad input as eager steps do."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from xferlib.adapters.torch import EmbeddingBagCollection, TableConfig  # noqa: E402
from xferlib.testing import GPU_SKIP_REASON  # noqa: E402

HYPER = {"sgd": {"lr": 0.3, "momentum": 0.9}, "adam": {"lr": 0.05},
         "rowwise_adagrad": {"lr": 0.2}}
ROWS, DIMS = (700, 1, 3300), (8, 4, 8)  # a cache needs one width of host rows
PLACEMENTS = {"hbm": dict(placement="hbm"), "host": dict(placement="host"),
              "cache": dict(placement="host", cache_rows=64)}


def _need_gpu():
    import xferlib

    if not (torch.cuda.is_available() and xferlib.cupy_available()):
        pytest.skip(GPU_SKIP_REASON)


def build(optimizer="sgd", placement="hbm", cuda_graphs=False, device="cuda"):
    # the middle table stays in HBM: a host table and an HBM one share each step
    configs = [TableConfig(n, d, name=f"f{t}", init=("normal", 0.0, 1.0),
                           **(PLACEMENTS[placement] if t != 1 else PLACEMENTS["hbm"]))
               for t, (n, d) in enumerate(zip(ROWS, DIMS))]
    return EmbeddingBagCollection(configs, optimizer, HYPER[optimizer], device=device, seed=5,
                                  cuda_graphs=cuda_graphs)


def shaped_batches(B, count, seed, device="cuda", dtype=torch.int64):
    """``count`` batches of one shape (the same bag lengths), Zipf-like rows: repeats."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 6, size=len(ROWS) * B)
    offsets = torch.as_tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=dtype,
                              device=device)
    out = []
    for _ in range(count):
        parts = [np.minimum(rng.zipf(1.3, int(lengths[t * B:(t + 1) * B].sum())) - 1, n - 1)
                 for t, n in enumerate(ROWS)]
        idx = torch.as_tensor(np.concatenate(parts), dtype=dtype, device=device)
        grad = torch.as_tensor(rng.standard_normal((B, sum(DIMS))), dtype=torch.float32,
                               device=device)
        out.append((idx, offsets, grad))
    return out


def assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def train(module, batches):
    outs = []
    for idx, off, grad in batches:
        out = module(idx, off)
        outs.append(out.detach().clone())
        out.backward(grad)
    return outs


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", sorted(HYPER))
@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_replayed_steps_train_as_eager_steps_bit_for_bit(optimizer, placement):
    _need_gpu()
    # three shapes, interleaved: each gets its own graphs; the largest's batches are past
    # one tile of the sort (the radix sort's launches, recorded)
    a, b, c = (shaped_batches(24, 6, seed=1), shaped_batches(9, 6, seed=2),
               shaped_batches(600, 6, seed=3))
    batches = [x for group in zip(a, b, c) for x in group]
    eager, graphed = build(optimizer, placement), build(optimizer, placement, True)
    for got, want in zip(train(graphed, batches), train(eager, batches)):
        assert torch.equal(got, want)
    torch.cuda.synchronize()
    assert_same_state(graphed, eager)
    shapes = graphed._graphs.shapes
    assert len(shapes) == 3
    assert all(s.forward is not None and s.backward is not None for s in shapes.values())
    if placement == "cache":
        assert graphed.collection.cache_stats() == eager.collection.cache_stats()


@pytest.mark.gpu
def test_the_dict_form_and_per_sample_weights_are_replayed_alike():
    _need_gpu()
    batches = shaped_batches(10, 5, seed=9)
    rng = np.random.default_rng(10)
    weights = [torch.as_tensor(rng.random(idx.numel()), dtype=torch.float32, device="cuda")
               for idx, _, _ in batches]
    eager, graphed = build("adam", "host"), build("adam", "host", True)

    def script(m):
        outs = []
        for (idx, off, grad), psw in zip(batches, weights):
            out = m(idx, off, psw)
            outs.append(out.detach().clone())
            out.backward(grad)
        B = (off.numel() - 1) // len(ROWS)
        for idx, off, grad in batches:  # the same lookups table by table
            features = {}
            for t, name in enumerate(m.names):
                lo, hi = int(off[t * B]), int(off[(t + 1) * B])
                features[name] = (idx[lo:hi], off[t * B:(t + 1) * B + 1] - lo)
            out = m(features)
            outs.append(out.detach().clone())
            out.backward(grad)
        return outs

    for got, want in zip(script(graphed), script(eager)):
        assert torch.equal(got, want)
    torch.cuda.synchronize()
    assert_same_state(graphed, eager)
    assert len(graphed._graphs.shapes) == 2  # flat with weights; packed without
    assert all(s.forward is not None for s in graphed._graphs.shapes.values())


@pytest.mark.gpu
def test_two_forwards_before_their_backwards_and_steps_between_fall_back_exactly():
    """Gradient accumulation (two forwards, then both backwards), a lookup through the
    cache and another shape's step between a replayed forward and its backward: each runs
    as the eager module runs it."""
    _need_gpu()
    a, b = shaped_batches(16, 8, seed=3), shaped_batches(5, 4, seed=4)
    eager, graphed = build("adam", "cache"), build("adam", "cache", True)

    def script(m):
        outs = train(m, a[:3])  # the third is replayed
        o1, o2 = m(*a[3][:2]), m(*a[4][:2])  # the second forward finds the first pending
        outs += [o1.detach().clone(), o2.detach().clone()]
        (o1 * a[3][2]).sum().backward()
        (o2 * a[4][2]).sum().backward()
        o = m(*a[5][:2])  # replayed
        with torch.no_grad():
            outs.append(m(*b[0][:2]).clone())  # a lookup's cache pass between
        outs.append(o.detach().clone())
        o.backward(a[5][2])
        o = m(*a[6][:2])
        outs += train(m, b[1:3])  # another shape's steps between
        outs.append(o.detach().clone())
        o.backward(a[6][2])
        return outs + train(m, a[7:])

    for got, want in zip(script(graphed), script(eager)):
        assert torch.equal(got, want)
    torch.cuda.synchronize()
    assert_same_state(graphed, eager)


@pytest.mark.gpu
def test_steps_on_changing_streams_replay_as_eager_steps():
    """Each step on the next of two side streams, ordered after the other's (the tables
    need that order, eagerly too): the graphs, captured on one stream, replay on both."""
    _need_gpu()
    batches = shaped_batches(64, 10, seed=14)
    eager, graphed = build("adam", "host"), build("adam", "host", True)
    want = train(eager, batches)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    torch.cuda.synchronize()  # the module's tables and the batches, made on the default stream
    got = []
    for k, (idx, off, grad) in enumerate(batches):
        stream = streams[k % 2]
        stream.wait_stream(streams[(k + 1) % 2])
        with torch.cuda.stream(stream):
            out = graphed(idx, off)
            got.append(out.detach().clone())
            out.backward(grad)
    torch.cuda.synchronize()
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert_same_state(graphed, eager)


@pytest.mark.gpu
def test_a_bad_batch_in_a_replayed_shape_raises_later_and_changes_nothing():
    _need_gpu()
    batches = shaped_batches(12, 4, seed=6)
    graphed = build("sgd", "host", True)
    train(graphed, batches[:3])  # captured at the second, replayed at the third
    torch.cuda.synchronize()
    before = {k: v.clone() for k, v in graphed.state_dict().items()}
    idx, off, grad = batches[3]
    bad = idx.clone()
    bad[-1] = ROWS[-1] + 7  # past the last table
    with pytest.raises(IndexError):  # from the backward's poll or the check
        graphed(bad, off).backward(grad)
        graphed.check()
    after = graphed.state_dict()
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    graphed(idx, off).backward(grad)  # a good batch after the bad one trains
    graphed.check()


def varied_batches(B, count, seed, device="cuda"):
    """``count`` batches of B bags whose lengths change from batch to batch: the number of
    lookups too (0..3 a bag, so the batches fall in a few buckets)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        lengths = rng.integers(0, 4, size=len(ROWS) * B)
        offsets = torch.as_tensor(np.concatenate([[0], np.cumsum(lengths)]), device=device)
        parts = [np.minimum(rng.zipf(1.3, int(lengths[t * B:(t + 1) * B].sum())) - 1, n - 1)
                 for t, n in enumerate(ROWS)]
        idx = torch.as_tensor(np.concatenate(parts), device=device)
        grad = torch.as_tensor(rng.standard_normal((B, sum(DIMS))), dtype=torch.float32,
                               device=device)
        out.append((idx, offsets, grad))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["hbm", "cache"])
def test_batches_of_changing_lengths_share_a_buckets_graphs(placement):
    """Batches of one B and different numbers of lookups replay one bucket's graphs (their
    lookups copied to the front of its padded indices) and train as the eager module."""
    _need_gpu()
    from xferlib.adapters.torch.collection_graphs import capacity

    batches = varied_batches(30, 16, seed=21)
    sizes = {idx.numel() for idx, _, _ in batches}
    eager, graphed = build("adam", placement), build("adam", placement, True)
    for got, want in zip(train(graphed, batches), train(eager, batches)):
        assert torch.equal(got, want)
    torch.cuda.synchronize()
    assert_same_state(graphed, eager)
    shapes = graphed._graphs.shapes
    assert len(shapes) == len({capacity(n) for n in sizes}) < len(sizes)
    assert any(s.forward is not None and s.backward is not None for s in shapes.values())


@pytest.mark.gpu
@pytest.mark.parametrize("last", [-1, +1])
def test_a_replayed_bucket_refuses_offsets_that_miss_the_batch_end(last):
    """A batch whose last bag does not end at its number of lookups, replayed in a bucket
    whose padding would hide it, is refused as the eager step refuses it (ValueError, from
    a later call or the check) and changes nothing."""
    _need_gpu()
    batches = shaped_batches(12, 3, seed=22)
    graphed = build("sgd", "host", True)
    train(graphed, batches)  # the bucket captured and replayed
    torch.cuda.synchronize()
    before = {k: v.clone() for k, v in graphed.state_dict().items()}
    idx, off, grad = batches[0]
    bad = off.clone()
    bad[-1] += last  # one lookup short of the end, or one past it (in the padding)
    with pytest.raises(ValueError, match="offsets"):
        graphed(idx, bad).backward(grad)
        graphed.check()
    after = graphed.state_dict()
    for key, value in before.items():
        assert torch.equal(after[key], value), key


@pytest.mark.gpu
def test_a_module_with_graphs_copies_and_moves():
    _need_gpu()
    batches = shaped_batches(8, 3, seed=7)
    graphed = build("sgd", "hbm", True)
    train(graphed, batches)
    clone = copy.deepcopy(graphed)
    assert clone._graphs is not None and not clone._graphs.shapes
    assert_same_state(clone, graphed)
    train(clone, batches)
    train(graphed, batches)
    assert_same_state(clone, graphed)
    graphed.double()  # a rebuild drops the graphs captured on the old buffers
    assert not graphed._graphs.shapes


def test_cuda_graphs_is_a_flag_and_changes_nothing_on_the_cpu():
    with pytest.raises(TypeError, match="cuda_graphs"):
        build(cuda_graphs=1, device="cpu")
    batches = shaped_batches(6, 3, seed=8, device="cpu")
    plain, flagged = build(device="cpu"), build(cuda_graphs=True, device="cpu")
    for got, want in zip(train(flagged, batches), train(plain, batches)):
        assert torch.equal(got, want)
    assert_same_state(flagged, plain)
    assert "cuda_graphs=True" in repr(flagged)
    assert copy.deepcopy(flagged)._graphs is not None


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["host", "cache"])
def test_eager_lookup_backpropagated_after_a_replayed_step_trains_as_without_graphs(
        placement):
    """Each step looks up a new shape (eager), then a replayed one, and backpropagates
    through both: autograd runs the replayed update first, so the eager lookup's staged rows
    are stale when its own update runs (a replay counts as an update: its update reads the
    rows where they live, the rows the replay left pending written back first). Trains as
    the module without graphs, bit for bit."""
    _need_gpu()
    graphed, eager = build("rowwise_adagrad", placement, True), build("rowwise_adagrad",
                                                                      placement, False)
    replayed = shaped_batches(16, 6, seed=3)
    new_shapes = [shaped_batches(5 + k, 1, seed=10 + k)[0] for k in range(6)]
    for module in (graphed, eager):
        for (idx, off, grad), (new_idx, new_off, new_grad) in zip(replayed, new_shapes):
            first = module(new_idx, new_off)
            second = module(idx, off)
            ((first * new_grad).sum() + (second * grad).sum()).backward()
    assert_same_state(graphed, eager)
