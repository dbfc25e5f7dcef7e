"""``TTEmbeddingBag``: FBTT-Embedding's module and names over xferlib's TT core.

Constructor, defaults (``use_cache=True`` included), core layout (``tt_cores[k]`` is
``[1, p_k, R_k * q_k * R_{k+1}]``, each row an ``R_k x q_k x R_{k+1}`` slice), buffer names
and B+1 offsets are FBTT's, so its code and checkpoints run unchanged. With ``sparse=True``
the optimizer update is fused into backward and reaches every core row the batch touched.
CPU tensors run the NumPy path of ``xferlib.tt``; CUDA tensors run its CUDA kernels on views
of the tensors, on torch's stream. ``process_group=`` trains replicas on several ranks as one
process on the global batch (``tt_dist``). The machinery is ``TableBatchedTTEmbeddingBag``'s
(``tt_batched``); FBTT's free names live in ``tt_fbtt_compat``.
"""

from __future__ import annotations

import torch  # noqa: F401  (the docstring's example)

from xferlib.adapters.torch.tt_batched import TableBatchedTTEmbeddingBag
from xferlib.adapters.torch.tt_fbtt_compat import OptimType, suggested_tt_shapes, tt_matrix_to_full

__all__ = ["OptimType", "TTEmbeddingBag", "TableBatchedTTEmbeddingBag", "suggested_tt_shapes",
           "tt_matrix_to_full"]


class TTEmbeddingBag(TableBatchedTTEmbeddingBag):
    """An ``nn.EmbeddingBag`` whose table is a Tensor Train (FBTT-Embedding's API).

    ``forward(indices, offsets, warmup=True, *, per_sample_weights=None)`` takes B+1 offsets
    (FBTT's convention; ``include_last_offset=False`` takes B) and returns
    ``(B, embedding_dim)`` pooled with ``mode`` ("sum" or "mean"); ``warmup`` is FBTT's
    argument and ignored as in FBTT (see ``TableBatchedTTEmbeddingBag``).

    ``sparse=True``: backward updates the cores in place with ``optimizer`` (every touched core
    row; no gradient is returned). ``sparse=False``: the cores get dense gradients for any
    torch optimizer. ``use_cache=True`` (FBTT's default): training forwards count accesses;
    after :meth:`cache_populate` the ``cache_size`` (default 10% of the rows) most frequent
    rows are read from dense rows, trained with the same optimizer, while the cores still
    learn from every lookup (write-through, see ``xferlib.tt.TTRowCache``). On the GPU a
    training step does not wait for its input check; see :meth:`check_inputs`. The module is
    built on the CPU (``device=`` or ``.to()`` moves it; FBTT builds on the GPU) and refuses
    inputs on another device.

    Rows are ``embedding_dim`` wide: without ``tt_q_shapes`` the width is factored exactly,
    whatever ``enforce_embedding_dim`` (FBTT's flag, accepted for its call form) says. FBTT
    would round 96 up to 100 there and then fail its own assertion that the width is kept; no
    call FBTT accepts gets other shapes here. Indices and offsets are int32 or int64 (as
    torch's bags), sizes integers (TypeError otherwise).

    >>> bag = TTEmbeddingBag(1000, 16, [4, 4], sparse=False)
    >>> bag(torch.tensor([1, 2, 999]), torch.tensor([0, 2, 3])).shape
    torch.Size([2, 16])
    >>> TTEmbeddingBag(1000, 96, [4, 4], use_cache=False).tt_q_shapes  # 96 wide, not 100
    [4, 4, 6]
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tt_ranks, tt_p_shapes=None,
                 tt_q_shapes=None, optimizer: OptimType = OptimType.SGD,
                 learning_rate: float = 0.1, eps: float = 1.0e-10, sparse: bool = True,
                 use_cache: bool = True, cache_size: int = 0, hashtbl_size: int = 0,
                 weight_dist: str = "approx-normal", enforce_embedding_dim: bool = False,
                 **kwargs):
        super().__init__(1, num_embeddings, embedding_dim, tt_ranks, tt_p_shapes, tt_q_shapes,
                         optimizer, learning_rate, eps, sparse, use_cache, cache_size,
                         hashtbl_size, weight_dist, enforce_embedding_dim, **kwargs)

    def forward(self, indices, offsets, warmup=True, *, per_sample_weights=None):
        # (B, dim) as pooled: no view / select in the autograd graph (their backward would
        # queue a zero fill and a copy of the gradient at every step)
        return self._bags(indices, offsets, warmup, per_sample_weights)

