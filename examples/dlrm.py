"""A DLRM-style click model trained with xferlib, in PyTorch or inside one ``jax.jit`` step.

Synthetic click log with a known oracle (26 categorical features, Zipf popularity, 13 dense
features). All 26 tables are ONE embedding collection (xferlib's ``EmbeddingBagCollection`` /
``embedding_bag_collection``), each table placed by size in HBM or pinned host RAM (with a
GPU cache of hot rows) under a GPU memory budget: one pooled lookup and one fused backward +
Adagrad update per step. MLPs trained by xferlib's flat Adam; on a GPU the whole torch step
is one CUDA graph, the JAX step one ``jax.jit``. Both frameworks start from the same initial
values, and ``--compare`` trains the plain-torch setup (and FBGEMM's TBE where ``fbgemm_gpu``
imports) beside them. See docs/dlrm.md.

    python examples/dlrm.py                                   # tiny preset, CPU, torch
    python examples/dlrm.py --framework jax
    python examples/dlrm.py --preset medium --framework both --compare --plot medium.png
    python examples/dlrm.py --preset medium --profile          # where a step's time goes
    torchrun --nproc_per_node=2 examples/dlrm.py --preset medium   # two GPUs (global batch)
    torchrun --nproc_per_node=2 examples/dlrm.py --preset medium --framework jax  # a process each
    python examples/dlrm.py --preset medium --plan --world-size 2  # where each table lives
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch/CuPy share the GPU

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dlrm_parts import checkpoint, config, dist, loop, metrics  # noqa: E402
from dlrm_parts.data import ClickLog  # noqa: E402


def _int_at_least(low: int):
    """An argparse type: an integer >= ``low``. argparse reports a bad value with the
    option's name and exit status 2, so 0 never stands for "the preset's value"."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") \
                from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    return parse


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", help=f"one of {sorted(config.PRESETS)}")
    p.add_argument("--framework", default="torch", choices=("torch", "jax", "both"))
    p.add_argument("--placement", default="auto", choices=config.PLACEMENTS)
    p.add_argument("--gpu-memory", type=float, default=None, metavar="GB",
                   help="GPU memory budget for tables, caches and TT cores (default: preset's)")
    p.add_argument("--compare", action="store_true",
                   help="also train the plain-torch baseline (all tables in HBM) if it fits, "
                        "and, where fbgemm_gpu imports, FBGEMM's TBE beside xferlib with "
                        "row-wise Adagrad on both")
    p.add_argument("--profile", action="store_true",
                   help="after training, print where a step's time goes (a profiled window "
                        "of 20 more steps)")
    p.add_argument("--steps", type=_int_at_least(0), default=None,
                   help="steps this invocation runs (default: preset's; 0: evaluate only)")
    p.add_argument("--batch-size", type=_int_at_least(1), default=None,
                   help="samples per step, the global batch under torchrun or --devices "
                        "(default: preset's)")
    p.add_argument("--pooling", type=_int_at_least(1), default=None,
                   help="rows per bag (multi-hot; default: preset's)")
    p.add_argument("--seed", type=_int_at_least(0), default=0)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--evals", type=_int_at_least(1), default=None,
                   help="evaluation points along the run (default: preset's)")
    p.add_argument("--eval-samples", type=_int_at_least(1), default=None,
                   help="size of the held-out set (default: preset's)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PATH", help="PNG: AUC and loss vs samples, throughput")
    p.add_argument("--save", metavar="PATH",
                   help="checkpoint directory written at the end (one run: not with --compare "
                        "or --framework both)")
    p.add_argument("--load", metavar="PATH", help="checkpoint directory to continue from")
    p.add_argument("--no-graph", action="store_true",
                   help="torch: run every step eagerly (default on a GPU: the whole step in "
                        "one CUDA graph after warm-up)")
    p.add_argument("--overlap", action="store_true",
                   help="torch on a GPU: the embeddings' lookup, exchange and update on a "
                        "stream of their own, beside the dense model's forward, backward, "
                        "all-reduce and optimizer (the same results; no effect on the CPU)")
    p.add_argument("--deterministic", action="store_true",
                   help="bitwise-repeatable GPU runs of the dense model too: torch's "
                        "deterministic algorithms and XLA's deterministic ops (xferlib's own "
                        "kernels are deterministic either way; docs/reliability.md)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--devices", type=_int_at_least(1), default=1,
                   help="jax: train on N devices of this host (a mesh; the batch sharded)")
    p.add_argument("--plan", action="store_true",
                   help="print the sharding plan (which table lives on which rank, its bytes, "
                        "each rank's expected share of lookups) and exit")
    p.add_argument("--world-size", type=_int_at_least(1), default=None,
                   help="ranks the --plan is for (default: torchrun's WORLD_SIZE, else 1)")
    p.add_argument("--row-wise", default="", metavar="TABLES",
                   help="torchrun: comma-separated tables (t0,t9,...) split by rows over the "
                        "ranks; the others are placed whole (table-wise, the default)")
    return p.parse_args(argv)


