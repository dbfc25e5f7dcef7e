import pytest

from xferlib._kernels import all_modules


def test_modules_are_registered_and_not_compiled_at_import():
    modules = all_modules()
    assert modules and all(m.name_expressions for m in modules)
    assert all(not m._compiled for m in modules)


@pytest.mark.gpu
def test_every_module_compiles():
    for module in all_modules():
        for name in module.name_expressions:
            assert module.get_function(name) is not None, name


def test_unknown_instantiation_is_a_clear_error():
    module = all_modules()[0]
    with pytest.raises(KeyError, match="not a registered instantiation"):
        module.get_function("no_such_kernel<float>")
