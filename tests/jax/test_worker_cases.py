"""The multi-device tests' worker protocol (worker_cases.py): results come back by case, a
failing case names itself, and a stuck worker exits with its stacks and the case it was in."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.jax.worker_cases import results_of

HERE = Path(__file__).parent


def _worker(tmp_path, body: str, limit_s: str = "240"):
    script = tmp_path / "worker.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(HERE)!r})\n"
                      "from worker_cases import run_cases\n" + textwrap.dedent(body))
    env = {"XFERLIB_TEST_WORKER_LIMIT_S": limit_s, "PATH": ""}
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=60)


def test_each_case_reports_its_result_or_its_error(tmp_path):
    proc = _worker(tmp_path, """
        def bad():
            raise ValueError("no such row")
        run_cases({"one": lambda: 1.5, "bad": bad})
    """)
    results = results_of(proc.returncode, proc.stdout, proc.stderr, ["one", "bad"])
    assert results == {"one": 1.5, "bad": "ValueError: no such row"}
    with pytest.raises(AssertionError, match="cases and the test's list differ"):
        results_of(proc.returncode, proc.stdout, proc.stderr, ["one"])


def test_a_stuck_worker_exits_with_its_stacks_and_names_its_case(tmp_path):
    proc = _worker(tmp_path, """
        import time
        run_cases({"quick": lambda: 0.0, "stuck": lambda: time.sleep(30)})
    """, limit_s="1")
    assert proc.returncode != 0
    with pytest.raises(AssertionError) as failure:
        results_of(proc.returncode, proc.stdout, proc.stderr)
    message = str(failure.value)
    assert message.startswith("stopped in case 'stuck'")
    assert "Timeout" in message and "in <lambda>" in message  # the stacks, the stuck frame
    # with the cases named, each one's result is that text (each case's test fails with it)
    results = results_of(proc.returncode, proc.stdout, proc.stderr, ["quick", "stuck"])
    assert results == {"quick": message, "stuck": message}