def _device(choice):
    if choice == "cpu":
        return "cpu"
    import torch

    from xferlib import cupy_available

    gpu = torch.cuda.is_available() and cupy_available()
    if choice == "cuda" and not gpu:
        raise ValueError("--device cuda: no CUDA GPU with CuPy here")
    return "cuda" if gpu else "cpu"


def _run_config(args, preset, plan, framework, batch_size, pooling):
    return {"preset": preset.name, "framework": framework, "placement": args.placement,
            "tables": [t.where for t in plan.tables], "cardinalities": list(preset.cardinalities),
            "dim": preset.dim, "batch_size": batch_size, "pooling": pooling, "seed": args.seed}


PROFILE_STEPS = 20
# What XLA may record into its command buffers (CUDA graphs) in a JAX run: its defaults
# and the collectives (XLA_FLAGS naming xla_gpu_enable_command_buffer overrides it)
COMMAND_BUFFERS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,COLLECTIVES"


class Job:
    """One run of the invocation: a framework, an embedding engine (``xferlib``, the
    plain-torch baseline ``torch``, or ``fbgemm``) and the tables' optimizer."""

    def __init__(self, framework, engine, optimizer=None, graph=True):
        self.framework, self.engine, self.graph = framework, engine, graph
        self.optimizer = optimizer or ("rowwise_adagrad" if engine == "fbgemm" else "adagrad")

    @property
    def label(self):
        return {"torch": "torch-baseline", "fbgemm": "torch-fbgemm"}.get(self.engine,
                                                                        self.framework)

    def name(self, placement):
        if self.engine == "torch":
            return "torch baseline (all HBM)"
        if self.engine == "fbgemm":
            return (f"torch + FBGEMM TBE ({placement}, rowwise_adagrad"
                    f"{'' if self.graph else ', eager'})")
        extra = "" if self.optimizer == "adagrad" else f", {self.optimizer}"
        return f"{self.framework} xferlib ({placement}{extra})"


def fbgemm_available() -> bool:
    try:
        from xferlib.adapters.bench.fbgemm import available
    except ImportError:
        return False
    return available()


def _sharding(args, preset, plan, world, optimizer, pooling, batch_size, device):
    """xferlib's sharding plan of the collection over ``world`` ranks (None: TT tables,
    which stay replicated)."""
    from dlrm_parts.sharding import sharding_plan

    row_wise = [n.strip() for n in args.row_wise.split(",") if n.strip()]
    return sharding_plan(preset, plan, world, optimizer=optimizer, pooling=pooling,
                         batch_size=batch_size, device_type=device.split(":")[0],
                         row_wise=row_wise)


def _make_run(job, args, preset, plan, device, xp, ranks, sharding=None):
    if job.framework == "torch":
        from dlrm_parts.torch_run import TorchRun

        return TorchRun(preset, plan, args.seed, device, engine=job.engine,
                        graph=job.graph and not args.no_graph, optimizer=job.optimizer,
                        ranks=ranks, overlap=args.overlap,
                        sharding=sharding if job.engine == "xferlib" and ranks.world > 1
                        else None)
    if ranks.world > 1:  # JAX's processes under torchrun: the collection across them
        from dlrm_parts.jax_sharded_run import JaxShardedRun

        return JaxShardedRun(preset, plan, args.seed, device, sharding, xp=xp,
                             devices=ranks.world, optimizer=job.optimizer, processes=True)
    if args.devices > 1 and sharding is not None:  # the collection sharded over the mesh
        from dlrm_parts.jax_sharded_run import JaxShardedRun

        return JaxShardedRun(preset, plan, args.seed, device, sharding, xp=xp,
                             devices=args.devices, optimizer=job.optimizer)
    if args.devices > 1:  # TT tables: the replicated per-table design
        from dlrm_parts.jax_mesh_run import JaxMeshRun

        return JaxMeshRun(preset, plan, args.seed, device, xp=xp, devices=args.devices)
    from dlrm_parts.jax_run import JaxRun

    return JaxRun(preset, plan, args.seed, device, xp=xp, optimizer=job.optimizer)


