"""The ``xferlib`` command, run as a user runs it (a subprocess)."""

import os
import subprocess
import sys
from importlib import metadata

import pytest

from xferlib._backend import cupy_available


def _run(*args, env=None):
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "xferlib", *args], capture_output=True,
                          text=True, timeout=240, env=full_env)


def test_doctor_reports_every_check():
    result = _run("doctor", env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert out.startswith("xferlib ") and " doctor: Python " in out
    for key in ("host memory", "GPU", "CuPy", "torch", "JAX", "JAX preallocation"):
        assert f"  {key} " in out, f"no {key!r} line in:\n{out}"
    assert "GB available" in out
    if cupy_available():
        assert "pinned memory" in out and "GB/s pinned" in out
        assert "  host tables " in out and ("managed memory kept in host RAM" in out
                                           or "pinned memory (" in out), out
        assert "CUDA driver" in out and "CUDA versions" in out
        assert "off (XLA_PYTHON_CLIENT_PREALLOCATE=false)" in out
    elif not _cupy_installed():  # a CPU machine as the README's install leaves it
        assert "the NumPy path runs" in out
        assert "Nothing to fix" in out and "\n  !!" not in out, out  # nothing is broken
        # ... and the GPU paths are an optional install, not a fix
        optional = out[out.index("Optional, for more paths:"):]
        assert "for the GPU paths: pip install 'xferlib[cuda13]'" in optional, out
    elif _cupy_imports():  # CuPy without a GPU: nothing to install
        assert "the NumPy path runs" in out and "Nothing to fix" in out, out
    else:  # a CuPy that does not import is broken: doctor says so and how to fix it
        assert "  !!  CuPy " in out and "What to do:" in out and "reinstall CuPy" in out, out


def _cupy_installed() -> bool:
    for dist in ("cupy-cuda13x", "cupy-cuda12x", "cupy"):
        try:
            metadata.version(dist)
            return True
        except metadata.PackageNotFoundError:
            pass
    return False


def _cupy_imports() -> bool:
    try:
        import cupy  # noqa: F401
    except Exception:  # ImportError, or a CUDA library that fails to load
        return False
    return True


@pytest.mark.gpu
def test_doctor_says_to_turn_off_jax_preallocation():
    env = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_PREALLOCATE"}
    result = subprocess.run([sys.executable, "-m", "xferlib", "doctor"], capture_output=True,
                            text=True, timeout=240, env=env)
    assert "export XLA_PYTHON_CLIENT_PREALLOCATE=false" in result.stdout, result.stdout


def test_info_still_works():
    result = _run("info")
    assert result.returncode == 0, result.stderr
    assert "backends: numpy" in result.stdout and "xferlib doctor" in result.stdout


def test_unknown_command_is_a_usage_error():
    result = _run("docter")
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_doctor_warm_compiles_the_kernels_or_says_why_not():
    """``xferlib doctor --warm`` compiles every fixed kernel family on a GPU machine and
    says how long it took; without a GPU it has nothing to compile and says so (exit 0)."""
    import xferlib

    result = _run("doctor", "--warm")
    assert result.returncode == 0, result.stderr
    if xferlib.cupy_available():
        assert "kernel modules in" in result.stdout and "collection" in result.stdout
    else:
        assert "nothing to compile" in result.stdout


def test_warm_lists_the_fixed_families_and_the_runs_update_modules():
    import xferlib
    from xferlib._kernels import all_modules
    from xferlib.warm import fixed_modules

    names = [m.name for m in fixed_modules(rules=["adagrad", "rowwise_adagrad"])]
    assert names[:8] == ["collection", "optim", "rows", "scattered_rows", "table_cache", "table",
                         "interaction", "verdict"]
    assert len(names) == 10 and all(n.startswith("collection-update-") for n in names[8:])
    every = fixed_modules(rules=xferlib.SPARSE_OPTIMIZERS, dtypes=("float32", "float64"))
    registered = {m.name for m in all_modules()}
    assert {m.name for m in every} <= registered  # what the warm-up compiles is registered
    assert not any(n.startswith("tt_") for n in {m.name for m in every})


@pytest.mark.gpu
def test_warm_kernels_compiles_for_the_current_gpu():
    import cupy

    from xferlib.warm import fixed_modules, warm_kernels

    modules = fixed_modules(rules=["sgd"])
    took = warm_kernels(modules, workers=4)
    assert sorted(took) == sorted(m.name for m in modules)
    device = cupy.cuda.runtime.getDevice()
    assert all(device in m._compiled for m in modules)
    warm_kernels(modules, background=True).join(timeout=120)


@pytest.mark.parametrize("args, message", [
    (["--json", "."], "--json . is a directory"),
    (["--plot", "."], "--plot . is a directory"),
    (["--plot", "gather.xyz"], "--plot gather.xyz: matplotlib writes no 'xyz' files"),
])
def test_bench_refuses_an_output_it_cannot_write_before_running(args, message):
    """These ran the suite first and then crashed writing its results (IsADirectoryError,
    matplotlib's ValueError: a traceback, exit status 1)."""
    if "xyz" in args[-1]:
        pytest.importorskip("matplotlib")
    result = _run("bench", "optim", "--quick", *args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr, result.stderr
    assert "== xferlib bench" not in result.stdout  # refused before any suite ran
