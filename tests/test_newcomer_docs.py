"""What a newcomer reads matches what the code does.

- A signature the docs show in full is the real one (``inspect.signature``): the same
  parameters in the same order, the same keyword-only ones, the same defaults. So the docs
  cannot promise ``HostTable(num_rows, dim, optimizer="adam")`` while the third positional
  argument is ``dtype``.
- The README links every page in docs/. Each measured figure lives on one page: the README
  links to it instead of repeating it, and docs/benchmarks.md keeps only figures no topic
  page carries.
- ``xferlib bench table`` without a GPU compares like with like: every optimizer it times
  has an xferlib row and a plain NumPy row, and the NumPy baselines compute the update
  xferlib's host tables compute.
"""

import ast
import collections
import importlib
import inspect
import pathlib
import re

import numpy as np
import pytest

import xferlib

ROOT = pathlib.Path(__file__).resolve().parent.parent

# (page, the name as the page writes it, where the object lives): signatures shown in full.
SIGNATURES = [
    ("docs/host-tables.md", "xferlib.HostTable", "xferlib:HostTable"),
    ("docs/host-tables.md", "HostEmbeddingBag", "xferlib.adapters.torch:HostEmbeddingBag"),
    ("docs/transfer.md", "gather_rows", "xferlib:gather_rows"),
    ("docs/transfer.md", "scatter_rows", "xferlib:scatter_rows"),
    ("docs/transfer.md", "scatter_add_rows", "xferlib:scatter_add_rows"),
]

_KINDS = inspect.Parameter


def _shown_signature(page: str, name: str) -> list:
    """The parameters of the first inline code span ``name(...)`` on ``page`` that reads as a
    parameter list (a call such as ``name(1000, 4)`` does not), as (name, kind, default)."""
    text = (ROOT / page).read_text()
    for match in re.finditer(rf"`{re.escape(name)}\(([^`]*)\)`", text):
        try:
            tree = ast.parse(f"def _({' '.join(match.group(1).split())}): pass")
        except SyntaxError:
            continue
        args = tree.body[0].args
        positional = ([(a, _KINDS.POSITIONAL_ONLY) for a in args.posonlyargs]
                      + [(a, _KINDS.POSITIONAL_OR_KEYWORD) for a in args.args])
        defaults = [_KINDS.empty] * (len(positional) - len(args.defaults)) + [
            ast.literal_eval(d) for d in args.defaults]
        shown = [(a.arg, kind, d) for (a, kind), d in zip(positional, defaults)]
        if args.vararg:
            shown.append((args.vararg.arg, _KINDS.VAR_POSITIONAL, _KINDS.empty))
        shown += [(a.arg, _KINDS.KEYWORD_ONLY,
                   _KINDS.empty if d is None else ast.literal_eval(d))
                  for a, d in zip(args.kwonlyargs, args.kw_defaults)]
        if args.kwarg:
            shown.append((args.kwarg.arg, _KINDS.VAR_KEYWORD, _KINDS.empty))
        return shown
    raise AssertionError(f"{page} shows no signature `{name}(...)`")


@pytest.mark.parametrize("page, name, target", SIGNATURES,
                         ids=[f"{p}:{n}" for p, n, _ in SIGNATURES])
def test_signature_in_the_docs_is_the_real_one(page, name, target):
    module, attr = target.split(":")
    if module.startswith("xferlib.adapters.torch"):
        pytest.importorskip("torch")
    obj = getattr(importlib.import_module(module), attr)
    real = [(p.name, p.kind, p.default) for p in inspect.signature(obj).parameters.values()]
    shown = _shown_signature(page, name)
    assert shown == real, (f"{page} shows {name}{_render(shown)}, the code has "
                           f"{name}{inspect.signature(obj)}")


def _render(params) -> str:
    return str(inspect.Signature([inspect.Parameter(n, k, default=d) for n, k, d in params]))


def test_the_signature_reader_tells_positional_from_keyword():
    # The doc's old HostTable line read as a signature whose third positional parameter is
    # the optimizer; the real third positional parameter is dtype.
    old = [("num_rows", _KINDS.POSITIONAL_OR_KEYWORD, _KINDS.empty),
           ("dim", _KINDS.POSITIONAL_OR_KEYWORD, _KINDS.empty),
           ("optimizer", _KINDS.POSITIONAL_OR_KEYWORD, "adam")]
    real = [(p.name, p.kind, p.default)
            for p in inspect.signature(xferlib.HostTable).parameters.values()]
    assert real[:3] != old and real[2][0] == "dtype"


