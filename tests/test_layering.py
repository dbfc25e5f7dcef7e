"""Layering rules of the source tree, checked on its syntax (nothing is imported).

1. No module imports a private name (``_name``) of another module of the project, or reaches
   into one through a module it imported (``rows._take_rows``); a private module
   (``pkg._mod``) is imported only from inside its package ``pkg``.
2. The core (``xferlib/`` without the adapters) never imports torch, JAX or the adapters at
   module level; inside functions only where listed in ``FRAMEWORK_INSIDE_FUNCTIONS``.
3. The adapters use the core's public modules (``xferlib.backend``, not ``xferlib._backend``;
   no ``xferlib._*`` module).
4. Imports run one way. At import time (module-level imports, with the packages an import
   initializes) no module needs itself; and counting every import, inside functions too,
   the modules form no circle. The kernel sources are made from the optimizer rules
   (``xferlib._kernels`` imports ``xferlib.optim.rules``), so the flat step imports the
   kernels inside the functions that launch them.
5. A class's fields are written only by the module that defines it: ``obj.name = ...`` (or
   ``+=``, or an item of it) on anything but ``self`` / ``cls`` names a field that some class
   of the writing module sets too (a field no project class sets, CuPy's or a function's, is
   not the project's); and no module reaches into an object's ``__dict__``.

The adapters' source is ``adapters/`` (installed as ``xferlib.adapters``); a copy or link at
``xferlib/adapters`` is skipped.
"""

from __future__ import annotations

import ast
import pathlib
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FRAMEWORKS = ("torch", "jax", "jaxlib", "optax", "flax")

# (importing file, module imported from, private name; None for the whole private module)
# -> why it is allowed for now. Every entry must still occur: remove it with its import.
ALLOWED_PRIVATE = {
}

# Core files that may import a framework or the adapters inside a function (never at module
# level), and why.
FRAMEWORK_INSIDE_FUNCTIONS = {
    "xferlib/handoff.py": "DLPack handoff to and from torch and JAX arrays",
    "xferlib/doctor.py": "reports the installed torch and JAX and what they see",
}


