"""The model's initial values, made once by xferlib's side (NumPy / CuPy) and handed to each
framework with ``xferlib.handoff``, so torch, JAX and the baseline start from the same numbers.

- MLP layers: torch.nn.Linear's default, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), drawn from a
  seeded NumPy generator (``weight`` is ``(out, in)``, as torch stores it).
- Tables: U(-s, s) per row, a pure function of ``(seed, table, row, column)``
  (:func:`dlrm_parts.data.init_rows`), made in chunks on the device that will hold them.
- TT cores: FBTT's ``approx-normal`` draw (``xferlib.tt.init_tt_cores``) from a seeded
  generator.
"""

from __future__ import annotations

import numpy as np

from .data import NUM_DENSE, init_rows

CHUNK_ROWS = 1 << 20


def mlp_sizes(preset, num_tables: int):
    """(bottom layer sizes, top layer sizes) including inputs and the output."""
    bottom = (NUM_DENSE, *preset.bottom, preset.dim)
    vectors = num_tables + 1
    top = (preset.dim + vectors * (vectors - 1) // 2, *preset.top, 1)
    return bottom, top


def dense_params(preset, num_tables: int, seed: int) -> dict:
    """Named float32 NumPy arrays: ``bottom.{i}.weight``, ``bottom.{i}.bias``, ``top...``."""
    rng = np.random.default_rng([seed, 7])
    out = {}
    for name, sizes in zip(("bottom", "top"), mlp_sizes(preset, num_tables)):
        for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            bound = 1.0 / np.sqrt(fan_in)
            out[f"{name}.{i}.weight"] = rng.uniform(-bound, bound, (fan_out, fan_in)).astype(
                np.float32)
            out[f"{name}.{i}.bias"] = rng.uniform(-bound, bound, fan_out).astype(np.float32)
    return out


def table_init(seed: int, index: int, rows: int, dim: int, scale: float, xp=np):
    """The whole initial table ``index`` as one ``xp`` array (for tables that live on the
    device or in the framework's own memory)."""
    out = xp.empty((rows, dim), xp.float32)
    for start in range(0, rows, CHUNK_ROWS):
        stop = min(rows, start + CHUNK_ROWS)
        out[start:stop] = init_rows(seed, index, start, stop, dim, scale, xp)
    return out


def fill_host_table(table, seed: int, index: int, scale: float, xp=np) -> None:
    """Write the initial rows into an ``xferlib.HostTable`` chunk by chunk (on the GPU the
    chunk is made there and scattered straight into pinned memory), keeping the table's
    interleaved weights-and-state layout."""
    for start in range(0, table.num_rows, CHUNK_ROWS):
        stop = min(table.num_rows, start + CHUNK_ROWS)
        rows = init_rows(seed, index, start, stop, table.dim, scale, xp)
        table.scatter(xp.arange(start, stop, dtype=xp.int64), rows)
    table.flush()


def tt_cores(plan_table, seed: int):
    from xferlib import tt

    shape = tt.TTShape(plan_table.tt_p, plan_table.tt_q, plan_table.tt_ranks)
    return tt.init_tt_cores(shape, "approx-normal", plan_table.rows,
                            rng=np.random.default_rng([seed, 11, plan_table.index]))
