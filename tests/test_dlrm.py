"""examples/dlrm.py in one process: the tiny preset learns (torch and JAX), a resumed run equals
an uninterrupted one, two runs save the same bits, bad input is refused before anything is
allocated or overwritten, the click log is a pure function of (seed, step) with the planted
structure, a finished run releases its tables, a checkpoint switches atomically, the profile
sorts kernels by kind. Runs over torchrun ranks and JAX devices: test_dlrm_sharded.py."""

import json
import os
import pathlib

import numpy as np
import pytest

from tests.dlrm_helpers import _ok, _run, import_parts, resumed_equals_full

REQUIRED_KEYS = {"framework", "preset", "steps", "samples_per_s", "auc", "oracle_auc", "logloss"}


@pytest.fixture(scope="module")
def parts():
    yield from import_parts()


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_tiny_preset_learns(framework, tmp_path):
    pytest.importorskip("torch")
    if framework == "jax":
        pytest.importorskip("optax")
    out = tmp_path / "run.json"
    _ok(_run("--framework", framework, "--device", "cpu", "--json", out))
    doc = json.loads(out.read_text())
    assert REQUIRED_KEYS <= set(doc)
    assert doc["framework"] == framework and doc["preset"] == "tiny" and doc["steps"] == 400
    assert doc["samples_per_s"] > 0
    assert 0.8 < doc["oracle_auc"] < 0.95  # the planted model is informative, not trivial
    assert doc["auc"] >= 0.5 + 0.8 * (doc["oracle_auc"] - 0.5), doc["runs"][0]["history"]
    assert doc["runs"][0]["history"][-1]["step"] == 400


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_resume_equals_uninterrupted(framework, tmp_path):
    pytest.importorskip("torch")
    if framework == "jax":
        pytest.importorskip("optax")
    common = ("--framework", framework, "--device", "cpu", "--eval-samples", 2048,
              "--evals", 1)
    _ok(_run(*common, "--steps", 24, "--json", tmp_path / "full.json"))
    _ok(_run(*common, "--steps", 12, "--save", tmp_path / "ckpt"))
    _ok(_run(*common, "--steps", 12, "--load", tmp_path / "ckpt", "--json",
             tmp_path / "resumed.json"))
    resumed = resumed_equals_full(tmp_path)
    # the resumed run's curve carries the first invocation's points
    assert [h["step"] for h in resumed["runs"][0]["history"]] == [12, 24]


def _saved_arrays(ckpt) -> dict:
    """Every array of a checkpoint's step directory (state file and host tables), by name."""
    import torch

    from dlrm_parts import checkpoint

    step, arrays = pathlib.Path(checkpoint.current(ckpt)), {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}", item)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(f"{prefix}.{i}", item)
        elif isinstance(value, torch.Tensor):
            arrays[prefix] = value.detach().cpu().numpy()
        else:
            arrays[prefix] = np.asarray(value)

    for file in sorted(step.iterdir()):
        if file.suffix == ".pt":
            walk(file.name, torch.load(file, map_location="cpu", weights_only=False))
        elif file.suffix == ".npz":
            with np.load(file) as z:
                arrays.update({f"{file.name}.{k}": z[k] for k in z.files})
        elif file.suffix == ".npy":
            arrays[file.name] = np.load(file)
    return arrays


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_two_runs_save_bitwise_identical_state(framework, device, tmp_path, parts):
    """Two runs of the tiny preset (same seed, same batches) end with the same bits in every
    weight and optimizer state: the MLPs, the flat optimizer, every embedding table (on a
    GPU with ``--deterministic``, for torch's and XLA's own reductions)."""
    torch = pytest.importorskip("torch")
    if framework == "jax":
        pytest.importorskip("optax")
    import xferlib

    if device == "cuda" and not (torch.cuda.is_available() and xferlib.cupy_available()):
        pytest.skip("needs a CUDA GPU with CuPy")
    common = ("--framework", framework, "--device", device, "--eval-samples", 1024,
              "--evals", 1, "--steps", 16) + (("--deterministic",) if device == "cuda" else ())
    for name in ("a", "b"):
        _ok(_run(*common, "--save", tmp_path / name))
    first, second = _saved_arrays(tmp_path / "a"), _saved_arrays(tmp_path / "b")
    assert sorted(first) == sorted(second) and len(first) > 10, sorted(first)
    for key, value in first.items():
        other = second[key]
        assert value.dtype == other.dtype and value.shape == other.shape, key
        # bytes compared, so NaNs in the same places also count as equal
        assert np.ascontiguousarray(value).tobytes() == np.ascontiguousarray(other).tobytes(), \
            f"{framework}: {key} differs between two runs"


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["auto", "hbm"])
def test_overlap_trains_the_same_bits_in_one_cuda_graph(placement, tmp_path, parts):
    """--overlap (the embeddings on a stream of their own, beside the dense model) changes
    where work runs, not what it computes: the same bits in every weight and state as the
    step without it (both --deterministic), and the overlapped step is still captured."""
    torch = pytest.importorskip("torch")
    import xferlib

    if not (torch.cuda.is_available() and xferlib.cupy_available()):
        pytest.skip("needs a CUDA GPU with CuPy")
    common = ("--device", "cuda", "--placement", placement, "--eval-samples", 1024,
              "--evals", 1, "--steps", 16, "--deterministic")
    for name, extra in (("plain", ()), ("overlap", ("--overlap",))):
        _ok(_run(*common, *extra, "--save", tmp_path / name, "--json",
                 tmp_path / f"{name}.json"))
        note = json.loads((tmp_path / f"{name}.json").read_text())["runs"][0]["notes"]
        assert note.startswith("whole step in one CUDA graph"), (name, note)
    plain, overlap = _saved_arrays(tmp_path / "plain"), _saved_arrays(tmp_path / "overlap")
    assert sorted(plain) == sorted(overlap) and len(plain) > 10
    for key, value in plain.items():
        assert np.ascontiguousarray(value).tobytes() == \
            np.ascontiguousarray(overlap[key]).tobytes(), f"{key} differs with --overlap"


