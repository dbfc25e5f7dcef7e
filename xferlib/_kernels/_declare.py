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

_SCALARS = {"unsigned long long": np.uint64, "i64": np.int64, "long long": np.int64, "int": np.int32, "unsigned": np.uint32,
            "double": np.float64, "float": np.float32}


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


def _pointer(value):
    if value is None:
        return _NULL  # a null pointer: the kernel treats the input as absent
    if isinstance(value, (int, np.integer)):
        return np.uint64(value)
    return value  # a CuPy array: CuPy passes its device pointer


def _converter(ctype: str):
    """The function that turns a Python value into a kernel argument of C type ``ctype``."""
    if "*" in ctype:
        return _pointer
    base = ctype.replace("const ", "").replace("__restrict__", "").strip()
    if base not in _SCALARS:
        raise TypeError(f"no conversion for a kernel argument of type {ctype!r}")
    return _SCALARS[base]


def _convert(ctype: str, value):
    return _converter(ctype)(value)


def _build_arguments(name: str, args: tuple):
    """A function taking exactly the declared names (keyword-only) that returns the launch
    tuple: written out once per kernel, so a launch pays one call and each argument's
    conversion, not a loop over the declaration."""
    scope = {"_NULL": _NULL, "_u64": np.uint64, "_ints": (int, np.integer)}
    items = []
    for k, (ctype, arg) in enumerate(args):
        if "*" in ctype:
            items.append(f"(_NULL if {arg} is None else _u64({arg}) "
                         f"if isinstance({arg}, _ints) else {arg})")
        else:
            scope[f"_c{k}"] = _converter(ctype)
            items.append(f"_c{k}({arg})")
    params = ", ".join(arg for _, arg in args)
    code = (f"def {name}(*, {params}):\n    return ({', '.join(items)},)\n" if args
            else f"def {name}():\n    return ()\n")
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
        if not template_args:
            return self.name
        return f"{self.name}<{', '.join(str(a) for a in template_args)}>"

    def arguments(self, **values) -> tuple:
        """The launch tuple, in declaration order, each value converted to its C type."""
        try:
            return self._build(**values)
        except TypeError:
            names = [name for _, name in self.args]
            missing = [n for n in names if n not in values]
            unknown = sorted(set(values) - set(names))
            if missing:
                raise TypeError(f"{self.name}: missing argument(s) {missing}") from None
            if unknown:
                raise TypeError(f"{self.name}: unknown argument(s) {unknown}") from None
            raise  # a value its C type does not take

    def function(self, module, *template_args):
        """The compiled instantiation ``template_args`` of this kernel from ``module``, for a
        caller that keeps its :meth:`arguments` tuple and launches it many times."""
        return module.get_function(self.instance(*template_args))

    def launch(self, module, template_args, grid, block, *, stream, shared_mem: int = 0,
               **values) -> None:
        """Launch the instantiation ``template_args`` of this kernel from ``module`` (a
        :class:`~xferlib._kernels.KernelModule`) on ``stream`` with named arguments."""
        arguments = self.arguments(**values)
        function = module.get_function(self.instance(*template_args))
        function(grid, block, arguments, stream=stream, shared_mem=shared_mem)
