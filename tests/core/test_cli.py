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