# --------------------------------------------------------------------- one home per figure

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```.*?^```[ \t]*$", re.S | re.M)
# A measured figure: a time, a rate or a speed ratio ("2.6x"; "200 x 220" is a shape).
FIGURE = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?"
                    r"(?:\s*(?:ms|us|µs|GB/s|TB/s|MB/s|samples/s|lookups/s)(?![\w/])|x(?!\w))")
# Ratios in the README that are not measurements: they follow from sizes and shapes.
README_NOT_MEASURED = {
    "734x": "FBTT's benchmark table against its TT cores, from the shapes",
    "8.6x": "the large DLRM preset's bytes of tables and state over its 3 GB budget",
}


def _figures(path) -> set:
    """The figures in a page's prose and tables (code blocks are what commands print)."""
    text = FENCE.sub("", path.read_text())
    return {" ".join(m.group(0).split()) for m in FIGURE.finditer(text)}


def test_the_readme_refers_to_figures_instead_of_repeating_them():
    figures = _figures(ROOT / "README.md") - set(README_NOT_MEASURED)
    assert not figures, (f"README.md repeats measured figures {sorted(figures)}: keep each on "
                         f"its topic's page (docs/) and link to it")


def test_benchmarks_page_keeps_only_figures_no_topic_page_has():
    ours = _figures(ROOT / "docs" / "benchmarks.md")
    elsewhere = collections.defaultdict(list)
    for page in PAGES:
        if page.name != "benchmarks.md":
            for figure in _figures(page) & ours:
                elsewhere[figure].append(page.name)
    assert not elsewhere, f"docs/benchmarks.md repeats figures of other pages: {dict(elsewhere)}"


LINK = re.compile(r"\]\(([\w./-]*\.md)?#([\w-]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_to_a_section_find_it():
    # The README and benchmarks.md send readers to each figure's section by anchor.
    for page in PAGES:
        for target, anchor in LINK.findall(page.read_text()):
            linked = (page.parent / target).resolve() if target else page
            headings = re.findall(r"^#+ (.*)$", FENCE.sub("", linked.read_text()), re.M)
            assert anchor in {_slug(h) for h in headings}, \
                f"{page.name} links to {target or page.name}#{anchor}: no such heading"


def test_the_readme_lists_every_page_in_docs():
    # A page the README's documentation list leaves out is one a newcomer never finds.
    listed = set(re.findall(r"\(docs/([\w.-]+\.md)\)", (ROOT / "README.md").read_text()))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages <= listed, f"docs pages the README does not link: {sorted(pages - listed)}"


def test_the_figure_pattern_finds_what_it_should():
    found = {" ".join(m.group(0).split()) for m in FIGURE.finditer(
        "1.93 ms, 36.1 ms, 12.6x, 20,047 samples/s, 43 GB/s; 200 x 220; 8M x 128; 0.009 us")}
    assert found == {"1.93 ms", "36.1 ms", "12.6x", "20,047 samples/s", "43 GB/s", "0.009 us"}


# --------------------------------------------------------------------- bench table on the CPU

def test_cpu_table_bench_rows_compare_the_same_optimizer():
    # It used to time xferlib's Adam step against NumPy SGD.
    from xferlib.adapters.bench import table

    report = table._run_numpy(True, rows=4096, dim=8, batch=512, repeats=1)
    steps = collections.defaultdict(list)
    for r in report["results"]:
        assert r["kind"] == "step" and r["ms"] > 0
        steps[r["optimizer"]].append(r["impl"])
    assert sorted(steps) == sorted(table.CPU_OPTIMIZERS) == ["adam", "sgd"]
    for optimizer, impls in steps.items():
        assert len(impls) == 2, impls
        assert sum(i.startswith("xferlib") for i in impls) == 1, impls
        assert all(i.endswith(f"({optimizer})") or f", {optimizer})" in i for i in impls), impls


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_cpu_table_bench_baselines_compute_xferlibs_update(optimizer):
    # Like with like in numbers too: three steps with repeated rows and rows first touched
    # at different steps (lazy Adam's per-row bias correction) give the same table.
    from xferlib.adapters.bench import table as bench

    rng = np.random.default_rng(0)
    host = xferlib.HostTable(50, 4, optimizer=optimizer, optimizer_kwargs={"lr": bench.CPU_LR},
                             init=("uniform", -0.1, 0.1), seed=0)
    step, weights = bench.numpy_step(optimizer, host)
    for k in range(3):
        idx = rng.integers(0, 10 if k == 0 else 50, 40)
        grads = rng.standard_normal((40, 4)).astype(np.float32)
        host.apply_gradients(idx, grads)
        step(idx, grads)
    np.testing.assert_allclose(weights, np.array(host.numpy()), rtol=1e-5, atol=1e-6)
