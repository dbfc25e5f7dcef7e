"""Bad input to xferlib's JAX ops as exceptions a caller can catch by type.

An op's input check (an index out of range, malformed offsets) depends on the values, so under
``jax.jit`` it runs inside the op's ``buffer_callback``, where XLA turns any Python exception
into ``jax.errors.JaxRuntimeError`` ("INTERNAL: Error when calling buffer callback", a
traceback, and the error's text last; a jitted function called again after a successful call
takes JAX's C++ fast path, which raises the same text as a plain ValueError). ``except
IndexError`` catches neither, and no hook of the jit call can change their type, so:

* eager calls (concrete arrays, not tracers) check their indices on the host before the op
  runs and raise the core's own IndexError / ValueError;
* inside :func:`typed_errors` (a ``with`` block, or a function it wraps), XLA's error for an
  xferlib op's failed check is raised again as :class:`CallbackIndexError` or
  :class:`CallbackValueError`: an IndexError (ValueError) AND a ``JaxRuntimeError``, whose
  message is the check's own ("index 9 at position 1 is out of range ..."), with XLA's error
  as its ``__cause__``.

Either way the check runs before the op writes anything: a rejected call leaves host tables,
their optimizer state and TT cores as they were.

>>> import jax, jax.numpy as jnp, xferlib
>>> from xferlib.adapters.jax import host_lookup, typed_errors
>>> table = xferlib.HostTable(8, 4, init="zeros")
>>> lookup = jax.jit(lambda idx: host_lookup(table, idx))
>>> try:
...     with typed_errors():
...         jax.block_until_ready(lookup(jnp.array([1, 9])))
... except IndexError as err:
...     print(err)
index 9 at position 1 is out of range for a table of 8 rows (valid: 0 <= index < 8)
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["CallbackIndexError", "CallbackValueError", "typed_errors"]


class CallbackIndexError(jax.errors.JaxRuntimeError, IndexError):
    """An index out of range, found by an xferlib op's check while XLA ran it (under ``jit``);
    raised by :func:`typed_errors`. ``except IndexError`` and ``except JaxRuntimeError`` both
    catch it; the message starts with the bad index and its position."""


class CallbackValueError(jax.errors.JaxRuntimeError, ValueError):
    """A malformed value (e.g. offsets that decrease), found by an xferlib op's check while
    XLA ran it (under ``jit``); raised by :func:`typed_errors`."""


# The text of the checks that callbacks raised lately. XLA hands back only a formatted string,
# so typed_errors finds the check's own message in it; the exception objects are not kept
# (their frames hold views of XLA's buffers).
_RAISED: collections.deque = collections.deque(maxlen=64)
_LOCK = threading.Lock()  # XLA runs callbacks on its own threads


def reporting(callback):
    """``callback`` (a ``buffer_callback`` function) remembering the text of the IndexError or
    ValueError it raises, so that :func:`typed_errors` can raise it again by type."""
    @functools.wraps(callback)
    def wrapped(*args, **kwargs):
        try:
            return callback(*args, **kwargs)
        except (IndexError, ValueError) as err:
            with _LOCK:
                _RAISED.append((IndexError if isinstance(err, IndexError) else ValueError,
                                str(err)))
            raise

    return wrapped


def typed_error(err: BaseException):
    """The :class:`CallbackIndexError` / :class:`CallbackValueError` that ``err`` (XLA's
    error for a failed callback) carries, or None when ``err`` is no xferlib op's failed
    check (or is that check's own exception, raised outside XLA)."""
    # By text, not type: JAX reports a failed callback as JaxRuntimeError or, from jit's C++
    # fast path, as ValueError.
    if not isinstance(err, Exception) or isinstance(err, (CallbackIndexError,
                                                           CallbackValueError)):
        return None
    text = str(err)
    with _LOCK:
        raised = list(_RAISED)
    for kind, message in reversed(raised):  # the latest first
        if message and message in text and message != text:
            return (CallbackIndexError if kind is IndexError else CallbackValueError)(message)
    return None


class _TypedErrors(contextlib.ContextDecorator):
    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        typed = typed_error(exc) if exc is not None else None
        if typed is None:
            return False  # anything else goes on as it was
        raise typed from exc


def typed_errors(function=None):
    """Raise an xferlib op's failed input check under ``jit`` by its type.

    ``with typed_errors(): ...`` (or ``typed_errors(step)``, ``step`` a function, e.g. a
    jitted one) turns XLA's error for an xferlib op's failed check (a ``JaxRuntimeError``,
    or a ValueError from jit's C++ fast path, both starting "INTERNAL: Error when calling
    buffer callback") into :class:`CallbackIndexError` (an IndexError: an index out of
    range) or :class:`CallbackValueError` (a ValueError: e.g. malformed offsets), whose
    message is the check's own, starting with the bad index and its position. Other errors
    pass unchanged.

    JAX dispatches asynchronously: on a GPU the error may come from a later call or from
    ``jax.block_until_ready``, and a host table's GPU check from a later step or
    ``table.check()`` (no host sync in a step); keep those inside the block too.
    """
    return _TypedErrors() if function is None else _TypedErrors()(function)


def is_concrete(*values) -> bool:
    """Whether the arrays have values now (an eager call), not tracers (jit, vmap, shard_map)."""
    return not any(isinstance(v, jax.core.Tracer) for v in values if v is not None)


def as_index_array(name: str, values, error=IndexError) -> jax.Array:
    """``values`` as a JAX array, refusing host integers JAX would wrap: without x64,
    ``jnp.asarray`` narrows int64 to int32 (``2**32 + 1`` would become row 1). ``error``
    (IndexError for indices, ValueError for offsets) names the first value that does not
    fit, before any op runs; JAX arrays, tracers and GPU arrays (CuPy, CUDA torch) pass as
    JAX converts them."""
    if isinstance(values, (jax.Array, jax.core.Tracer)) or hasattr(
            values, "__cuda_array_interface__"):  # JAX's own, or GPU memory: not read here
        return jnp.asarray(values)
    # Through NumPy first: jnp.asarray([1, 2**40]) raises a bare OverflowError (x64 off)
    # where NumPy keeps the values as int64, which the check below names.
    host = np.asarray(values)
    if host.dtype.kind in "OSUV":  # no numbers: Python ints past 64 bits, None, strings
        if host.size and all(isinstance(v, int) for v in host.reshape(-1).tolist()):
            raise error(f"{name} holds values that fit no 64-bit integer")
        raise TypeError(f"{name} must be an array of integers, got {type(values).__name__} "
                        f"({host.dtype})")
    converted = jnp.asarray(host)
    if host.dtype != converted.dtype and host.size and np.issubdtype(host.dtype, np.integer):
        wrapped = np.flatnonzero(host.reshape(-1) != np.asarray(converted).reshape(-1))
        if wrapped.size:
            k = int(wrapped[0])
            raise error(f"{name}[{k}] = {int(host.reshape(-1)[k])} does not fit JAX's "
                        f"{converted.dtype} (x64 is off): it would wrap to another value")
    return converted
