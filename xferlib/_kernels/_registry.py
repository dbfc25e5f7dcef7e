"""A registry of CUDA source strings compiled lazily into ``cupy.RawModule`` objects."""

from __future__ import annotations

import threading

_MODULES: list["KernelModule"] = []


class KernelModule:
    """One family of kernels: a source string and the template instantiations to compile.

    Compiled with NVRTC on first use, once per device, with every instantiation listed in
    ``name_expressions`` (CuPy's ``RawModule(name_expressions=...)``), so a launch never
    waits for a compile after the first. No jitify: it is deprecated and can hang.
    """

    def __init__(self, name: str, source: str, name_expressions, options=("--std=c++17",)):
        self.name = name
        self.source = source
        self.name_expressions = tuple(name_expressions)
        self._names = frozenset(self.name_expressions)
        self.options = tuple(options)
        self._compiled = {}
        self._functions = {}  # (device, name) -> kernel: launches skip the module lookup
        self._lock = threading.Lock()
        _MODULES.append(self)

    def module(self):
        import cupy

        device = cupy.cuda.runtime.getDevice()
        mod = self._compiled.get(device)
        if mod is None:
            with self._lock:
                mod = self._compiled.get(device)
                if mod is None:
                    mod = cupy.RawModule(
                        code=self.source,
                        options=self.options,
                        name_expressions=self.name_expressions,
                    )
                    mod.compile()
                    self._compiled[device] = mod
        return mod

    def get_function(self, name_expression: str):
        if name_expression not in self._names:
            raise KeyError(f"{self.name}: {name_expression!r} is not a registered instantiation")
        import cupy

        key = (cupy.cuda.runtime.getDevice(), name_expression)
        function = self._functions.get(key)
        if function is not None:
            return function
        function = self._functions[key] = self.module().get_function(name_expression)
        return function


def all_modules() -> tuple[KernelModule, ...]:
    """Every registered module (the GPU test compiles them all)."""
    return tuple(_MODULES)


def grid_1d(num_items: int, threads_per_block: int = 256, max_blocks: int | None = None):
    """Grid and block for a kernel that gives one thread to each of ``num_items`` items, at
    least one block, at most ``max_blocks`` (the kernel then strides over the rest).

    >>> grid_1d(1000)
    ((4,), (256,))
    >>> grid_1d(10**9, max_blocks=4096)
    ((4096,), (256,))
    """
    blocks = max(1, -(-int(num_items) // threads_per_block))
    if max_blocks is not None:
        blocks = min(blocks, max_blocks)
    return (blocks,), (threads_per_block,)


def launch_config(num_warps: int, threads_per_block: int = 256, max_blocks: int = 65535 * 8):
    """Grid and block for a kernel that gives one warp to each of ``num_warps`` items and
    strides over the rest."""
    return grid_1d(num_warps * 32, threads_per_block, max_blocks)
