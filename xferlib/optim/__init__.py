"""Flat-buffer optimizers and the optimizer rules every kernel family shares.

``rules``: one :class:`~xferlib.optim.rules.Rule` per optimizer (id, defaults, check, state
slots, per-step scalars, NumPy update); ``scalar_records``: the flat rules' per-step scalar
records; ``layout``: the flat layout; ``step``: the flat ``(init, update)`` optimizers and the
CUDA step; ``clip``: global-norm clipping.
"""

from xferlib.optim.clip import (clip_by_global_norm, clip_coefficient, global_norm,
                                global_norm_clip_factor, partial_norm)
from xferlib.optim.layout import ALIGN_BYTES, FlatLayout, Segment
from xferlib.optim.rules import (COMMON, FLAT_RULES, OPTIMIZERS, RULES, SCALARS, OptId, Rule,
                                 check_common, common_scalars, cuda_defines, get_rule,
                                 resolve_hyper)
from xferlib.optim.step import (CudaStep, FlatOptimizer, FlatState, TableRing, adagrad, adam,
                                adam_device_hyper, adamax, adamw, apply_adam_device_scalars,
                                apply_table, chunk_table, fill_step_table,
                                flat_update_arguments, fresh_value, lion, nadam, radam,
                                rmsprop, sgd, step_scalars)

__all__ = [
    "Segment",
    "FlatLayout",
    "FlatState",
    "FlatOptimizer",
    "OPTIMIZERS",
    "sgd",
    "adam",
    "adamw",
    "adagrad",
    "rmsprop",
    "adamax",
    "nadam",
    "radam",
    "lion",
    "global_norm",
    "partial_norm",
    "clip_coefficient",
    "clip_by_global_norm",
    "apply_table",
    "apply_adam_device_scalars",
    "adam_device_hyper",
    "resolve_hyper",
    "fill_step_table",
    "CudaStep",
    "TableRing",
    "OptId",
    "Rule",
    "RULES",
    "FLAT_RULES",
    "get_rule",
    "global_norm_clip_factor",
    "ALIGN_BYTES",
    "COMMON",
    "SCALARS",
    "check_common",
    "common_scalars",
    "cuda_defines",
    "chunk_table",
    "flat_update_arguments",
    "step_scalars",
    "fresh_value",
]
