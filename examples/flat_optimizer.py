"""Train a small MLP with xferlib's flat AdamW, in torch and in JAX, beside the stock optimizer.

Prints the loss reached and the time per optimizer step of each. On a GPU the flat optimizer
is one kernel launch per step; without one everything runs on the CPU (NumPy path).

    python examples/flat_optimizer.py [--steps 200] [--lr 1e-3] [--weight-decay 0.01]
"""

import argparse
import functools
import time

import numpy as np


def _mlp_data(n=512, d=32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype(np.float32)
    w = rng.standard_normal((d, 1)).astype(np.float32)
    y = np.tanh(x @ w) + 0.05 * rng.standard_normal((n, 1)).astype(np.float32)
    return x, y


def torch_demo(steps=200, lr=1e-3, weight_decay=0.01):
    import torch

    from xferlib.adapters.torch import FlatAdamW

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, y = (torch.tensor(a, device=device) for a in _mlp_data())
    for name, make in (("torch.optim.AdamW", torch.optim.AdamW), ("xferlib FlatAdamW", FlatAdamW)):
        torch.manual_seed(0)
        layers = [torch.nn.Linear(32, 64)] + [torch.nn.Linear(64, 64) for _ in range(5)]
        model = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.GELU())],
                                    torch.nn.Linear(64, 1)).to(device)
        opt = make(model.parameters(), lr=lr, weight_decay=weight_decay)
        step_time = 0.0
        for _ in range(steps):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.step()
            if device == "cuda":
                torch.cuda.synchronize()
            step_time += time.perf_counter() - t0
        print(f"torch ({device}) {name:20s} loss {loss.item():.4f}  "
              f"step {1e6 * step_time / steps:8.1f} us")


def jax_demo(steps=200, lr=1e-3, weight_decay=0.01):
    import jax
    import jax.numpy as jnp
    import optax

    from xferlib.adapters.jax import flat_adamw, flat_step, ravel

    x, y = (jnp.asarray(a) for a in _mlp_data())
    keys = jax.random.split(jax.random.key(0), 7)
    sizes = [32] + [64] * 6
    params = [{"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
              for k, a, b in zip(keys, sizes[:-1], sizes[1:])]
    params.append({"w": jax.random.normal(keys[-1], (64, 1)) / 8.0, "b": jnp.zeros(1)})

    def loss_fn(p):
        h = x
        for layer in p[:-1]:
            h = jax.nn.gelu(h @ layer["w"] + layer["b"])
        return jnp.mean((h @ p[-1]["w"] + p[-1]["b"] - y) ** 2)

    ref_tx = optax.adamw(lr, weight_decay=weight_decay)

    @jax.jit
    def ref_step(p, s):
        loss, g = jax.value_and_grad(loss_fn)(p)
        u, s = ref_tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    flat, unravel = ravel(params)
    tx = flat_adamw(lr, weight_decay=weight_decay)

    # Parameters and state donated: flat_step updates them in place, in one fused pass.
    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_flat(f, s):
        loss, g = jax.value_and_grad(lambda f: loss_fn(unravel(f)))(f)
        f, s = flat_step(tx, g, s, f)  # gradients w.r.t. the flat buffer are flat already
        return f, s, loss

    for name, step, p, s in (("optax.adamw", ref_step, params, ref_tx.init(params)),
                             ("xferlib flat_adamw", train_flat, flat, tx.init(flat))):
        p, s, loss = step(p, s)  # compile
        jax.block_until_ready(p)
        t0 = time.perf_counter()
        for _ in range(steps):
            p, s, loss = step(p, s)
        jax.block_until_ready(p)
        print(f"jax ({jax.default_backend()}) {name:20s} loss {float(loss):.4f}  "
              f"train step {1e6 * (time.perf_counter() - t0) / steps:8.1f} us")


def _number(text: str, kind, what: str, ok):
    """An argparse type: ``kind(text)`` where ``ok`` holds, else an error argparse reports
    with the option's name (exit status 2)."""
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
    return value


def _positive_int(text: str) -> int:
    return _number(text, int, "an integer >= 1", lambda v: v >= 1)


def _positive_float(text: str) -> float:
    return _number(text, float, "a number > 0", lambda v: 0 < v < float("inf"))


def _nonnegative_float(text: str) -> float:
    return _number(text, float, "a number >= 0", lambda v: 0 <= v < float("inf"))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=_positive_int, default=200,
                        help="optimizer steps per run (default: %(default)s)")
    parser.add_argument("--lr", type=_positive_float, default=1e-3,
                        help="AdamW's learning rate (default: %(default)s)")
    parser.add_argument("--weight-decay", type=_nonnegative_float, default=0.01,
                        help="AdamW's decoupled weight decay (default: %(default)s)")
    parser.add_argument("--skip-torch", action="store_true", help="no torch runs")
    parser.add_argument("--skip-jax", action="store_true", help="no JAX runs")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if not args.skip_torch:
        torch_demo(args.steps, args.lr, args.weight_decay)
    if not args.skip_jax:
        jax_demo(args.steps, args.lr, args.weight_decay)


if __name__ == "__main__":
    main()
