"""Kernels declared once: a name, a template head and typed, named arguments.

One :class:`KernelDecl` makes both the CUDA signature (:meth:`KernelDecl.source`) and the
Python launch (:meth:`KernelDecl.launch`), so the two cannot drift: a launch passes its
arguments by name, a missing or unknown name is a TypeError at the call (never a wrong
result from a shifted position), and each value is converted to the declared C type
(pointers from CuPy arrays or addresses, ``i64`` as ``numpy.int64``, ``int`` as
``numpy.int32``, ``double`` as ``numpy.float64``). Constants shared with the CUDA source are
written into it from Python by :func:`defines`.

>>> decl = KernelDecl("axpy", "template <typename T>",
...                   (("T*", "y"), ("const T*", "x"), ("double", "a"), ("i64", "n")),
...                   "/* body */")
>>> print(decl.source().splitlines()[1])
__global__ void axpy(T* y, const T* x, double a, i64 n) {
>>> decl.arguments(y=0, x=0, a=2, n=5)[2:]
(np.float64(2.0), np.int64(5))
>>> decl.arguments(y=0, x=0, a=2)
Traceback (most recent call last):
...
TypeError: axpy: missing argument(s) ['n']
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["KernelDecl", "defines", "named"]

_SCALARS = {"unsigned long long": np.uint64, "i64": np.int64, "long long": np.int64,
            "int": np.int32, "unsigned": np.uint32, "double": np.float64, "float": np.float32}


def defines(**constants) -> str:
    """``#define NAME value`` lines for constants the CUDA source shares with Python."""
    return "".join(f"#define {name} {int(value)}\n" for name, value in constants.items())


def named(names, values) -> dict:
    """``{name: value}`` for a group of arguments several kernels share, given in the order
    of ``names`` (a ValueError when the counts differ).

    >>> named(("x", "n"), (0, 5))
    {'x': 0, 'n': 5}
    """
    return dict(zip(names, values, strict=True))


_NULL = np.uint64(0)
# Pointer values that are addresses to convert (anything else: an array CuPy passes as is).
_POINTER_CONVERTS = frozenset({int, bool, type(None), np.int8, np.int16, np.int32, np.int64,
                               np.uint8, np.uint16, np.uint32, np.uint64, np.intp, np.uintp,
                               np.longlong, np.ulonglong})


def _pointer(value):
    if value is None:
        return _NULL  # a null pointer: the kernel treats the input as absent
    if type(value) is int or isinstance(value, np.integer):
        return np.uint64(value)
    return value  # a CuPy array: CuPy passes its device pointer


def _scalar(kind):
    """``kind``'s conversion as a launch makes it many times a step: a value already of the
    type passes as it is, and small Python ints (sizes, flags, strides) are converted once
    and kept (``numpy.int64(5)`` costs about as much as a kernel argument's whole packing);
    ``convert.kept`` is that cache (the launch builders look values up in it inline)."""
    kept = {}

    def convert(value):
        if type(value) is kind:
            return value
        if type(value) in (int, bool):
            found = kept.get(value)
            if found is None:
                found = kind(value)
                if len(kept) < 4096:
                    kept[value] = found
            return found
        return kind(value)

    convert.kept = kept
    return convert


_CONVERTERS = {}


def _converter(ctype: str):
    """The function that turns a Python value into a kernel argument of C type ``ctype``."""
    if "*" in ctype:
        return _pointer
    base = ctype.replace("const ", "").replace("__restrict__", "").strip()
    if base not in _SCALARS:
        raise TypeError(f"no conversion for a kernel argument of type {ctype!r}")
    if base not in _CONVERTERS:
        _CONVERTERS[base] = _scalar(_SCALARS[base])
    return _CONVERTERS[base]


def _convert(ctype: str, value):
    return _converter(ctype)(value)


