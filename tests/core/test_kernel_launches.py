"""Every kernel launch names its arguments, checked on the CPU.

Kernels are declared once (:class:`xferlib._kernels.KernelDecl`: name, template head, typed
arguments) and launched by name (``DECL.launch(module, template_args, grid, block,
stream=..., name=value, ...)``, or ``DECL.arguments(name=value, ...)`` for a launch that
keeps its argument tuple). A launch with a missing or unknown name fails at the call,
which only a GPU reaches; this test reads every launch in the source (its syntax, nothing is
run) and checks the names it passes, and the number of template arguments where they are
written out, against the declaration, so a wrong launch fails here first.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import pkgutil

import pytest

import xferlib._kernels as kernels_pkg
from xferlib._kernels import KernelDecl, all_modules

ROOT = pathlib.Path(__file__).resolve().parents[2]
LAUNCH_KEYWORDS = {"stream", "shared_mem"}


def _kernel_modules():
    out = {}
    for info in pkgutil.iter_modules(kernels_pkg.__path__):
        name = f"xferlib._kernels.{info.name}"
        out[name] = importlib.import_module(name)
    return out


def _declarations():
    """``{(module name, attribute): KernelDecl}`` and ``{(module, attribute): names tuple}``."""
    decls, groups = {}, {}
    for modname, mod in _kernel_modules().items():
        for attr, value in vars(mod).items():
            if isinstance(value, KernelDecl):
                decls[(modname, attr)] = value
            elif (attr.endswith("_ARGS") and isinstance(value, tuple)
                  and all(isinstance(v, str) for v in value)):
                groups[(modname, attr)] = value
    return decls, groups


def _template_count(decl: KernelDecl) -> int:
    head = decl.template.strip()
    if not head:
        return 0
    inner = head[head.index("<") + 1:head.rindex(">")]
    depth, count = 0, 1
    for ch in inner:
        depth += {"<": 1, "(": 1, ">": -1, ")": -1}.get(ch, 0)
        count += ch == "," and depth == 0
    return count


def _launches():
    """``(file, line, decl, passed names, opaque, template args node)`` of every launch;
    ``opaque``: some names come from a ``**`` the test cannot read (a dict built elsewhere),
    so only the names it can read are checked."""
    decls, groups = _declarations()
    found = []
    for top in ("xferlib", "adapters"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith("xferlib/adapters/"):
                continue
            tree = ast.parse(path.read_text())
            imported = {}
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                        and node.module.startswith("xferlib._kernels"):
                    for alias in node.names:
                        imported[alias.asname or alias.name] = (node.module, alias.name)
            # a file's own declarations (the kernels modules launch some themselves)
            own = module_of(rel)
            for (modname, attr) in decls:
                if modname == own:
                    imported.setdefault(attr, (modname, attr))
            for node in ast.walk(tree):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in ("launch", "arguments")
                        and isinstance(node.func.value, ast.Name)):
                    continue
                target = imported.get(node.func.value.id)
                decl = decls.get(target) or decls.get(_reexported(target, decls))
                if decl is None:
                    continue
                names, opaque = [], False
                for kw in node.keywords:
                    if kw.arg is not None:
                        names.append(kw.arg)
                        continue
                    call = kw.value
                    group = None
                    if (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                            and call.func.id == "named" and call.args
                            and isinstance(call.args[0], ast.Name)):
                        ref = imported.get(call.args[0].id)
                        group = groups.get(ref) or groups.get(_reexported(ref, groups))
                    if group is None:
                        opaque = True  # a ** the test cannot read: its names unchecked
                        continue
                    names.extend(group)
                template = (node.args[1] if node.func.attr == "launch" and len(node.args) > 1
                            else None)
                found.append((rel, node.lineno, decl, names, opaque, template))
    return found


def module_of(rel: str) -> str:
    return ".".join(pathlib.PurePosixPath(rel).with_suffix("").parts)


def _reexported(target, table):
    """A name imported from the package ``xferlib._kernels`` itself: the module it is from."""
    if target is None or target[0] != "xferlib._kernels":
        return None
    for key in table:
        if key[1] == target[1]:
            return key
    return None


LAUNCHES = _launches()


def test_launches_are_found():
    """Every family's launches are seen (none left positional: they would not be found)."""
    assert len(LAUNCHES) >= 40, [f"{f}:{line}" for f, line, *_ in LAUNCHES]


