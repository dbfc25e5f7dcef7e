"""Flat optimizers against torch.optim (and optax for lion): 100 float32 steps, two groups,
segments that miss a gradient now and then, a state copy-and-restore in the middle."""

import copy

import numpy as np
import pytest

from xferlib import optim
from xferlib.testing import assert_outputs_match, for_each_backend, reference_check

torch = pytest.importorskip("torch")

SHAPES = [(7, 3), (5,), (4, 4, 2), (1,), (33,)]
GROUPS = [0, 1, 0, 1, 1]

TORCH_CASES = [
    ("sgd", torch.optim.SGD, dict(lr=0.05)),
    ("sgd", torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    ("sgd", torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, maximize=True)),
    ("adam", torch.optim.Adam, dict(lr=1e-2)),
    ("adam", torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    ("adam", torch.optim.Adam, dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, maximize=True)),
    ("adamw", torch.optim.AdamW, dict(lr=1e-2)),
    ("adamw", torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.3, amsgrad=True)),
    ("adagrad", torch.optim.Adagrad, dict(lr=0.1)),
    ("adagrad", torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.01, weight_decay=0.01,
                                          initial_accumulator_value=0.5)),
    ("rmsprop", torch.optim.RMSprop, dict(lr=1e-2)),
    ("rmsprop", torch.optim.RMSprop, dict(lr=1e-2, momentum=0.5, centered=True,
                                          weight_decay=0.01)),
    ("adamax", torch.optim.Adamax, dict(lr=1e-2, weight_decay=0.01)),
    ("nadam", torch.optim.NAdam, dict(lr=1e-2)),
    ("nadam", torch.optim.NAdam, dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)),
    ("radam", torch.optim.RAdam, dict(lr=1e-2, weight_decay=0.1)),
    ("radam", torch.optim.RAdam, dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)),
]


def _ids():
    return [f"{name}-{'-'.join(f'{k}={v}' for k, v in kw.items())}" for name, _, kw in TORCH_CASES]


def _steps(rng, layout, count, skip=0.15, inactive_grads=False):
    """``count`` steps of (active flags as a tuple of bools, packed gradients). An inactive
    segment's gradient is zero, or with ``inactive_grads`` random too (the step must ignore
    it)."""
    steps = []
    for _ in range(count):
        active = rng.random(len(layout.segments)) > skip
        grads = layout.pack([rng.standard_normal(seg.shape).astype(np.float32)
                             if on or inactive_grads else np.zeros(seg.shape, np.float32)
                             for seg, on in zip(layout.segments, active)])
        steps.append((tuple(bool(a) for a in active), grads))
    return steps


@pytest.mark.parametrize("name,torch_cls,kwargs", TORCH_CASES, ids=_ids())
@for_each_backend("numpy", "cupy")
def test_matches_torch_over_100_steps(backend, name, torch_cls, kwargs):
    rng = np.random.default_rng(0)
    init = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    layout = optim.FlatLayout.from_shapes(SHAPES, GROUPS)
    lr2 = kwargs["lr"] * 0.5

    def flat(params, steps):
        opt = getattr(optim, name)(**kwargs)
        hypers = [opt.defaults, {**opt.defaults, "lr": lr2}]
        state = opt.init(layout, hypers, xp=backend.xp)
        for step, (active, grads) in enumerate(steps):
            state = opt.update(layout, params, grads, state, hypers, active=np.array(active))
            if step == 50:  # restore from a copy: nothing may live outside the state
                state = copy.deepcopy(state)
        return layout.views(params)

    def torch_reference(params, steps):
        tparams = [torch.tensor(a, requires_grad=True) for a in init]
        groups = [{"params": [p for p, g in zip(tparams, GROUPS) if g == 0]},
                  {"params": [p for p, g in zip(tparams, GROUPS) if g == 1], "lr": lr2}]
        topt = torch_cls(groups, **kwargs)
        for active, grads in steps:
            for p, on, g in zip(tparams, active, layout.views(grads)):
                p.grad = torch.tensor(g.copy()) if on else None
            topt.step()
        return [p.detach().numpy() for p in tparams]

    # The CUDA kernel rounds in another order than torch's CPU loops (fused multiply-adds).
    rtol, atol = (5e-5, 5e-6) if backend.gpu else (1e-6, 1e-6)
    reference_check(backend, flat, torch_reference, layout.pack(init), _steps(rng, layout, 100),
                    rtol=rtol, atol=atol)


