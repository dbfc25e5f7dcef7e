"""A collection's training step captured in one CUDA graph and replayed beside eager steps:
the harness the torch collection tests share (GPU only)."""

from __future__ import annotations

import numpy as np
import torch


def linear_head_step(ebc, dense, opt, idx, off, y):
    """One step of a linear head on the pooled embeddings (MSE), embeddings trained in
    backward, the head by ``opt``; the loss."""
    opt.zero_grad(set_to_none=False)
    loss = (dense(ebc(idx, off)).squeeze(1) - y).square().mean()
    loss.backward()
    opt.step()
    return loss


def fixed_length_batches(rows, B: int, count: int, seed: int = 4):
    """``(offsets, [(indices, targets)] * count)`` on the GPU: every batch with the same bag
    lengths (a captured step replays fixed shapes, the number of indices too)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 5, size=len(rows) * B)
    offsets = torch.as_tensor(np.concatenate([[0], np.cumsum(lengths)]), device="cuda")

    def draw():
        parts = [rng.integers(0, n, int(lengths[t * B:(t + 1) * B].sum()))
                 for t, n in enumerate(rows)]
        return (torch.as_tensor(np.concatenate(parts), device="cuda"),
                torch.as_tensor(rng.standard_normal(B), dtype=torch.float32, device="cuda"))

    return offsets, [draw() for _ in range(count)]


def replay_beside_eager(build, step, batches, offsets):
    """Two models from ``build()``, both warmed up on a side stream with ``batches[:2]``
    (kernels compiled, the collection's GPU side made); ``step`` captured on one and
    replayed for ``batches[2:]`` beside eager steps of the other, their losses compared.
    Returns ``(eager, graphed)`` after the device finished."""
    eager, graphed = build(), build()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for model in (eager, graphed):
            for idx, y in batches[:2]:
                step(*model, idx, offsets, y)
    torch.cuda.current_stream().wait_stream(side)
    static_idx, static_y = batches[2][0].clone(), batches[2][1].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step(*graphed, static_idx, offsets, static_y)
    for idx, y in batches[2:]:
        static_idx.copy_(idx)
        static_y.copy_(y)
        graph.replay()
        loss = step(*eager, idx, offsets, y)
        torch.testing.assert_close(static_loss, loss, rtol=1e-5, atol=1e-6)
    torch.cuda.synchronize()
    return eager, graphed
