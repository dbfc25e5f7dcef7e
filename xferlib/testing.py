"""Shared test helpers: the backends to run a test on, and comparison with the references.

A *backend* is where a test's arrays live:

``numpy``        NumPy table and indices: the CPU path.
``cupy``         CuPy table and indices: the GPU path on device memory.
``cupy-pinned``  a pinned NumPy table with CuPy indices and rows: the zero-copy path.

The GPU backends carry the ``gpu`` marker and skip, saying why, where no GPU is present.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from xferlib._backend import cupy_available

__all__ = ["Backend", "BACKEND_NAMES", "get_backend", "tolerance", "assert_matches_reference",
           "random_rows", "GPU_SKIP_REASON"]

BACKEND_NAMES = ("numpy", "cupy", "cupy-pinned")
GPU_SKIP_REASON = "needs a CUDA GPU with CuPy; none on this machine"


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str

    @property
    def gpu(self) -> bool:
        return self.name != "numpy"

    def table(self, host: np.ndarray):
        """Place a table as this backend keeps tables."""
        if self.name == "numpy":
            return host.copy()
        if self.name == "cupy-pinned":
            from xferlib.memory import pinned_empty

            table = pinned_empty(host.shape, host.dtype)
            table[...] = host
            return table
        import cupy

        return cupy.asarray(host)

    def array(self, host: np.ndarray):
        """Place indices or rows as this backend passes them."""
        if self.name == "numpy":
            return host.copy()
        import cupy

        return cupy.asarray(host)

    def to_host(self, x) -> np.ndarray:
        if isinstance(x, np.ndarray):
            self.synchronize()
            return np.array(x)
        return x.get()

    def synchronize(self) -> None:
        if self.gpu:
            import cupy

            cupy.cuda.get_current_stream().synchronize()


def get_backend(name: str) -> Backend:
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {name!r}; one of {BACKEND_NAMES}")
    if name != "numpy" and not cupy_available():
        import pytest

        pytest.skip(GPU_SKIP_REASON)
    return Backend(name)


_TOLERANCES = {"float64": 1e-12, "float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


def tolerance(dtype) -> float:
    """Relative and absolute tolerance against a float64 reference, keyed by dtype."""
    return _TOLERANCES.get(np.dtype(dtype).name, 0.0)


def assert_matches_reference(actual, reference, dtype, *, scale: float = 1.0) -> None:
    """``actual`` (any dtype) against a float64 reference, with the dtype's tolerance.

    ``scale`` widens the tolerance for results that sum ``scale`` rounded terms."""
    actual = np.asarray(actual).astype(np.float64)
    tol = tolerance(dtype) * scale
    np.testing.assert_allclose(actual, reference, rtol=tol, atol=tol)


def random_rows(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    """Random normal data (never zeros) in ``dtype`` (``"bfloat16"`` via ml_dtypes)."""
    from xferlib.memory import numpy_dtype

    return rng.standard_normal(shape).astype(numpy_dtype(dtype))