def test_lion_matches_optax():
    optax = pytest.importorskip("optax")
    import jax.numpy as jnp

    rng = np.random.default_rng(1)
    layout = optim.FlatLayout.from_shapes(SHAPES)
    init = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    tx = optax.lion(learning_rate=1e-2, weight_decay=0.1)
    jparams = [jnp.asarray(a) for a in init]
    jstate = tx.init(jparams)
    opt = optim.lion(learning_rate=1e-2, weight_decay=0.1)
    params = layout.pack(init)
    state = opt.init(layout)
    for _ in range(100):
        grads_list = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
        updates, jstate = tx.update([jnp.asarray(g) for g in grads_list], jstate, jparams)
        jparams = optax.apply_updates(jparams, updates)
        state = opt.update(layout, params, layout.pack(grads_list), state)
    for view, p in zip(layout.views(params), jparams):
        np.testing.assert_allclose(view, np.asarray(p), rtol=1e-6, atol=1e-6)


def test_layout_alignment_and_views():
    layout = optim.FlatLayout.from_shapes([(3,), (2, 2), (5,)], [0, 0, 1])
    assert [s.offset for s in layout.segments] == [0, 4, 8]
    assert layout.total == 16 and layout.num_groups == 2
    flat = layout.pack([np.ones(3), np.full((2, 2), 2.0), np.full(5, 3.0)])
    assert flat[3] == 0 and flat[13] == 0  # padding stays zero
    views = layout.views(flat)
    views[1][0, 0] = 9.0
    assert flat[4] == 9.0
    with pytest.raises(ValueError, match="16 elements"):
        layout.views(np.zeros(10, np.float32))


@pytest.mark.parametrize("name,bad,match", [
    ("adam", dict(lr=-1.0), "Invalid learning rate"),
    ("adam", dict(betas=(1.0, 0.9)), "beta parameter at index 0"),
    ("adamw", dict(betas=(0.9, -0.1)), "beta parameter at index 1"),
    ("sgd", dict(nesterov=True), "Nesterov"),
    ("rmsprop", dict(alpha=-1.0), "alpha"),
    ("adam", dict(foo=1), "unknown hyperparameter"),
    ("adagrad", dict(eps=-1.0), "epsilon"),
    ("adam", dict(eps=float("nan")), "epsilon"),  # every updated row would turn NaN
    ("adamw", dict(weight_decay=float("nan")), "weight_decay"),
])
def test_bad_hyperparameters(name, bad, match):
    with pytest.raises(ValueError, match=match):
        getattr(optim, name)(**bad)


def test_global_norm_and_clip():
    g = np.array([3.0, 4.0, 0.0], np.float32)
    assert optim.global_norm(g) == pytest.approx(5.0)
    assert optim.global_norm(g, float("inf")) == pytest.approx(4.0)
    assert optim.clip_coefficient(5.0, 1.0) == pytest.approx(1.0 / (5.0 + 1e-6))
    assert optim.clip_coefficient(0.5, 1.0) == 1.0


@pytest.mark.parametrize("norm_type", [0.0, -2.0, float("-inf"), float("nan")])
def test_norm_types_that_are_no_norms_are_refused(norm_type):
    # 0 divided by zero (1 / p); -inf and negative ones returned a silent 1.0 or 0.0
    g = np.array([3.0, 4.0, 0.0], np.float32)
    for call in (lambda: optim.global_norm(g, norm_type),
                 lambda: optim.partial_norm(g, norm_type),
                 lambda: optim.clip_by_global_norm([g], 1.0, norm_type)):
        with pytest.raises(ValueError, match="norm_type"):
            call()
    np.testing.assert_array_equal(g, [3.0, 4.0, 0.0])


GPU_CASES = [(name, kw) for name, _, kw in TORCH_CASES] + [("lion", dict(learning_rate=1e-2,
                                                                          weight_decay=0.1))]


@pytest.mark.parametrize("name,kwargs", GPU_CASES, ids=[f"{n}-{i}" for i, (n, _) in
                                                         enumerate(GPU_CASES)])
