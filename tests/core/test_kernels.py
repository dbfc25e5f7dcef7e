"""The kernel registry: every family registered at import, none compiled then; on a GPU every
family compiles, the TT source once per core count (its modules are built per table shape)."""

import subprocess
import sys

import pytest

from xferlib._kernels import all_modules
from xferlib._kernels.tt import tt_module

# Every family registered when xferlib._kernels is imported (the per-shape TT modules aside).
FAMILIES = sorted({m.name for m in all_modules() if not m.name.startswith("tt_")})
# One TT shape per core count: the source branches on D (d = 3 sorts by the middle core).
TT_SHAPES = {
    2: ((40, 3), (2, 2), (2,)),
    3: ((200, 220, 250), (4, 4, 4), (32, 32)),  # FBTT's benchmark shape, registered at import
    4: ((3, 4, 5, 6), (2, 3, 2, 2), (3, 4, 5)),
}


def test_modules_are_registered_and_not_compiled_at_import():
    code = ("import xferlib; from xferlib._kernels import all_modules;"
            "m = all_modules(); print(len(m), all(x.name_expressions for x in m),"
            " any(x._compiled for x in m))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    count, named, compiled = out.stdout.split()
    assert int(count) >= 1 and named == "True" and compiled == "False"


def test_every_kernel_family_is_registered():
    names = {m.name for m in all_modules()}
    for family in ("rows", "table", "table_cache", "optim"):
        assert family in names, names
    assert any(name.startswith("tt_") for name in names), names


def test_every_kernel_source_is_in_a_registered_module():
    """Importing every file of xferlib._kernels registers nothing new (no family is left out
    of the package import, so the compile test sees it), and every ``*_KERNEL`` source string
    is compiled as part of some registered module."""
    code = """if True:
        import importlib, pkgutil
        import xferlib._kernels as k
        before = {m.name for m in k.all_modules()}
        sources = {}
        for info in pkgutil.iter_modules(k.__path__):
            mod = importlib.import_module(f"xferlib._kernels.{info.name}")
            sources.update({f"{info.name}.{n}": v for n, v in vars(mod).items()
                            if n.endswith("_KERNEL") and isinstance(v, str)})
        after = k.all_modules()
        print("new:", sorted({m.name for m in after} - before))
        print("kernels:", sorted(sources))
        print("orphans:", sorted(n for n, src in sources.items()
                                 if not any(src in m.source for m in after)))
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[0] == "new: []", out
    assert "'rows.ROWS_KERNEL'" in out[1] and "'tt.TT_KERNEL'" in out[1], out
    assert out[2] == "orphans: []", out


def _compile_all(module):
    for name in module.name_expressions:
        assert module.get_function(name) is not None, f"{module.name}: {name}"


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_every_module_compiles(family):
    (module,) = [m for m in all_modules() if m.name == family]
    _compile_all(module)


@pytest.mark.gpu
@pytest.mark.parametrize("d", sorted(TT_SHAPES))
def test_tt_module_compiles_for_each_core_count(d):
    _compile_all(tt_module(*TT_SHAPES[d]))


def test_unknown_instantiation_is_a_clear_error():
    module = all_modules()[0]
    with pytest.raises(KeyError, match="not a registered instantiation"):
        module.get_function("no_such_kernel<float>")
