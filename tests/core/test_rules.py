"""The optimizer rules written once: one id per rule for every kernel family, ids reach the
CUDA sources only through the generated #define block, the per-element CUDA math lives in one
snippet every family includes and calls (no family writes a rule's arithmetic itself), one
error type for unknown names, and the shared per-step scalars agree across array namespaces.
CPU only: the kernel sources are checked as text (the GPU run compiles them and compares each
family with its NumPy reference: tests/core/test_kernels*, test_optim, test_table, test_tt*)."""

import doctest
import importlib
import re

import numpy as np
import pytest

from xferlib import optim
from xferlib.optim.rules import FLAT_RULES, RULES, OptId, cuda_defines, get_rule

DEFINE = re.compile(r"^#define XF_OPT_(\w+) (\d+)$", re.M)
USED = re.compile(r"\bXF_OPT_(\w+)\b")
# A hand-written id: a rule/opt/kind compared with, or a template instantiated on, a number.
HAND_ID = re.compile(r"\b(?:KIND|RULE|opt)\s*[!=]=\s*\d|update_chunk<\s*\d")


def _sources():
    from xferlib._kernels.optim import OPTIM_KERNEL
    from xferlib._kernels.table import TABLE_KERNEL
    from xferlib._kernels.tt import TT_MODULE, tt_module

    return {"optim": OPTIM_KERNEL, "table": TABLE_KERNEL, "tt": TT_MODULE.source,
            "tt_other_shape": tt_module((5, 6), (2, 2), (3,)).source}


def test_define_block_matches_the_enum():
    text = cuda_defines()
    found = {name: int(value) for name, value in DEFINE.findall(text)}
    assert found == {o.name: int(o) for o in OptId}
    assert len(set(found.values())) == len(found)  # one id per rule
    assert len(text.strip().splitlines()) == len(OptId) + 1  # the header comment + defines


@pytest.mark.parametrize("family", ["optim", "table", "tt", "tt_other_shape"])
def test_kernel_sources_take_ids_from_the_define_block(family):
    source = _sources()[family]
    assert cuda_defines() in source
    assert source.index(cuda_defines()) < source.index("__global__")
    body = source.replace(cuda_defines(), "")
    assert not DEFINE.search(body), "an optimizer id defined by hand"
    assert not HAND_ID.findall(re.sub(r"//[^\n]*", "", body)), "an optimizer id copied by hand"
    used = set(USED.findall(body))
    assert used and used <= set(OptId.__members__)


def test_entry_points_are_still_there():
    from xferlib._kernels.optim import OPTIM_MODULE
    from xferlib._kernels.table import TABLE_MODULE
    from xferlib._kernels.tt import TT_MODULE

    sources = _sources()
    for family, names in [("optim", ["flat_update", "flat_adam_device_scalars",
                                     "advance_steps", "update_chunk"]),
                          ("table", ["sparse_update", "row_consts", "elem",
                                     "rowwise_adagrad_row"]),
                          ("tt", ["tt_update", "update_row", "tt_cache_update"])]:
        for name in names:
            assert re.search(rf"\b{name}\s*[<(]", sources[family]), (family, name)
    for module in (OPTIM_MODULE, TABLE_MODULE, TT_MODULE):
        for expr in module.name_expressions:
            base = expr.split("<")[0]
            assert re.search(rf"\b{base}\s*[<(]", module.source), expr


def test_flat_family_ids_and_slots_come_from_the_rules():
    from xferlib._kernels.optim import KINDS, OPTIM_MODULE, slot_names, update_name

    assert set(KINDS) == {int(r.kind) for r in FLAT_RULES.values()}
    assert KINDS == tuple(range(8))  # the flat ids did not move in the package split
    for name, rule in FLAT_RULES.items():
        assert slot_names(rule.kind) == rule.slots
        assert set(rule.buffers(rule.defaults)) <= set(rule.slots)
        assert getattr(optim, name)().kind == rule.kind == OptId[name.upper().replace(
            "ADAMW", "ADAM")]
        assert update_name(rule.kind) in OPTIM_MODULE.name_expressions
        assert f"XF_OPT_{OptId(rule.kind).name}" in OPTIM_MODULE.source