def test_overlap_is_refused_for_jax():
    result = _run("--framework", "jax", "--overlap")
    assert result.returncode == 2 and "--overlap is for the torch model" in result.stderr


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_deterministic_flag_trains(framework, tmp_path):
    pytest.importorskip("torch")
    if framework == "jax":
        pytest.importorskip("optax")
    _ok(_run("--framework", framework, "--device", "cpu", "--steps", 4, "--evals", 1,
             "--eval-samples", 512, "--deterministic", "--json", tmp_path / "d.json"))


def test_unknown_preset_is_refused():
    r = _run("--preset", "huge")
    assert r.returncode == 2 and "unknown preset 'huge'" in r.stderr


def test_budget_smaller_than_hbm_tables_is_refused(tmp_path):
    out = tmp_path / "x.json"
    r = _run("--placement", "hbm", "--gpu-memory", "0.0001", "--json", out)
    assert r.returncode == 2 and "smaller than the tables placed in HBM" in r.stderr
    assert not out.exists()


def test_load_of_another_configuration_is_refused(tmp_path, parts):
    from dlrm_parts import checkpoint

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    plan = parts.config.plan_tables(parts.config.get_preset("tiny"), "auto", None)
    config = {"preset": "tiny", "framework": "torch", "placement": "auto",
              "tables": [t.where for t in plan.tables], "seed": 0}
    meta = {"format": checkpoint.FORMAT, "config": config, "step": 5, "history": []}
    (ckpt / "meta.json").write_text(json.dumps(meta))
    out = tmp_path / "x.json"
    r = _run("--placement", "host", "--load", ckpt, "--save", ckpt, "--json", out)
    assert r.returncode == 2 and "another configuration" in r.stderr
    assert "placement: checkpoint 'auto', this run 'host'" in r.stderr
    assert sorted(p.name for p in ckpt.iterdir()) == ["meta.json"]  # nothing overwritten
    assert json.loads((ckpt / "meta.json").read_text()) == meta and not out.exists()
    r = _run("--load", tmp_path / "missing")
    assert r.returncode == 2 and "not a checkpoint" in r.stderr


