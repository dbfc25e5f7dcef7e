"""examples/dlrm.py over several ranks or devices: a rank's part of the click log is its slice
of the global batch, torchrun ranks train the model one process trains, --plan prints where
each table lives, each rank keeps to its own GPU, JAX's --devices N equals one device and its
checkpoints move between device counts or are refused up front."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.dlrm_helpers import EXAMPLES, SCRIPT, _ok, _run, import_parts, resumed_equals_full


@pytest.fixture(scope="module")
def parts():
    yield from import_parts()


def test_a_ranks_part_is_its_slice_of_the_global_batch(parts):
    log = parts.data.ClickLog([7, 1, 100, 1000] + [50] * 22, seed=3, pooling=2)
    whole = log.batch(5, 12)
    for rank in range(3):
        part = log.batch(5, 12, part=(rank, 3))
        share = slice(4 * rank, 4 * rank + 4)
        np.testing.assert_array_equal(part.cat, whole.cat[:, share])
        for name in ("dense", "label", "logit"):
            np.testing.assert_array_equal(getattr(part, name), getattr(whole, name)[share])
    chunk = log.batches(5, 2, 12)  # several steps at once, as the training loop makes them
    for rank in range(3):
        part = log.batches(5, 2, 12, part=(rank, 3))
        share = slice(4 * rank, 4 * rank + 4)
        np.testing.assert_array_equal(part.cat, chunk.cat[:, :, share])
        for name in ("dense", "label", "logit"):
            np.testing.assert_array_equal(getattr(part, name), getattr(chunk, name)[:, share])
    with pytest.raises(ValueError, match="divisible"):
        log.batch(5, 10, part=(0, 3))
    with pytest.raises(ValueError, match="rank"):
        log.batch(5, 12, part=(3, 3))


def _torchrun(nproc, *args, timeout=300):
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc_per_node={nproc}", str(SCRIPT), "--quiet",
                           *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env=env)


@pytest.mark.slow
@pytest.mark.parametrize("placement,nproc,row_wise", [("auto", 2, ""), ("hbm", 3, "t2,t9")])
def test_ranks_equal_one_process_on_the_global_batch(placement, nproc, row_wise, tmp_path):
    """torchrun (gloo) shards the collection over the ranks (each rank holds its shards
    only and looks up its own samples; table-wise, and row-wise for the named tables) and
    trains the model one process trains on the same global batch: at every evaluation
    point the held-out logloss and AUC, functions of every weight, agree to float32
    rounding (the dense gradients are summed over the ranks in another order)."""
    pytest.importorskip("torch")
    args = ("--device", "cpu", "--placement", placement, "--steps", 12, "--evals", 2,
            "--batch-size", 384, "--eval-samples", 2048)
    one, many = tmp_path / "one.json", tmp_path / "many.json"
    _ok(_run(*args, "--json", one))
    result = _ok(_torchrun(nproc, *args, "--row-wise", row_wise, "--json", many))
    assert f"sharding plan over {nproc} ranks" in result.stdout
    for name in row_wise.split(",") if row_wise else []:
        assert f"  {name}: " in result.stdout and "row_wise" in result.stdout
    a, b = json.loads(one.read_text()), json.loads(many.read_text())
    run = b["runs"][0]
    assert run["ranks"] == nproc and run["batch_size"] == 384
    assert "sharded over" in run["notes"]
    assert [h["step"] for h in run["history"]] == [6, 12]
    for x, y in zip(a["runs"][0]["history"], run["history"]):
        assert y["logloss"] == pytest.approx(x["logloss"], rel=1e-6), (x, y)
        assert y["auc"] == pytest.approx(x["auc"], abs=1e-5), (x, y)


def _plan(*args, env=None):
    full = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, str(SCRIPT), "--plan", *map(str, args)],
                          capture_output=True, text=True, timeout=120, env=full)


def test_plan_prints_where_each_table_lives():
    """--plan: every table on a rank with its bytes, each rank's share of the expected
    lookups; torchrun's WORLD_SIZE or --world-size; only rank 0 speaks; exits 0."""
    out = _ok(_plan("--world-size", 3, "--row-wise", "t2")).stdout
    assert "sharding plan over 3 ranks" in out
    assert "t2: 3000 x 16 host, row_wise" in out and "rank 2 rows 2000:3000" in out
    assert all(f"  t{k}: " in out for k in range(26))
    shares = [float(line.split("%")[0].rsplit(" ", 1)[1]) for line in out.splitlines()
              if line.startswith("  rank ")]
    assert len(shares) == 3 and abs(sum(shares) - 100) < 0.2 and min(shares) > 25
    out = _ok(_plan(env={"WORLD_SIZE": "2", "RANK": "0"})).stdout
    assert "sharding plan over 2 ranks" in out
    assert _ok(_plan(env={"WORLD_SIZE": "2", "RANK": "1"})).stdout == ""
    assert "no sharding plan" in _ok(_plan("--placement", "tt", "--world-size", 2)).stdout
    bad = _plan("--world-size", 2, "--row-wise", "t99")
    assert bad.returncode == 2 and "unknown tables ['t99']" in bad.stderr


