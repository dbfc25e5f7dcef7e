"""The examples in docstrings run as written."""

import doctest
import importlib

import pytest

MODULES = ["xferlib.rows", "xferlib.memory", "xferlib.perf", "xferlib.adapters.torch.rows",
           "xferlib.adapters.jax.rows", "xferlib.adapters.torch.contiguous",
           "xferlib.adapters.torch.tt", "xferlib.adapters.torch.speedtorch",
           "xferlib.adapters.torch.speedtorch.cupy_live", "xferlib.adapters.torch.tt_batched",
           "xferlib.adapters.jax.optim", "xferlib.adapters.jax.mesh"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
