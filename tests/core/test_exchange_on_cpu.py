"""The exchange kernels' CUDA source run on the CPU: compiled by the host's C++ compiler under a
small shim (``__global__`` a plain function, the atomics plain read-modify-writes) and run for
every block and thread in turn, which is one schedule a GPU may pick (the kernels share no
memory between threads but their counts and flags, and use no barriers). Against the NumPy
reference, bit for bit, so a machine without a GPU still checks the kernels' logic; the GPU
tests (``test_exchange.py``) run the same source on the device."""

import ctypes
import shutil
import subprocess

import numpy as np
import pytest

from xferlib._kernels.exchange import (EXCHANGE_KERNEL, XCH_CHECK, XCH_COUNT, XCH_PACK,
                                       XCH_UNPACK)
from xferlib.collection.exchange import exchange_routes

from tests.core import test_exchange as ref

_SHIM = r"""
#include <cstdint>
#define __global__
#define __device__
#define __forceinline__ inline
struct dim3_ { unsigned x; };
static dim3_ blockIdx, threadIdx, gridDim, blockDim;
static unsigned long long atomicOr(unsigned long long* a, unsigned long long v) {
    unsigned long long o = *a; *a |= v; return o; }
static unsigned long long atomicAdd(unsigned long long* a, unsigned long long v) {
    unsigned long long o = *a; *a += v; return o; }
"""
_DECLS = (XCH_CHECK, XCH_COUNT, XCH_PACK, XCH_UNPACK)


def _driver(decl) -> str:
    """``run_<name>(grid, block, args...)``: the kernel for every (block, thread) in turn."""
    templated = bool(decl.template)
    params = ", ".join(f"{t.replace('W', 'float') if templated else t} {n}"
                       for t, n in decl.args)
    call = f"{decl.name}<float>" if templated else decl.name
    names = ", ".join(n for _, n in decl.args)
    return (f'extern "C" void run_{decl.name}(unsigned grid, unsigned block, {params}) {{\n'
            f"  gridDim.x = grid; blockDim.x = block;\n"
            f"  for (unsigned b = 0; b < grid; ++b) for (unsigned t = 0; t < block; ++t) {{\n"
            f"    blockIdx.x = b; threadIdx.x = t; {call}({names}); }}\n}}\n")


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    compiler = shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("needs a C++ compiler (g++ or clang++)")
    folder = tmp_path_factory.mktemp("exchange_cpu")
    source = folder / "exchange.cpp"
    source.write_text(_SHIM + EXCHANGE_KERNEL + "".join(_driver(d) for d in _DECLS))
    library = folder / "libexchange.so"
    subprocess.run([compiler, "-O1", "-shared", "-fPIC", "-std=c++17", "-o", str(library),
                    str(source)], check=True, capture_output=True, timeout=120)
    return ctypes.CDLL(str(library))


def _launch(lib, decl, grid, **values):
    args = []
    for ctype, name in decl.args:
        v = values[name]
        if "*" in ctype:
            args.append(ctypes.c_void_p(0 if v is None else v.ctypes.data))
        else:
            args.append(ctypes.c_int(int(v)) if ctype == "int" else ctypes.c_longlong(int(v)))
    getattr(lib, f"run_{decl.name}")(ctypes.c_uint(grid[0]), ctypes.c_uint(grid[1]), *args)