def test_expected_lookups_follow_the_click_logs_zipf_law(parts):
    """The plan's lookup weights: pooling x (1 + the distinct fraction of a batch's draws),
    the fraction as the click log draws it."""
    from dlrm_parts import sharding

    cards, B, pooling = [4, 300, 3000, 50_000], 4096, 2
    log = parts.data.ClickLog(cards + [5] * 22, seed=0, pooling=pooling)
    batch = log.batch(3, B)
    for t, n in enumerate(cards):
        seen = len(np.unique(batch.cat[t])) / (B * pooling)
        assert sharding.distinct_fraction(n, B * pooling) == pytest.approx(seen, abs=0.02)
    weights = sharding.expected_lookups(cards, pooling, B)
    assert weights == sorted(weights) and pooling < weights[0] and weights[-1] < 2 * pooling
    big = sharding.distinct_fraction(40_000_000, 16384)  # exact head, approximated tail
    assert 0.5 < big < 1.0


def test_a_rank_picks_its_own_gpu(parts):
    """Each rank's GPU is its LOCAL_RANK's, never a default 0; more ranks than GPUs is
    refused (two ranks on one GPU)."""
    from dlrm_parts import dist

    assert dist.local_gpu({"LOCAL_RANK": "1", "RANK": "5"}, 2) == 1
    assert dist.local_gpu({"RANK": "1"}, 2) == 1
    assert dist.local_gpu({}, 1) == 0
    with pytest.raises(ValueError, match="local rank 2 has no GPU of its own"):
        dist.local_gpu({"LOCAL_RANK": "2"}, 2)


def test_freeing_memory_touches_only_this_ranks_gpu(parts, monkeypatch):
    """The crash of issue 29: torch.cuda.empty_cache() in _free() raised "CUDA-capable
    device(s) is/are busy or unavailable" on a torchrun rank (it walks every GPU torch
    knows). A rank among several never calls it, and frees CuPy's pool of its own GPU."""
    import contextlib
    import types

    torch = pytest.importorskip("torch")
    from dlrm_parts import dist

    touched = []

    def empty_cache():
        touched.append(("torch empty_cache", torch.cuda.current_device_seen))

    @contextlib.contextmanager
    def torch_device(d):
        torch.cuda.current_device_seen = str(d)
        yield

    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "device", torch_device)
    monkeypatch.setattr(torch.cuda, "current_device_seen", None, raising=False)

    class FakeDevice:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            touched.append(("cupy device", self.index))

        def __exit__(self, *exc):
            return False

    pool = types.SimpleNamespace(free_all_blocks=lambda: touched.append(("cupy free",)))
    cupy = types.SimpleNamespace(
        cuda=types.SimpleNamespace(Device=FakeDevice, runtime=types.SimpleNamespace(
            getDevice=lambda: 0)), get_default_memory_pool=lambda: pool)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    dist.free_gpu_memory(dist.Ranks(rank=1, world=2, local_rank=1), "cuda:1")
    assert touched == [("cupy device", 1), ("cupy free",)]
    touched.clear()
    dist.free_gpu_memory(dist.Ranks(), "cuda:0")
    assert touched == [("torch empty_cache", "cuda:0"), ("cupy device", 0), ("cupy free",)]
    touched.clear()
    dist.free_gpu_memory(dist.Ranks(), "cpu")
    assert touched == []


_CONTEXT_PROBE = """
import json, os, subprocess, sys
sys.path.insert(0, {examples!r})
import dlrm
rc = dlrm.main(sys.argv[1:])
import cupy
own = cupy.cuda.Device(int(os.environ["LOCAL_RANK"])).pci_bus_id
try:
    apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_bus_id",
                           "--format=csv,noheader"], capture_output=True, text=True).stdout
except OSError:  # no nvidia-smi: the test skips
    apps = ""
mine = [line.split(",")[1].strip() for line in apps.splitlines()
        if line.split(",")[0].strip() == str(os.getpid())]
with open(os.path.join({out!r}, "rank%s.json" % os.environ["RANK"]), "w") as f:
    json.dump(dict(rc=rc, own=own, contexts=mine), f)
sys.exit(rc)
"""


