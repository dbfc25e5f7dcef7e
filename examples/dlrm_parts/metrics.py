"""AUC (scikit-learn's ``roc_auc_score``), logloss, the final table, ``--json`` and
``--plot``."""

from __future__ import annotations

import json
import math
import os

import numpy as np


def auc(labels, scores) -> float:
    """ROC AUC by scikit-learn's ``roc_auc_score``; :func:`rank_auc` where scikit-learn is
    not installed."""
    labels, scores = np.asarray(labels), np.asarray(scores, np.float64)
    try:
        from sklearn.metrics import roc_auc_score
    except ImportError:
        return rank_auc(labels, scores)
    return float(roc_auc_score(labels, scores))


def rank_auc(labels, scores) -> float:
    """AUC as the Mann-Whitney U statistic: ``(sum of the positives' ranks - P (P + 1) / 2) /
    (P N)``, tied scores sharing their average rank (what ``roc_auc_score`` computes).

    >>> rank_auc([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8])
    0.75
    """
    labels, scores = np.asarray(labels) > 0.5, np.asarray(scores, np.float64)
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    average_rank = np.cumsum(counts) - (counts - 1) / 2.0  # 1-based, ties averaged
    ranks = average_rank[inverse]
    n_pos, n_neg = int(labels.sum()), int((~labels).sum())
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def logloss(labels, logits) -> float:
    """Mean binary cross-entropy of logits, in float64."""
    x, y = np.asarray(logits, np.float64), np.asarray(labels, np.float64)
    return float(np.mean(np.maximum(x, 0) - x * y + np.log1p(np.exp(-np.abs(x)))))


def _gb(b):
    return f"{b / 2**30:.3f}"