def test_host_ram_is_checked_before_allocating(parts):
    cfg = parts.config
    plan = cfg.plan_tables(cfg.get_preset("large"), "auto", 3.0)
    assert plan.bytes_host >= 4 * plan.budget_bytes  # the large preset's promise
    with pytest.raises(MemoryError, match="host tables need .* GB of pinned host RAM"):
        cfg.check_host_ram(plan, available=plan.bytes_host // 2)
    cfg.check_host_ram(plan, available=plan.bytes_host * 2)


def test_placement_respects_the_budget(parts):
    cfg = parts.config
    preset = cfg.get_preset("medium")
    plan = cfg.plan_tables(preset, "auto", 2.0)
    assert plan.bytes_hbm <= plan.budget_bytes // 2
    assert plan.bytes_hbm + plan.bytes_cache <= plan.budget_bytes
    hbm = [t.rows for t in plan.tables if t.where == "hbm"]
    host = [t.rows for t in plan.tables if t.where == "host"]
    assert host and max(hbm) <= min(host)  # the smallest tables stay in HBM
    assert all(0 < t.cache_rows <= t.rows for t in plan.tables if t.where == "host")
    tt = cfg.plan_tables(preset, "tt", None)
    assert all((t.where == "tt") == (t.rows >= preset.tt_min_rows) for t in tt.tables)
    with pytest.raises(ValueError, match="unknown placement"):
        cfg.plan_tables(preset, "disk", None)
    with pytest.raises(ValueError, match="positive number of GB"):
        cfg.plan_tables(preset, "auto", -1)


def test_click_log_is_a_pure_function_of_seed_and_step(parts):
    data = parts.data
    cards = [7, 1, 100, 1000] + [50] * 22
    log = data.ClickLog(cards, seed=3, pooling=2)
    a, b = log.batch(11, 64), log.batch(11, 64)
    for name in ("dense", "cat", "label", "logit"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(log.batch(12, 64).cat, a.cat)
    assert not np.array_equal(data.ClickLog(cards, seed=4, pooling=2).batch(11, 64).cat, a.cat)
    assert a.cat.shape == (26, 64, 2) and a.dense.shape == (64, 13)
    assert ((a.cat >= 0) & (a.cat < np.array(cards)[:, None, None])).all()
    assert (a.cat[1] == 0).all()  # a one-row table
    # Zipf popularity scattered by a permutation: the hottest row is common and not row 0
    rows = log.batch(0, 20000).cat[3].ravel()
    counts = np.bincount(rows, minlength=1000)
    assert counts.max() > 20 * counts.mean() and counts.argmax() != 0
    assert (counts > 0).sum() > 500


def test_initial_rows_do_not_depend_on_chunking(parts):
    init_rows = parts.data.init_rows
    whole = init_rows(0, 5, 0, 100, 8, 0.05)
    np.testing.assert_array_equal(np.concatenate([init_rows(0, 5, 0, 37, 8, 0.05),
                                                  init_rows(0, 5, 37, 100, 8, 0.05)]), whole)
    assert np.abs(whole).max() <= 0.05 and whole.std() > 0.02


def test_rank_auc_matches_scikit_learn(parts, rng):
    from dlrm_parts.metrics import rank_auc

    sklearn_metrics = pytest.importorskip("sklearn.metrics")
    labels = rng.random(5000) < 0.3
    scores = np.round(rng.standard_normal(5000) + labels, 1)  # many ties
    assert rank_auc(labels, scores) == pytest.approx(
        sklearn_metrics.roc_auc_score(labels, scores), abs=1e-12)


@pytest.mark.gpu
def test_click_log_is_the_same_on_gpu_and_cpu(parts):
    import cupy

    log = parts.data.ClickLog(parts.config.get_preset("tiny").cardinalities, seed=1, pooling=3)
    cpu, gpu = log.batch(5, 512, np), log.batch(5, 512, cupy)
    np.testing.assert_array_equal(cpu.cat, gpu.cat.get())
    np.testing.assert_allclose(cpu.dense, gpu.dense.get(), rtol=1e-5, atol=1e-5)
    assert (cpu.label != gpu.label.get()).mean() < 0.01  # float rounding at the threshold


@pytest.mark.gpu
def test_click_log_gpu_kernels_give_the_array_operations_bits(parts):
    """The GPU's one-kernel hashes and rows equal the array operations run on CuPy, bit for
    bit (no FMA contraction, the same float functions)."""
    import cupy

    d = parts.data
    rng = np.random.default_rng(0)
    counters = cupy.asarray(rng.integers(0, 2**63, (4, 50_000), dtype=np.uint64))
    keys = cupy.asarray(rng.integers(0, 2**63, (4, 1), dtype=np.uint64))
    for fast, ops in ((d.hash_uniform, d.uniform_ops), (d.hash_normal, d.normal_ops)):
        np.testing.assert_array_equal(fast(keys, counters, cupy).get(),
                                      ops(keys, counters, cupy).get())
    log = d.ClickLog([7, 1, 100, 1000, 2_000_000] + [50] * 21, seed=2, pooling=3)
    rows = log.batches(3, 2, 4096, cupy).cat
    c = log._on(cupy)
    step_keys = log._keys([3, 4], 0, d._CAT, cupy)[:, None, None, None]
    F, B, L = len(log.cardinalities), 4096, 3
    counters = (cupy.arange(F, dtype=cupy.uint64)[:, None, None] * np.uint64(B * L)
                + cupy.arange(B * L, dtype=cupy.uint64).reshape(1, B, L))
    f = {k: c[k][:, None, None] for k in ("span", "n", "a", "b")}
    expected = d.rank_rows_ops(d.uniform_ops(step_keys, counters, cupy), f["span"], f["n"],
                               f["a"], f["b"], log.alpha, cupy)
    np.testing.assert_array_equal(rows.get(), expected.get())


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_short_gpu_run(framework, tmp_path):
    out = tmp_path / "run.json"
    _ok(_run("--framework", framework, "--device", "cuda", "--steps", 60, "--evals", 1,
             "--compare", "--json", out))
    doc = json.loads(out.read_text())
    runs = {r["framework"]: r for r in doc["runs"]}
    assert runs[framework]["peak_gpu_bytes"] > 0 and runs[framework]["device"] == "cuda"
    assert runs[framework]["auc"] > 0.6 and "torch-baseline" in runs
    # same initial values and data: the curves agree closely after 60 steps
    assert abs(runs[framework]["auc"] - runs["torch-baseline"]["auc"]) < 0.02


def test_a_finished_run_releases_its_tables_before_the_next_run(parts, monkeypatch):
    """The large preset's baseline crashed in a CuPy malloc (cudaErrorAlreadyMapped) after
    the xferlib run: that run's pinned host tables (cudaHostRegister'ed, mapped into the
    GPU's address space) were still alive and registered when the baseline allocated. A run
    is now closed before the next starts: its host buffer is unpinned at once and nothing
    keeps its tables alive."""
    import gc
    import weakref

    pytest.importorskip("torch")
    import xferlib
    from dlrm_parts import torch_run

    preset = parts.config.get_preset("tiny")
    plan = parts.config.plan_tables(preset, "auto", None)
    run = torch_run.TorchRun(preset, plan, 0, "cpu")
    core = run.model.embeddings.collection.collection
    host = core.buffers["host"]
    unpinned = []
    # on a GPU machine the buffer is pinned; here pretend it is, and see close() unpin it
    monkeypatch.setattr(xferlib, "is_pinned", lambda a: a is host)
    monkeypatch.setattr(xferlib, "unpin", lambda a: unpinned.append(a))
    alive = weakref.ref(core)
    del core
    run.close()
    assert len(unpinned) == 1 and unpinned[0] is host
    host = unpinned = None  # the lambdas above close over these names: drop what they hold
    gc.collect()
    assert alive() is None and run.model is None


def test_checkpoint_switch_is_atomic(tmp_path, monkeypatch, parts):
    """A save that dies before its LATEST pointer is replaced leaves the previous checkpoint
    the one that loads; a complete save switches to the new one and removes the old step."""
    import xferlib
    from dlrm_parts import checkpoint

    class FakeRun:
        def __init__(self, value):
            self.value = value

        def save_state(self, path):
            with open(path, "w") as fh:
                fh.write(self.value)

        def host_tables(self):
            return {}

    config = {"preset": "tiny"}
    ckpt = tmp_path / "ckpt"
    checkpoint.save(ckpt, FakeRun("one"), "torch", config, 1, [])
    assert checkpoint.read_meta(ckpt, config)["step"] == 1

    def dies(*args, **kwargs):
        raise KeyboardInterrupt("killed before the switch")

    monkeypatch.setattr(xferlib, "atomic_write", dies)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(ckpt, FakeRun("two"), "torch", config, 2, [])
    monkeypatch.undo()
    assert checkpoint.read_meta(ckpt, config)["step"] == 1
    assert open(os.path.join(checkpoint.current(ckpt), "state.pt")).read() == "one"
    checkpoint.save(ckpt, FakeRun("two"), "torch", config, 2, [])
    assert checkpoint.read_meta(ckpt, config)["step"] == 2
    assert open(os.path.join(checkpoint.current(ckpt), "state.pt")).read() == "two"
    assert sorted(p.name for p in ckpt.iterdir()) == ["LATEST", "step-000000002"]


def test_kernel_kinds_sort_kernels_by_name(parts):
    import dlrm_parts.metrics as metrics

    kernels = [("ncclDevKernel_AllReduce_Sum_f32", 30.0), ("coll_pool<float>", 100.0),
               ("sm90_xmma_gemm_f32f32", 50.0),
               ("void cub::CUB_300001_SM_900::detail::radix_sort::DeviceRadixSortOnesweepKernel"
                "<...>(...)", 20.0),
               ("Memcpy DtoD (Device -> Device)", 10.0), ("vectorized_elementwise_kernel", 40.0),
               ("void fbgemm_gpu::split_embedding_codegen_forward_kernel<float>(int)", 70.0),
               ("cache_insert<4, float>", 5.0), ("void doti_bwd<float, 4, 8>(...)", 6.0),
               ("void radix_pass<long long>(...)", 7.0), ("bounds_check_indices_kernel_v1", 8.0)]
    kinds = metrics.kernel_kinds(kernels * 2, steps=2)
    assert kinds["collectives (NCCL)"] == pytest.approx(0.030)
    # FBGEMM's input check with its kernels, not a matmul
    assert kinds["embedding kernels (FBGEMM TBE)"] == pytest.approx(0.078)
    # the collection's own sort with its kernels; CUB's (FBGEMM's, torch's) a sort
    assert kinds["embedding kernels (xferlib)"] == pytest.approx(0.112)
    assert kinds["matmuls"] == pytest.approx(0.050)
    assert kinds["sorts and scans (torch / CUB)"] == pytest.approx(0.020)
    assert kinds["copies and fills"] == pytest.approx(0.010)
    assert kinds["other kernels"] == pytest.approx(0.040)
    assert kinds["dot interaction (xferlib)"] == pytest.approx(0.006)
    # either engine's kernels with the sorts: FBGEMM's is CUB's
    assert kinds[metrics.EMBEDDING_PART] == pytest.approx(0.078 + 0.112 + 0.020)
    assert kinds["kernels per step"] == 11
    top = metrics.top_kernels(kernels * 2, steps=2, count=2)
    assert top == [["coll_pool", pytest.approx(0.100), 1.0],
                   ["fbgemm_gpu::split_embedding_codegen_forward_kernel",
                    pytest.approx(0.070), 1.0]]


def test_fbgemm_pair_lines_compare_samples_and_embedding_parts(parts):
    import dlrm_parts.metrics as metrics

    def run(name, engine, optimizer, samples, auc, part=None):
        r = dict(name=name, engine=engine, optimizer=optimizer, samples_per_s=samples, auc=auc,
                 notes="whole step in one CUDA graph")
        if part is not None:
            r["profile_replay_ms"] = {metrics.EMBEDDING_PART: part}
        return r

    results = [run("xferlib (hbm)", "xferlib", "adagrad", 12e6, 0.81),
               run("xferlib (hbm, rowwise_adagrad)", "xferlib", "rowwise_adagrad", 15e6, 0.80,
                   0.30),
               run("FBGEMM TBE (hbm, rowwise_adagrad)", "fbgemm", "rowwise_adagrad", 12e6,
                   0.81, 0.45)]
    lines = metrics.fbgemm_pair_lines(results)
    assert len(lines) == 2
    assert lines[0].startswith("xferlib (hbm, rowwise_adagrad): 1.25x FBGEMM TBE")
    assert lines[0].endswith("AUC -0.0100")
    assert lines[1].endswith("embedding part 0.300 ms per replayed step against 0.450 "
                             "(FBGEMM TBE (hbm, rowwise_adagrad)): 1.50x")
    del results[2]["profile_replay_ms"]  # not profiled: no embedding-part line
    assert len(metrics.fbgemm_pair_lines(results)) == 1
    assert metrics.fbgemm_pair_lines(results[:1] + results[2:]) == []  # no row-wise run


@pytest.mark.gpu
def test_profile_shows_the_replayed_steps_kernels(tmp_path):
    out = tmp_path / "run.json"
    result = _ok(_run("--device", "cuda", "--steps", 30, "--evals", 1, "--profile", "--json",
                      out))
    run = json.loads(out.read_text())["runs"][0]
    kinds = run["profile_replay_ms"]
    assert kinds["embedding kernels (xferlib)"] > 0 and kinds["matmuls"] > 0
    assert kinds["kernels per step"] > 10 and kinds["replayed step (events, profiler on)"] > 0
    assert "replayed step's kernels" in result.stdout
