"""Every code block of README.md and docs/*.md runs as written.

A ```python block runs on the CPU (CI runs it); a ```python gpu block runs only where a GPU
is present (skipped, with the reason, elsewhere). Other fences (bash, text) are not run.
Each block runs on its own, in a fresh namespace and an empty working directory, so a block
is a complete snippet a reader can paste.
"""

import gc
import pathlib
import re

import pytest

from xferlib._backend import cupy_available

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)


def _blocks():
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            info = match.group(1).split()
            if not info or info[0] != "python":
                continue
            line = text.count("\n", 0, match.start()) + 1
            gpu = "gpu" in info[1:]
            yield pytest.param(match.group(2), gpu,
                               id=f"{page.relative_to(ROOT)}:{line}",
                               marks=[pytest.mark.gpu] if gpu else [])


BLOCKS = list(_blocks())


def test_pages_have_blocks():
    assert (ROOT / "README.md").exists() and BLOCKS


@pytest.mark.parametrize("source, gpu", BLOCKS)
def test_block_runs(source, gpu, tmp_path, monkeypatch):
    if gpu and not cupy_available():
        pytest.skip("a ```python gpu block: needs a CUDA GPU with CuPy; none here")
    if gpu:
        # Objects left by earlier tests in this process are freed now, not inside a block's
        # CUDA-graph capture (torch's default capture mode refuses a free from any thread).
        gc.collect()
    monkeypatch.chdir(tmp_path)
    code = compile(source, "<doc block>", "exec")
    exec(code, {"__name__": "__doc_block__"})
