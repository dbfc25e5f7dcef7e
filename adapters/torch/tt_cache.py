"""The TT modules' row cache methods and checkpoint hooks (bound in ``tt_batched``); the
cache itself is the core table's (:class:`xferlib.tt.TTTable`), over these buffers.

Buffers keep FBTT's names and meaning: ``hashtbl`` / ``cache_freq`` (the 32-way frequency
table: row ids, -1 empty, and their access counts), ``cache_state`` (each table entry's cache
slot, -1 if not cached), ``cache_weight`` (the dense rows) and ``cache_optimizer_state``;
xferlib adds ``cache_rows`` (the cached ids, sorted, so a lookup finds its slot by binary
search) and the extra optimizer state of the Adam rules.
"""

from __future__ import annotations

import numpy as np
import torch

from xferlib import tt as core
from xferlib.adapters.torch import tt_fbtt_compat as compat
from xferlib.adapters.torch._convert import array_of as _array
from xferlib.adapters.torch._convert import on_stream as _on_stream


def require_cache(self):
    """The core table's row cache; RuntimeError for a module built without one."""
    if not self.use_cache:
        raise RuntimeError("this module was built with use_cache=False")
    return self._table().cache


def update_cache(self, indices) -> None:
    """Count the lookups of ``indices`` in the access frequencies (training forwards do it;
    the cache's contents change only at :meth:`cache_populate`)."""
    self._require_cache()
    indices = torch.as_tensor(indices)
    if indices.dtype not in (torch.int32, torch.int64):  # as forward: .long() would count
        raise TypeError(f"indices must be an integer tensor of dtype int32 or int64 (as "
                        f"torch's EmbeddingBag takes), got {indices.dtype}")
    indices = indices.long().to(self.cache_rows.device)
    with _on_stream(self.cache_rows):
        self._table().count_cache(_array(indices))


@torch.no_grad()
def cache_populate(self) -> None:
    """Fill the cache with the ``cache_size`` most frequently looked-up rows and end the
    warmup (lookups of cached rows read them from now on). Rows that stay keep their trained
    dense values and optimizer state; new rows start from the cores. The cores keep learning
    every row (write-through, see ``xferlib.tt.TTRowCache``), so rows that leave lose nothing
    the cores were taught."""
    self._require_cache()
    with _on_stream(self.cache_rows):
        self._table().populate_cache()


@torch.no_grad()
def reset_cache(self) -> None:
    """Empty the cache and its access counts; every row reads the cores again (warmup)."""
    self._require_cache()
    with _on_stream(self.cache_rows):
        self._table().reset_cache()


# ---------------------------------------------------------------------------- checkpoints
# A checkpoint of this module holds FBTT's keys plus ``optimizer_step`` (the global step of
# the FBGEMM rules) and the extras above; one without ``optimizer_step`` is read as FBTT's.

_STEP = "optimizer_step"


def save_to_state_dict(self, destination, prefix, keep_vars):
    self._resolve_pending_check()
    torch.nn.Module._save_to_state_dict(self, destination, prefix, keep_vars)
    destination[prefix + _STEP] = torch.tensor(self.iter, dtype=torch.int64)


def load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                         unexpected_keys, error_msgs):
    """Our checkpoints load as saved. FBTT's load strictly too: its ``L``, ``tt_cores``,
    ``cache_weight`` and frequency counts as they are; its ``optimizer_state`` where the rule
    matches (Adagrad's sums; row-wise Adagrad from their row means), fresh state otherwise;
    its cache re-indexed (rows re-counted under this table's hash, cached rows sorted, their
    dense rows and Adagrad state carried along). Ignored from FBTT: the optimizer state of
    rules other than Adagrad (FBTT ran Adagrad for them) and the hash positions."""
    # Mapped in place: torch hands the (copied) dict on to the submodules after this hook.
    ours = dict(self.state_dict(prefix=prefix, keep_vars=True))
    if prefix + _STEP in state_dict:
        self.iter = int(state_dict.pop(prefix + _STEP))
    else:  # FBTT's checkpoint: map it onto this module's keys
        self.iter = 0
        _map_fbtt(self, state_dict, ours, prefix)
    torch.nn.Module._load_from_state_dict(self, state_dict, prefix, local_metadata, strict,
                                          missing_keys, unexpected_keys, error_msgs)
    if self.use_cache and prefix + "cache_rows" in state_dict:
        self.warmup = not bool((state_dict[prefix + "cache_rows"] != core.NO_ROW).any())


def _map_fbtt(self, own, ours, prefix):
    for k in range(self.tt_ndim):
        for j, name in enumerate(self._state_names or [None]):
            key = prefix + "optimizer_state." + (f"optimizer_state{k}" if j == 0 else
                                                 f"{name}{k}")
            expected = ours[key]
            value = own.get(key)
            mapped = None if value is None or j > 0 else compat.fbtt_core_state(
                self._core_optimizer, value, expected)
            own[key] = mapped if mapped is not None else expected.detach().clone()
    if not self.use_cache or prefix + "hashtbl" not in own:
        return
    host = lambda key: own[prefix + key].detach().cpu().numpy()  # noqa: E731
    if own[prefix + "hashtbl"].numel() != self.hashtbl_size or \
            own[prefix + "cache_weight"].shape != self.cache_weight.shape:
        return  # a size mismatch: the regular load reports it
    opt_state = own.get(prefix + "cache_optimizer_state")
    keys, counts, slots, rows, weight, state = compat.fbtt_cache(
        host("hashtbl"), host("cache_freq"), host("cache_state").astype(np.int64),
        host("cache_weight"), None if opt_state is None else opt_state.detach().cpu().numpy(),
        self._core_optimizer)
    for key, value in (("hashtbl", keys), ("cache_freq", counts), ("cache_state", slots),
                       ("cache_rows", rows), ("cache_weight", weight)):
        own[prefix + key] = torch.from_numpy(value)
    for key, value in ours.items():  # optimizer state of the cache: mapped or fresh
        if key.startswith(prefix + "cache_optimizer_state"):
            first = key == prefix + "cache_optimizer_state"
            own[key] = (torch.from_numpy(state) if first and state is not None
                        else torch.zeros_like(value.detach()))
