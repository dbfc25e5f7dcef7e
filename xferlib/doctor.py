"""``xferlib doctor``: what this machine can use, and what to install or set where it cannot.

Each check prints one line tagged ``ok`` (works), ``--`` (absent, optional) or ``!!`` (a
problem that costs speed or breaks a path); the closing lists say what to do about each
``!!`` and what to install for more paths (each ``--``): a CPU machine without CuPy has
nothing to fix, its NumPy path runs, and the GPU paths are an optional install. The checks
run in an order that keeps them honest: free GPU memory is read before torch or JAX touch the
GPU, and JAX is imported last, with the user's preallocation setting reported as it was
found.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib import metadata

import numpy as np

__all__ = ["run_doctor"]


class _Report:
    def __init__(self):
        self.todo: list[str] = []  # fixes for problems (``!!``)
        self.optional: list[str] = []  # installs that add paths (``--``)
        self.failed = False

    def line(self, tag: str, what: str, detail: str) -> None:
        print(f"  {tag:2}  {what:<22} {detail}")

    def ok(self, what, detail):
        self.line("ok", what, detail)

    def absent(self, what, detail, todo=None):
        self.line("--", what, detail)
        if todo:
            self.optional.append(todo)

    def problem(self, what, detail, todo=None, failed=False):
        self.line("!!", what, detail)
        if todo:
            self.todo.append(todo)
        self.failed |= failed


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _gb(n) -> str:
    return f"{n / 1e9:.1f} GB"


def _cuda_text(version: int | None) -> str:
    return "none" if not version else f"{version // 1000}.{version % 1000 // 10}"


def _cupy_extra(driver: int | None) -> str:
    return "cuda13" if driver and driver >= 13000 else "cuda12"


def _nvidia_smi_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    text = out.stdout.strip()
    return text.splitlines()[0] if out.returncode == 0 and text else None


def _host(report: _Report) -> None:
    from xferlib.memory import meminfo, available_host_memory

    info = meminfo()
    available = available_host_memory()
    if available is None:
        report.absent("host memory", "the system does not report its free memory")
    else:
        total = f" of {_gb(info['MemTotal'])}" if "MemTotal" in info else ""
        report.ok("host memory", f"{_gb(available)} available{total} (host tables "
                  "and their optimizer state must fit in it)")


def _gpu(report: _Report) -> dict:
    """GPU, driver, CuPy; free GPU memory before any framework allocates."""
    found = {"driver": None, "cupy_cuda": None, "gpu": False}
    cupy_dist = next((d for d in ("cupy-cuda13x", "cupy-cuda12x", "cupy") if _version(d)), None)
    smi_driver = _nvidia_smi_driver()
    try:
        import cupy
    except Exception as err:  # ImportError, or a CUDA library that fails to load
        if cupy_dist:
            report.problem("CuPy", f"{cupy_dist} {_version(cupy_dist)} is installed but does not "
                           f"import: {type(err).__name__}: {err}",
                           f"reinstall CuPy for this machine's CUDA: pip install "
                           f"'xferlib[cuda13]' (driver >= 580) or 'xferlib[cuda12]'")
        else:
            report.absent("CuPy", "not installed: GPU paths are off, the NumPy path runs",
                          "for the GPU paths: pip install 'xferlib[cuda13]' (or 'xferlib[cuda12]' "
                          "for a CUDA 12 driver)")
        report.absent("GPU", f"not usable without CuPy (nvidia-smi driver: {smi_driver or 'none'})")
        return found
    try:
        found["driver"] = cupy.cuda.runtime.driverGetVersion() or None
    except Exception:
        found["driver"] = None
    try:
        runtime = cupy.cuda.runtime.runtimeGetVersion()
        found["cupy_cuda"] = runtime // 1000
    except Exception:
        runtime = None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:
        count = 0
        reason = str(err).split(":")[0]
    else:
        reason = "no CUDA device"
    if count == 0:
        report.absent("GPU", f"none ({reason}); CUDA driver: "
                      f"{_cuda_text(found['driver']) if found['driver'] else smi_driver or 'none'}"
                      f"; the NumPy path runs")
        report.ok("CuPy", f"{cupy.__version__} ({cupy_dist}, CUDA runtime "
                  f"{_cuda_text(runtime) if runtime else 'not loadable'}), no device to use")
        return found
    found["gpu"] = True
    for i in range(count):
        props = cupy.cuda.runtime.getDeviceProperties(i)
        with cupy.cuda.Device(i):
            free, total = cupy.cuda.runtime.memGetInfo()
        report.ok(f"GPU {i}", f"{props['name'].decode()} (sm_{props['major']}{props['minor']}), "
                  f"{_gb(free)} free of {_gb(total)}")
    driver_text = _cuda_text(found["driver"]) + (f" (driver {smi_driver})" if smi_driver else "")
    report.ok("CUDA driver", f"supports CUDA up to {driver_text}")
    if found["driver"] and runtime and runtime // 1000 > found["driver"] // 1000:
        report.problem("CuPy", f"{cupy.__version__} ({cupy_dist}) needs CUDA {_cuda_text(runtime)}"
                       f", newer than the driver's {_cuda_text(found['driver'])}",
                       f"install the CuPy of the driver's CUDA: pip install "
                       f"'xferlib[{_cupy_extra(found['driver'])}]', or update the driver",
                       failed=True)
    else:
        report.ok("CuPy", f"{cupy.__version__} ({cupy_dist}), CUDA runtime {_cuda_text(runtime)}")
    _pinned(report, cupy)
    _managed(report, cupy)
    return found


def _pinned(report: _Report, cupy) -> None:
    """Pin 64 MB in place, round-trip it, and time pinned against pageable uploads."""
    import xferlib

    n = 16 << 20  # float32 values: 64 MB
    pageable = np.arange(n, dtype=np.float32)
    try:
        host = xferlib.pinned_empty(n, np.float32)
    except Exception as err:
        report.problem("pinned memory", f"allocation failed: {type(err).__name__}: {err}",
                       "pinned memory is unusable: check `ulimit -l` and the container's "
                       "memory limit", failed=True)
        return
    with host:
        host[:] = pageable
        device = cupy.empty(n, dtype=np.float32)
        stream = cupy.cuda.Stream(non_blocking=True)
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()

        def rate(src) -> float:
            device.data.copy_from_host_async(src.ctypes.data, src.nbytes, stream)  # warm-up
            start.record(stream)
            for _ in range(5):
                device.data.copy_from_host_async(src.ctypes.data, src.nbytes, stream)
            stop.record(stream)
            stop.synchronize()
            return 5 * src.nbytes / (cupy.cuda.get_elapsed_time(start, stop) * 1e-3) / 1e9

        pinned_rate, pageable_rate = rate(host), rate(pageable)
        ok = xferlib.is_pinned(host) and bool((device == cupy.arange(n, dtype=cupy.float32))
                                              .all())
    if ok:
        report.ok("pinned memory", f"works: host->GPU {pinned_rate:.1f} GB/s pinned, "
                  f"{pageable_rate:.1f} GB/s pageable ({pinned_rate / pageable_rate:.0f}x: "
                  "pin host tables with xferlib.pin)")
    else:
        report.problem("pinned memory", "registered memory did not round-trip correctly",
                       "pinned memory is broken here: report the output of `xferlib doctor`",
                       failed=True)


def _managed(report: _Report, cupy) -> None:
    """Where a collection's host tables go: managed memory kept in host RAM (the GPU maps it
    in large pages), checked by a round trip through a kernel, or pinned memory."""
    from xferlib import managed

    if managed.pinned_requested():
        report.ok("host tables", "pinned memory (XFERLIB_HOST_MEMORY=pinned)")
        return
    try:
        if not managed.managed_available():
            report.ok("host tables", "pinned memory (this GPU or driver offers no managed "
                      "memory kept in host RAM; scattered rows cross the link more slowly)")
            return
        host = managed.managed_empty(1 << 20, np.float32)
        view = managed.gpu_view(host)
        view += cupy.arange(host.size, dtype=cupy.float32)  # a kernel writes host RAM
        cupy.cuda.get_current_stream().synchronize()
        ok = bool(np.array_equal(host, np.arange(host.size, dtype=np.float32)))
        detail = "managed memory did not round-trip correctly"
    except Exception as err:
        ok, detail = False, f"managed memory failed: {type(err).__name__}: {err}"
    if ok:
        report.ok("host tables", "managed memory kept in host RAM, mapped by the GPU "
                  "(XFERLIB_HOST_MEMORY=pinned to pin instead)")
    else:
        report.problem("host tables", detail, "set XFERLIB_HOST_MEMORY=pinned and report the "
                       "output of `xferlib doctor`", failed=True)


def _torch(report: _Report, found: dict) -> None:
    version = _version("torch")
    if version is None:
        report.absent("torch", "not installed (needed only for xferlib.adapters.torch)",
                      "for the torch adapters: pip install torch")
        return
    import torch

    cuda = torch.version.cuda
    found["torch_cuda"] = int(cuda.split(".")[0]) if cuda else None
    if not cuda:
        detail = f"{torch.__version__}, a CPU build"
        if found["gpu"]:
            report.problem("torch", detail + " on a machine with a GPU",
                           "install a CUDA build of torch (https://pytorch.org/get-started, "
                           f"CUDA {found['driver'] // 1000 if found['driver'] else 12}.x wheels)")
        else:
            report.ok("torch", detail)
        return
    usable = torch.cuda.is_available()
    detail = f"{torch.__version__}, CUDA {cuda}, GPU {'usable' if usable else 'NOT usable'}"
    if found["gpu"] and not usable:
        report.problem("torch", detail, "torch's CUDA build does not run with this driver: "
                       "install the torch build of the driver's CUDA version")
    else:
        report.ok("torch", detail)
    alloc = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    report.ok("torch allocator", f"PYTORCH_CUDA_ALLOC_CONF={alloc}" if alloc else
              "default caching allocator (PYTORCH_CUDA_ALLOC_CONF unset)")


def _jax(report: _Report, found: dict, prealloc: str | None) -> None:
    version = _version("jax")
    plugin = next((d for d in ("jax-cuda13-plugin", "jax-cuda12-plugin") if _version(d)), None)
    found["jax_cuda"] = int(plugin.split("-cuda")[1][:2]) if plugin else None
    if version is None:
        report.absent("JAX", "not installed (needed only for xferlib.adapters.jax)",
                      "for the JAX adapters: pip install 'xferlib[jax]'")
        return
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # this probe only
    try:
        import jax

        platforms = sorted({d.platform for d in jax.devices()})
    except Exception as err:
        report.problem("JAX", f"{version} fails to start: {type(err).__name__}: {err}",
                       "reinstall JAX with the plugin of the driver's CUDA: pip install "
                       f"'jax[{_cupy_extra(found['driver'])}]'")
        return
    detail = f"{version}, plugin {plugin or 'none'}, devices: {', '.join(platforms)}"
    if found["gpu"] and "gpu" not in platforms and "cuda" not in platforms:
        report.problem("JAX", detail + " (no GPU)",
                       f"for JAX on the GPU: pip install 'jax[{_cupy_extra(found['driver'])}]'")
    else:
        report.ok("JAX", detail)
    if prealloc is not None and prealloc.lower() in ("false", "0"):
        report.ok("JAX preallocation", f"off (XLA_PYTHON_CLIENT_PREALLOCATE={prealloc}): "
                  "torch and CuPy share the GPU")
    elif found["gpu"]:
        setting = "unset" if prealloc is None else f"={prealloc}"
        report.problem("JAX preallocation", f"on (XLA_PYTHON_CLIENT_PREALLOCATE {setting}): "
                       "JAX takes 75% of GPU memory when it starts, starving torch/CuPy in "
                       "the same process",
                       "with torch or CuPy in the same process as JAX: export "
                       "XLA_PYTHON_CLIENT_PREALLOCATE=false (or set os.environ before "
                       "`import jax`)")
    else:
        report.ok("JAX preallocation", "irrelevant without a GPU (on a GPU, set "
                  "XLA_PYTHON_CLIENT_PREALLOCATE=false where torch or CuPy share the process)")


def _matching(report: _Report, found: dict) -> None:
    builds = {name: found.get(key) for name, key in (("CuPy", "cupy_cuda"),
              ("torch", "torch_cuda"), ("JAX", "jax_cuda")) if found.get(key)}
    if not builds:
        return
    driver = found["driver"] // 1000 if found["driver"] else None
    too_new = [f"{n} (CUDA {v})" for n, v in builds.items() if driver and v > driver]
    if too_new:
        report.problem("CUDA versions", f"built for a newer CUDA than the driver's {driver}: "
                       + ", ".join(too_new),
                       "update the NVIDIA driver, or install builds for CUDA "
                       f"{driver} ('xferlib[cuda{driver}]', torch cu{driver}x wheels)",
                       failed=False)
    text = ", ".join(f"{n} {v}" for n, v in builds.items())
    if len(set(builds.values())) > 1:
        report.problem("CUDA versions", f"the builds differ ({text}): each loads its own CUDA "
                       "libraries (more memory, slower start); arrays still pass between them",
                       "prefer one CUDA major for CuPy, torch and JAX: xferlib[cuda12] with "
                       "cu12x torch, or xferlib[cuda13] with cu13x torch")
    elif not too_new:
        report.ok("CUDA versions", f"match ({text})")


def run_doctor() -> int:
    """Print the report; 0 unless something present is broken (a failed pinned-memory check,
    a CuPy newer than the driver)."""
    import xferlib

    prealloc = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")  # as the user set it
    report = _Report()
    print(f"xferlib {xferlib.__version__} doctor: Python {platform.python_version()} on "
          f"{platform.system()} {platform.machine()}, NumPy {np.__version__}")
    _host(report)
    found = _gpu(report)
    _torch(report, found)
    _jax(report, found, prealloc)
    if found["gpu"]:
        _matching(report, found)
    if found["gpu"]:
        report.ok("GPU paths", "on: CUDA tensors, CuPy arrays and pinned host tables use the "
                  "kernels")
    else:
        report.ok("CPU path", "NumPy arrays and CPU tensors run the vectorized NumPy code")
    if report.todo:
        print("What to do:")
        for i, item in enumerate(dict.fromkeys(report.todo), 1):
            print(f"  {i}. {item}")
    elif found["gpu"] and not report.optional:
        print("Nothing to do: every path xferlib has is usable here.")
    elif found["gpu"]:
        print("Nothing to fix: the GPU paths are usable here.")
    else:
        print("Nothing to fix. Without a GPU xferlib runs every op on its NumPy path; the GPU "
              "paths need an NVIDIA GPU, its driver and CuPy.")
    if report.optional:
        print("Optional, for more paths:")
        for i, item in enumerate(dict.fromkeys(report.optional), 1):
            print(f"  {i}. {item}")
    sys.stdout.flush()
    return 1 if report.failed else 0
