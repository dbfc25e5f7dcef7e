"""The model's initial values, made once by xferlib's side (NumPy / CuPy) and handed to each
framework with ``xferlib.handoff``, so torch, JAX and the baseline start from the same numbers.

- MLP layers: torch.nn.Linear's default, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), drawn from a
  seeded NumPy generator (``weight`` is ``(out, in)``, as torch stores it).
- Tables: U(-s, s), a pure function of ``(seed, table position, row, column)``: the embedding
  collection's own counter-based initializer (``TableConfig(init=("uniform", -s, s))``, the
  same values on the CPU and the GPU); :func:`collection_rows` makes the same rows for the
  baseline's ``nn.EmbeddingBag`` tables, FBGEMM's TBE and the ``--devices`` JAX run.
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


def table_init_spec(preset):
    """The collection's initializer for every table: U(-init_scale, init_scale)."""
    return ("uniform", -preset.init_scale, preset.init_scale)


def collection_rows(preset, seed: int, position: int, rows: int, xp=np):
    """The initial ``(rows, dim)`` weights of the table at ``position`` of an
    ``EmbeddingCollection(seed=seed)`` built with :func:`table_init_spec`: the collection's
    initializer run on a weights-only row layout (NumPy, or a kernel on the GPU)."""
    from xferlib.collection.init import fill_rows_gpu, fill_rows_numpy, table_stream
    from xferlib.table.layout import RowLayout

    layout = RowLayout(preset.dim, 4, (), ())
    block = xp.empty((rows, layout.row_width), xp.float32)
    args = (block, layout, table_init_spec(preset), table_stream(seed, position), 0.0)
    if xp is np:
        fill_rows_numpy(*args)
    else:
        fill_rows_gpu(*args, "float32")
    return xp.ascontiguousarray(block[:, :preset.dim])


def fill_host_table_like_collection(table, preset, seed: int, position: int, xp=np) -> None:
    """Write :func:`collection_rows` into an ``xferlib.HostTable`` (the ``--devices`` run)."""
    rows = collection_rows(preset, seed, position, table.num_rows, xp)
    table.scatter(xp.arange(table.num_rows, dtype=xp.int64), rows)
    table.flush()
