import subprocess
import sys


def test_import_xferlib_loads_no_framework():
    code = ("import sys, xferlib, xferlib.rows, xferlib.memory, xferlib.handoff, xferlib.cli;"
            "print(sorted(m for m in ('torch', 'jax', 'cupy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_adapters_live_inside_the_package():
    code = ("import importlib.util as u;"
            "print(u.find_spec('adapters') is None, u.find_spec('xferlib.adapters') is not None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd="/")
    assert out.stdout.split() == ["True", "True"]