def test_table_family_ids_defaults_and_checks_are_the_shared_ones():
    from xferlib._kernels.table import RULE_IDS, RULES as TABLE_RULES, SPARSE_UPDATE, \
        TABLE_MODULE
    from xferlib.table import SPARSE_OPTIMIZERS, optimizer_defaults
    from xferlib.table.rules import _RULES

    for name in SPARSE_OPTIMIZERS:
        shared = RULES[name]
        assert _RULES[name].kind == shared.kind
        assert int(shared.kind) in RULE_IDS
        assert optimizer_defaults(name) == shared.defaults
        assert _RULES[name].check is shared.check
        assert _RULES[name].slots(shared.defaults) == shared.buffers(shared.defaults)
        assert SPARSE_UPDATE.instance(int(shared.kind), 1, "float", "long long") \
            in TABLE_MODULE.name_expressions
    assert RULE_IDS == tuple(int(OptId[n.upper()]) for n in TABLE_RULES)
    for rule_id in RULE_IDS:
        assert f"XF_OPT_{OptId(rule_id).name}" in TABLE_MODULE.source


def test_tt_family_ids():
    from xferlib import tt
    from xferlib._kernels.tt import TT_MODULE

    used = set(USED.findall(TT_MODULE.source.replace(cuda_defines(), "")))
    names = {n.upper() for n in tt.SPARSE_OPTIMIZERS}
    assert used <= names
    # partial_rowwise_lamb is the kernel's fall-through branch (no comparison names it)
    assert names - used == {"PARTIAL_ROWWISE_LAMB"}


def test_the_hand_id_check_can_fail():
    for text in ("if (KIND == 0) {", "} else if (RULE == 3) {", "if (opt != 4)",
                 "update_chunk<1, G>(p"):
        assert HAND_ID.search(text), text
    assert not HAND_ID.search("if (KIND == XF_OPT_SGD) {")


@pytest.mark.parametrize("call", [
    lambda: optim.resolve_hyper("adamz"),
    lambda: get_rule("adamz"),
    lambda: optim.apply_table("adamz", optim.FlatLayout.from_shapes([(4,)]),
                              np.zeros(4, np.float32), np.zeros(4, np.float32), {},
                              np.zeros((1, 11))),
    lambda: optim.resolve_hyper("rowwise_adagrad"),  # a host-table rule, not a flat one
    lambda: __import__("xferlib.table", fromlist=["HostTable"]).HostTable(4, 2,
                                                                          optimizer="adamz"),
    lambda: __import__("xferlib.tt", fromlist=["tt"]).tt_sparse_state(
        __import__("xferlib.tt", fromlist=["tt"]).TTShape((2, 2), (2, 2), (2,)), "adamz"),
])
def test_unknown_names_are_value_errors_naming_the_choices(call):
    with pytest.raises(ValueError, match="adamz|rowwise_adagrad") as info:
        call()
    assert "sgd" in str(info.value)


@pytest.mark.parametrize("name,hyper", [
    ("adam", dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0, amsgrad=False)),
    ("adamw", dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, amsgrad=False)),
    ("sgd", dict(lr=0.1, momentum=0.9, dampening=0.2, nesterov=False, weight_decay=0.0)),
    ("adagrad", dict(lr=0.1, lr_decay=0.01, eps=1e-10)),
    ("adamax", dict(lr=2e-3, betas=(0.9, 0.999), eps=1e-8)),
    ("lion", dict(learning_rate=1e-3, b1=0.9, b2=0.99, weight_decay=1e-3)),
])
def test_step_scalars_agree_across_namespaces(name, hyper):
    """The same scalar code on host floats (float64) and on traced jnp step counts (float32;
    1 - b2^t cancels in float32, hence the tolerance)."""
    jnp = pytest.importorskip("jax.numpy")
    rule = RULES[name]
    for step in (1, 2, 7, 1000):
        host = np.array(rule.scalars(hyper, step, {}), dtype=np.float64)
        traced = np.array([np.asarray(v) for v in rule.scalars(
            hyper, jnp.asarray(step, jnp.float32), {}, jnp)], dtype=np.float64)
        np.testing.assert_allclose(traced, host, rtol=1e-4, atol=0)


