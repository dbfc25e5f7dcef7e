import pathlib
import subprocess
import sys

import pytest

# examples/dlrm.py has its own tests (tests/test_dlrm.py: both frameworks, resume, bad input).
EXAMPLES = sorted(p for p in (pathlib.Path(__file__).parent.parent / "examples").glob("*.py")
                  if p.name != "dlrm.py")


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(path):
    pytest.importorskip("torch")
    pytest.importorskip("optax")
    result = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
