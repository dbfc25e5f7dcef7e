"""Shared test helpers: the backends a test runs on, and comparison with the float64 references.

A *backend* is where a test's arrays live:

``numpy``        NumPy table and indices: the CPU path.
``cupy``         CuPy table and indices: the GPU path on device memory.
``cupy-pinned``  a pinned NumPy table with CuPy indices and rows: the zero-copy path.

The GPU backends carry the ``gpu`` marker and skip, saying why, where no GPU is present.

Two pieces, in the spirit of CuPy's ``testing.numpy_cupy_allclose``:

* :func:`for_each_backend` runs a test once per backend, handing it a :class:`Backend`;
* :func:`reference_check` moves an op's inputs to that backend, runs the op, brings every
  output back and compares each one with the op's NumPy reference (:func:`assert_outputs_match`:
  dtype-keyed tolerances, exact for integers, the first mismatch named with its index).

Example (a test module)::

    @for_each_backend("numpy", "cupy")
    def test_gather(backend, rng):
        table, idx = rng.standard_normal((9, 4)), rng.integers(0, 9, 20)
        reference_check(backend, lambda t, i: xferlib.gather_rows(t, i),
                        xferlib.gather_rows_reference, table, idx)
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import numpy as np

from xferlib.backend import cupy_available

__all__ = ["Backend", "BACKEND_NAMES", "get_backend", "backend_params", "for_each_backend",
           "free_port", "gpu_count", "reference_check", "assert_outputs_match", "tolerance",
           "assert_matches_reference", "table_arrays", "random_rows", "GPU_SKIP_REASON"]

BACKEND_NAMES = ("numpy", "cupy", "cupy-pinned")
GPU_SKIP_REASON = "needs a CUDA GPU with CuPy; none on this machine"


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str

    @property
    def gpu(self) -> bool:
        return self.name != "numpy"

    @property
    def xp(self):
        """The array namespace of this backend's indices and rows (numpy or cupy)."""
        if not self.gpu:
            return np
        import cupy

        return cupy

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

    def put(self, tree):
        """Every NumPy array in ``tree`` (nested lists, tuples, dicts) placed by :meth:`array`
        (a copy on ``numpy``, so the op never writes into the reference's inputs); anything
        else passes through as it is."""
        return _tree_map(tree, lambda x: self.array(x) if isinstance(x, np.ndarray) else x)

    def get(self, tree):
        """Every array in ``tree`` brought back as a NumPy array (after the work queued on the
        backend's stream has finished)."""
        self.synchronize()
        return _tree_map(tree, _host_copy)

    def synchronize(self) -> None:
        if self.gpu:
            import cupy

            cupy.cuda.get_current_stream().synchronize()


def _host_copy(x):
    if isinstance(x, np.ndarray):
        return np.array(x)
    if hasattr(x, "__cuda_array_interface__"):  # CuPy: a device-to-host copy
        return x.get()
    return x


