"""The flat rules' per-step scalar records: one NamedTuple per flat optimizer rule.

Each :class:`~xferlib.optim.rules.Rule` of the flat family names its record (``Rule.record``)
and its ``scalars`` function returns one; the flat kernel reads the record's fields, in order,
as the columns of its segment's row of the scalar table.
"""

from __future__ import annotations

from typing import NamedTuple

# Each flat rule's per-step scalars as a named record (optax names its states alike), made
# by the rule's one scalars function from the hyperparameters and the step. The first field
# is always the step's size (the kernels' s.lr); flags are 0.0 / 1.0. The flat kernel reads a
# record from its segment's row of the scalar table (Rule.row): the columns' names and order
# are the record's fields, generated into the CUDA source (flat_scalar_defines).


class SgdScalars(NamedTuple):
    """torch.optim.SGD: ``keep`` and ``take``, what the momentum buffer keeps of itself and
    takes of the gradient (0 and 1 on torch's first step, which copies the gradient)."""
    lr: float
    momentum: float
    keep: float
    take: float
    use_momentum: float
    nesterov: float


class AdamScalars(NamedTuple):
    """Adam / AdamW: ``step_size = lr / (1 - b1^t)``, ``bc2_sqrt = sqrt(1 - b2^t)``."""
    step_size: float
    b1: float
    b2: float
    eps: float
    bc2_sqrt: float
    amsgrad: float


class AdagradScalars(NamedTuple):
    """Adagrad: ``clr = lr / (1 + (t - 1) lr_decay)``."""
    clr: float
    eps: float


class RmspropScalars(NamedTuple):
    lr: float
    alpha: float
    eps: float
    momentum: float
    centered: float


class AdamaxScalars(NamedTuple):
    """Adamax: ``clr = lr / (1 - b1^t)``."""
    clr: float
    b1: float
    b2: float
    eps: float


class NadamScalars(NamedTuple):
    """NAdam: the gradient's and the first moment's coefficients (negative: added to the
    parameter), ``bc2 = 1 - b2^t``."""
    coef_grad: float
    coef_avg: float
    b1: float
    b2: float
    bc2: float
    eps: float


class RadamScalars(NamedTuple):
    """RAdam: ``lr_bc1 = lr / (1 - b1^t)``, the rectification term and whether it applies."""
    lr_bc1: float
    b1: float
    b2: float
    eps: float
    bc2_sqrt: float
    rect: float
    rectified: float


class LionScalars(NamedTuple):
    lr: float
    b1: float
    b2: float
    weight_decay: float