def test_adam_scalars_in_jnp_are_optax_bias_corrections_bit_for_bit():
    """What the JAX adapter's kernel row computed before it used the shared rule."""
    jnp = pytest.importorskip("jax.numpy")
    b1, b2, lr = 0.9, 0.999, 1e-3
    for step in (1, 3, 50):
        t = jnp.asarray(step, jnp.float32)
        ours = RULES["adam"].scalars(dict(lr=lr, betas=(b1, b2), eps=1e-8, amsgrad=False), t,
                                     {}, jnp)
        bc1 = 1.0 - jnp.power(jnp.float32(b1), t)
        bc2 = 1.0 - jnp.power(jnp.float32(b2), t)
        assert np.float32(ours[0]) == np.float32(lr / bc1)
        assert np.float32(ours[4]) == np.float32(jnp.sqrt(bc2))


def test_host_scalars_stay_python_floats():
    """The eager GPU step fills its table from these every step: no ufunc calls per scalar."""
    row = RULES["sgd"].scalars(dict(RULES["sgd"].defaults, momentum=0.9), 2, {})
    assert all(isinstance(v, float) for v in row)
    row = RULES["adam"].scalars(RULES["adam"].defaults, 2, {})
    assert all(isinstance(v, float) for v in row)


def test_old_names_still_importable():
    old = ["Segment", "FlatLayout", "FlatState", "FlatOptimizer", "OPTIMIZERS", "sgd", "adam",
           "adamw", "adagrad", "rmsprop", "adamax", "nadam", "radam", "lion", "global_norm",
           "partial_norm", "clip_coefficient", "clip_by_global_norm", "apply_table",
           "apply_adam_device_scalars", "adam_device_hyper", "resolve_hyper",
           "fill_step_table", "CudaStep", "TableRing", "global_norm_clip_factor",
           "step_scalars", "COMMON", "SCALARS", "ALIGN_BYTES", "chunk_table"]
    for name in old:
        assert hasattr(optim, name), name
    assert optim.OPTIMIZERS == tuple(optim.FLAT_RULES)
    assert set(optim.OPTIMIZERS) == {"sgd", "adam", "adamw", "adagrad", "rmsprop", "adamax",
                                     "nadam", "radam", "lion"}


@pytest.mark.parametrize("module", ["xferlib.optim.rules", "xferlib.optim.layout",
                                    "xferlib.optim.clip"])
def test_docstring_examples(module):
    result = doctest.testmod(importlib.import_module(module))
    assert result.failed == 0 and result.attempted > 0


# update_row's [elementwise, second elementwise, per row, per-row step] pointers, by rule.
TT_POINTERS = {
    "sgd": [None, None, None, None],
    "adagrad": ["sum", None, None, None],
    "rowwise_adagrad": [None, None, "sum", None],
    "rowwise_adam": ["exp_avg", None, "exp_avg_sq", "step"],
    "lamb": ["exp_avg", "exp_avg_sq", None, None],
    "lars_sgd": ["momentum", None, None, None],
    "partial_rowwise_adam": ["exp_avg", None, "exp_avg_sq", None],
    "partial_rowwise_lamb": ["exp_avg", None, "exp_avg_sq", None],
}


@pytest.mark.parametrize("optimizer", sorted(TT_POINTERS))
def test_tt_state_and_kernel_pointers_from_one_table(optimizer):
    from xferlib.tt.rules import row_state
    from xferlib.tt.rules import state_pointers

    state = row_state(3, 4, optimizer)
    shapes = {"sum": None, "exp_avg": (3, 4), "momentum": (3, 4), "step": (3,)}
    for name, array in state.items():
        want = shapes.get(name)
        assert want is None or array.shape == want, (name, array.shape)
        assert array.dtype == (np.int64 if name == "step" else np.float32)
        assert not array.any()
    pointers = state_pointers(state, optimizer)
    for got, name in zip(pointers, TT_POINTERS[optimizer]):
        if name is None:
            assert isinstance(got, np.uint64) and got == 0
        else:
            assert got is state[name]
    assert set(state) == {n for n in TT_POINTERS[optimizer] if n}
    if "step" in state:  # a state without its step count: the kernel gets NULL there
        del state["step"]
        assert state_pointers(state, optimizer)[3] == 0
    elif state:
        with pytest.raises(KeyError):
            state_pointers({}, optimizer)


# ------------------------------------------------------------ the shared per-element CUDA math