def _tree_map(tree, leaf):
    if isinstance(tree, dict):
        return {k: _tree_map(v, leaf) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return type(tree)(_tree_map(v, leaf) for v in tree)
    return leaf(tree)


def get_backend(name: str) -> Backend:
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {name!r}; one of {BACKEND_NAMES}")
    if name != "numpy" and not cupy_available():
        import pytest

        pytest.skip(GPU_SKIP_REASON)
    return Backend(name)


def backend_params(*names: str) -> list:
    """``pytest.param`` for each backend named (all when none is), GPU ones marked ``gpu``: the
    parameters of :func:`for_each_backend` and of the suite's ``backend`` fixture."""
    import pytest

    names = names or BACKEND_NAMES
    for name in names:
        if name not in BACKEND_NAMES:
            raise ValueError(f"unknown backend {name!r}; one of {BACKEND_NAMES}")
    return [pytest.param(name, marks=() if name == "numpy" else pytest.mark.gpu, id=name)
            for name in names]


def for_each_backend(*names: str):
    """Decorator: run the test once per backend in ``names`` (all of :data:`BACKEND_NAMES` when
    none is given), as its ``backend`` argument (a :class:`Backend`).

    The GPU backends carry the ``gpu`` marker and skip with :data:`GPU_SKIP_REASON` where no
    GPU is present; ``numpy`` always runs. Test ids end in the backend's name.

    >>> @for_each_backend("numpy", "cupy")
    ... def test_sum(backend):
    ...     assert backend.get(backend.xp.arange(3).sum()) == 3
    """
    import pytest

    params = backend_params(*names)

    def decorate(test):
        # The wrapper keeps the test's signature (pytest reads it through __wrapped__), so the
        # backend arrives by name and is turned into a Backend (or a skip) at run time.
        @functools.wraps(test)
        def run(*args, backend, **kwargs):
            return test(*args, backend=get_backend(backend), **kwargs)

        return pytest.mark.parametrize("backend", params)(run)

    return decorate


_TOLERANCES = {"float64": 1e-12, "float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


def gpu_count() -> int:
    """How many CUDA GPUs CuPy sees (0 without CuPy or a driver): multi-GPU tests skip below
    what they need."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def free_port() -> int:
    """A TCP port free on this host now: the rendezvous of a multi-process test.

    Drawn at random from the 12,000 ports below the kernel's ephemeral range (Linux's
    ``ip_local_port_range``, 32768-60999 by default), which the kernel never hands to other
    sockets (a bind to port 0, an outgoing connection of NCCL, gloo or XLA). A port of that
    range, free when asked for, could be taken by any such socket before the rendezvous
    binds it; here only another caller of this function can take it (1 chance in 12,000
    for two tests started at once), as when tests run in parallel workers."""
    import random
    import socket

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: the usual default
        ephemeral = 32768
    low = max(1024, ephemeral - 12000)
    draw = random.SystemRandom()
    for _ in range(200):
        port = draw.randrange(low, ephemeral)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use: draw again
            return port
    with socket.socket() as s:  # every draw taken: any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tolerance(dtype) -> float:
    """Relative and absolute tolerance against a float64 reference, keyed by dtype (0 for
    integer and boolean dtypes: those must match exactly)."""
    return _TOLERANCES.get(np.dtype(dtype).name, 0.0)


def assert_outputs_match(actual, expected, *, rtol: float | None = None,
                         atol: float | None = None, dtype=None, scale: float = 1.0,
                         relative_to_max: bool = False, what: str = "output") -> None:
    """Every array of ``actual`` (nested dicts, lists, tuples) against the same place in
    ``expected``; raises ``AssertionError`` naming the output, the first mismatch's index and
    both values.

    The structures must match (same keys, same lengths, same shapes), so no output goes
    uncompared. Floating outputs pass where ``|a - e| <= atol + rtol * |e|`` (NaNs where both
    are NaN); ``rtol`` and ``atol`` default to :func:`tolerance` of ``dtype`` (or of the
    output's own dtype) times ``scale``. ``relative_to_max`` measures ``rtol`` against the
    largest ``|e|`` of the array instead (for sums of many terms, where small entries carry
    the rounding of large ones). Integer and boolean outputs must be equal.

    >>> assert_outputs_match({"w": np.float32([1, 2])}, {"w": np.array([1.0, 2.0 + 1e-7])})
    """
    if isinstance(expected, dict) or isinstance(actual, dict):
        if not (isinstance(expected, dict) and isinstance(actual, dict)):
            raise AssertionError(f"{what}: got {type(actual).__name__}, expected a "
                                 f"{type(expected).__name__}")
        if set(actual) != set(expected):
            raise AssertionError(f"{what}: keys differ: only in the result "
                                 f"{sorted(set(actual) - set(expected))}, only in the reference "
                                 f"{sorted(set(expected) - set(actual))}")
        for key in expected:
            assert_outputs_match(actual[key], expected[key], rtol=rtol, atol=atol, dtype=dtype,
                                 scale=scale, relative_to_max=relative_to_max,
                                 what=f"{what}[{key!r}]")
        return
    if isinstance(expected, (list, tuple)) or isinstance(actual, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or not isinstance(expected, (list, tuple)) \
                or len(actual) != len(expected):
            raise AssertionError(f"{what}: got {_describe(actual)}, expected "
                                 f"{_describe(expected)}")
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_outputs_match(a, e, rtol=rtol, atol=atol, dtype=dtype, scale=scale,
                                 relative_to_max=relative_to_max, what=f"{what}[{i}]")
        return
    if expected is None or actual is None:
        if expected is not actual:
            raise AssertionError(f"{what}: got {_describe(actual)}, expected "
                                 f"{_describe(expected)}")
        return
    _assert_array_close(np.asarray(actual), np.asarray(expected), rtol, atol, dtype, scale,
                        relative_to_max, what)


def _describe(x) -> str:
    if isinstance(x, (list, tuple)):
        return f"a {type(x).__name__} of {len(x)}"
    return "None" if x is None else type(x).__name__


def _assert_array_close(a, e, rtol, atol, dtype, scale, relative_to_max, what):
    if a.shape != e.shape:
        raise AssertionError(f"{what}: shape {a.shape}, expected {e.shape}")
    exact = all(x.dtype.kind in "biu" for x in (a, e))
    if exact:
        bad = a != e
        rule = "exactly"
    else:
        tol = tolerance(a.dtype if dtype is None else dtype) * scale
        rtol = tol if rtol is None else rtol
        atol = tol if atol is None else atol
        a64, e64 = a.astype(np.float64), e.astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            reach = np.abs(e64).max(initial=0.0) if relative_to_max else np.abs(e64)
            close = np.abs(a64 - e64) <= atol + rtol * reach
            # Equal infinities and NaN beside NaN count as equal (numpy's assert_allclose).
            close |= (a64 == e64) | (np.isnan(a64) & np.isnan(e64))
        bad = ~close
        rule = (f"within rtol={rtol:g}{' of the largest |expected|' if relative_to_max else ''}"
                f", atol={atol:g}")
    count = int(np.count_nonzero(bad))
    if count:
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        with np.errstate(invalid="ignore", over="ignore"):
            largest = np.max(np.abs(a.astype(np.float64) - e.astype(np.float64))[bad])
        raise AssertionError(
            f"{what}: {count} of {a.size} elements do not match {rule}; first at index "
            f"{first}: got {a[first]!r}, expected {e[first]!r} (largest difference "
            f"{largest:.3g})")


def reference_check(backend: Backend, op, reference, *args, rtol: float | None = None,
                    atol: float | None = None, dtype=None, scale: float = 1.0,
                    relative_to_max: bool = False, **kwargs):
    """Run ``op`` on ``backend`` and ``reference`` on the host; compare every output.

    Every NumPy array in ``args`` and ``kwargs`` (nested in lists, tuples, dicts too) is placed
    by :meth:`Backend.put` for ``op``; ``reference`` gets the host inputs (deep copies, so
    neither side sees the other's writes). Both return the same structure: an array, or lists,
    tuples, dicts of arrays (an update returns the weights AND every state array). The op's
    outputs come back to the host and :func:`assert_outputs_match` compares each one with the
    reference's, with the tolerance arguments given. Returns the op's outputs on the host.

    >>> out = reference_check(Backend("numpy"), lambda x: x * 2, lambda x: x * 2.0,
    ...                       np.float32([1, 2]))
    """
    host_args, host_kwargs = copy.deepcopy(args), copy.deepcopy(kwargs)
    actual = backend.get(op(*backend.put(args), **backend.put(kwargs)))
    expected = reference(*host_args, **host_kwargs)
    assert_outputs_match(actual, expected, rtol=rtol, atol=atol, dtype=dtype, scale=scale,
                         relative_to_max=relative_to_max, what=f"{backend.name} output")
    return actual


def assert_matches_reference(actual, reference, dtype, *, scale: float = 1.0) -> None:
    """``actual`` (any dtype) against a float64 reference, with the dtype's tolerance.

    ``scale`` widens the tolerance for results that sum ``scale`` rounded terms."""
    tol = tolerance(dtype) * scale
    actual = np.asarray(actual).astype(np.float64)
    assert_outputs_match(actual, np.asarray(reference), rtol=tol, atol=tol)


def table_arrays(table) -> dict:
    """A host table's weights and every state array (``step`` too), as NumPy arrays: what an
    update changes, for comparing a table with a reference or with another table."""
    arrays = {"weights": np.array(table.numpy())}
    for name in table.state_names():
        arrays[name] = np.array(table.state(name))
    return arrays


def random_rows(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    """Random normal data (never zeros) in ``dtype`` (``"bfloat16"`` via ml_dtypes)."""
    from xferlib.memory import numpy_dtype

    return rng.standard_normal(shape).astype(numpy_dtype(dtype))
