"""The examples a user copies from: each runs (at small sizes, so CI's two cores finish in
seconds), answers ``--help`` without running, and refuses bad arguments with exit status 2
and a message that names the flag (argparse's ``parser.error``).

examples/dlrm.py's training runs have their own tests (tests/test_dlrm.py: both frameworks,
resume, bad configurations); its argument checks are here with the others'.
"""

import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLES_DIR = pathlib.Path(__file__).resolve().parent.parent / "examples"
ALL = sorted(EXAMPLES_DIR.glob("*.py"))
EXAMPLES = [p for p in ALL if p.name != "dlrm.py"]

# Small arguments per example, and a line of its output that shows it got through: a full run
# at these sizes takes seconds. (sharded_flat_step.py runs at its own CPU defaults.)
SMALL = {
    "embedding_rows.py": (["--rows", "10000", "--batch", "1024", "--steps", "10"],
                          "core: gathered 1024 rows"),
    "flat_optimizer.py": (["--steps", "20"], "xferlib FlatAdamW"),
    "tt_recommender.py": (["--steps", "30"], "xferlib TTEmbeddingBag"),
    # 10 steps learn nothing yet: the run prints its figures and exits 0 (it used to end in
    # an AssertionError).
    "word2vec_host_table.py": (["--steps", "10"], "topics not learned yet"),
}


def _run(path, *args, timeout=300):
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    return subprocess.run([sys.executable, str(path), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(path):
    pytest.importorskip("torch")
    pytest.importorskip("optax")
    args, shows = SMALL.get(path.name, ([], ""))
    result = _run(path, *args)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert shows in result.stdout, result.stdout[-2000:]


@pytest.mark.parametrize("path", ALL, ids=[p.name for p in ALL])
def test_help_answers_without_running(path):
    # --help used to be ignored by three examples, which then trained in full.
    result = _run(path, "--help", timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("usage:"), result.stdout[-2000:]
    assert "loss" not in result.stdout.split("options:")[0]  # nothing trained before the help


BAD = [
    ("embedding_rows.py", ["--steps", "0"], "argument --steps: must be an integer >= 1, got 0"),
    ("embedding_rows.py", ["--rows", "many"],
     "argument --rows: expected an integer >= 1, got 'many'"),
    ("embedding_rows.py", ["--fast"], "unrecognized arguments: --fast"),
    ("flat_optimizer.py", ["--lr", "-1"], "argument --lr: must be a number > 0, got -1"),
    ("flat_optimizer.py", ["--steps", "0"], "argument --steps: must be an integer >= 1, got 0"),
    ("tt_recommender.py", ["--batch", "0"], "argument --batch: must be an integer >= 1, got 0"),
    ("tt_recommender.py", ["100"], "unrecognized arguments: 100"),
    ("word2vec_host_table.py", ["--steps", "0"],
     "argument --steps: must be an integer >= 1, got 0"),
    ("word2vec_host_table.py", ["--gpu-budget-mb", "-1"],
     "argument --gpu-budget-mb: must be a number of MB >= 0, got -1"),
    ("word2vec_host_table.py", ["--topics", "1"], "--topics must be between 2 and --vocab"),
    # dlrm.py used to run these with the preset's batch and pooling instead
    ("dlrm.py", ["--batch-size", "0"], "argument --batch-size: must be an integer >= 1, got 0"),
    ("dlrm.py", ["--pooling", "0"], "argument --pooling: must be an integer >= 1, got 0"),
    ("dlrm.py", ["--evals", "0"], "argument --evals: must be an integer >= 1, got 0"),
    ("dlrm.py", ["--steps", "-1"], "argument --steps: must be an integer >= 0, got -1"),
    # these trained first and then crashed writing the result (a traceback, exit status 1)
    ("dlrm.py", ["--steps", "1", "--json", "."], "--json . is a directory"),
    ("dlrm.py", ["--steps", "1", "--plot", "."], "--plot . is a directory"),
    ("dlrm.py", ["--steps", "1", "--plot", "curves.xyz"],
     "--plot curves.xyz: matplotlib writes no 'xyz' files"),
    ("sharded_flat_step.py", ["--json", "."], "--json . is a directory"),
    # int(nan), int(inf): a ValueError / OverflowError traceback
    ("sharded_flat_step.py", ["--params", "nan"], "--params must be a finite number >= 1"),
    ("sharded_flat_step.py", ["--params", "inf"], "--params must be a finite number >= 1"),
]


@pytest.mark.parametrize("name, args, message", BAD,
                         ids=[f"{n}:{' '.join(a)}" for n, a, _ in BAD])
def test_bad_arguments_are_refused(name, args, message):
    result = _run(EXAMPLES_DIR / name, *args, timeout=120)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert message in result.stderr, result.stderr[-2000:]


def test_dlrm_refuses_to_save_a_compare_run(tmp_path):
    # docs/dlrm.md: a checkpoint holds one run, so --compare --save is refused up front
    ckpt = tmp_path / "ckpt"
    result = _run(EXAMPLES_DIR / "dlrm.py", "--quiet", "--compare", "--save", ckpt, timeout=120)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "--save holds one run" in result.stderr and "--compare" in result.stderr
    assert not ckpt.exists()


@pytest.mark.slow
def test_word2vec_learns_the_planted_topics():
    # The run fails (exit 1) when a run of at least LEARN_STEPS steps did not learn them.
    pytest.importorskip("torch")
    result = _run(EXAMPLES_DIR / "word2vec_host_table.py", "--steps", 300, "--skip-jax")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "torch: mean cosine" in result.stdout and "topics learned" in result.stdout