@pytest.mark.parametrize("launch", LAUNCHES, ids=[f"{f}:{line}" for f, line, *_ in LAUNCHES])
def test_launch_passes_exactly_the_declared_names(launch):
    rel, line, decl, names, opaque, template = launch
    passed = [n for n in names if n not in LAUNCH_KEYWORDS]
    assert len(passed) == len(set(passed)), f"{rel}:{line}: a name passed twice: {passed}"
    missing = [] if opaque else [n for n in decl.names if n not in passed]
    unknown = [n for n in passed if n not in decl.names]
    assert not missing and not unknown, (
        f"{rel}:{line}: {decl.name}: missing {missing}, unknown {unknown}")
    if isinstance(template, ast.Tuple):
        assert len(template.elts) == _template_count(decl), (
            f"{rel}:{line}: {decl.name} takes {_template_count(decl)} template arguments")


def test_every_declaration_is_compiled_in_a_module():
    decls, _ = _declarations()
    for (modname, attr), decl in decls.items():
        holders = [m for m in all_modules() if decl.source() in m.source]
        if not holders and decl.name.startswith("tt_"):
            from xferlib._kernels.tt import TT_MODULE
            holders = [TT_MODULE] if decl.source() in TT_MODULE.source else []
        assert holders, f"{modname}.{attr}: its source is in no registered module"


def test_declared_names_are_checked_at_the_call():
    decl = KernelDecl("k", "template <typename T>", (("T*", "x"), ("i64", "n")), "")
    with pytest.raises(TypeError, match=r"missing argument\(s\) \['n'\]"):
        decl.arguments(x=0)
    with pytest.raises(TypeError, match=r"unknown argument\(s\) \['m'\]"):
        decl.arguments(x=0, n=1, m=2)
    with pytest.raises(ValueError):
        KernelDecl("k", "", (("int", "a"), ("int", "a")), "")


def test_flat_update_arguments_are_the_kernels_order():
    """The one builder of the flat update's arguments gives the tuple the kernel's signature
    takes: the state slots padded with null pointers, the chunk table, int32 column count."""
    import numpy as np

    from xferlib.optim import flat_update_arguments

    args = flat_update_arguments(1, 2, (3, None), 4, (5, 6, 7), 11, None, 8)
    assert args == (1, 2, 3, 0, 0, 4, 5, 6, 7, 11, 0, 8)
    assert [type(a) for a in args] == [np.uint64] * 9 + [np.int32] + [np.uint64] * 2


def test_packing_is_each_argument_converted_to_its_c_type():
    """Every declaration's launch tuple holds, in declaration order, each value converted to
    its declared C type: pointers as given (arrays), absent ones as a null uint64, integer
    addresses as uint64; scalars as the numpy type of their C type, whatever the value came
    as (a Python int or bool, or already that numpy type), and twice the same."""
    import numpy as np

    from xferlib._kernels._declare import _SCALARS

    array = np.zeros(3)
    for decl in _declarations()[0].values():
        for round_ in range(2):
            values, expected = {}, []
            for k, (ctype, name) in enumerate(decl.args):
                if "*" in ctype:
                    value = (array, None, 4096)[(k + round_) % 3]
                    values[name] = value
                    expected.append(value if value is array else np.uint64(value or 0))
                else:
                    kind = _SCALARS[ctype.replace("const ", "").strip()]
                    value = (7, kind(7), True)[(k + round_) % 3]
                    values[name] = value
                    expected.append(kind(value))
            packed = decl.arguments(**values)
            assert len(packed) == len(expected), decl.name
            for got, want, (ctype, name) in zip(packed, expected, decl.args):
                assert type(got) is type(want), (decl.name, name, type(got), type(want))
                assert got is want if want is array else got == want, (decl.name, name)
