"""The sharded flat step (ZeRO-1) beside the unsharded one, on N ranks.

Each rank holds the same ~100M parameters (48 tensors) and the same gradients, as after DDP
has averaged them, and times, back to back:

- ``FlatAdamW.step()``: every rank updates the whole buffer (what DDP + a flat optimizer do);
- ``ShardedFlatAdamW(reduce_grads=False).step()``: each rank updates its 1/N slice, then the
  parameters are all-gathered;
- the all-gather alone (``all_gather_into_tensor`` of the same buffer);
- ``ShardedFlatAdamW(reduce_grads=True).step()`` (no DDP: a reduce-scatter of the gradients
  first), for reference;

and reports the optimizer state each rank holds. The target: state per rank 1/N, and the
sharded step within 1.2x of the unsharded one plus the all-gather. After the timed steps the
two parameter sets (same start, same gradients, same number of steps) must agree.

    torchrun --nproc_per_node=2 examples/sharded_flat_step.py --json step.json   # GPUs
    python examples/sharded_flat_step.py            # CPU: 2 gloo processes, a small buffer
"""

import argparse
import json
import os
import socket
import time

import torch
import torch.distributed as dist

from xferlib.adapters.torch import FlatAdamW, ShardedFlatAdamW, leave_process_group


def _shapes(params: int):
    """24 matrices (1024, c) and 24 vectors (c,): ``params`` elements in 48 tensors."""
    c = max(1, params // (24 * 1025))
    return [(1024, c)] * 24 + [(c,)] * 24


def _tensors(shapes, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, device=device, generator=g) * 0.02)
            for s in shapes]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, iters, device, repeats=3):
    """Best mean seconds per call over ``repeats`` runs of ``iters`` calls back to back."""
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync(device)
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def _optimizer(cls, shapes, device, **kw):
    params = _tensors(shapes, device, seed=0)
    grads = _tensors(shapes, device, seed=1)  # the same on every rank: DDP's averaged grads
    for p, g in zip(params, grads):
        p.grad = g.detach()
    return params, cls(params, lr=1e-3, weight_decay=0.01, **kw)


def run(args, rank, world, device):
    shapes = _shapes(args.params)
    count = sum(torch.Size(s).numel() for s in shapes)
    steps = {}
    flat_params, flat = _optimizer(FlatAdamW, shapes, device)
    shard_params, sharded = _optimizer(ShardedFlatAdamW, shapes, device, reduce_grads=False)
    _, reducing = _optimizer(ShardedFlatAdamW, shapes, device, reduce_grads=True)
    for name, opt in (("unsharded", flat), ("sharded", sharded),
                      ("sharded_reduce_scatter", reducing)):
        for _ in range(args.warmup):
            opt.step()
        steps[name] = _time(opt.step, args.iters, device)
    # The all-gather alone, over a buffer of the sharded optimizer's padded length.
    padded = -(-count // (world * 16)) * world * 16
    buffer = torch.zeros(padded, device=device)
    mine = buffer[rank * padded // world:(rank + 1) * padded // world]
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    if device.type != "cuda":
        mine = mine.clone()  # gloo: the input must not alias the output
    steps["all_gather"] = _time(lambda: gather(buffer, mine), args.iters, device)
    # Same start, same gradients, same number of steps: the same parameters.
    diff = max(float((a.detach() - b.detach()).abs().max())
               for a, b in zip(flat_params, shard_params))
    ms = {k: round(v * 1e3, 4) for k, v in steps.items()}
    bound = 1.2 * ms["unsharded"] + ms["all_gather"]
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "backend": dist.get_backend(), "world_size": world, "params": count,
        "tensors": len(shapes), "optimizer": "AdamW", "iters": args.iters,
        "unsharded_step_ms": ms["unsharded"], "sharded_step_ms": ms["sharded"],
        "sharded_step_reduce_scatter_ms": ms["sharded_reduce_scatter"],
        "all_gather_ms": ms["all_gather"],
        "all_gather_GBps": round(padded * 4 * (world - 1) / world / steps["all_gather"] / 1e9,
                                 1),
        "target_ms": round(bound, 4),
        "sharded_over_unsharded_plus_gather": round(
            ms["sharded"] / (ms["unsharded"] + ms["all_gather"]), 3),
        "step_target_met": ms["sharded"] <= bound,
        "state_bytes_unsharded": flat.state_nbytes(),
        "state_bytes_sharded": sharded.state_nbytes(),
        "state_fraction": round(sharded.state_nbytes() / flat.state_nbytes(), 4),
        "max_abs_diff": diff,
    }


def _report(result, path):
    for key, value in result.items():
        print(f"{key:36s} {value}")
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def _worker(rank, world, port, args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = run(args, rank, world, torch.device("cpu"))
        if rank == 0:
            _report(result, args.json)
    except BaseException:
        leave_process_group(wait=False)  # this rank failed: the others are not waited for
        raise
    leave_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=float, default=None,
                        help="parameters (default 100e6 on GPUs, 2e5 on the CPU)")
    parser.add_argument("--iters", type=int, default=None, help="steps per timing")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2, help="CPU processes without torchrun")
    parser.add_argument("--json", default=None, help="write the figures here (rank 0)")
    args = parser.parse_args()
    for flag, value, low in (("--params", args.params, 1), ("--iters", args.iters, 1),
                             ("--warmup", args.warmup, 0), ("--nproc", args.nproc, 1)):
        if value is not None and not low <= value < float("inf"):  # nan, inf: no count
            parser.error(f"{flag} must be a finite number >= {low}, got {value}")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        parser.error(f"--json {args.json}: its folder does not exist")
    if args.json and os.path.isdir(args.json):
        parser.error(f"--json {args.json} is a directory; give a file name")
    if "RANK" in os.environ:  # torchrun
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo")
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else \
            torch.device("cpu")
        args.params = int(args.params if args.params is not None else
                          (100e6 if cuda else 2e5))
        args.iters = args.iters if args.iters is not None else (50 if cuda else 3)
        try:
            result = run(args, dist.get_rank(), dist.get_world_size(), device)
            if dist.get_rank() == 0:
                _report(result, args.json)
        except BaseException:
            leave_process_group(wait=False)
            raise
        leave_process_group()
        return
    import torch.multiprocessing as mp

    args.params = int(args.params if args.params is not None else 2e5)
    args.iters = args.iters if args.iters is not None else 3
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(args.nproc, port, args), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
