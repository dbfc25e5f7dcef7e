"""Drop-in for SpeedTorch 0.1.6: every class its package exports, with its names, arguments,
call order and attributes, so a SpeedTorch script runs by changing its import::

    from xferlib.adapters.torch import speedtorch as SpeedTorch

=====================================  ==================================================
SpeedTorch family                      collection
=====================================  ==================================================
``ModelFactory``, ``OptimizerFactory``  CuPy array on the GPU, or pinned host memory read
``COM``, ``DataGadget``                 as a CuPy array (``CPUPinn=True``)
``*MM`` (``ModelFactoryMM``, ...)       the same, started from a zero file on disk
``PytorchModelFactory``, ...            torch tensor on ``deviceType`` (``pinType``)
``GPUPytorch*``                         CUDA tensor
``CPUPytorch*``                         pinned CPU tensor
=====================================  ==================================================

Collections are pinned host tables (or GPU tables) whose rows move through xferlib's row
kernels: sorted, deduplicated, zero-copy from pinned memory, on torch's current stream, with
no device-wide synchronization. Without a GPU everything runs on the CPU: collections are
NumPy arrays / CPU tensors and rows are CPU tensors.

What behaves differently, and why:

* Repeated indexes lose no update. When a batch names a row at several positions, the
  gradients of its copies are summed and every copy takes the same step, so the row receives
  the update of a dense step on its summed gradient. SpeedTorch writes the copies back in
  arbitrary order and keeps one copy's update (the other copies' gradients are lost).
* The optimizer state is found by parameter, not by position in ``optimizer.state_dict()``,
  and starts from the optimizer's own initial state: every torch.optim optimizer whose state
  is per row works on torch 2.x (SpeedTorch supports seven, and its state lookup breaks on
  torch 2.x); one whose state spans rows (Adafactor's factored moments) is refused with a
  ValueError, as LBFGS (which needs a closure) is.
* ``DataGadget.getData(indexes)`` keeps the index shape (``indexes.shape + row_shape``), as
  CuPy indexing does; negative indexes count from the end; a bad index raises IndexError
  naming its position before anything moves.
* Switched-in rows land on the model variable's device (SpeedTorch moved them to the GPU,
  which only worked with a model on the GPU, where this is the same).
* Initializers are reproducible after seeding: CuPy families draw from CuPy's global
  generator on a GPU (``cupy.random.seed``; the same numbers SpeedTorch draws for
  ``CPUPinn=False``), NumPy's global generator without a GPU (``numpy.random.seed``); torch
  families use ``torch.nn.init`` (``torch.manual_seed``), as SpeedTorch.
* ``getCupyVar()`` / ``.CUPYcorpus`` is a CuPy array; for ``CPUPinn=True`` a CuPy array over
  the pinned host memory itself (writes through it change the collection). Without a GPU it
  is the NumPy array holding the collection.

Example (runs on the CPU; on a GPU the same lines run there):

>>> import numpy as np, torch
>>> from xferlib.adapters.torch import speedtorch as SpeedTorch
>>> emb = torch.nn.Embedding(4, 3)
>>> opt = torch.optim.Adamax(emb.parameters(), lr=0.1)
>>> model_sw = SpeedTorch.ModelFactory(emb, total_classes=50, embed_dimension=3)
>>> model_sw.uniformDistributionInit(-0.1, 0.1)
>>> class Model(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.u_embeddings = emb
>>> opt_sw = SpeedTorch.OptimizerFactory(opt, 50, 3, Model(), "u_embeddings")
>>> opt_sw.optInit()
>>> idx = np.array([7, 7, 20, 41])
>>> for sw in (model_sw, opt_sw):
...     sw.beforeForwardPass(idx)
>>> emb(torch.arange(4)).sum().backward()
>>> opt.step(); opt.zero_grad()
>>> for sw in (model_sw, opt_sw):
...     sw.afterOptimizerStep(idx)
>>> opt_sw.optVarList
['exp_avg', 'exp_inf']
"""

from xferlib.adapters.torch.speedtorch.cupy_live import (COM, DataGadget, ModelFactory,
                                                         OptimizerFactory, my_pinned_allocator)
from xferlib.adapters.torch.speedtorch.cupy_memmap import (COMMM, DataGadgetMM,
                                                           ModelFactoryMM, OptimizerFactoryMM,
                                                           my_pinned_allocatorMM)
from xferlib.adapters.torch.speedtorch.torch_tensors import (
    CPUPytorchCOM, CPUPytorchModelFactory, CPUPytorchOptimizerFactory, GPUPytorchCOM,
    GPUPytorchModelFactory, GPUPytorchOptimizerFactory, PytorchCOM, PytorchModelFactory,
    PytorchOptimizerFactory)

__all__ = ["PMemory", "my_pinned_allocator", "ModelFactory", "OptimizerFactory", "COM",
           "DataGadget", "PMemoryMM", "my_pinned_allocatorMM", "ModelFactoryMM",
           "OptimizerFactoryMM", "COMMM", "DataGadgetMM", "GPUPytorchModelFactory",
           "GPUPytorchOptimizerFactory", "GPUPytorchCOM", "CPUPytorchModelFactory",
           "CPUPytorchOptimizerFactory", "CPUPytorchCOM", "PytorchModelFactory",
           "PytorchOptimizerFactory", "PytorchCOM"]


def __getattr__(name):
    # PMemory / PMemoryMM subclass CuPy's memory class: built on first use (needs CuPy).
    if name in ("PMemory", "PMemoryMM"):
        from xferlib.adapters.torch.speedtorch import cupy_live

        return cupy_live.__getattr__(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