# The functions of each family that run a rule per element (not those computing the step's
# scalars: that stays each family's), and the shared rules each must call (the families' rule
# sets: flat, host tables, TT).
RULE_FUNCTIONS = {
    "optim": ["update_chunk", "flat_update"],
    "table": ["elem", "update_row", "rowwise_adagrad_row", "sparse_update"],
    "tt": ["update_row", "tt_update", "tt_cache_update"],
}
CALLS = {
    "optim": ["xf_preamble", "xf_sgd", "xf_adam", "xf_adagrad", "xf_rmsprop", "xf_adamax",
              "xf_nadam", "xf_radam", "xf_lion"],
    "table": ["xf_preamble", "xf_sgd", "xf_adam", "xf_adagrad", "xf_adamax", "xf_rmsprop",
              "xf_adadelta", "xf_descend"],
    "tt": ["xf_sgd", "xf_adagrad", "xf_descend", "xf_rowwise_adam", "xf_lamb_den",
           "xf_lamb_direction", "xf_lars"],
}
# What an optimizer's elementwise arithmetic looks like, written out: the helpers it calls,
# a moving average ((g - m) * w), a scaled squared gradient (c * g * g), a weight update
# with a quotient, or any compound assignment to the weight (w, p; the flat kernel's
# `updates` output, p - old, is not a rule).
RULE_MATH = [
    re.compile(r"\b(?:lerp\w*|fmaxf?|fminf?|fabsf?|copysignf?)\s*\("),
    re.compile(r"\(\s*[\w.\[\]]+\s*-\s*[\w.\[\]]+\s*\)\s*\*|\*\s*\(\s*[\w.\[\]]+\s*-\s*[\w.\[\]]+\s*\)"),
    re.compile(r"\*\s*([\w.]+(?:\[\w+\])?)\s*\*\s*\1(?![\w\[.])"),
    re.compile(r"(?:-=|\+=)[^;]*/"),
    re.compile(r"\b(?:w|p)(?:\[\w+\])?\s*[-+*/]=(?!\s*old\[)"),
]


def _strip_comments(text):
    return re.sub(r"//[^\n]*", "", text)


def _function_body(source, name):
    """The text of the definition of ``name`` (signature to closing brace)."""
    match = re.search(rf"(?:void|T|XfScalars<\w+>)\s+(?:__launch_bounds__\([^)]*\)\s*)?{name}\s*\(",
                      source)
    assert match, f"no definition of {name}"
    depth, i = 0, source.index("{", match.end())
    for j in range(i, len(source)):
        depth += {"{": 1, "}": -1}.get(source[j], 0)
        if depth == 0:
            return source[match.start():j + 1]
    raise AssertionError(f"unbalanced braces in {name}")


def rule_math(text):
    """The pieces of ``text`` (comments stripped) that look like a rule's arithmetic."""
    text = _strip_comments(text)
    return [m.group(0) for pattern in RULE_MATH for m in pattern.finditer(text)]


def _family_bodies():
    from xferlib._kernels.rules import RULES_KERNEL

    sources = _sources()
    out = {}
    for family, source in sources.items():
        assert source.count(RULES_KERNEL) == 1, family
        out[family] = source.replace(RULES_KERNEL, "")
    return out


@pytest.mark.parametrize("family", ["optim", "table", "tt", "tt_other_shape"])
def test_every_family_starts_with_the_shared_rules(family):
    from xferlib._kernels.rules import RULES_KERNEL

    source = _sources()[family]
    assert source.count(RULES_KERNEL) == 1
    assert source.index(RULES_KERNEL) < source.index("__global__")
    assert RULES_KERNEL.index(cuda_defines()) == 0  # the ids come with the snippet


@pytest.mark.parametrize("family", ["optim", "table", "tt", "tt_other_shape"])
def test_no_family_writes_a_rules_math_itself(family):
    body = _family_bodies()[family]
    key = family.split("_")[0]
    # no shared helper redefined outside the snippet
    assert not re.search(r"__device__[^;{]*\bxf_\w+\s*\(", body)
    for name in RULE_FUNCTIONS[key]:
        found = rule_math(_function_body(body, name))
        assert not found, f"{family}: {name} writes rule math itself: {found}"
    for call in CALLS[key]:
        assert re.search(rf"\b{call}\s*\(", body), f"{family} does not call {call}"


