"""leave_process_group: every rank waits for the others, the groups are destroyed, and a
script without torch.distributed is untouched. (Its reason to exist, a gloo worker thread
freeing a tensor while Python shuts down, is a race: the gloo tests of this suite and the
examples all leave through it.)"""

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from xferlib.adapters.torch import leave_process_group  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def test_without_a_group_nothing_happens():
    assert not dist.is_initialized()
    leave_process_group()
    assert not dist.is_initialized()


def test_the_group_is_destroyed():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        x = torch.ones(3)
        dist.all_reduce(x)
        leave_process_group()
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
