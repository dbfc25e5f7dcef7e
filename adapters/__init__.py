"""Framework adapters: ``xferlib.adapters.torch`` and ``xferlib.adapters.jax``.

Each adapter only moves data (DLPack) and calls the core's ops; no math lives here.
"""

__all__: list[str] = []