def test_every_shared_rule_is_used():
    from xferlib._kernels.rules import RULES_KERNEL

    defined = set(re.findall(r"\b(xf_\w+)\s*\(", RULES_KERNEL))
    called = set()
    for body in _family_bodies().values():
        called |= set(re.findall(r"\b(xf_\w+)\s*[<(]", body))
    helpers = {"xf_lerp", "xf_sq_avg", "xf_ema", "xf_max"}  # used inside the snippet
    assert defined - helpers <= called, defined - helpers - called


def test_the_rule_math_check_can_fail():
    """Lines each family had before the snippet: the check finds every one, and finds the
    snippet's own arithmetic."""
    from xferlib._kernels.rules import RULES_KERNEL

    copied = [
        "a[e] += (g[e] - a[e]) * (1.0f - c[1]);",                 # flat adam's first moment
        "b[e] = b[e] * c[2] + (1.0f - c[2]) * g[e] * g[e];",      # flat adam's second moment
        "p[e] -= c[0] * (a[e] / denom);",
        "b[e] = fmaxf(b[e] * c[2], fabsf(g[e]) + c[3]);",         # flat adamax
        "const T m = lerp_low(st[0], g, c[2]);",                  # host-table adam
        "w -= c[0] * g;",                                          # host-table sgd
        "w[o] -= lr * gg / (sqrtf(sum) + eps);",                   # TT adagrad
        "w[o] -= lr * g[o];",                                      # TT sgd
        "const float v = b2 * e2[o] + nb2 * gg * gg;",             # TT lamb
    ]
    for line in copied:
        assert rule_math(line), line
    assert not rule_math("p[e] -= old[e];  // the updates output")
    assert len(rule_math(RULES_KERNEL)) >= 10


def test_constants_come_from_the_rules():
    from xferlib.optim.rules import cuda_constants
    from xferlib._kernels.rules import RULES_KERNEL

    slots = max(len(r.slots) for r in RULES.values())
    assert cuda_constants() == f"#define XF_MAX_SLOTS {slots}\n"
    assert cuda_constants() in RULES_KERNEL
    table = _family_bodies()["table"]
    assert "XF_MAX_SLOTS" in table
    assert not re.search(r"\b(?:sv|st)\[\d\]\s*[;=]", table)  # no slot count written by hand


def test_one_optimizer_vocabulary():
    """Every family's optimizer names come from the one rule table, a name meaning one rule:
    the host tables', TT's and the flat step's lists are its parts (``Rule.families``)."""
    import xferlib
    import xferlib.tt
    from xferlib.optim.rules import FLAT, TABLE, TT, optimizers_for
    from xferlib.table.rules import _RULES
    from xferlib.tt.rules import LAZY_OPTIMIZERS, STATE_SLOTS

    assert set(xferlib.SPARSE_OPTIMIZERS) == set(optimizers_for(TABLE)) == set(_RULES)
    assert xferlib.tt.SPARSE_OPTIMIZERS == optimizers_for(TT) == tuple(STATE_SLOTS)
    assert set(LAZY_OPTIMIZERS) <= set(optimizers_for(TT))
    assert optim.OPTIMIZERS == optimizers_for(FLAT)
    assert {n for n, r in RULES.items() if r.flat} == set(optimizers_for(FLAT))
    for name in optimizers_for(TT):
        assert RULES[name].slots == tuple(s for s, _ in STATE_SLOTS[name]) or \
            RULES[name].kind in (OptId.SGD, OptId.ADAGRAD, OptId.ROWWISE_ADAGRAD), name
    with pytest.raises(ValueError, match="unknown kernel family"):
        optimizers_for("jax")