def table(results) -> str:
    head = ("run", "AUC", "oracle AUC", "logloss", "samples/s", "peak GPU GB", "host GB",
            "HBM GB", "TT MB")
    rows = [head]
    for r in results:
        tb = r["table_bytes"]
        rows.append((r["name"], f"{r['auc']:.4f}", f"{r['oracle_auc']:.4f}",
                     f"{r['logloss']:.4f}", f"{r['samples_per_s']:,.0f}",
                     _gb(r["peak_gpu_bytes"]) if r["peak_gpu_bytes"] else "-",
                     _gb(tb["host"]), _gb(tb["hbm"] + tb["cache"]),
                     f"{tb['tt'] / 2**20:.2f}"))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    lines = ["  ".join(str(c).rjust(w) if i else str(c).ljust(w)
                       for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def profile_table(name, breakdown) -> str:
    """``--profile``'s breakdown: milliseconds per step by phase."""
    width = max(len(k) for k in breakdown)
    lines = [f"profile of {name}: ms per step"]
    lines += [f"  {k.ljust(width)}  {v:8.3f}" for k, v in breakdown.items()]
    return "\n".join(lines)


# Kinds of GPU kernel in a replayed DLRM step, by name (first match wins).
KERNEL_KINDS = (
    ("collectives (NCCL)", ("nccl",)),
    # FBGEMM's before the matmuls: its kernels' namespace, fbgemm_gpu, holds "gemm"
    ("embedding kernels (FBGEMM TBE)", ("fbgemm", "split_embedding", "lru_cache", "lxu_cache",
                                        "bounds_check_indices", "linearize_index")),
    # the collection's own sort and run numbering with it (FBGEMM's sort is CUB's, below:
    # its kernels live in cub::...::radix_sort::, so the keys name ours in full)
    ("embedding kernels (xferlib)", ("coll_", "radix_pass", "radix_histogram",
                                     "check_and_sort", "run_ids", "run_counts", "cache_")),
    ("dot interaction (xferlib)", ("doti_",)),
    ("matmuls", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_")),
    ("sorts and scans (torch / CUB)", ("radix", "sort", "scan", "cub::")),
    ("copies and fills", ("memcpy", "memset", "copy", "fill")),
)


EMBEDDING_PART = "embedding part (its kernels and sorts)"


def kernel_kinds(kernels, steps: int) -> dict:
    """``(name, microseconds)`` of every GPU kernel in ``steps`` steps, as milliseconds per
    step by kind (``KERNEL_KINDS``, the rest "other kernels"), the embedding part
    (``EMBEDDING_PART``: both engines' kernels and the sorts) and the kernel count per
    step. Kernels of different streams may overlap, so the kinds can add up to more than
    the step."""
    out = {kind: 0.0 for kind, _ in KERNEL_KINDS}
    out["other kernels"] = 0.0
    for name, us in kernels:
        low = name.lower()
        kind = next((k for k, keys in KERNEL_KINDS if any(key in low for key in keys)),
                    "other kernels")
        out[kind] += us / 1e3 / steps
    # What the embedding engine costs the step, whichever it is: FBGEMM's sort is CUB's,
    # counted above as a sort (the other engines' runs have next to no sorting of their own)
    out[EMBEDDING_PART] = (out["embedding kernels (FBGEMM TBE)"]
                           + out["embedding kernels (xferlib)"]
                           + out["sorts and scans (torch / CUB)"])
    out["kernels per step"] = len(kernels) / steps
    return out


def top_kernels(kernels, steps: int, count: int = 15) -> list:
    """The ``count`` kernels taking the most GPU time in ``steps`` steps, by name (template
    arguments and parameter lists cut): ``[name, ms per step, launches per step]``."""
    totals = {}
    for name, us in kernels:
        short = name.split("(")[0].split("<")[0].replace("void ", "").strip()
        t = totals.setdefault(short, [0.0, 0])
        t[0] += us / 1e3 / steps
        t[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:count]
    return [[name, ms, n / steps] for name, (ms, n) in ranked]


def top_kernels_table(name, top) -> str:
    lines = [f"{name}: the {len(top)} costliest kernels, ms per step (launches per step)"]
    lines += [f"  {ms:7.3f} ({n:4.1f})  {k[:90]}" for k, ms, n in top]
    return "\n".join(lines)


def fbgemm_pair_lines(results) -> list:
    """The closing lines of a ``--compare`` with FBGEMM: the xferlib run with row-wise Adagrad
    against each FBGEMM run (same model, table optimizer and matmul precision), in samples/s
    and AUC, and in the embedding part of a replayed step where both were profiled."""
    pair = [r for r in results
            if r["engine"] == "xferlib" and r["optimizer"] == "rowwise_adagrad"]
    lines = []
    for tbe in (r for r in results if r["engine"] == "fbgemm" and r["samples_per_s"]):
        if not pair:
            break
        ours = pair[0]
        lines.append(f"{ours['name']}: {ours['samples_per_s'] / tbe['samples_per_s']:.2f}x "
                     f"{tbe['name']}'s samples/s ({tbe['notes']}; same model, table optimizer "
                     f"and matmul precision, Adam for the dense part), AUC "
                     f"{ours['auc'] - tbe['auc']:+.4f}")
        mine, theirs = (r.get("profile_replay_ms", {}).get(EMBEDDING_PART) for r in (ours, tbe))
        if mine and theirs:  # --profile: the embedding engines' replayed kernels
            lines.append(f"{ours['name']}: embedding part {mine:.3f} ms per replayed step "
                         f"against {theirs:.3f} ({tbe['name']}): {theirs / mine:.2f}x")
    return lines


def write_json(path, results, extra) -> None:
    main = results[0]
    doc = {k: main[k] for k in ("framework", "preset", "steps", "samples_per_s", "auc",
                                "oracle_auc", "logloss")}
    doc.update(extra)
    doc["runs"] = results
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=lambda o: o.item() if hasattr(o, "item") else str(o))
    os.replace(tmp, path)


def plot(path, results, title) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_auc, ax_loss, ax_bar) = plt.subplots(1, 3, figsize=(13, 3.8))
    for r in results:
        h = r["history"]
        x = [p["samples"] / 1e6 for p in h]
        ax_auc.plot(x, [p["auc"] for p in h], marker="o", ms=3, label=r["name"])
        ax_loss.plot(x, [p["logloss"] for p in h], marker="o", ms=3, label=r["name"])
    oracle = results[0]["oracle_auc"]
    ax_auc.axhline(oracle, ls="--", c="k", lw=0.8, label=f"oracle {oracle:.4f}")
    ax_auc.set(xlabel="samples (M)", ylabel="eval AUC", title="AUC")
    ax_loss.set(xlabel="samples (M)", ylabel="eval logloss", title="logloss")
    ax_auc.legend(fontsize=7)
    ax_loss.legend(fontsize=7)
    names = [r["name"] for r in results]
    speeds = [r["samples_per_s"] / 1e3 for r in results]
    bars = ax_bar.bar(range(len(names)), speeds, color=[f"C{i}" for i in range(len(names))])
    ax_bar.set_xticks(range(len(names)), names, rotation=15, fontsize=7)
    ax_bar.set(ylabel="thousand samples/s", title="training throughput")
    for b, s in zip(bars, speeds):
        ax_bar.annotate(f"{s:,.1f}", (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center", va="bottom", fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def target_line(auc_value, oracle_auc) -> str:
    need = 0.5 + 0.8 * (oracle_auc - 0.5)
    ok = auc_value >= need and math.isfinite(auc_value)
    return (f"learned: AUC {auc_value:.4f} {'>=' if ok else '<'} {need:.4f} "
            f"= 0.5 + 0.8 (oracle - 0.5)")
