"""Printing, JSON and PNG output shared by the benchmark suites."""

from __future__ import annotations

import json
import platform


def environment() -> dict:
    """Versions and device, recorded beside every result."""
    from importlib import metadata

    env = {"python": platform.python_version(), "machine": platform.machine()}
    for dist in ("numpy", "cupy-cuda12x", "cupy-cuda13x", "torch", "jax", "ml_dtypes"):
        try:
            env[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    from xferlib._backend import cupy_available

    if cupy_available():
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        env["gpu"] = props["name"].decode()
        env["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
    else:
        env["gpu"] = None
    return env


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """``columns``: (key, header, format)."""
    widths = [max(len(h), 10) for _, h, _ in columns]
    print("  ".join(h.rjust(w) for (_, h, _), w in zip(columns, widths)))
    for row in rows:
        cells = []
        for (key, _, fmt), w in zip(columns, widths):
            value = row.get(key, "")
            cells.append((format(value, fmt) if value not in ("", None) else "-").rjust(w))
        print("  ".join(cells))


def write_json(path: str, payload: dict) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {path}")


def write_plot(path: str, results: list[dict]) -> None:
    """GB/s against rows per call, one panel per row size, one line per implementation."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; no plot (pip install 'xferlib[bench]')")
        return
    records = [r for r in results if r.get("rows") and "row_bytes" in r]
    if not records:
        return _bar_plot(path, results, plt)
    sizes = sorted({r["row_bytes"] for r in records})
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        lines = {}
        for r in records:
            if r["row_bytes"] == size:
                lines.setdefault((r["op"], r["impl"], r["order"]), []).append(
                    (r["rows"], r["GB_per_s"]))
        for (op, impl, order), points in sorted(lines.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                    label=f"{op} {impl} ({order})")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows per call")
        ax.set_ylabel("GB/s")
        ax.set_title(f"{size} B rows")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def _bar_plot(path, results, plt):
    """Milliseconds per implementation, one panel per parameter set (``xferlib bench optim``)."""
    sets = sorted({r["set"] for r in results if "set" in r})
    if not sets:
        print("nothing to plot")
        return
    fig, axes = plt.subplots(1, len(sets), figsize=(5 * len(sets), 4), squeeze=False)
    for ax, name in zip(axes[0], sets):
        rows = [r for r in results if r.get("set") == name]
        ax.barh([r["impl"] for r in rows], [r["ms"] for r in rows])
        ax.axvline(rows[0]["floor_ms"], color="k", linestyle="--", label="HBM floor")
        ax.set_xscale("log")
        ax.set_xlabel("ms per step")
        ax.set_title(name)
        ax.tick_params(axis="y", labelsize=6)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
