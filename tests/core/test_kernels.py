import subprocess
import sys

import pytest

from xferlib._kernels import all_modules


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


@pytest.mark.gpu
def test_every_module_compiles():
    for module in all_modules():
        for name in module.name_expressions:
            assert module.get_function(name) is not None, name


def test_unknown_instantiation_is_a_clear_error():
    module = all_modules()[0]
    with pytest.raises(KeyError, match="not a registered instantiation"):
        module.get_function("no_such_kernel<float>")