def _bus(text):  # nvidia-smi writes 00000000:18:00.0, CUDA 0000:18:00.0
    return text.split(":", 1)[1].lower()


@pytest.mark.gpu
def test_each_rank_creates_contexts_on_its_own_gpu_only(tmp_path):
    """torchrun on two GPUs: after training (and freeing memory between runs), each rank's
    process holds a CUDA context on its own GPU and on no other (nvidia-smi's list of
    compute processes; a rank touching GPU 0 from rank 1 would show there)."""
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    probe = tmp_path / "probe.py"
    probe.write_text(_CONTEXT_PROBE.format(examples=str(EXAMPLES), out=str(tmp_path)))
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc_per_node=2", str(probe), "--quiet", "--device", "cuda",
                             "--steps", "20", "--evals", "1", "--eval-samples", "4096"],
                            capture_output=True, text=True, timeout=600, env=env)
    _ok(result)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    if not any(r["contexts"] for r in reports):
        pytest.skip("nvidia-smi lists no compute process of these pids (another PID "
                    "namespace): cannot see which GPUs the ranks opened")
    for rank, report in enumerate(reports):
        assert report["rc"] == 0
        assert {_bus(c) for c in report["contexts"]} == {_bus(report["own"])}, (rank, report)


@pytest.mark.gpu
def test_two_ranks_overlapped_train_what_they_train_without(tmp_path):
    """torchrun on two GPUs (NCCL, each rank's step in one CUDA graph): with --overlap the
    exchange and the embeddings' update run beside the dense model and its all-reduce, and
    the held-out logloss and AUC equal those of the run without, to the last digit."""
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    docs = []
    for name, extra in (("plain", ()), ("overlap", ("--overlap",))):
        out = tmp_path / f"{name}.json"
        _ok(_torchrun(2, "--device", "cuda", "--steps", 30, "--evals", 1, "--eval-samples",
                      4096, "--deterministic", "--json", out, *extra))
        docs.append(json.loads(out.read_text())["runs"][0])
    plain, overlap = docs
    assert "one CUDA graph" in overlap["notes"], overlap["notes"]
    assert overlap["logloss"] == plain["logloss"] and overlap["auc"] == plain["auc"]