def _send(lib, grid, plan, idx, off, w, B, max_bag, others, mean, n):
    """One rank's messages through the kernels run on the CPU (``ref._send``'s steps)."""
    routes = exchange_routes(plan)
    S, caps, msg_base, w_base = ref._rooms(plan, B, max(n, idx.size), max_bag)
    route = dict(idx=idx.astype(np.int64), n=idx.size, off=off.astype(np.int64), B=B,
                 T=(off.size - 1) // B if B else 0, table_rows=routes.table_rows,
                 table_shard0=routes.table_shard0, shard_row0=routes.shard_row0)
    flags = np.zeros(2, dtype=np.uint64)
    _launch(lib, XCH_CHECK, grid, max_bag=max_bag, flags=flags, **route)
    any_bad = np.array([int(flags.sum()) + others], dtype=np.int64)
    counts = np.zeros(plan.world_size * S * B, dtype=np.int64)
    _launch(lib, XCH_COUNT, grid, shard_slot=routes.shard_slot, flags=flags, any_bad=any_bad,
            counts=counts, **route)
    msg = np.zeros(plan.world_size * S * B + int(caps.sum()), dtype=np.int64)
    w_msg = np.zeros(int(caps.sum()), dtype=np.float32)
    _launch(lib, XCH_PACK, grid, shard_slot=routes.shard_slot, flags=flags, any_bad=any_bad,
            counts=counts, scan=np.cumsum(counts), S=S, world=plan.world_size,
            msg_base=np.asarray(msg_base, np.int64), caps=np.asarray(caps, np.int64), msg=msg,
            psw=np.ascontiguousarray(w, np.float32), mean=int(mean),
            w_base=np.asarray(w_base, np.int64), w_msg=w_msg, **route)
    return flags, counts, msg, w_msg


def _receive(lib, grid, plan, messages, w_messages, B, owner, layout):
    S, caps, msg_base, w_base = layout
    world, head, room = plan.world_size, S * B, int(caps[owner])
    received = np.ascontiguousarray(np.stack(
        [m[msg_base[owner]:msg_base[owner] + head + room] for m in messages]))
    w_received = np.ascontiguousarray(np.stack(
        [w[w_base[owner]:w_base[owner] + room] for w in w_messages]))
    T_me = len(plan.shards_of(owner))
    lengths = received[:, :T_me * B]
    offsets = np.concatenate([[0], np.cumsum(lengths.reshape(world, T_me, B)
                                             .transpose(1, 0, 2).reshape(-1))]).astype(np.int64)
    idx = np.zeros(world * room, dtype=np.int64)
    w = np.zeros(world * room, dtype=np.float32)
    _launch(lib, XCH_UNPACK, grid, received=received, world=world, row=received.shape[1],
            head=head, room=room, T_me=T_me, B=B, scan=np.cumsum(lengths.reshape(-1)),
            offsets=offsets, idx_out=idx, w_received=w_received, w_out=w)
    return offsets, idx, w


@pytest.mark.parametrize("grid", [(1, 1), (3, 7), (64, 32)])
@pytest.mark.parametrize("world,row_wise,B,max_len,max_bag",
                         ref.CASES + [(2, ("d",), 2, 40, 0)])
@pytest.mark.parametrize("case", ["good", "bad index", "other rank bad", "bad offsets",
                                  "mean"])
def test_kernels_on_the_cpu_match_the_reference(kernels, grid, world, row_wise, B, max_len,
                                                max_bag, case):
    plan = ref._plan(world, row_wise)
    rng = np.random.default_rng(world * 7 + B + max_len)
    batches = [ref._batch(rng, B, max_len, bad_index=case == "bad index")
               for _ in range(world)]
    if case == "bad offsets":
        i, o, w = batches[0]
        batches[0] = (i, np.concatenate([o[:-1], [o[-1] + 2]]), w)
    others, mean = int(case == "other rank bad"), case == "mean"
    n = max(i.size for i, _, _ in batches)
    want = [ref._send(np, plan, i, o, w, B, max_bag, others, mean, n=n)
            for i, o, w in batches]
    got = [_send(kernels, grid, plan, i, o, w, B, max_bag, others, mean, n)
           for i, o, w in batches]
    for a, b in zip(want, got):
        for x, y in zip(a[:4], b):
            np.testing.assert_array_equal(np.asarray(x).astype(y.dtype), y)
    layout = want[0][4]
    for owner in range(world):
        if plan.shards_of(owner):
            expected = ref._receive(np, plan, [s[2] for s in want], [s[3] for s in want], B,
                                    owner, layout)
            for x, y in zip(expected, _receive(kernels, grid, plan, [s[2] for s in got],
                                               [s[3] for s in got], B, owner, layout)):
                np.testing.assert_array_equal(x, y)
