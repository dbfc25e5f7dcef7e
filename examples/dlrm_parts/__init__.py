"""Parts of examples/dlrm.py: data, placement, models, loop, metrics, checkpoints."""
