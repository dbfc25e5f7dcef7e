"""``TTEmbeddingBag``: FBTT-Embedding's module and names over xferlib's TT core.

Constructor, defaults, core layout (``tt_cores[k]`` is ``[1, p_k, R_k * q_k * R_{k+1}]``, each
row an ``R_k x q_k x R_{k+1}`` slice) and B+1 offsets are FBTT's, so its checkpoints load.
With ``sparse=True`` the optimizer update is fused into backward and reaches every core row
the batch touched; an optimizer type that is not implemented raises instead of silently
running another. CPU tensors run the NumPy path of ``xferlib.tt``; CUDA tensors run the same
code on CuPy views of the tensors (batched products through cuBLAS, on torch's stream).
"""

from __future__ import annotations

import collections
import enum

import numpy as np
import torch

from xferlib import tt as core
from xferlib.adapters.torch._convert import as_core_array

__all__ = ["OptimType", "TTEmbeddingBag", "tt_matrix_to_full"]


class OptimType(enum.Enum):
    SGD = "sgd"
    EXACT_SGD = "exact_sgd"
    ADAGRAD = "adagrad"
    EXACT_ADAGRAD = "exact_adagrad"
    EXACT_ROWWISE_ADAGRAD = "exact_row_wise_adagrad"
    ADAM = "adam"

    def __str__(self):
        return self.value


# Deterministic summation makes SGD and EXACT_SGD (and the Adagrad pair) the same update.
_CORE_OPTIMIZER = {
    OptimType.SGD: "sgd",
    OptimType.EXACT_SGD: "sgd",
    OptimType.ADAGRAD: "adagrad",
    OptimType.EXACT_ADAGRAD: "adagrad",
    OptimType.EXACT_ROWWISE_ADAGRAD: "rowwise_adagrad",
    OptimType.ADAM: "rowwise_adam",
}


def _array(t: torch.Tensor):
    """A zero-copy NumPy (CPU) or CuPy (CUDA) view of a tensor."""
    if t.device.type not in ("cuda", "cpu"):
        raise ValueError(f"TTEmbeddingBag runs on CPU or CUDA tensors, got {t.device}")
    return as_core_array(t)


def _torch(array) -> torch.Tensor:
    from xferlib.handoff import to_torch

    return to_torch(array)


def _on_stream(t: torch.Tensor):
    """torch's current stream as a context for CuPy work (nothing on the CPU)."""
    from xferlib._backend import stream_scope

    gpu = t.device.type == "cuda"
    return stream_scope(torch.cuda.current_stream(t.device) if gpu else None, gpu)


def tt_matrix_to_full(tt_p_shapes, tt_q_shapes, tt_ranks, tt_cores, tt_permute=None):
    """The full ``(prod(p), prod(q))`` table from TT cores, as FBTT's function of this name.

    ``tt_ranks`` may include the padding 1s or not. ``tt_permute`` gives the cores' axis
    order relative to ``(R_k, p_k, q_k, R_{k+1})``; FBTT's modules store ``[1, 0, 2, 3]``,
    which is also what ``None`` means here for 2-D or ``[1, p, ...]`` cores.
    """
    ranks = list(tt_ranks)
    if len(ranks) == len(tt_p_shapes) + 1:
        ranks = ranks[1:-1]
    shape = core.TTShape(tt_p_shapes, tt_q_shapes, ranks)
    permute = [1, 0, 2, 3] if tt_permute is None else list(tt_permute)
    if sorted(permute) != [0, 1, 2, 3]:
        raise ValueError(f"tt_permute must be a permutation of [0, 1, 2, 3], got {tt_permute}")
    padded = shape.padded_ranks
    cores = []
    for k, c in enumerate(tt_cores):
        natural = (padded[k], shape.p_shapes[k], shape.q_shapes[k], padded[k + 1])
        stored = [natural[i] for i in permute]
        a = torch.as_tensor(c).detach().cpu().numpy().reshape(stored).transpose(
            np.argsort(permute))
        cores.append(np.ascontiguousarray(a.transpose(1, 0, 2, 3)).reshape(shape.core_shape(k)))
    return torch.from_numpy(core.tt_to_dense(cores, shape))