def _free(ranks, device):
    """Release a finished run's memory, touching this rank's GPU only (dist.free_gpu_memory:
    torch.cuda.empty_cache() crashed a torchrun rank, issue 29)."""
    gc.collect()
    dist.free_gpu_memory(ranks, device)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.devices > 1 and "jax" not in sys.modules:  # N host devices, before jax starts
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.devices}")
    if args.framework != "torch" and "jax" not in sys.modules \
            and "xla_gpu_enable_command_buffer" not in os.environ.get("XLA_FLAGS", ""):
        # XLA's default command buffers and the collectives: a sharded step's all_to_alls
        # are recorded with the owners' callbacks around them, and the step replays whole
        # (one GPU: the same speed either way)
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_gpu_enable_command_buffer={COMMAND_BUFFERS}")
    if args.framework != "torch" and "jax" not in sys.modules and dist.launched() \
            and "xla_gpu_enable_latency_hiding_scheduler" not in os.environ.get("XLA_FLAGS", ""):
        # XLA's latency-hiding scheduler: the ranks' all_to_alls beside the dense work (two
        # H200s, medium preset, every table in HBM: 10.9M samples/s without, 11.5M with)
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_gpu_enable_latency_hiding_scheduler=true")
    try:  # bad input is refused here, before any table is allocated or file written
        if args.plan:
            return _print_plan(args)
        setup = _prepare(args)
    except (ValueError, MemoryError) as err:
        print(f"dlrm.py: error: {err}", file=sys.stderr)
        return 2
    if args.deterministic:  # after the checks (torch is there), before any GPU work
        _deterministic()
    return _train(args, *setup)