def test_torchrun_refuses_what_runs_in_one_process():
    env = dict(os.environ, WORLD_SIZE="2", RANK="0", LOCAL_RANK="0")
    result = subprocess.run([sys.executable, str(SCRIPT), "--quiet", "--compare"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2 and "one process" in result.stderr


def test_jax_sharded_profile_times_the_host_side(tmp_path):
    """--profile of a sharded JAX run (one jitted step): the host time to dispatch a step,
    the collection's callbacks, the step queued and waited for; every figure measured."""
    pytest.importorskip("optax")
    out = tmp_path / "p.json"
    _ok(_run("--framework", "jax", "--device", "cpu", "--devices", 2, "--steps", 3,
             "--batch-size", 64, "--evals", 1, "--eval-samples", 512, "--profile", "--json",
             out))
    profile = json.loads(out.read_text())["runs"][0]["profile_ms"]
    assert set(profile) == {"host (dispatch a step, median)",
                            "the owners' collection forward (host, mean)",
                            "the owners' collection backward (host, mean)",
                            "whole step, steps queued back to back (mean)",
                            "whole step, each waited for (median)",
                            "step (timed run: 1 / steps per s)"}
    assert all(v > 0 for v in profile.values()), profile


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["auto", "tt"])
def test_jax_on_two_devices_equals_one_device(placement, tmp_path):
    """--devices 2 (two forced host devices, the global batch sharded) trains the model that
    one device trains on the same global batch: host tables, HBM tables and TT cores."""
    pytest.importorskip("torch")
    pytest.importorskip("optax")
    docs = []
    for devices in (1, 2):
        out = tmp_path / f"d{devices}.json"
        _ok(_run("--framework", "jax", "--device", "cpu", "--placement", placement, "--steps",
                 12, "--batch-size", 256, "--evals", 2, "--eval-samples", 4096, "--devices",
                 devices, "--json", out))
        docs.append(json.loads(out.read_text()))
    one, two = (d["runs"][0] for d in docs)
    assert two["devices"] == 2 and one["devices"] == 1 and two["batch_size"] == 256
    for a, b in zip(one["history"], two["history"]):
        assert a["step"] == b["step"]
        assert abs(a["logloss"] - b["logloss"]) < 1e-4, (one["history"], two["history"])
        assert abs(a["auc"] - b["auc"]) < 1e-3
        assert abs(a["train_loss"] - b["train_loss"]) < 1e-4


@pytest.mark.slow
def test_jax_processes_under_torchrun_equal_devices_in_one_process(tmp_path):
    """torchrun --framework jax: one process per device (jax.distributed; here the CPU's
    gloo collectives), each building only its own shards and feeding its own samples, trains
    what one process with the same number of devices trains: the same bits of every
    evaluation (float32 sums in the same order on each device). 40 steps: the processes'
    batches cross a chunk's end (32 steps converted at once)."""
    pytest.importorskip("torch")
    pytest.importorskip("optax")
    args = ("--framework", "jax", "--device", "cpu", "--placement", "auto", "--steps", 40,
            "--batch-size", 256, "--evals", 2, "--eval-samples", 3000)
    one, many = tmp_path / "one.json", tmp_path / "many.json"
    _ok(_run(*args, "--devices", 2, "--json", one))
    result = _ok(_torchrun(2, *args, "--json", many))
    assert "sharding plan over 2 ranks" in result.stdout
    a, b = json.loads(one.read_text())["runs"][0], json.loads(many.read_text())["runs"][0]
    assert b["ranks"] == 2 and "x 2 ranks" in b["name"]
    assert [h["step"] for h in b["history"]] == [20, 40]
    for x, y in zip(a["history"], b["history"]):
        assert (x["logloss"], x["auc"], x["train_loss"]) == \
            (y["logloss"], y["auc"], y["train_loss"]), (a["history"], b["history"])


def test_torchrun_jax_refuses_devices_and_tt_tables():
    env = dict(os.environ, WORLD_SIZE="2", RANK="0", LOCAL_RANK="0")
    for extra, said in ((("--devices", "2"), "one device a process"),
                        (("--placement", "tt"), "TT tables")):
        result = subprocess.run([sys.executable, str(SCRIPT), "--quiet", "--framework", "jax",
                                 "--device", "cpu", *extra],
                                capture_output=True, text=True, timeout=120, env=env)
        assert result.returncode == 2 and said in result.stderr, result.stderr[-2000:]


@pytest.mark.slow
def test_jax_checkpoint_of_two_devices_continues_on_one(tmp_path):
    """--devices 2 shards the collection over the mesh; its checkpoint holds every table
    whole, so one device continues it and ends where an uninterrupted run ends."""
    pytest.importorskip("torch")
    pytest.importorskip("optax")
    common = ("--framework", "jax", "--device", "cpu", "--eval-samples", 2048, "--evals", 1,
              "--batch-size", 256)
    _ok(_run(*common, "--steps", 24, "--json", tmp_path / "full.json"))
    first = _ok(_run(*common, "--steps", 12, "--devices", 2, "--save", tmp_path / "ckpt"))
    assert "sharding plan over 2 ranks" in first.stdout
    _ok(_run(*common, "--steps", 12, "--load", tmp_path / "ckpt", "--json",
             tmp_path / "resumed.json"))
    # Two devices sum their dense gradients over the mesh, one device over its whole batch:
    # the first 12 steps round differently (logloss within 1e-9 here), which may swap a few
    # of the 2,048 evaluation samples' ranks (about 1e-6 of AUC each).
    resumed_equals_full(tmp_path, auc_abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("saved, loaded", [(1, 2), (2, 1)])
def test_jax_tt_checkpoint_on_the_other_device_count_is_refused(saved, loaded, tmp_path):
    """With TT tables one device and --devices N save different states (the collection;
    the per-table mesh design): loading one into the other was a KeyError / ValueError
    traceback after the model was built (exit status 1); it is refused up front."""
    pytest.importorskip("torch")
    pytest.importorskip("optax")
    common = ("--framework", "jax", "--device", "cpu", "--placement", "tt", "--eval-samples",
              512, "--evals", 1, "--batch-size", 64)
    _ok(_run(*common, "--steps", 1, "--devices", saved, "--save", tmp_path / "ckpt"))
    before = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    r = _run(*common, "--steps", 1, "--devices", loaded, "--load", tmp_path / "ckpt",
             "--save", tmp_path / "ckpt")
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-3000:]
    assert "holds a JAX run with TT tables saved" in r.stderr and "Traceback" not in r.stderr
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == before


def test_devices_is_refused_for_torch_and_a_batch_it_does_not_divide():
    assert _run("--framework", "torch", "--devices", 2).returncode == 2
    result = _run("--framework", "jax", "--devices", 3, "--batch-size", 256)
    assert result.returncode == 2 and "multiple" in result.stderr
