"""The ``xferlib`` command: ``xferlib doctor``, ``xferlib info`` and
``xferlib bench [SUITE ...]``."""

from __future__ import annotations

import argparse
import os
import sys


def _info() -> int:
    import numpy as np

    import xferlib
    from xferlib._backend import cupy_available
    from xferlib.bench.report import environment

    env = environment()
    print(f"xferlib {xferlib.__version__}")
    for key, value in env.items():
        print(f"  {key}: {value}")
    backends = ["numpy"] + (["cupy (CUDA kernels)"] if cupy_available() else [])
    print(f"  backends: {', '.join(backends)}")
    print("  (`xferlib doctor` checks builds and settings and says what to fix)")
    if not cupy_available():
        print("  pinned memory: unavailable (no CUDA GPU); host arrays are ordinary memory")
        return 0
    import cupy

    with xferlib.pinned_empty((1 << 20,), np.float32) as host:
        host[:] = np.arange(host.size, dtype=np.float32)
        pinned = xferlib.is_pinned(host)
        device = cupy.asarray(host)
        ok = bool((device == cupy.arange(host.size, dtype=cupy.float32)).all())
    print(f"  pinned memory: {'ok' if pinned and ok else 'FAILED'} "
          f"(registered={pinned}, round trip={'ok' if ok else 'wrong'})")
    return 0 if pinned and ok else 1


def _suites_help(argv) -> str:
    """``xferlib bench``'s list of suites, read from the registry (the entry points of
    ``xferlib.bench``) only when the command line is about ``bench``: the other commands
    load no suite."""
    if "bench" not in argv:
        return "suites to run"
    from xferlib.bench import SUITES

    return f"suites to run: {', '.join(SUITES) or 'none registered (reinstall xferlib)'}"


def plot_format_error(path):
    """Why matplotlib cannot write ``path`` (its extension names no format it writes), or
    None; None too where matplotlib is not installed (the plot is then skipped, saying so)."""
    ext = os.path.splitext(path)[1][1:].lower()
    if not ext:
        return None  # matplotlib writes a PNG
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return None
    formats = FigureCanvasBase.get_supported_filetypes()
    if ext in formats:
        return None
    return f"--plot {path}: matplotlib writes no {ext!r} files; use one of {sorted(formats)}"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="xferlib", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="what this machine can use (GPU, CUDA, CuPy/torch/JAX "
                            "builds, pinned memory, memory settings) and what to install or set")
    doctor.add_argument("--warm", action="store_true",
                        help="compile the kernels ahead instead (once per machine: CuPy caches "
                             "them on disk), so a first run starts at once")
    sub.add_parser("info", help="versions, GPU, CUDA runtime, backends, pinned-memory check")
    bench = sub.add_parser("bench", help="run benchmark suites (all when none is named)")
    bench.add_argument("suites", nargs="*", help=_suites_help(argv))
    bench.add_argument("--quick", action="store_true",
                       help="a reduced set (each suite a minute or two)")
    bench.add_argument("--json", metavar="PATH", help="write the results as JSON")
    bench.add_argument("--plot", metavar="PATH", help="write a PNG plot")
    args = parser.parse_args(argv)
    if args.command == "info":
        return _info()
    if args.command == "doctor":
        if args.warm:
            from xferlib.warm import warm_command

            return warm_command()
        from xferlib.doctor import run_doctor

        return run_doctor()
    from xferlib.bench import run_suites

    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not os.path.isdir(folder):  # before the suites run, not after
            parser.error(f"{flag} {path}: the folder {folder} does not exist")
        if path and os.path.isdir(path):
            parser.error(f"{flag} {path} is a directory; give a file name")
    unknown = plot_format_error(args.plot) if args.plot else None
    if unknown:
        parser.error(unknown)
    try:
        run_suites(args.suites, quick=args.quick, json_path=args.json, plot_path=args.plot)
    except ValueError as err:
        parser.error(str(err))
    return 0


if __name__ == "__main__":
    sys.exit(main())