class _TTBagFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, module, training, indices, offsets, per_sample_weights, cache_weight,
                *cores):
        # training: the step will be differentiated; it reads the GPU input check in backward,
        # before any core changes, so the forward never waits on the device.
        device = cores[0]
        module._resolve_pending_check(wait=False)
        num_bags = offsets.shape[0] - (1 if module.include_last_offset else 0)
        out = torch.empty((max(num_bags, 0), module.embedding_dim), device=device.device)
        with _on_stream(device):
            arrays = [_array(c)[0] for c in cores]
            indices = _array(indices.to(device.device))
            cache = module._core_cache()
            if cache is not None and training and module.training:
                cache.count(indices)  # FBTT counts accesses in training forwards
            _, residuals = core.tt_embedding_bag_fwd(
                arrays, module.shape, indices, _array(offsets.to(device.device)),
                mode=module.mode, per_sample_weights=None if per_sample_weights is None
                else _array(per_sample_weights.to(device.device)),
                include_last_offset=module.include_last_offset, check=not training,
                num_embeddings=module.num_embeddings, out=_array(out), cache=cache)
        ctx.module, ctx.residuals, ctx.arrays, ctx.device = module, residuals, arrays, device
        ctx.cache = cache
        return out

    @staticmethod
    def backward(ctx, grad_out):
        module, cache = ctx.module, ctx.cache
        none = (None,) * 5
        with _on_stream(ctx.device):
            grad_bags = _array(grad_out.contiguous())
            if module.sparse:  # fused: update the cores in place, hand no gradient back
                with torch.no_grad():
                    # ctx.arrays view the cores' memory: the update writes through them
                    pending = core.tt_fused_update(
                        ctx.arrays, module.shape, ctx.residuals, grad_bags,
                        module._state_for(ctx.arrays[0]), _CORE_OPTIMIZER[module.optimizer],
                        lr=module.learning_rate, eps=module.eps, cache=cache,
                        defer_check=module.defer_input_check)
                if pending is not None:
                    module._pending_checks.append(pending)
                return none + (None,) * (1 + len(ctx.arrays))
            grads = core.tt_embedding_bag_bwd(ctx.arrays, module.shape, ctx.residuals,
                                              grad_bags)
            cache_grad = None
            if cache is not None:
                cache_grad = _torch(core.tt_cache_grad(cache, module.shape, ctx.residuals,
                                                       grad_bags)[0])
        return none + (cache_grad,) + tuple(_torch(g)[None] for g in grads)