def module_name(rel: str) -> str:
    parts = list(pathlib.PurePosixPath(rel).with_suffix("").parts)
    if parts[0] == "adapters":
        parts = ["xferlib", "adapters"] + parts[1:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def is_package(rel: str) -> bool:
    return rel.endswith("__init__.py")


def source_files() -> dict:
    """``{relative path: source}`` of every module of the core and the adapters."""
    found = {}
    for top in ("xferlib", "adapters"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith("xferlib/adapters/"):
                continue  # an installed copy of adapters/
            found[rel] = path.read_text()
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _absolute(node: ast.ImportFrom, me: str, package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = me.split(".") if package else me.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _private_module(module: str):
    """The package a private module belongs to, for ``a.b._c.d``: ``a.b``; else None."""
    parts = module.split(".")
    for k, part in enumerate(parts):
        if _private(part):
            return ".".join(parts[:k])
    return None


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _top_level_nodes(tree: ast.Module):
    """Statements run at import time: the module body, through if/try/with blocks (not
    into functions or classes' methods)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        stack.extend(ast.iter_child_nodes(node))


def check_source(rel: str, source: str, modules: set) -> list:
    """Every layering violation in one file, as ``(rule, name, line, text)`` tuples; ``name``
    is ``(module imported from, private name)`` for rule "private", else the module."""
    me, package = module_name(rel), is_package(rel)
    core = not me.startswith("xferlib.adapters")
    tree = ast.parse(source, rel)
    found = []
    module_aliases = {}  # local name -> project module it is bound to
    imports = []  # (node, absolute module imported, whether it is the statement's own)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                imports.append((node, alias.name, True))
                if alias.name.split(".")[0] == "xferlib":
                    if alias.asname:
                        module_aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            source_module = _absolute(node, me, package)
            imports.append((node, source_module, True))
            if source_module.split(".")[0] != "xferlib":
                continue
            for alias in node.names:
                full = f"{source_module}.{alias.name}"
                if full in modules:  # `from xferlib import rows`: a module
                    module_aliases[alias.asname or alias.name] = full
                    imports.append((node, full, False))
                elif _private(alias.name) and source_module != me:
                    found.append(("private", (source_module, alias.name), node.lineno,
                                  f"from {source_module} import {alias.name}"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                chain.insert(0, value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in module_aliases:
                target = module_aliases[value.id]
                # `tt.shape._x`: the last module in the chain is the one reached into
                for attr in chain[:-1]:
                    if f"{target}.{attr}" in modules:
                        target = f"{target}.{attr}"
                    else:
                        break
                if target != me:
                    found.append(("private", (target, node.attr), node.lineno,
                                  f"{value.id}.{'.'.join(chain)}"))
    top = set(map(id, _top_level_nodes(tree)))
    for node, module, own in imports:
        if module.split(".")[0] != "xferlib":
            if core and module.split(".")[0] in FRAMEWORKS:
                rule = "framework-top" if id(node) in top else "framework-function"
                found.append((rule, module, node.lineno, f"import {module}"))
            continue
        owner = _private_module(module)
        if owner is not None and not _inside(me, owner):
            found.append(("private-module", module, node.lineno, f"import {module}"))
        if not core and owner == "xferlib":  # xferlib._backend, xferlib._kernels, ...
            found.append(("adapter-private-core", module, node.lineno, f"import {module}"))
        if core and own and _inside(module, "xferlib.adapters"):
            rule = "framework-top" if id(node) in top else "framework-function"
            found.append((rule, module, node.lineno, f"import {module}"))
    return sorted(set(found), key=lambda f: (f[2], f[0], str(f[1])))


def violations(files: dict) -> list:
    """``(file, rule, name, line, text)`` for every violation not allowed above."""
    modules = {module_name(rel) for rel in files}
    out = []
    for rel, source in files.items():
        for rule, name, line, text in check_source(rel, source, modules):
            if rule == "private" and (rel, *name) in ALLOWED_PRIVATE:
                continue
            if rule == "private-module" and (rel, name, None) in ALLOWED_PRIVATE:
                continue
            if rule == "framework-function" and rel in FRAMEWORK_INSIDE_FUNCTIONS:
                continue
            out.append((rel, rule, name, line, text))
    return out


@pytest.fixture(scope="module")
def files():
    found = source_files()
    assert "xferlib/rows.py" in found and "adapters/torch/host.py" in found
    return found


def test_no_private_names_across_modules(files):
    bad = [v for v in violations(files) if v[1] in ("private", "private-module")]
    assert not bad, "private names used across modules:\n" + "\n".join(
        f"  {rel}:{line}: {text}" for rel, _, _, line, text in bad)


def test_core_imports_no_framework_at_module_level(files):
    bad = [v for v in violations(files) if v[1].startswith("framework")]
    assert not bad, ("the core imports torch/JAX/the adapters (module level never; inside "
                     "functions only in FRAMEWORK_INSIDE_FUNCTIONS):\n" + "\n".join(
                         f"  {rel}:{line}: {text}" for rel, _, _, line, text in bad))


def test_adapters_use_the_public_backend(files):
    bad = [v for v in violations(files) if v[1] == "adapter-private-core"]
    assert not bad, ("adapters import a private core module (xferlib._backend: use "
                     "xferlib.backend):\n") + "\n".join(
        f"  {rel}:{line}: {text}" for rel, _, _, line, text in bad)


def test_every_exception_is_still_needed(files):
    """An allowance whose import is gone must go too (the lists only shrink)."""
    modules = {module_name(rel) for rel in files}
    used_private, used_framework = set(), set()
    for rel, source in files.items():
        for rule, name, _, _ in check_source(rel, source, modules):
            if rule == "private":
                used_private.add((rel, *name))
            elif rule == "private-module":
                used_private.add((rel, name, None))
            elif rule == "framework-function":
                used_framework.add(rel)
    assert not set(ALLOWED_PRIVATE) - used_private, sorted(set(ALLOWED_PRIVATE) - used_private)
    assert not set(FRAMEWORK_INSIDE_FUNCTIONS) - used_framework, \
        sorted(set(FRAMEWORK_INSIDE_FUNCTIONS) - used_framework)


# Circles left to the code that owns them (its own session of work), with why.
ALLOWED_CIRCLES = {
    frozenset({"xferlib.collection.collection", "xferlib.collection.device"}):
        "the collection's engine and its GPU side import each other inside functions",
}
# (file, field) writes of another module's class, with why.
ALLOWED_FIELD_WRITES = {
    ("xferlib/collection/io.py", "tables"): "the collection's loader fills a collection it made",
    ("xferlib/table/host_table.py", "__dict__"): "HostTable.device_view: a view shares the "
                                                 "table's fields (its own method)",
}


def import_graph(files: dict, module_level: bool) -> dict:
    """``{module: modules it imports}``. ``module_level``: only what runs at import, plus the
    packages an import initializes (importing ``a.b.c`` runs ``a`` and ``a.b``); else every
    import statement, inside functions too, as written."""
    modules = {module_name(rel) for rel in files}

    def resolve(name):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {m: set() for m in modules}
    for rel, source in files.items():
        me, package = module_name(rel), is_package(rel)
        tree = ast.parse(source, rel)
        nodes = list(_top_level_nodes(tree)) if module_level else list(ast.walk(tree))
        for node in nodes:
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node, me, package)
                # `from pkg import sub`: the submodule; `from mod import name`: the module
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            else:
                continue
            for target in targets:
                found = resolve(target) if target.split(".")[0] == "xferlib" else None
                if found is None or found == me:
                    continue
                graph[me].add(found)
                if module_level:
                    parts = found.split(".")
                    for k in range(1, len(parts)):
                        parent = ".".join(parts[:k])
                        if parent in modules and not _inside(me, parent):
                            graph[me].add(parent)
    return graph


def circles(graph: dict) -> list:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _owned_fields(files: dict) -> dict:
    """``{field: files of a class that sets it}``: ``self.x = ...`` in a method, a class-body
    annotation or assignment (dataclass fields)."""
    owners = {}
    for rel, source in files.items():
        for cls in ast.walk(ast.parse(source, rel)):
            if not isinstance(cls, ast.ClassDef):
                continue
            for node in ast.walk(cls):
                if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                        and isinstance(node.value, ast.Name)
                        and node.value.id in ("self", "cls")):
                    owners.setdefault(node.attr, set()).add(rel)
            for node in cls.body:
                targets = ([node.target] if isinstance(node, ast.AnnAssign) else
                           node.targets if isinstance(node, ast.Assign) else [])
                for target in targets:
                    if isinstance(target, ast.Name):
                        owners.setdefault(target.id, set()).add(rel)
    return owners


def field_writes(rel: str, source: str, owners: dict) -> list:
    """``(line, text)`` of each write to another module's class's field in one file."""
    found = []
    for node in ast.walk(ast.parse(source, rel)):
        if isinstance(node, ast.Attribute) and node.attr == "__dict__" and not (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            found.append((node.lineno, ast.unparse(node), "__dict__"))
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        flat = []
        for target in targets:
            flat.extend(target.elts if isinstance(target, ast.Tuple) else [target])
        for target in flat:
            while isinstance(target, ast.Subscript):
                target = target.value
            if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                    and target.value.id not in ("self", "cls")
                    and target.attr in owners and rel not in owners[target.attr]):
                found.append((node.lineno, ast.unparse(target), target.attr))
    return found


def test_imports_run_one_way(files):
    at_import = circles(import_graph(files, module_level=True))
    assert not at_import, f"modules that need themselves at import: {at_import}"
    left = [c for c in circles(import_graph(files, module_level=False))
            if frozenset(c) not in ALLOWED_CIRCLES]
    assert not left, f"modules that import each other (inside functions too): {left}"


def test_fields_are_written_by_their_class(files):
    core = {rel: src for rel, src in files.items() if rel.startswith("xferlib/")}
    owners = _owned_fields(core)
    bad = [f"  {rel}:{line}: {text}" for rel, src in core.items()
           for line, text, field in field_writes(rel, src, owners)
           if (rel, field) not in ALLOWED_FIELD_WRITES]
    assert not bad, "fields written outside their class's module:\n" + "\n".join(bad)


def test_every_circle_and_field_allowance_is_still_needed(files):
    found = {frozenset(c) for c in circles(import_graph(files, module_level=False))}
    assert set(ALLOWED_CIRCLES) <= found, set(ALLOWED_CIRCLES) - found
    core = {rel: src for rel, src in files.items() if rel.startswith("xferlib/")}
    owners = _owned_fields(core)
    used = {(rel, field) for rel, src in core.items()
            for _, _, field in field_writes(rel, src, owners)}
    assert set(ALLOWED_FIELD_WRITES) <= used, set(ALLOWED_FIELD_WRITES) - used


# The checker itself, on small made-up modules: each rule fires, and allowed forms pass.

_FAKE_MODULES = {"xferlib", "xferlib.rows", "xferlib.memory", "xferlib.table",
                 "xferlib.table.layout", "xferlib.table.host_table", "xferlib._backend",
                 "xferlib.adapters", "xferlib.adapters.jax", "xferlib.adapters.jax.host",
                 "xferlib.adapters.jax._callback", "xferlib.adapters.jax.mesh",
                 "xferlib.adapters.torch", "xferlib.adapters.torch.host"}


def _rules(rel, source):
    return [(rule, name) for rule, name, _, _ in
            check_source(rel, textwrap.dedent(source), _FAKE_MODULES)]


def test_checker_flags_private_imports_and_reach_ins():
    found = _rules("xferlib/table/host_table.py", """
        from xferlib.rows import _take_rows, gather_rows
        from .layout import (RowLayout,
                             _split_state)
        from xferlib import memory
        import xferlib.table.layout as lay

        def f(table):
            from xferlib.memory import _meminfo
            return memory._format_bytes(1), lay._INIT, table._gpu, memory.__name__
        """)
    assert found == [("private", ("xferlib.rows", "_take_rows")),
                     ("private", ("xferlib.table.layout", "_split_state")),
                     ("private", ("xferlib.memory", "_meminfo")),
                     ("private", ("xferlib.memory", "_format_bytes")),
                     ("private", ("xferlib.table.layout", "_INIT"))]


def test_checker_allows_own_names_and_package_private_modules():
    assert _rules("adapters/jax/host.py", """
        from xferlib.adapters.jax._callback import as_core_array
        from xferlib.adapters.jax.host import _mine
        from xferlib.backend import stream_scope
        from xferlib.table import HostTable
        """) == []
    assert _rules("xferlib/rows.py", "from xferlib._backend import is_cupy_array\n") == []


def test_checker_flags_private_modules_and_the_private_backend_in_adapters():
    assert _rules("adapters/torch/host.py", """
        from xferlib.adapters.jax._callback import as_core_array

        def f():
            from xferlib._backend import stream_scope
        """) == [("private-module", "xferlib.adapters.jax._callback"),
                 ("adapter-private-core", "xferlib._backend")]


def test_checker_flags_frameworks_in_the_core():
    found = _rules("xferlib/rows.py", """
        import numpy as np
        import torch
        try:
            import jax.numpy as jnp
        except ImportError:
            jnp = None
        from xferlib.adapters import torch as xt

        def f():
            import optax
            from xferlib.adapters.jax import host
        """)
    assert found == [("framework-top", "torch"), ("framework-top", "jax.numpy"),
                     ("framework-top", "xferlib.adapters"),
                     ("framework-function", "optax"),
                     ("framework-function", "xferlib.adapters.jax")]
    assert _rules("adapters/torch/host.py", "import torch\n") == []


def test_checker_finds_circles_at_import_and_inside_functions():
    files = {"xferlib/__init__.py": "", "xferlib/a.py": "from xferlib import b\n",
             "xferlib/b.py": "def f():\n    from xferlib.a import x\n",
             "xferlib/p/__init__.py": "from xferlib.p.s import y\n",
             "xferlib/p/s.py": "import numpy\n", "xferlib/q.py": "from xferlib.p.s import y\n",
             "xferlib/p/t.py": "from xferlib.q import z\n"}
    assert circles(import_graph(files, module_level=True)) == []
    assert circles(import_graph(files, module_level=False)) == [["xferlib.a", "xferlib.b"]]
    files["xferlib/p/__init__.py"] += "from xferlib.p.t import w\n"
    # p runs t, t imports q, q's import of p.s runs p: a circle at import time
    assert circles(import_graph(files, module_level=True)) == [
        ["xferlib.p", "xferlib.p.t", "xferlib.q"]]


def test_checker_finds_fields_written_outside_their_class():
    files = {"xferlib/a.py": "class A:\n    def __init__(self):\n        self.n = 0\n"
                             "        self._w = [0]\n",
             "xferlib/b.py": "def f(a, k):\n    a.n = 1\n    a._w[0] += 1\n    k.size = 2\n"
                             "    a.__dict__.update({})\n"}
    owners = _owned_fields(files)
    assert [t for _, t, _ in field_writes("xferlib/b.py", files["xferlib/b.py"], owners)] == [
        "a.n", "a._w", "a.__dict__"]
    assert field_writes("xferlib/a.py", files["xferlib/a.py"], owners) == []