def test_no_other_optimizer_name_list():
    """No module writes a list of optimizer names of its own (three or more rule names in one
    literal): lists come from xferlib.optim.rules."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    allowed = {("xferlib/tt/rules.py", "LAZY_OPTIMIZERS")}  # TT's lazy subset, not a vocabulary
    found = []
    for path in sorted((root / "xferlib").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == "xferlib/optim/rules.py":
            continue
        tree = ast.parse(path.read_text())
        skip = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and ((rel, t.id) in allowed or t.id == "__all__")
                        for t in node.targets)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and id(node) not in skip:
                names = [e.value for e in node.elts if isinstance(e, ast.Constant)]
                if sum(isinstance(n, str) and n in RULES for n in names) >= 3:
                    found.append(f"{rel}:{node.lineno}")
    assert not found, found


def test_flat_scalars_are_named_records():
    """Each flat rule's scalars are one NamedTuple made by its scalars function; the kernel
    reads their columns by the names generated from the record's fields."""
    from xferlib._kernels.optim import OPTIM_MODULE
    from xferlib.optim.rule_rows import adam_hyper_defines, flat_scalar_defines
    from xferlib.optim.rules import SCALARS, resolve_hyper

    for name, rule in FLAT_RULES.items():
        record = rule.scalars(resolve_hyper(name), 3, {"mu_product": 1.0}, np)
        assert type(record) is rule.record, name
        assert len(record) <= SCALARS
        row = rule.row(record)
        assert len(row) == SCALARS and rule.read_row(np.asarray(row)) == record
        for k, field in enumerate(record._fields):
            prefix = OptId(rule.kind).name
            assert f"#define XF_{prefix}_{field.upper()} {k}\n" in flat_scalar_defines()
    source = OPTIM_MODULE.source
    assert flat_scalar_defines() in source and adam_hyper_defines() in source
    body = _function_body(source, "flat_scalars")
    assert set(re.findall(r"\bc\[(\w+)\]", body)) - {"0"} <= {
        line.split()[1] for line in flat_scalar_defines().splitlines()[2:]}
    assert not re.search(r"\bh\[\d", _function_body(source, "flat_adam_device_scalars"))


def test_moment_updates_written_once_per_language():
    """NumPy's first and second moments come from xferlib.optim.rules, jax.numpy's from the
    adapter's one helper: no rule writes `(g - m) * (1 - b)` or `(1 - b) * g + b * m` itself."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    for rel in ("xferlib/optim/rules.py", "xferlib/table/rules.py", "adapters/jax/optim.py"):
        text = (root / rel).read_text()
        lerps = re.findall(r"\+= *\(g - \w+\) \*|\+= *f\(1\.0 - \w+\) \* \(g - \w+\)", text)
        emas = re.findall(r"\(1(?:\.0)? - b\d\) \* g(?: \*\* 2)? \+ b\d \* \w+", text)
        assert len(lerps) <= 1 and len(emas) <= 1, (rel, lerps, emas)


def test_host_table_hyper_rows_are_named_records():
    """The host-table kernel's row of hyperparameters per rule is one record made by
    device_hyper, in the order the kernel has always read it, its columns generated."""
    from xferlib._kernels.table import TABLE_MODULE
    from xferlib.optim.rule_rows import adam_hyper_defines, device_hyper, hyper_defines
    from xferlib.table.rules import optimizer_defaults

    def old(name, h):  # the lists the table family wrote by hand before
        return {"sgd": lambda: [h["lr"], h["momentum"], h["dampening"], h["weight_decay"],
                                h["nesterov"], h["maximize"]],
                "adagrad": lambda: [h["lr"], h["lr_decay"], h["weight_decay"], h["eps"],
                                    h["maximize"]],
                "rowwise_adagrad": lambda: [h["lr"], h["weight_decay"], h["eps"], h["maximize"]],
                "adamax": lambda: [h["lr"], *h["betas"], h["eps"], h["weight_decay"],
                                   h["maximize"]],
                "rmsprop": lambda: [h["lr"], h["alpha"], h["eps"], h["weight_decay"],
                                    h["momentum"], h["centered"], h["maximize"]],
                "adadelta": lambda: [h["lr"], h["rho"], h["eps"], h["weight_decay"],
                                     h["maximize"]]}[name]()

    for name in ("sgd", "adagrad", "rowwise_adagrad", "adamax", "rmsprop", "adadelta"):
        h = dict(optimizer_defaults(name), lr=0.5, weight_decay=0.25, maximize=True)
        row = device_hyper(name, h)
        assert [float(v) for v in row] == [float(v) for v in old(name, h)], name
        for k, field in enumerate(row._fields):
            assert f"#define XF_H_{OptId(RULES[name].kind).name}_{field.upper()} {k}\n" \
                in hyper_defines()
    assert device_hyper("adamw", dict(optimizer_defaults("adamw"))).decoupled == 1.0
    source = TABLE_MODULE.source
    assert hyper_defines() in source and adam_hyper_defines() in source
    assert not re.search(r"\bh\[\d", _function_body(source, "row_consts"))
