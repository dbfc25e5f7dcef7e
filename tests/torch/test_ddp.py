"""FlatAdamW under DistributedDataParallel (2 CPU processes, gloo) equals one process
training on the whole batch."""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from xferlib.adapters.torch import FlatAdamW, leave_process_group  # noqa: E402
from tests.torch.dist_helpers import free_port, join  # noqa: E402

STEPS = 15


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 2))


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 6, generator=g), torch.randn(16, 2, generator=g))
            for _ in range(STEPS)]


def _worker(rank, world, port, out_dir):
    join(rank, world, port, "gloo")
    model = torch.nn.parallel.DistributedDataParallel(_model())
    opt = FlatAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in _batches():
        half = slice(rank * 8, (rank + 1) * 8)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[half]), y[half]).backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    np.save(os.path.join(out_dir, f"rank{rank}.npy"), flat.numpy())
    leave_process_group()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                    reason="torch.distributed with gloo is not available")
def test_ddp_over_gloo_matches_single_process(tmp_path):
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    model = _model()
    opt = FlatAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in _batches():
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    expected = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    for rank in range(2):
        np.testing.assert_allclose(np.load(tmp_path / f"rank{rank}.npy"), expected,
                                   rtol=1e-5, atol=1e-6)
