"""A DLRM-style click model with a TT-compressed embedding table vs a dense one.

A click log is generated with planted structure: every item has a hidden taste vector, every
user a preference vector, and the click probability rises with their agreement. Both models
learn item embeddings from (user, item) pairs; the item table is either ``nn.EmbeddingBag`` or
xferlib's ``TTEmbeddingBag`` (row-wise Adagrad fused into the backward). Printed: parameters,
AUC on held-out clicks, and time per training step.

    python examples/tt_recommender.py [--steps 300] [--batch 512]
"""

import argparse
import time

import numpy as np

NUM_ITEMS, NUM_USERS, DIM, TASTE = 20_000, 500, 16, 4


def click_log(n, rng):
    items_taste = rng.standard_normal((NUM_ITEMS, TASTE))
    users_pref = rng.standard_normal((NUM_USERS, TASTE))
    popular = rng.zipf(1.2, size=n) % NUM_ITEMS  # a Zipf-like item popularity
    users = rng.integers(0, NUM_USERS, n)
    logits = 2.0 * (items_taste[popular] * users_pref[users]).sum(1) / np.sqrt(TASTE)
    clicks = rng.random(n) < 1.0 / (1.0 + np.exp(-logits))
    return users, popular, clicks.astype(np.float32)


def auc(scores, labels):
    order = np.argsort(scores)
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    pos = labels > 0.5
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return (ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def click_model(item_table):
    """The model: item and user vectors, their dot product, a small MLP on top. (Built in a
    function so that ``--help`` answers without importing torch.)"""
    import torch

    class ClickModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.items = item_table
            self.users = torch.nn.Embedding(NUM_USERS, DIM)
            self.top = torch.nn.Sequential(torch.nn.Linear(2 * DIM + 1, 32), torch.nn.ReLU(),
                                           torch.nn.Linear(32, 1))

        def forward(self, users, items):
            offsets = torch.arange(0, len(items) + 1)
            item_vec = self.items(items, offsets)
            user_vec = self.users(users)
            dot = (item_vec * user_vec).sum(1, keepdim=True)
            return self.top(torch.cat([item_vec, user_vec, dot], 1)).squeeze(1)

    return ClickModel()


def train(name, item_table, data, dense_items, steps=300, batch=512):
    import torch

    torch.manual_seed(0)
    model = click_model(item_table)
    others = [p for n, p in model.named_parameters() if not n.startswith("items")]
    opt = torch.optim.Adam(others, lr=3e-3)
    sparse_opt = (torch.optim.SGD(item_table.parameters(), lr=0.5) if dense_items else None)
    (users, items, clicks), (tu, ti, tc) = data
    rng = np.random.default_rng(1)
    t0 = time.perf_counter()
    for _ in range(steps):
        pick = rng.integers(0, len(users), batch)
        u, i, c = (torch.as_tensor(x[pick]) for x in (users, items, clicks))
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(u, i), c)
        opt.zero_grad()
        if sparse_opt is not None:
            sparse_opt.zero_grad()
        loss.backward()  # the TT table updates itself here (fused SGD)
        opt.step()
        if sparse_opt is not None:
            sparse_opt.step()
    step_ms = (time.perf_counter() - t0) / steps * 1e3
    with torch.no_grad():
        scores = model(torch.as_tensor(tu), torch.as_tensor(ti)).numpy()
    n_params = sum(p.numel() for p in item_table.parameters())
    print(f"{name:28s} item-table parameters {n_params:9d}  AUC {auc(scores, tc):.3f}  "
          f"step {step_ms:6.2f} ms")


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
    parser.add_argument("--steps", type=_positive_int, default=300,
                        help="training steps of each model (default: %(default)s)")
    parser.add_argument("--batch", type=_positive_int, default=512,
                        help="clicks per step (default: %(default)s)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import torch

    from xferlib.adapters.torch import OptimType, TTEmbeddingBag

    rng = np.random.default_rng(0)
    users, items, clicks = click_log(120_000, rng)
    split = 100_000
    data = ((users[:split], items[:split], clicks[:split]),
            (users[split:], items[split:], clicks[split:]))
    dense = torch.nn.EmbeddingBag(NUM_ITEMS, DIM, mode="sum", sparse=True,
                                  include_last_offset=True)
    train("dense nn.EmbeddingBag", dense, data, dense_items=True, steps=args.steps,
          batch=args.batch)
    tt_table = TTEmbeddingBag(NUM_ITEMS, DIM, [8, 8], tt_p_shapes=[20, 25, 40],
                              tt_q_shapes=[2, 2, 4], optimizer=OptimType.EXACT_ROWWISE_ADAGRAD,
                              learning_rate=0.05, weight_dist="normal", seed=0)
    train("xferlib TTEmbeddingBag", tt_table, data, dense_items=False, steps=args.steps,
          batch=args.batch)


if __name__ == "__main__":
    main()
