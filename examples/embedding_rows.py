"""Train a small embedding table whose rows are fetched with xferlib's gather, in torch and JAX.

A toy word2vec-style objective: pull the embeddings of co-occurring ids together. On a GPU the
table lives in pinned host RAM and each step gathers only the touched rows to the GPU; without
a GPU everything runs on the CPU through the NumPy path.

    python examples/embedding_rows.py [--rows 100000] [--dim 64] [--batch 8192] [--steps 50]
"""

import argparse

import numpy as np

import xferlib


def core_demo(num_rows=100_000, dim=64, batch=8192):
    rng = np.random.default_rng(0)
    table = xferlib.pinned_empty((num_rows, dim), np.float32)
    rng.standard_normal(dtype=np.float32, out=table)  # in place: no second table-sized array
    idx = rng.integers(0, num_rows, batch)
    if xferlib.cupy_available():
        import cupy

        idx = cupy.asarray(idx)  # indices on the GPU: rows come straight from host RAM
    rows = xferlib.gather_rows(table, idx)
    xferlib.scatter_add_rows(table, idx, -0.01 * rows)
    # GPU calls take no host sync; their index checks are read later. check_rows() waits for
    # them (and so for the calls) and raises for a bad index before the host reads the table.
    xferlib.check_rows()
    print(f"core: gathered {rows.shape[0]} rows of {dim} ({type(rows).__module__}); "
          f"table pinned: {xferlib.is_pinned(table)}")


def torch_demo(steps=50):
    import torch

    from xferlib.adapters.torch import gather_rows

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    table = torch.nn.Parameter(0.1 * torch.randn(1000, 32, device=device))
    opt = torch.optim.Adam([table], lr=0.05)
    pairs = torch.randint(0, 1000, (steps, 256, 2), device=device)
    for step in range(steps):
        a = gather_rows(table, pairs[step, :, 0])
        b = gather_rows(table, pairs[step, :, 1])
        loss = torch.nn.functional.softplus(-(a * b).sum(1)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"torch ({device}): loss after {steps} steps {loss.item():.4f}")


def jax_demo(steps=50):
    import jax
    import optax

    from xferlib.adapters.jax import gather_rows

    table = 0.1 * jax.random.normal(jax.random.key(0), (1000, 32))
    pairs = jax.random.randint(jax.random.key(1), (steps, 256, 2), 0, 1000)

    def loss_fn(t, pair):
        a, b = gather_rows(t, pair[:, 0]), gather_rows(t, pair[:, 1])
        return jax.nn.softplus(-(a * b).sum(1)).mean()

    opt = optax.adam(0.05)

    @jax.jit
    def train(t):
        def step(carry, pair):
            t, state = carry
            loss, g = jax.value_and_grad(loss_fn)(t, pair)
            updates, state = opt.update(g, state)
            return (optax.apply_updates(t, updates), state), loss

        return jax.lax.scan(step, (t, opt.init(t)), pairs)

    _, losses = train(table)
    print(f"jax ({jax.default_backend()}): loss after {steps} steps {float(losses[-1]):.4f}")


def _positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (argparse reports a bad one with exit status 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=_positive_int, default=100_000,
                        help="rows of the pinned table of the core demo (default: %(default)s)")
    parser.add_argument("--dim", type=_positive_int, default=64,
                        help="its row width (default: %(default)s)")
    parser.add_argument("--batch", type=_positive_int, default=8192,
                        help="rows gathered and scattered back (default: %(default)s)")
    parser.add_argument("--steps", type=_positive_int, default=50,
                        help="training steps of the torch and JAX demos (default: %(default)s)")
    parser.add_argument("--skip-torch", action="store_true", help="no torch demo")
    parser.add_argument("--skip-jax", action="store_true", help="no JAX demo")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    core_demo(args.rows, args.dim, args.batch)
    if not args.skip_torch:
        torch_demo(args.steps)
    if not args.skip_jax:
        jax_demo(args.steps)


if __name__ == "__main__":
    main()
