"""Sizes typed as torch types them: a row count, a width or a rank is an integer.

``int(10.7)`` is 10 and ``int("10")`` is 10, so a constructor that calls ``int()`` on its sizes
builds a smaller table than asked without a word. torch refuses such sizes
(``nn.EmbeddingBag(10.7, 4)`` raises TypeError) and so does xferlib, through these checks.

>>> integral_size("num_rows", 10)
10
>>> integral_sizes("tt_ranks", (16, np.int64(8)))
[16, 8]
"""

from __future__ import annotations

import operator

import numpy as np

__all__ = ["integral_size", "integral_sizes"]


def _describe(value) -> str:
    shown = repr(value) if isinstance(value, (str, bytes)) else str(value)  # np.float64: 3.0
    return f"{type(value).__name__} {shown}"


def integral_size(name: str, value) -> int:
    """``value`` as a Python int when it is an integer: a Python int, a NumPy integer, or any
    object that declares itself one through ``__index__`` (a 0-d integer torch tensor does).

    Floats (even ``10.0``), strings and bools raise TypeError naming ``name`` and the value,
    as torch does for tensor sizes: truncating ``10.7`` to 10 would hide a bug in the caller.
    The range (positive, at least zero) is the caller's to check, with a ValueError.

    >>> integral_size("num_rows", 10.7)
    Traceback (most recent call last):
    ...
    TypeError: num_rows must be an integer, got float 10.7
    """
    # bool is an int subclass, but torch refuses it as a size (True rows is a bug)
    if isinstance(value, (bool, np.bool_)) or "bool" in str(getattr(value, "dtype", "")):
        raise TypeError(f"{name} must be an integer, got {_describe(value)}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {_describe(value)}") from None


def integral_sizes(name: str, values) -> list[int]:
    """Every element of the sequence ``values`` checked by :func:`integral_size`, as a list of
    Python ints; the error names the bad element and its position.

    >>> integral_sizes("tt_ranks", [16, 16.5])
    Traceback (most recent call last):
    ...
    TypeError: tt_ranks must hold integers, got [16, 16.5] (float 16.5 at position 1)
    """
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a sequence of integers, got {_describe(values)}")
    try:
        items = list(values)
    except TypeError:  # a 0-d array or tensor declares __iter__ but has no elements
        raise TypeError(f"{name} must be a sequence of integers, got "
                        f"{_describe(values)}") from None
    out = []
    for position, value in enumerate(items):
        try:
            out.append(integral_size(name, value))
        except TypeError:
            raise TypeError(f"{name} must hold integers, got {values!r} ({_describe(value)} at "
                            f"position {position})") from None
    return out
