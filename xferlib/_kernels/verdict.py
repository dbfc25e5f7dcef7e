"""A batch verdict's two words copied to its pinned host slot by a kernel
(``xferlib.checks.PendingChecks``), not by a device-to-host copy: a copy node waits on the
copy engine, and the stream's next kernel waits for it (an H200, a replayed collection step
with a 16-byte copy between its forward and backward: about 8 us between their kernels,
against 0.4 from kernel to kernel). Pinned host memory is mapped for the device: the same
pointer serves both."""

from __future__ import annotations

from xferlib._kernels._declare import KernelDecl
from xferlib._kernels._registry import KernelModule

__all__ = ["VERDICT_COPY", "VERDICT_KERNEL", "VERDICT_MODULE"]

VERDICT_COPY = KernelDecl(
    "verdict_copy", "",
    (("const unsigned long long* __restrict__", "words"),
     ("unsigned long long* __restrict__", "host")),
    r"""
    if (threadIdx.x < 2) host[threadIdx.x] = words[threadIdx.x];""",
    extern_c=True)

VERDICT_KERNEL = VERDICT_COPY.source()
VERDICT_MODULE = KernelModule("verdict", VERDICT_KERNEL, [VERDICT_COPY.instance()])
