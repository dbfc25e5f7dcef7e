"""TT row cache kernels' CUDA source, spliced into the TT module by ``xferlib._kernels.tt``.

Two pieces of ``TT_KERNEL``, kept here so the TT kernel file stays readable; they are not a
module of their own (they use the TT shape's constants, ``rejected`` and ``update_row``), and
``tt.py`` concatenates them at their place in its source. The cache has no launch of its own
in a training step: its lookups run inside ``tt_prepare``, its counting inside ``tt_rows``, its
gradient sums inside ``tt_bwd_pieces`` and its optimizer step inside ``tt_update``.

* ``TT_CACHE_LOOKUP_KERNEL`` (before ``tt_prepare``): ``count_row`` (a row's accesses in an
  open-addressing frequency table), ``cache_slot_of`` (a row's slot among the sorted cached
  rows) and ``tt_count`` (``update_cache()``'s counting kernel).
* ``TT_CACHE_UPDATE_KERNEL`` (before ``tt_update``): ``tt_cache_update``, run by the blocks of
  ``tt_update`` past the core rows: each cached row's gradient summed from the segment sums
  ``tt_bwd_pieces`` left, in a fixed order, then its optimizer step.
"""

from __future__ import annotations

from xferlib._kernels._declare import KernelDecl

_COUNT_ROW = r"""
// Row access frequencies in an open-addressing table (key -1 = empty): a row is counted in
// one of the 32 slots after its hash, or not at all when those are taken by other rows.
// amount: the accesses added at once (a run of one row in a sorted batch: one atomic).
__device__ __forceinline__ void count_row(i64 row, i64* keys, long long* counts, i64 size,
                                          long long amount) {
    if (size <= 0) return;
    const u64 home = ((u64)row * 0x9E3779B97F4A7C15ull) % (u64)size;
    const int probes = size < 32 ? (int)size : 32;
    for (int probe = 0; probe < probes; ++probe) {
        const i64 s = (i64)((home + probe) % (u64)size);
        const u64 prev = atomicCAS(reinterpret_cast<u64*>(keys + s), ~0ull, (u64)row);
        if (prev == ~0ull || prev == (u64)row) {
            atomicAdd(reinterpret_cast<u64*>(counts + s), (u64)amount);
            return;
        }
    }
}

"""

TT_COUNT = KernelDecl(
    "tt_count", "",
    (("const i64*", "idx"), ("i64", "n"), ("i64*", "keys"), ("long long*", "counts"),
     ("i64", "size")),
    r"""
    for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t < n;
         t += (i64)gridDim.x * blockDim.x) {
        if (idx[t] >= 0) count_row(idx[t], keys, counts, size, 1);
    }""", extern_c=True)

_CACHE_SLOT_OF = r"""
// A row's slot in the sorted cached rows crow[0..capacity) (NO_ROW in empty slots), -1 if
// it is not cached.
__device__ __forceinline__ i64 cache_slot_of(i64 row, const i64* crow, i64 capacity) {
    i64 lo = 0, hi = capacity;  // first position with crow[pos] >= row
    while (lo < hi) {
        const i64 mid = (lo + hi) >> 1;
        if (crow[mid] < row) lo = mid + 1; else hi = mid;
    }
    return (lo < capacity && crow[lo] == row) ? lo : -1;
}
"""

TT_CACHE_LOOKUP_KERNEL = _COUNT_ROW + TT_COUNT.source() + _CACHE_SLOT_OF

# Sorted positions per chunk of the cache update (TT_CACHE_CHUNK in the TT module's defines).
CACHE_CHUNK = 64