def _deterministic() -> None:
    """torch and XLA in their deterministic modes, set before either touches the GPU: the
    dense model's reductions (cuBLAS's and XLA's) then sum in a fixed order, as xferlib's
    kernels (the collection's, the dot interaction's) do."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's condition
    if "jax" not in sys.modules:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_gpu_deterministic_ops=true")
    import torch

    torch.use_deterministic_algorithms(True)


def _print_plan(args) -> int:
    """``--plan``: the sharding plan for ``--world-size`` (or torchrun's) ranks, on rank 0
    only; nothing allocated, no process group joined, no GPU touched."""
    preset = config.get_preset(args.preset)
    world = args.world_size or dist.world_size()
    batch_size = preset.batch_size if args.batch_size is None else args.batch_size
    pooling = preset.pooling if args.pooling is None else args.pooling
    plan = config.plan_tables(preset, args.placement, args.gpu_memory)
    sharding = _sharding(args, preset, plan, world, "adagrad", pooling, batch_size,
                         "cuda" if args.device == "cuda" else "cpu")
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    if sharding is None:
        print(f"--placement {args.placement} has TT tables: they are replicated on every "
              f"rank (no sharding plan)")
        return 0
    print(f"preset {preset.name}, placement {args.placement}, global batch {batch_size}, "
          f"pooling {pooling}: expected lookups per sample = pooling x (1 + the fraction of "
          f"a batch's Zipf draws that hit distinct rows)")
    print(sharding.describe())
    return 0


def _prepare(args):
    preset = config.get_preset(args.preset)
    # None means "the preset's"; a given 0 is refused below, never replaced by the preset's
    batch_size = preset.batch_size if args.batch_size is None else args.batch_size
    steps = preset.steps if args.steps is None else args.steps
    pooling = preset.pooling if args.pooling is None else args.pooling
    if batch_size < 1 or steps < 0 or pooling < 1:
        raise ValueError(f"--batch-size and --pooling must be >= 1 and --steps >= 0, got "
                         f"{batch_size}, {pooling}, {steps}")
    preset = dataclasses.replace(preset, pooling=pooling)  # the runs read it from the preset
    frameworks = ["torch", "jax"] if args.framework == "both" else [args.framework]
    needed = (["torch", "tqdm"] + (["jax", "optax"] if "jax" in frameworks else [])
              + (["matplotlib"] if args.plot else []))
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"--framework {args.framework}{' --plot' if args.plot else ''} "
                         f"needs {missing} installed "
                         f"(pip install -e \".[bench,jax]\" torch)")
    if args.profile and args.save:
        raise ValueError("--profile trains 20 more steps after the run: not with --save")
    # Where results go, checked before any training: a bad path fails now, not after it.
    if args.save and os.path.exists(args.save) and not os.path.isdir(args.save):
        raise ValueError(f"--save {args.save} exists and is not a directory")
    for flag, path in (("--json", args.json), ("--plot", args.plot),
                       ("--save", args.save)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not os.path.isdir(folder):
            raise ValueError(f"{flag} {path}: the folder {folder} does not exist")
        if flag != "--save" and path and os.path.isdir(path):
            raise ValueError(f"{flag} {path} is a directory; give a file name")
    if args.plot:
        importlib.import_module("matplotlib")  # --plot needs it: refused before training

        from xferlib.cli import plot_format_error

        unknown = plot_format_error(args.plot)
        if unknown:
            raise ValueError(unknown)
    if args.overlap and "torch" not in frameworks:
        raise ValueError("--overlap is for the torch model (XLA orders the JAX step's "
                         "work itself)")
    if (args.save or args.load) and len(frameworks) > 1:
        raise ValueError("--save/--load hold one run: pick --framework torch or jax")
    if args.load and args.compare:
        raise ValueError("--compare trains fresh runs; it cannot continue from --load")
    if args.save and args.compare:  # a checkpoint holds one run; --compare trains two
        raise ValueError("--save holds one run; it cannot save the --compare baseline: drop "
                         "--compare or --save")
    if args.devices < 1 or (args.devices > 1 and frameworks != ["jax"]):
        raise ValueError(f"--devices {args.devices}: N devices in one process is for "
                         f"--framework jax (torch: torchrun --nproc_per_node=N)")
    if args.devices > 1 and (args.compare or batch_size % args.devices):
        raise ValueError(f"--devices {args.devices} needs --batch-size (the global batch, "
                         f"{batch_size}) a multiple of it, and no --compare")
    if dist.launched():
        world = int(os.environ["WORLD_SIZE"])
        if frameworks not in (["torch"], ["jax"]):
            raise ValueError("torchrun runs one framework: --framework torch, or jax (one "
                             "process per GPU, the collection sharded across them)")
        if frameworks == ["jax"] and args.devices > 1:
            raise ValueError("torchrun with --framework jax: one device a process (drop "
                             "--devices; --devices N is N devices in one process)")
        if args.compare or args.save or args.load:
            raise ValueError("--compare, --save and --load run in one process (without "
                             "torchrun)")
        if batch_size % world:
            raise ValueError(f"--batch-size {batch_size} (the global batch) must be a "
                             f"multiple of the {world} ranks")
        if args.world_size not in (None, world):
            raise ValueError(f"--world-size {args.world_size} is for --plan; torchrun "
                             f"started {world} ranks")
    plan = config.plan_tables(preset, args.placement, args.gpu_memory)
    if dist.launched() and frameworks == ["jax"] and plan.bytes_tt:
        raise ValueError("torchrun with --framework jax shards the collection; TT tables "
                         "(--placement tt) are not in it: use --devices N in one process")
    config.check_host_ram(plan)  # before any table is allocated
    if args.row_wise:  # an unknown table name is refused before anything starts
        _sharding(args, preset, plan, max(dist.world_size(), 1), "adagrad", pooling,
                  batch_size, "cpu")
    run_config = {fw: _run_config(args, preset, plan, fw, batch_size, pooling)
                  for fw in frameworks}
    meta = checkpoint.read_meta(args.load, run_config[frameworks[0]]) if args.load else None
    if meta is not None and frameworks == ["jax"] and plan.bytes_tt:
        checkpoint.check_jax_tt_layout(args.load, mesh=args.devices > 1)
    device = _device(args.device)
    return preset, plan, frameworks, run_config, meta, device, batch_size, steps, pooling


def _train(args, preset, plan, frameworks, run_config, meta, device, batch_size, steps,
           pooling) -> int:
    # one process per GPU under torchrun: torch.distributed, or JAX's processes
    ranks, device = (dist.init_jax(device) if frameworks == ["jax"] and dist.launched()
                     else dist.init(device))
    if not ranks.main:  # rank 0 speaks for all
        sys.stdout = open(os.devnull, "w")
    try:
        code = _train_ranks(args, preset, plan, frameworks, run_config, meta, device,
                            batch_size, steps, pooling, ranks)
    except BaseException:
        dist.finish(ranks, ok=False)
        raise
    dist.finish(ranks)
    return code


def _train_ranks(args, preset, plan, frameworks, run_config, meta, device, batch_size, steps,
                 pooling, ranks) -> int:
    if device.startswith("cuda"):
        import cupy as xp
    else:
        import numpy as xp
    if device.startswith("cuda"):
        import torch

        from xferlib.warm import fixed_modules, warm_kernels

        # TF32 matmuls for every torch run, as XLA's default precision runs JAX's
        torch.set_float32_matmul_precision("high")
        # The kernels compile (NVRTC, once per machine: CuPy caches them) in the background
        # while the tables are built, several at once, instead of one by one at first use.
        warm_kernels(fixed_modules(rules=("adagrad", "rowwise_adagrad")), background=True)
    log = ClickLog(preset.cardinalities, seed=args.seed, pooling=pooling)
    eval_set = loop.EvalSet(log, args.eval_samples or preset.eval_samples, xp)
    budget = plan.budget_bytes / 2**30
    print(f"preset {preset.name}: {preset.description}\n  {len(plan.tables)} tables, "
          f"{sum(preset.cardinalities):,} rows x {preset.dim}, batch {batch_size}, pooling "
          f"{pooling}, device {device}"
          f"{f' x {ranks.world} ranks' if ranks.world > 1 else ''}, placement {args.placement} "
          f"(budget {budget:g} GB): {plan.summary()['placement'].count('hbm')} in HBM, "
          f"{plan.summary()['placement'].count('host')} in host RAM, "
          f"{plan.summary()['placement'].count('tt')} TT; oracle AUC {eval_set.oracle_auc:.4f}",
          flush=True)

    results = []
    jobs = [Job(fw, "xferlib") for fw in frameworks]
    if args.compare:
        jobs.append(Job("torch", "torch"))  # the plain-torch baseline, every table in HBM
        if plan.bytes_tt:
            print("FBGEMM TBE comparison: skipped (TT tables have no TBE counterpart)")
        elif device.startswith("cuda") and fbgemm_available():
            # FBGEMM's TBE runs row-wise Adagrad: xferlib runs it too for that pair
            jobs += [Job("torch", "xferlib", "rowwise_adagrad"), Job("torch", "fbgemm")]
            if plan.bytes_host and not args.no_graph:
                # A CUDA graph freezes FBGEMM's LRU clock (a Python int passed at capture):
                # once its cache is full the replays evict nothing. Its eager run is the
                # one whose cache behaves as FBGEMM's; both are shown.
                jobs.append(Job("torch", "fbgemm", graph=False))
        else:
            print("FBGEMM TBE comparison: skipped (needs fbgemm_gpu and a GPU)")
    sharding = None
    world = ranks.world if ranks.world > 1 else args.devices  # torchrun's ranks or JAX's mesh
    if world > 1:  # the collection's tables sharded over the ranks / devices
        sharding = _sharding(args, preset, plan, world, jobs[0].optimizer, pooling,
                             batch_size, device)
        where = "rank" if ranks.world > 1 else "device"
        print(sharding.describe() if sharding is not None else
              f"TT tables: every table replicated on every {where} (no sharding plan)")
    failed, run = [], None
    for job in jobs:
        name = job.name(args.placement)
        if ranks.world > 1:
            name += f" x {ranks.world} ranks"
        if job.framework == "jax" and args.devices > 1:
            name += f" x {args.devices} devices"
        try:  # one failing run (say, out of memory) must not lose the others' figures
            table_bytes = {"host": plan.bytes_host, "hbm": plan.bytes_hbm, "tt": plan.bytes_tt,
                           "cache": plan.bytes_cache}
            if job.engine == "torch":
                table_bytes = {"host": 0, "tt": 0, "cache": 0,
                               "hbm": sum(config.table_bytes(n, preset.dim)
                                          for n in preset.cardinalities)}
                if device.startswith("cuda"):
                    import torch

                    free = torch.cuda.mem_get_info(torch.device(device))[0]
                    if table_bytes["hbm"] * 1.3 > free:
                        print(f"{name}: skipped, its tables need "
                              f"{table_bytes['hbm'] / 2**30:.1f} GB and the GPU has "
                              f"{free / 2**30:.1f} GB free")
                        continue
            run = _make_run(job, args, preset, plan, device, xp, ranks, sharding)
            history, start = [], 0
            if meta is not None:
                checkpoint.load(args.load, run, job.framework)
                history, start = list(meta["history"]), int(meta["step"])
            seconds, timed_steps = loop.train(
                run, log, eval_set, name=name, start_step=start, steps=steps,
                batch_size=batch_size, xp=xp, evals=args.evals or preset.evals,
                history=history, progress=not args.quiet and ranks.main)
            if not history or history[-1]["step"] != start + steps:  # steps == 0: evaluate once
                a, ll = eval_set.evaluate(run, name)
                history.append({"step": start + steps, "samples": (start + steps) * batch_size,
                                "auc": a, "logloss": ll, "train_loss": None})
            final = history[-1]
            result = {
                "name": name, "framework": job.label, "engine": job.engine,
                "optimizer": job.optimizer, "preset": preset.name,
                "placement": "hbm" if job.engine == "torch" else args.placement,
                "device": device, "ranks": ranks.world, "steps": steps,
                "devices": args.devices if job.framework == "jax" else 1,
                "total_steps": start + steps,
                "batch_size": batch_size, "samples_per_s": timed_steps * batch_size / seconds
                if seconds > 0 else 0.0, "auc": final["auc"], "logloss": final["logloss"],
                "oracle_auc": eval_set.oracle_auc, "oracle_logloss": eval_set.oracle_logloss,
                "peak_gpu_bytes": run.peak_gpu_bytes(), "table_bytes": table_bytes,
                "cache_hit_rate": run.cache_hit_rate(), "notes": getattr(run, "graph_note", ""),
                "history": history}
            if args.save:
                checkpoint.save(args.save, run, job.framework, run_config[job.framework],
                                start + steps, history)
                print(f"saved {args.save} at step {start + steps}")
            if args.profile and hasattr(run, "profile"):
                feed = loop.Feed(run, log, batch_size, xp)
                stop = start + steps
                breakdown = run.profile([feed(stop + i) for i in range(PROFILE_STEPS)])
                if breakdown is None:
                    print(f"--profile: {name} times its phases with CUDA events; on the "
                          f"CPU there is nothing to show")
                if breakdown:
                    breakdown["step (timed run: 1 / steps per s)"] = (
                        1e3 * batch_size / result["samples_per_s"] if result["samples_per_s"]
                        else 0.0)
                    result["profile_ms"] = breakdown
                    print(metrics.profile_table(name, breakdown))
                if hasattr(run, "profile_replays"):  # the captured step, kernel by kernel
                    kinds = run.profile_replays(
                        [feed(stop + PROFILE_STEPS + i) for i in range(PROFILE_STEPS)])
                    if kinds:
                        result["profile_replay_ms"] = kinds
                        print(metrics.profile_table(f"{name}, replayed step's kernels", kinds))
                        result["profile_top_kernels"] = run.top_kernels
                        print(metrics.top_kernels_table(name, run.top_kernels))
            results.append(result)
        except Exception:
            if ranks.world > 1:  # the other ranks wait in the step's collectives: leave
                run = None  # (closing would run collectives they never reach)
                raise
            traceback.print_exc()
            failed.append(name)
        finally:  # the next run allocates only once this one's memory is released
            if run is not None and hasattr(run, "close"):
                try:
                    run.close()
                except Exception:
                    traceback.print_exc()
            run = None
            _free(ranks, device)

    if not results:
        print(f"dlrm.py: every run failed: {failed}", file=sys.stderr)
        return 1
    print()
    print(metrics.table(results))
    for r in results:  # how each run stepped: one CUDA graph, one jit, or eager (and why)
        if r["notes"]:
            print(f"  {r['name']}: {r['notes']}")
    main_run = results[0]
    print(metrics.target_line(main_run["auc"], main_run["oracle_auc"]))
    base = [r for r in results if r["engine"] == "torch"]
    for r in results:
        if base and r is not base[0] and base[0]["samples_per_s"]:
            print(f"{r['name']}: {r['samples_per_s'] / base[0]['samples_per_s']:.2f}x the "
                  f"baseline's samples/s, AUC {r['auc'] - base[0]['auc']:+.4f}")
    for line in metrics.fbgemm_pair_lines(results):
        print(line)
    if args.json and ranks.main:
        metrics.write_json(args.json, results, {"plan": plan.summary()})
    if args.plot and ranks.main:
        metrics.plot(args.plot, results, f"DLRM, {preset.name} preset, {device}, batch "
                     f"{batch_size}")
    if failed:
        print(f"dlrm.py: failed runs: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
