"""``xferlib bench``'s modules and registry, on the CPU.

The suites' GPU paths only run on a GPU, and most of their project imports sit inside those
functions; so every benchmark module is imported here and every ``xferlib`` import in its
source, at module level or inside a function, is resolved (the module exists and has the
names asked for).
"""

import ast
import importlib
import json
import os
import pathlib
import pkgutil
import subprocess
import sys
import textwrap

import pytest

import xferlib.adapters.bench
import xferlib.bench
from xferlib.backend import cupy_available
from xferlib.bench import SUITES, SuiteRegistry

ROOT = pathlib.Path(__file__).resolve().parents[2]
SUITE_NAMES = ["transfer", "optim", "table", "tt", "collection"]  # as listed and run


def _modules():
    names = []
    for package in (xferlib.bench, xferlib.adapters.bench):
        names.append(package.__name__)
        names += [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]
    return names


BENCH_MODULES = _modules()


def test_the_benchmark_modules_are_found():
    for name in ("transfer", "optim", "table", "tt"):
        assert f"xferlib.adapters.bench.{name}" in BENCH_MODULES
    for name in ("suite", "report", "timing", "shapes", "kernels"):
        assert f"xferlib.bench.{name}" in BENCH_MODULES
    assert not [m for m in BENCH_MODULES if m.rsplit(".", 1)[-1].startswith("_")
                and not m.endswith("__init__")]


def _project_imports(module):
    """``(line, module imported, names)`` for every import of ``xferlib`` in the module's
    source, functions included."""
    tree = ast.parse(pathlib.Path(module.__file__).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module and \
                node.module.split(".")[0] == "xferlib":
            yield node.lineno, node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "xferlib":
                    yield node.lineno, alias.name, []


@pytest.mark.parametrize("name", BENCH_MODULES)
def test_every_import_of_a_benchmark_module_resolves(name):
    module = importlib.import_module(name)
    checked = 0
    for line, source, names in _project_imports(module):
        target = importlib.import_module(source)
        for attr in names:
            if not hasattr(target, attr):
                try:
                    importlib.import_module(f"{source}.{attr}")  # a submodule
                except ImportError:
                    pytest.fail(f"{name}, line {line}: from {source} import {attr}: no such "
                                f"name")
        checked += 1
    assert checked or name in ("xferlib.bench.report", "xferlib.bench.timing",
                               "xferlib.bench.shapes", "xferlib.bench.kernels",
                               "xferlib.adapters.bench", "xferlib.adapters.bench.fbgemm",
                               "xferlib.adapters.bench.collection_floor"), name


def _python(code, **kw):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, **kw)


def test_the_core_bench_imports_no_adapter_and_listing_no_framework():
    result = _python("""
        import sys
        import xferlib.bench, xferlib.bench.kernels, xferlib.cli
        print(sorted(m for m in sys.modules if m.startswith("xferlib.adapters")))
        names = list(xferlib.bench.SUITES)      # reads the registry: loads the suites
        print(names, sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "jax",
                                                                           "cupy")))
        """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[]", f"{SUITE_NAMES} []"]


def test_registry_lists_the_suites_in_order():
    assert list(SUITES) == SUITE_NAMES
    for name in SUITE_NAMES:
        assert SUITES[name] is getattr(xferlib.adapters.bench, name).run


def test_bench_help_lists_the_same_suites():
    result = subprocess.run([sys.executable, "-m", "xferlib", "bench", "--help"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "suites to run: transfer, optim, table, tt" in " ".join(result.stdout.split())
    for flag in ("--quick", "--json PATH", "--plot PATH"):
        assert flag in result.stdout


def test_an_unknown_suite_is_a_usage_error():
    result = subprocess.run([sys.executable, "-m", "xferlib", "bench", "nope"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2
    assert "unknown benchmark suite(s) ['nope']; available: ['collection', 'optim', 'table', " \
           "'transfer', 'tt']" in result.stderr


def test_a_suite_runs_through_the_registry(tmp_path):
    if cupy_available():
        pytest.skip("on a GPU the optim suite runs in full (xferlib bench optim --quick)")
    path = tmp_path / "optim.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_PREALLOCATE"}
    result = subprocess.run([sys.executable, "-m", "xferlib", "bench", "optim", "--quick",
                             "--json", str(path)], capture_output=True, text=True, timeout=120,
                            cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("== xferlib bench optim (quick)\n")
    assert "no CUDA GPU found: the optimizer benchmark needs a GPU (skipped)" in result.stdout
    report = json.loads(path.read_text())
    assert list(report) == ["optim"]
    assert report["optim"]["suite"] == "optim" and report["optim"]["results"] == []
    assert report["optim"]["environment"]["gpu"] is None


def _distribution(where, name, entry_points=None):
    info = where / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    if entry_points:
        (info / "entry_points.txt").write_text(entry_points)


def test_a_package_registers_suites_with_an_entry_point(tmp_path, monkeypatch):
    """The hook for another package: an entry point naming a mapping of suites, listed in
    its order; a name registered twice keeps its first registration; a distribution without
    the group (a stale copy of xferlib's metadata, say) hides nothing."""
    (tmp_path / "fake_suites.py").write_text(textwrap.dedent("""
        def second(quick=False):
            return {"suite": "second", "quick": quick}

        def first(quick=False):
            return {"suite": "first", "quick": quick}

        SUITES = {"second": second, "first": first}
        AGAIN = {"first": second, "third": first}
        """))
    _distribution(tmp_path, "xferlib")  # shadows the installed metadata by name
    _distribution(tmp_path, "fake_bench", "[xferlib_bench_test]\n"
                  "fake = fake_suites:SUITES\nagain = fake_suites:AGAIN\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = SuiteRegistry("xferlib_bench_test")
    assert list(registry) == ["second", "first", "third"]
    assert registry["first"](quick=True) == {"suite": "first", "quick": True}
    assert list(SuiteRegistry()) == SUITE_NAMES