@for_each_backend("cupy")
def test_cuda_kernel_matches_numpy_path(backend, name, kwargs):
    """30 steps of the CUDA kernel against the NumPy path: parameters and every piece of state
    (buffers, step counters, host scalars)."""
    shapes = SHAPES + [(300, 257), (8193,)]
    groups = GROUPS + [0, 1]
    rng = np.random.default_rng(3)
    layout = optim.FlatLayout.from_shapes(shapes, groups)
    opt = getattr(optim, name)(**kwargs)
    lr_key = "learning_rate" if name == "lion" else "lr"
    hypers = [opt.defaults, {**opt.defaults, lr_key: opt.defaults[lr_key] * 0.5}]

    def run(params, steps, xp):
        state = opt.init(layout, hypers, xp=xp)
        for active, grads in steps:
            opt.update(layout, params, grads, state, hypers, active=np.array(active))
        return {"params": params, "buffers": state.buffers, "steps": state.steps,
                "scalars": state.scalars}

    params = layout.pack([rng.standard_normal(s).astype(np.float32) for s in shapes])
    steps = _steps(rng, layout, 30, skip=0.2, inactive_grads=True)
    reference_check(backend, lambda p, s: run(p, s, backend.xp), lambda p, s: run(p, s, np),
                    params, steps, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
@for_each_backend("numpy", "cupy")
def test_mixed_precision_master_weights(backend, low):
    import ml_dtypes

    xp = backend.xp
    low_dtype = np.dtype(ml_dtypes.bfloat16) if low == "bfloat16" else np.dtype(np.float16)
    rng = np.random.default_rng(5)
    layout = optim.FlatLayout.from_shapes(SHAPES)
    master0 = layout.pack([rng.standard_normal(s).astype(np.float32) for s in SHAPES])
    tparams = [torch.tensor(v.copy(), requires_grad=True) for v in layout.views(master0)]
    topt = torch.optim.AdamW(tparams, lr=1e-2, weight_decay=0.1)
    opt = optim.adamw(lr=1e-2, weight_decay=0.1)
    master = xp.asarray(master0)
    lowp = xp.asarray(master0.astype(low_dtype))
    state = opt.init(layout, xp=xp)
    for _ in range(30):
        grads = layout.pack([rng.standard_normal(s).astype(np.float32) for s in SHAPES])
        grads_low = grads.astype(low_dtype)
        for p, g in zip(tparams, layout.views(grads_low.astype(np.float32))):
            p.grad = torch.tensor(g.copy())
        topt.step()
        opt.update(layout, master, xp.asarray(grads_low), state, params_lowp=lowp)
    host_master, host_lowp = backend.get((master, lowp))
    assert_outputs_match(layout.views(host_master), [p.detach().numpy() for p in tparams],
                         rtol=2e-5, atol=2e-6, what="master weights")
    np.testing.assert_array_equal(host_lowp, host_master.astype(low_dtype))


@pytest.mark.parametrize("name", ["adam", "nadam", "sgd"])
@pytest.mark.parametrize("groups", [None, GROUPS])
def test_fill_step_table_equals_step_scalars(name, groups):
    """The table the eager GPU step writes into pinned staging memory (float32, no per-step
    allocation in the common case) is step_scalars' table, and advances the same state, on
    uniform steps and on steps where some segments have no gradient."""
    layout = optim.FlatLayout.from_shapes(SHAPES, groups)
    opt = getattr(optim, name)(lr=1e-2, **({"momentum": 0.9} if name == "sgd" else {}))
    hypers = [dict(opt.defaults), dict(opt.defaults, lr=3e-3)]
    rule = optim.FLAT_RULES[name]
    ours, ref = opt.init(layout), opt.init(layout)
    out = np.full((len(SHAPES), optim.COMMON + optim.SCALARS), np.nan, dtype=np.float32)
    actives = [np.ones(len(SHAPES), bool)] * 2 + [np.array([1, 0, 1, 1, 0], bool)] + \
        [np.ones(len(SHAPES), bool)] * 2
    for active in actives:
        optim.fill_step_table(rule, layout, ours, hypers, active, out)
        table = optim.step_scalars(rule, layout, ref, hypers, active)
        np.testing.assert_array_equal(out, table.astype(np.float32))
        np.testing.assert_array_equal(ours.steps, ref.steps)
        for key in ref.scalars:
            np.testing.assert_array_equal(ours.scalars[key], ref.scalars[key])
    assert list(ours.steps) == [5, 4, 5, 5, 4]