def _build_arguments(name: str, args: tuple):
    """A function of the dict of named values that returns the launch tuple: written out
    once per kernel (a lookup of each declared name and its conversion, in order), so a
    launch pays one call, not a loop over the declaration nor keyword binding. A missing
    name is a KeyError there; the caller checks the count for unknown ones."""
    # Each value's common case inline (an array pointer or a value already of its C type
    # passes as it is): a call per argument would cost about as much as the rest together.
    scope = {"_pointer": _pointer, "_to_convert": _POINTER_CONVERTS,
             "_hashable": (int, bool, float)}  # the kept conversions' keys
    items = []
    for k, (ctype, arg) in enumerate(args):
        if "*" in ctype:
            items.append(f"(_pointer(a{k}) if type(a{k} := v[{arg!r}]) in _to_convert "
                         f"else a{k})")
        else:
            kind = _SCALARS[ctype.replace("const ", "").replace("__restrict__", "").strip()]
            convert = _converter(ctype)
            scope[f"_c{k}"], scope[f"_k{k}"], scope[f"_kept{k}"] = convert, kind, convert.kept
            items.append(f"(a{k} if type(a{k} := v[{arg!r}]) is _k{k} else "
                         f"b{k} if type(a{k}) in _hashable and "
                         f"(b{k} := _kept{k}.get(a{k})) is not None else _c{k}(a{k}))")
    code = f"def {name}(v):\n    return ({', '.join(items)}{',' if items else ''})\n"
    exec(code, scope)  # noqa: S102  (our own declaration's names only)
    return scope[name]


@dataclasses.dataclass(frozen=True)
class KernelDecl:
    """A ``__global__`` kernel: ``name``, ``template`` head (``""`` for none), ``args`` as
    ``(C type, name)`` pairs, and the ``body`` (the statements inside the braces);
    ``launch_bounds`` (``"__launch_bounds__(1024)"``) and ``extern_c`` (C linkage: the
    kernel's name is its symbol, for a kernel without a template) when given."""

    name: str
    template: str
    args: tuple
    body: str
    launch_bounds: str = ""
    extern_c: bool = False
    # the launch tuple's builder, made once from the declaration (_build_arguments)
    _build: object = dataclasses.field(init=False, repr=False, compare=False)
    _instances: dict = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        names = [name for _, name in self.args]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.name}: an argument name is declared twice: {names}")
        if self.extern_c and self.template:
            raise ValueError(f"{self.name}: a template kernel cannot have C linkage")
        for ctype, name in self.args:
            if not name.isidentifier():
                raise ValueError(f"{self.name}: {name!r} is not an argument name")
            _converter(ctype)  # a TypeError for a type with no conversion
        object.__setattr__(self, "_build", _build_arguments(self.name, self.args))
        object.__setattr__(self, "_instances", {})  # template arguments -> name expression

    def source(self) -> str:
        params = ", ".join(f"{ctype} {name}" for ctype, name in self.args)
        bounds = f"{self.launch_bounds} " if self.launch_bounds else ""
        linkage = 'extern "C" ' if self.extern_c else ""
        return (f"{self.template}\n{linkage}__global__ void {bounds}{self.name}({params}) {{\n"
                f"{self.body}\n}}\n")

    @property
    def names(self) -> tuple:
        """The argument names, in declaration order."""
        return tuple(name for _, name in self.args)

    def instance(self, *template_args) -> str:
        """The name expression of one template instantiation (``axpy<float>``)."""
        name = self._instances.get(template_args)
        if name is None:
            name = self.name if not template_args else \
                f"{self.name}<{', '.join(str(a) for a in template_args)}>"
            self._instances[template_args] = name
        return name

    def arguments(self, **values) -> tuple:
        """The launch tuple, in declaration order, each value converted to its C type."""
        return self._tuple(values)

    def _tuple(self, values: dict) -> tuple:
        if len(values) == len(self.args):  # every name, if none is unknown
            try:
                return self._build(values)
            except KeyError:
                pass  # a name missing (and an unknown one in its place): said below
        names = [name for _, name in self.args]
        missing = [n for n in names if n not in values]
        unknown = sorted(set(values) - set(names))
        if missing:
            raise TypeError(f"{self.name}: missing argument(s) {missing}")
        raise TypeError(f"{self.name}: unknown argument(s) {unknown}")

    def function(self, module, *template_args):
        """The compiled instantiation ``template_args`` of this kernel from ``module``, for a
        caller that keeps its :meth:`arguments` tuple and launches it many times."""
        return module.get_function(self.instance(*template_args))

    def launch(self, module, template_args, grid, block, *, stream, shared_mem: int = 0,
               **values) -> None:
        """Launch the instantiation ``template_args`` of this kernel from ``module`` (a
        :class:`~xferlib._kernels.KernelModule`) on ``stream`` with named arguments."""
        arguments = self._tuple(values)
        function = module.get_function(self.instance(*template_args))
        function(grid, block, arguments, stream=stream, shared_mem=shared_mem)
