"""Skip-gram with negative sampling, the embedding tables in pinned host RAM.

A generated corpus with planted structure: the vocabulary is split into topics, and each
sentence draws its words from one topic. After training, words of the same topic should be
closer (cosine) than words of different topics, which the script checks.

The two tables (input and output vectors) with their Adam state are larger than the stated
GPU budget: they live in host RAM (xferlib.HostTable) and each step moves only the rows the
batch touches; the Adam update runs fused in backward (torch) or in ``host_update`` (JAX).
Runs on a CPU (the NumPy path) or a GPU, in torch and in JAX.

    python examples/word2vec_host_table.py [--steps 400] [--vocab 5000] [--gpu-budget-mb 1]
"""

from __future__ import annotations

import argparse

import numpy as np
from tqdm import tqdm

import xferlib


def make_corpus(rng, vocab: int, topics: int, sentences: int, length: int) -> np.ndarray:
    """Sentences of `length` words, each drawn from one topic's words (word % topics)."""
    topic = rng.integers(0, topics, size=(sentences, 1))
    slot = rng.integers(0, vocab // topics, size=(sentences, length))
    return slot * topics + topic


def skipgram_batches(rng, corpus, batch: int, window: int, negatives: int, vocab: int):
    """(center, context, negatives) index batches from random positions of the corpus."""
    sentences, length = corpus.shape
    while True:
        s = rng.integers(0, sentences, size=batch)
        i = rng.integers(0, length, size=batch)
        offset = rng.integers(1, window + 1, size=batch) * rng.choice([-1, 1], size=batch)
        j = np.clip(i + offset, 0, length - 1)
        yield (corpus[s, i].astype(np.int64), corpus[s, j].astype(np.int64),
               rng.integers(0, vocab, size=(batch, negatives)).astype(np.int64))


def topic_separation(vectors: np.ndarray, topics: int, rng) -> tuple[float, float]:
    """Mean cosine similarity of random same-topic and different-topic word pairs."""
    v = vectors / (np.linalg.norm(vectors, axis=1, keepdims=True) + 1e-8)
    a = rng.integers(0, len(v), size=20000)
    same = (a + topics * rng.integers(1, 5, size=a.size)) % len(v)
    other = (a + rng.integers(1, topics, size=a.size)) % len(v)
    return float(np.mean(np.sum(v[a] * v[same], 1))), float(np.mean(np.sum(v[a] * v[other], 1)))


def train_torch(args, corpus, rng):
    import torch
    import torch.nn.functional as F

    from xferlib.adapters.torch import HostEmbedding

    device = "cuda" if torch.cuda.is_available() and xferlib.cupy_available() else "cpu"
    adam = {"lr": args.lr}
    centers = HostEmbedding(args.vocab, args.dim, optimizer="adam", optimizer_kwargs=adam,
                            init=("uniform", -0.5 / args.dim, 0.5 / args.dim), device=device,
                            seed=1)
    contexts = HostEmbedding(args.vocab, args.dim, optimizer="adam", optimizer_kwargs=adam,
                             init="zeros", device=device)
    batches = skipgram_batches(rng, corpus, args.batch, args.window, args.negatives, args.vocab)
    for _ in (progress := tqdm(range(args.steps), desc="torch", mininterval=1.0)):
        c, o, n = (torch.from_numpy(x).to(device) for x in next(batches))
        u = centers(c)                                    # (B, D)
        pos = (u * contexts(o)).sum(-1)
        neg = torch.einsum("bd,bkd->bk", u, contexts(n))
        loss = -(F.logsigmoid(pos).mean() + F.logsigmoid(-neg).sum(-1).mean())
        loss.backward()                                   # Adam runs on the touched rows here
        progress.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    return np.array(centers.table.numpy())


def train_jax(args, corpus, rng):
    import jax
    import jax.numpy as jnp

    from xferlib.adapters.jax import host_lookup, host_update

    adam = {"lr": args.lr}
    centers = xferlib.HostTable(args.vocab, args.dim, optimizer="adam", optimizer_kwargs=adam,
                                init=("uniform", -0.5 / args.dim, 0.5 / args.dim), seed=1)
    contexts = xferlib.HostTable(args.vocab, args.dim, optimizer="adam",
                                 optimizer_kwargs=adam, init="zeros")

    def loss_fn(u, v_pos, v_neg):
        pos = jnp.sum(u * v_pos, -1)
        neg = jnp.einsum("bd,bkd->bk", u, v_neg)
        return -(jnp.mean(jax.nn.log_sigmoid(pos)) + jnp.mean(jnp.sum(jax.nn.log_sigmoid(-neg), -1)))

    @jax.jit
    def train_step(c, o, n):
        b, k = n.shape
        context_idx = jnp.concatenate([o, n.reshape(-1)])
        u = host_lookup(centers, c)
        v = host_lookup(contexts, context_idx)
        loss, (gu, gv) = jax.value_and_grad(
            lambda u, v: loss_fn(u, v[:b], v[b:].reshape(b, k, -1)), argnums=(0, 1))(u, v)
        return loss, host_update(centers, c, gu) + host_update(contexts, context_idx, gv)

    batches = skipgram_batches(rng, corpus, args.batch, args.window, args.negatives, args.vocab)
    for _ in (progress := tqdm(range(args.steps), desc="jax", mininterval=1.0)):
        loss, token = train_step(*next(batches))
        progress.set_postfix(loss=f"{float(loss):.3f}", refresh=False)
    jax.block_until_ready(token)
    return np.array(centers.numpy())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=5000)
    parser.add_argument("--topics", type=int, default=100)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--window", type=int, default=3)
    parser.add_argument("--negatives", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--gpu-budget-mb", type=float, default=1.0,
                        help="the GPU memory this run may use for embeddings (illustrative)")
    parser.add_argument("--skip-jax", action="store_true")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    corpus = make_corpus(rng, args.vocab, args.topics, sentences=20000, length=12)
    table_mb = 2 * args.vocab * args.dim * 4 * 3 / 2**20  # two tables, weights + Adam's m, v
    batch_mb = args.batch * (2 + args.negatives) * args.dim * 4 / 2**20
    print(f"tables with Adam state: {table_mb:.1f} MB, above the GPU budget of "
          f"{args.gpu_budget_mb:.1f} MB; a step moves {batch_mb:.2f} MB of rows")
    assert table_mb > args.gpu_budget_mb

    results = {"torch": train_torch(args, corpus, np.random.default_rng(1))}
    if not args.skip_jax:
        try:
            results["jax"] = train_jax(args, corpus, np.random.default_rng(1))
        except ImportError:
            print("jax is not installed: skipping the JAX run")
    for name, vectors in results.items():
        same, other = topic_separation(vectors, args.topics, np.random.default_rng(2))
        print(f"{name}: mean cosine, same topic {same:.3f}, different topics {other:.3f}")
        assert same > other + 0.2, f"{name}: the planted topics were not learned"


if __name__ == "__main__":
    main()