TT_CACHE_UPDATE_KERNEL = r"""
// The row cache's optimizer step, run by tt_update's blocks past the core rows, each taking
// chunks of CACHE_CHUNK sorted positions (rows / perm as tt_rows reads them): every cached run
// (the positions of one cached row) that STARTS in the chunk is summed and its dense row gets
// update_row. tt_bwd_pieces left, at the last position of each segment of a cached run (its
// part within one of that kernel's CHUNK-position blocks), the segment's gradient summed in
// position order (cseg[j * DIM ...]); a run's gradient is the sum of its segments, split into
// CACHE_G contiguous ranges added in order: deterministic, no float atomics, a hot row's
// thousands of lookups summed by the whole block. Each cached row has one run, so blocks
// update distinct rows. Every index is bounded by n and capacity; a rejected batch changes
// nothing (tt_update tests its verdict first).
constexpr int UPDATE_THREADS = TT_UPDATE_THREADS;  // tt_update's block size
constexpr int CACHE_CHUNK = TT_CACHE_CHUNK;
constexpr int CACHE_EW = DIM < UPDATE_THREADS ? DIM : UPDATE_THREADS;  // elements per pass
constexpr int CACHE_G = UPDATE_THREADS / CACHE_EW;                     // groups along a run

// Sorted position j's cache slot (its lookup's slot in [0, capacity)), -1 if not cached.
__device__ __forceinline__ i64 cached_slot(const i64* perm, i64 n, const i64* slot, i64 capacity,
                                           i64 j) {
    const i64 m = perm[j];
    const i64 c = (m >= 0 && m < n) ? slot[m] : -1;
    return (c >= 0 && c < capacity) ? c : -1;
}

// Block `block` of `blocks` (blockDim.x == UPDATE_THREADS, block-uniform call).
template <typename K>
__device__ void tt_cache_update(const K* rows, const i64* perm, i64 n, const i64* slot,
                                i64 capacity, const float* cseg, float* cw, float* e1,
                                float* e2, float* rs, i64* st, const Hyper& h, float* red,
                                i64 block, i64 blocks) {
    __shared__ float part[CACHE_G * DIM];
    __shared__ float gs[DIM];
    __shared__ i64 srow[CACHE_CHUNK + 2];  // rows at positions first - 1 .. last + 1 (-1 outside)
    __shared__ i64 starts[CACHE_CHUNK], ends[CACHE_CHUNK], cslots[CACHE_CHUNK];
    __shared__ int found;
    const int e0 = threadIdx.x % CACHE_EW, grp = threadIdx.x / CACHE_EW;
    const i64 chunks = (n + CACHE_CHUNK - 1) / CACHE_CHUNK;
    for (i64 c = block; c < chunks; c += blocks) {
        const i64 first = c * CACHE_CHUNK;
        const i64 last = (first + CACHE_CHUNK < n ? first + CACHE_CHUNK : n) - 1;
        const int len = (int)(last - first + 1);
        __syncthreads();  // the previous chunk's lists are no longer read
        if (threadIdx.x == 0) found = 0;
        for (int t = threadIdx.x; t < CACHE_CHUNK + 2; t += blockDim.x) {
            const i64 j = first - 1 + t;
            srow[t] = (j >= 0 && j < n && j <= last + 1) ? (i64)rows[j] : -1;
        }
        __syncthreads();
        // Each cached run starting here, with its end: within the chunk from the staged rows,
        // past it (the chunk's last run only) by a binary search of the sorted rows.
        for (int t = threadIdx.x; t < len; t += blockDim.x) {
            const i64 row = srow[t + 1];
            if (row == srow[t]) continue;  // not a run start
            const i64 cs = cached_slot(perm, n, slot, capacity, first + t);
            if (cs < 0) continue;
            int u = t + 1;
            while (u < len && srow[u + 1] == row) ++u;
            i64 end = first + u;
            if (u == len && srow[len + 1] == row) {  // rows[last + 1] is the row too
                i64 lo = last + 2, hi = n;
                while (lo < hi) {
                    const i64 mid = (lo + hi) >> 1;
                    if ((i64)rows[mid] <= row) lo = mid + 1; else hi = mid;
                }
                end = lo;
            }
            const int at = atomicAdd(&found, 1);  // runs update distinct rows: any list order
            starts[at] = first + t;
            ends[at] = end;
            cslots[at] = cs;
        }
        __syncthreads();
        const int runs = found;
        // Under an elementwise rule, the runs inside one block of tt_bwd_pieces (their sum is
        // that block's one segment) all at once, a thread per (run, element), no barrier per
        // run; the same arithmetic as update_row's.
        const bool elementwise = h.opt == XF_OPT_SGD || h.opt == XF_OPT_ADAGRAD;
        if (elementwise) {
            XfScalars<float> sc = xf_neutral<float>();
            sc.lr = h.lr;
            sc.eps = h.eps;
            for (int i = threadIdx.x; i < runs * DIM; i += blockDim.x) {
                const int e = i % DIM;
                const int r = (i - e) / DIM;
                const i64 j = ends[r] - 1, cs = cslots[r];
                if (starts[r] / CHUNK != j / CHUNK || j < 0 || j >= n) continue;  // a long run
                const float grad = cseg[j * DIM + e];
                if (h.opt == XF_OPT_SGD) {
                    float none = 0.f;  // no momentum buffer
                    xf_sgd(cw[cs * DIM + e], grad, none, sc);
                } else {
                    xf_adagrad(cw[cs * DIM + e], grad, e1[cs * DIM + e], sc);
                }
            }
        }
        for (int r = 0; r < runs; ++r) {
            const i64 j0 = starts[r], end = ends[r], cs = cslots[r];
            if (elementwise && j0 / CHUNK == (end - 1) / CHUNK) continue;  // done above
            // segment k (tt_bwd_pieces' block k) ends at min((k + 1) CHUNK, end) - 1
            const i64 k0 = j0 / CHUNK, segs = (end - 1) / CHUNK - k0 + 1;
            if (grp < CACHE_G) {
                const i64 ka = k0 + segs * grp / CACHE_G, kb = k0 + segs * (grp + 1) / CACHE_G;
                for (int e = e0; e < DIM; e += CACHE_EW) {
                    float s = 0.f;
                    for (i64 k = ka; k < kb; k += 8) {
                        float x[8];
#pragma unroll
                        for (int u = 0; u < 8; ++u) {
                            const i64 kk = k + u, next = (kk + 1) * CHUNK;
                            const i64 j = next < end ? next - 1 : end - 1;
                            x[u] = (kk < kb && j >= 0 && j < n) ? cseg[j * DIM + e] : 0.f;
                        }
#pragma unroll
                        for (int u = 0; u < 8; ++u) s += x[u];
                    }
                    part[grp * DIM + e] = s;
                }
            }
            __syncthreads();
            for (int e = threadIdx.x; e < DIM; e += blockDim.x) {
                float s = 0.f;
                for (int gg = 0; gg < CACHE_G; ++gg) s += part[gg * DIM + e];
                gs[e] = s;
            }
            __syncthreads();
            update_row(cw + cs * DIM, gs, DIM, e1 ? e1 + cs * DIM : nullptr,
                       e2 ? e2 + cs * DIM : nullptr, rs ? rs + cs : nullptr,
                       st ? st + cs : nullptr, h, red);
            __syncthreads();  // gs and part are refilled by the next run
        }
    }
}
"""
