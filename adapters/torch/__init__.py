"""PyTorch adapter: xferlib's ops as torch autograd functions, on CPU and CUDA tensors."""

from xferlib.adapters.torch.collection import EmbeddingBagCollection, TableConfig
from xferlib.adapters.torch.collection_checkpoint import load_sharded, save_sharded
from xferlib.adapters.torch.collection_dist import ShardedEmbeddingBagCollection
from xferlib.adapters.torch.contiguous import ContiguousParams
from xferlib.adapters.torch.optim import (
    FlatAdagrad,
    FlatAdam,
    FlatAdamax,
    FlatAdamW,
    FlatLion,
    FlatNAdam,
    FlatRAdam,
    FlatRMSprop,
    FlatSGD,
)
from xferlib.adapters.torch.grad_sync import GradAllReduce
from xferlib.adapters.torch.groups import leave_process_group
from xferlib.adapters.torch.host import HostEmbedding, HostEmbeddingBag
from xferlib.adapters.torch.interaction import DotInteraction, dot_interaction
from xferlib.adapters.torch.optim_sharded import (ShardedFlatAdagrad, ShardedFlatAdam,
                                                  ShardedFlatAdamax, ShardedFlatAdamW,
                                                  ShardedFlatLion, ShardedFlatNAdam,
                                                  ShardedFlatRAdam, ShardedFlatRMSprop,
                                                  ShardedFlatSGD)
from xferlib.adapters.torch.rows import gather_rows
from xferlib.adapters.torch.tt import (OptimType, TableBatchedTTEmbeddingBag, TTEmbeddingBag,
                                       suggested_tt_shapes, tt_matrix_to_full)

__all__ = ["ContiguousParams", "DotInteraction", "EmbeddingBagCollection", "FlatAdagrad",
           "FlatAdam", "FlatAdamax", "FlatAdamW", "FlatLion", "FlatNAdam", "FlatRAdam",
           "FlatRMSprop", "FlatSGD",
           "GradAllReduce", "HostEmbedding", "HostEmbeddingBag", "OptimType",
           "ShardedFlatAdagrad", "ShardedFlatAdam", "ShardedFlatAdamax", "ShardedFlatAdamW",
           "ShardedFlatLion", "ShardedFlatNAdam", "ShardedFlatRAdam", "ShardedFlatRMSprop",
           "ShardedFlatSGD", "ShardedEmbeddingBagCollection", "load_sharded", "save_sharded",
           "TTEmbeddingBag", "TableBatchedTTEmbeddingBag", "TableConfig", "dot_interaction",
           "gather_rows", "leave_process_group",
           "suggested_tt_shapes", "tt_matrix_to_full"]