class TTEmbeddingBag(torch.nn.Module):
    """An ``nn.EmbeddingBag`` whose table is a Tensor Train (FBTT-Embedding's API).

    ``forward(indices, offsets, per_sample_weights=None)`` takes B+1 offsets (FBTT's
    convention; ``include_last_offset=False`` takes B) and returns ``(B, embedding_dim)``
    pooled with ``mode`` ("sum" or "mean").

    ``sparse=True``: backward updates the cores in place with ``optimizer`` (every touched core
    row; no gradient is returned). ``sparse=False``: the cores get dense gradients for any
    torch optimizer. ``use_cache=True``: the ``cache_size`` most frequent rows (counted in
    training forwards, chosen at :meth:`cache_populate`) are read from dense rows; see
    ``xferlib.tt.TTRowCache`` for the write-through semantics. On the GPU a training step does
    not wait for its input check; see :meth:`check_inputs`.

    >>> bag = TTEmbeddingBag(1000, 16, [4, 4], sparse=False)
    >>> bag(torch.tensor([1, 2, 999]), torch.tensor([0, 2, 3])).shape
    torch.Size([2, 16])
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tt_ranks, tt_p_shapes=None,
                 tt_q_shapes=None, optimizer: OptimType = OptimType.SGD,
                 learning_rate: float = 0.1, eps: float = 1.0e-10, sparse: bool = True,
                 use_cache: bool = False, cache_size: int = 0, hashtbl_size: int = 0,
                 weight_dist: str = "approx-normal", enforce_embedding_dim: bool = False, *,
                 mode: str = "sum", include_last_offset: bool = True, seed=None):
        super().__init__()
        if num_embeddings <= 0 or embedding_dim <= 0:
            raise ValueError(f"num_embeddings and embedding_dim must be positive, got "
                             f"{num_embeddings}, {embedding_dim}")
        tt_ranks = [int(r) for r in tt_ranks]
        d = len(tt_ranks) + 1
        p = core.suggest_tt_shapes(num_embeddings, d) if tt_p_shapes is None else tt_p_shapes
        q = (core.suggest_tt_shapes(embedding_dim, d, allow_round_up=not enforce_embedding_dim)
             if tt_q_shapes is None else tt_q_shapes)
        self.shape = core.TTShape(p, q, tt_ranks)
        if self.shape.num_rows < num_embeddings:
            raise ValueError(f"prod(tt_p_shapes) = {self.shape.num_rows} < num_embeddings "
                             f"{num_embeddings}")
        if self.shape.dim != embedding_dim and tt_q_shapes is not None:
            raise ValueError(f"prod(tt_q_shapes) = {self.shape.dim} != embedding_dim "
                             f"{embedding_dim}")
        if not isinstance(optimizer, OptimType):
            raise ValueError(f"optimizer must be an OptimType ({[o.name for o in OptimType]}), "
                             f"got {optimizer!r}; others are not implemented")
        if mode not in ("sum", "mean"):
            raise ValueError(f"mode must be 'sum' or 'mean', got {mode!r}")
        self.num_embeddings, self.embedding_dim = num_embeddings, self.shape.dim
        self.tt_p_shapes, self.tt_q_shapes = list(self.shape.p_shapes), list(self.shape.q_shapes)
        self.tt_ranks = list(self.shape.padded_ranks)
        self.optimizer, self.learning_rate, self.eps = optimizer, float(learning_rate), eps
        self.sparse, self.mode, self.include_last_offset = sparse, mode, include_last_offset
        cores = core.init_tt_cores(self.shape, weight_dist, num_embeddings,
                                   rng=np.random.default_rng(seed))
        self.tt_cores = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.from_numpy(c)[None]) for c in cores])
        self.sparse_state = core.tt_sparse_state(self.shape, _CORE_OPTIMIZER[optimizer])
        # On the GPU a fused training step never waits for its input check: a batch with an
        # index out of range or bad offsets changes nothing (the kernels skip it) and the
        # IndexError / ValueError is raised by the first call of the module after the GPU
        # finished that step (at the latest the third call after it), or by check_inputs().
        # False: every step waits for its check and raises at once.
        self.defer_input_check = True
        self._pending_checks = collections.deque()
        self.use_cache, self.cache_size = bool(use_cache), int(cache_size)
        self.hashtbl_size = int(hashtbl_size) or 4 * self.cache_size
        self.cache_weight = None
        if self.use_cache:
            # The cache's arrays are the module's: buffers (and the dense rows a Parameter,
            # trained by an outside optimizer when sparse=False) that follow .to() and
            # state_dict.
            cache = core.TTRowCache(self.shape, self.cache_size, self.hashtbl_size,
                                    _CORE_OPTIMIZER[optimizer])
            self.cache_weight = torch.nn.Parameter(torch.from_numpy(cache.weight),
                                                   requires_grad=not sparse)
            self.register_buffer("cache_rows", torch.from_numpy(cache.rows))
            self.register_buffer("cache_freq_keys", torch.from_numpy(cache.freq_keys))
            self.register_buffer("cache_freq_counts", torch.from_numpy(cache.freq_counts))
            for name, value in cache.state.items():
                self.register_buffer(f"cache_state_{name}", torch.from_numpy(value))

    def forward(self, indices, offsets, per_sample_weights=None):
        training = torch.is_grad_enabled() and (
            any(c.requires_grad for c in self.tt_cores) or self.cache_weight is not None
            and self.cache_weight.requires_grad)
        return _TTBagFunction.apply(self, training, indices.long(), offsets.long(),
                                    per_sample_weights, self.cache_weight, *self.tt_cores)

    # Steps whose input check is still on its way: the host may run this many steps ahead of
    # the device before it waits for the oldest.
    _MAX_PENDING_CHECKS = 2

    def _resolve_pending_check(self, wait: bool = True) -> None:
        """Raise for a bad batch among the finished GPU steps (all of them with ``wait``)."""
        pending = self._pending_checks
        while pending and (wait or pending[0].ready
                           or len(pending) > self._MAX_PENDING_CHECKS):
            pending.popleft().resolve()

    def check_inputs(self) -> None:
        """Raise now for a bad batch of the GPU training steps so far, if there was one (that
        step changed nothing); a later call of the module would raise it anyway."""
        self._resolve_pending_check()

    # --------------------------------------------------------------------- row cache

    def _core_cache(self):
        """The cache as xferlib's TTRowCache over this module's tensors (None without)."""
        if not self.use_cache:
            return None
        state = {name[len("cache_state_"):]: _array(buf)
                 for name, buf in self.named_buffers(recurse=False)
                 if name.startswith("cache_state_")}
        return core.TTRowCache.from_arrays(
            self.shape, _CORE_OPTIMIZER[self.optimizer], rows=_array(self.cache_rows),
            weight=_array(self.cache_weight.data), state=state,
            freq_keys=_array(self.cache_freq_keys), freq_counts=_array(self.cache_freq_counts))

    def _require_cache(self):
        if not self.use_cache:
            raise RuntimeError("this TTEmbeddingBag was built with use_cache=False")
        return self._core_cache()

    def update_cache(self, indices) -> None:
        """Count the lookups of ``indices`` in the access frequencies (the forward does it in
        training; the cache's contents change only at :meth:`cache_populate`)."""
        cache = self._require_cache()
        indices = torch.as_tensor(indices).long().to(self.cache_rows.device)
        bad = (indices < 0) | (indices >= self.num_embeddings)
        if bool(bad.any()):
            position = int(torch.nonzero(bad)[0, 0])
            raise IndexError(f"index {int(indices[position])} at position {position} is out "
                             f"of range for {self.num_embeddings} embeddings")
        with _on_stream(self.cache_rows):
            cache.count(_array(indices))

    @torch.no_grad()
    def cache_populate(self) -> None:
        """Fill the cache with the ``cache_size`` most frequently looked-up rows. Rows that stay
        keep their trained dense values and optimizer state; new rows start from the cores.
        The cores keep learning every row (write-through, see ``xferlib.tt.TTRowCache``), so
        rows that leave lose nothing the cores were taught."""
        cache = self._require_cache()
        with _on_stream(self.cache_rows):
            cache.populate([_array(c.data)[0] for c in self.tt_cores])

    @torch.no_grad()
    def reset_cache(self) -> None:
        """Empty the cache and its access counts; every row reads the cores again."""
        cache = self._require_cache()
        with _on_stream(self.cache_rows):
            cache.reset()

    def _state_for(self, like):
        """The fused optimizer's state, moved (once) to where the cores are."""
        from xferlib._backend import array_module

        xp = array_module(like)

        def moved(v):
            if array_module(v) is xp:
                return v
            return xp.asarray(v) if xp is not np else v.get()

        self.sparse_state = [{k: moved(v) for k, v in st.items()} for st in self.sparse_state]
        return self.sparse_state

    def full_weight(self) -> torch.Tensor:
        """The dense ``(prod(p), embedding_dim)`` table the forward reads: the cores' rows, and
        the cached rows' dense values where a cache is in use."""
        self._resolve_pending_check()
        full = tt_matrix_to_full(self.tt_p_shapes, self.tt_q_shapes, self.tt_ranks,
                                 list(self.tt_cores), [1, 0, 2, 3]).to(self.tt_cores[0].device)
        if self.use_cache:
            with torch.no_grad(), _on_stream(self.cache_rows):
                self._core_cache().overlay(_array(full))
        return full

    def set_learning_rate(self, lr: float) -> None:
        self.learning_rate = float(lr)

    # The fused optimizer's state travels with the module's state_dict as
    # ``optimizer_state.<core>.<name>``; a checkpoint without it (FBTT's) loads with fresh state.
    _STATE_PREFIX = "optimizer_state."

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        self._resolve_pending_check()
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for k, state in enumerate(self.sparse_state):
            for name, value in state.items():
                host = value if isinstance(value, np.ndarray) else value.get()
                destination[f"{prefix}{self._STATE_PREFIX}{k}.{name}"] = torch.from_numpy(
                    np.array(host))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        head = prefix + self._STATE_PREFIX
        ours = [key for key in state_dict if key.startswith(head)]
        for key in ours:
            k, _, name = key[len(head):].partition(".")
            expected = (self.sparse_state[int(k)].get(name) if k.isdigit()
                        and int(k) < len(self.sparse_state) else None)
            value = state_dict[key]
            if expected is None:
                unexpected_keys.append(key)
            elif tuple(value.shape) != tuple(expected.shape):
                error_msgs.append(f"size mismatch for {key}: {tuple(value.shape)} in the "
                                  f"checkpoint, {tuple(expected.shape)} here")
            else:  # host copy; moved next to the cores at the next fused update
                self.sparse_state[int(k)][name] = value.detach().cpu().numpy().astype(
                    np.dtype(expected.dtype), copy=True)
        rest = {key: v for key, v in state_dict.items() if key not in ours}
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
