"""What the GPU TT step keeps between calls (views of the cores, state and step counter;
scratch buffers reused from step to step) never goes stale: a module whose tensors moved
trains on the new storage, and batches of changing sizes, or two forwards queued before
their backwards, train as on the CPU."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from xferlib.adapters.torch import OptimType, TTEmbeddingBag  # noqa: E402

KW = dict(tt_p_shapes=[6, 10, 10], tt_q_shapes=[2, 2, 4], learning_rate=0.05,
          weight_dist="normal", seed=3, use_cache=False)


def _require_gpu():
    import xferlib

    if not (torch.cuda.is_available() and xferlib.cupy_available()):
        pytest.skip("needs a CUDA GPU with CuPy; none here")


def _batch(n, seed, num=600, per_bag=5):
    g = torch.Generator().manual_seed(seed)
    indices = torch.randint(0, num, (n,), generator=g)
    indices[: min(n, 3)] = indices[min(n, 3) - 1]  # repeats
    offsets = torch.cat([torch.arange(0, n, per_bag), torch.tensor([n])])
    grad = torch.randn(offsets.numel() - 1, 16, generator=g)
    return indices, offsets, grad


def _assert_same_state(gpu, cpu, rtol=1e-4, atol=1e-5):
    for a, b in zip(gpu.tt_cores, cpu.tt_cores):
        np.testing.assert_allclose(a.detach().cpu().numpy(), b.detach().numpy(), rtol=rtol,
                                   atol=atol)
    theirs = dict(cpu.named_buffers())
    for name, value in gpu.named_buffers():
        np.testing.assert_allclose(value.cpu().numpy(), theirs[name].numpy(), rtol=rtol,
                                   atol=atol, err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", [OptimType.ADAM, OptimType.EXACT_ADAGRAD], ids=str)
def test_moved_module_trains_on_its_new_storage(optimizer):
    """After .cpu().cuda() (new cores, state and step counter) and after cores given new
    .data, the next steps read and write the new tensors (ADAM reads the step count)."""
    _require_gpu()
    moved = TTEmbeddingBag(600, 16, [3, 4], optimizer=optimizer, **KW).cuda()
    ref = TTEmbeddingBag(600, 16, [3, 4], optimizer=optimizer, **KW)
    batches = [_batch(20, seed) for seed in range(6)]
    for step, (indices, offsets, grad) in enumerate(batches):
        if step == 2:
            moved = moved.cpu().cuda()
        if step == 4:
            with torch.no_grad():
                for core in moved.tt_cores:
                    core.data = core.data.clone()
        moved(indices.cuda(), offsets.cuda()).backward(grad.cuda())
        ref(indices, offsets).backward(grad)
    moved.check_inputs()
    assert moved.iter == ref.iter == 6
    _assert_same_state(moved, ref)


@pytest.mark.gpu
def test_changing_batch_sizes_and_queued_forwards_train_as_on_the_cpu():
    """Sizes that change every buffer the step reuses (and how many merges the sorts take:
    1 to 2,048 positions sort in one tile, more merge), and two forwards queued before their
    backwards (the first backward must read its own plan), against the CPU module."""
    _require_gpu()
    gpu = TTEmbeddingBag(600, 16, [3, 4], optimizer=OptimType.EXACT_ADAGRAD, **KW).cuda()
    cpu = TTEmbeddingBag(600, 16, [3, 4], optimizer=OptimType.EXACT_ADAGRAD, **KW)
    for seed, n in enumerate([5, 3000, 1, 4500, 3000, 2048, 9000, 5]):
        indices, offsets, grad = _batch(n, seed)
        out_gpu = gpu(indices.cuda(), offsets.cuda())
        out_cpu = cpu(indices, offsets)
        np.testing.assert_allclose(out_gpu.detach().cpu().numpy(), out_cpu.detach().numpy(),
                                   rtol=1e-4, atol=1e-5)
        out_gpu.backward(grad.cuda())
        out_cpu.backward(grad)
    _assert_same_state(gpu, cpu)
    first, second = _batch(4500, 11), _batch(3000, 12)
    outs_gpu = [gpu(i.cuda(), o.cuda()) for i, o, _ in (first, second)]
    outs_cpu = [cpu(i, o) for i, o, _ in (first, second)]
    for out_gpu, out_cpu, (_, _, grad) in zip(outs_gpu, outs_cpu, (first, second)):
        out_gpu.backward(grad.cuda())
        out_cpu.backward(grad)
    gpu.check_inputs()
    _assert_same_state(gpu, cpu)
