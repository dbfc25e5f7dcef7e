"""TT row cache kernels: CUDA source spliced into the TT module by ``xferlib._kernels.tt``.

Two pieces of ``TT_KERNEL``, kept here so the TT kernel file stays readable; they are not a
module of their own (they use the TT shape's constants, ``rejected``, ``bound_at`` and
``update_row``), and ``tt.py`` concatenates them at their place in its source:

* ``TT_CACHE_SLOTS_KERNEL`` (after ``tt_reduce_join``): ``tt_count`` and ``tt_cache_slots``,
  each lookup's cache slot and its access count in an open-addressing frequency table.
* ``TT_CACHE_UPDATE_KERNEL`` (after ``tt_update``): ``tt_cache_chunks`` and
  ``tt_cache_update``, the cached rows' gradients summed in two deterministic passes over
  chunks of the sorted batch, then their optimizer step.
"""

from __future__ import annotations

TT_CACHE_SLOTS_KERNEL = r"""
// Row access frequencies in an open-addressing table (key -1 = empty): a row is counted in
// one of the 32 slots after its hash, or not at all when those are taken by other rows.
__device__ __forceinline__ void count_row(i64 row, i64* keys, long long* counts, i64 size) {
    const u64 home = ((u64)row * 0x9E3779B97F4A7C15ull) % (u64)size;
    const int probes = size < 32 ? (int)size : 32;
    for (int probe = 0; probe < probes; ++probe) {
        const i64 s = (i64)((home + probe) % (u64)size);
        const u64 prev = atomicCAS(reinterpret_cast<u64*>(keys + s), ~0ull, (u64)row);
        if (prev == ~0ull || prev == (u64)row) {
            atomicAdd(reinterpret_cast<u64*>(counts + s), 1ull);
            return;
        }
    }
}

extern "C" __global__ void tt_count(const i64* idx, i64 n, i64* keys, long long* counts,
                                    i64 size) {
    for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t < n;
         t += (i64)gridDim.x * blockDim.x) {
        if (idx[t] >= 0) count_row(idx[t], keys, counts, size);
    }
}

// Per lookup: its slot in the sorted cached rows crow[0..capacity) (-1 if absent; slot may be
// NULL) and, with keys != NULL, its count in the frequency table. Indices outside [0, bound)
// are neither counted nor cached (the sort's verdict rejects their batch). A rejected batch
// (verdict, when given, read after the sort and offset check) writes nothing: its lookups are
// not counted, and no later kernel reads its slots.
template <typename I>
__global__ void tt_cache_slots(const I* idx, i64 n, i64 bound, const i64* crow, i64 capacity,
                               i64* keys, long long* counts, i64 size, i64* slot,
                               const u64* verdict) {
    if (verdict != nullptr && rejected(verdict)) return;
    for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t < n;
         t += (i64)gridDim.x * blockDim.x) {
        const i64 row = (i64)idx[t];
        const bool valid = row >= 0 && row < bound;
        if (slot != nullptr) {
            i64 lo = 0, hi = capacity;  // first position with crow[pos] >= row
            while (lo < hi) {
                const i64 mid = (lo + hi) >> 1;
                if (crow[mid] < row) lo = mid + 1; else hi = mid;
            }
            slot[t] = (valid && lo < capacity && crow[lo] == row) ? lo : -1;
        }
        if (valid && keys != nullptr) count_row(row, keys, counts, size);
    }
}
"""

TT_CACHE_UPDATE_KERNEL = r"""
// The row cache's optimizer step, in two passes over chunks of CACHE_CHUNK sorted positions
// (rows / perm as tt_rows reads them), deterministic (fixed summation order, no float
// atomics) and parallel along a hot row's run:
// * tt_cache_chunks: thread (c, e) sums element e of the gradients of chunk c's first segment
//   (of one row) into head[c] where its run began in an earlier chunk, and of its last
//   segment into tail[c] where the run goes on past the chunk (one segment filling the chunk
//   is both), for cached rows only.
// * tt_cache_update: block per chunk; each cached run that STARTS in the chunk is summed (a
//   run inside the chunk from its positions; a longer one as tail[c] + head[c + 1] + ... +
//   head[c_end], the heads split into CACHE_G contiguous ranges added in order) and its dense
//   row gets update_row. Each cached row has one run, so blocks update distinct rows.
// A lookup's gradient is w * grad_bags[bag_of[m]] (w: its per-sample weight, divided by the
// bag's size for mean). Every index is bounded; a rejected batch changes nothing.
constexpr int CACHE_THREADS = 128;
constexpr int CACHE_CHUNK = 64;
constexpr int CACHE_EW = DIM < CACHE_THREADS ? DIM : CACHE_THREADS;  // elements per pass
constexpr int CACHE_G = CACHE_THREADS / CACHE_EW;                    // groups along a run

struct CacheBatch {  // what a lookup's gradient needs
    const i64* perm;
    i64 n;
    const i64* bag_of;
    const i64* offsets;
    i64 n_off;
    i64 bags;
    const float* psw;
    int mean;
    const float* grad_bags;
};

// Element e of the gradients of sorted positions [lo, hi), added in position order, with up
// to 8 lookups' loads in flight.
__device__ __forceinline__ float cache_run_sum(const CacheBatch& cb, i64 lo, i64 hi, int e) {
    float acc = 0.f;
    for (i64 j0 = lo; j0 < hi; j0 += 8) {
        i64 m[8], b[8];
        float x[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) m[u] = j0 + u < hi ? cb.perm[j0 + u] : -1;
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            b[u] = (m[u] >= 0 && m[u] < cb.n) ? cb.bag_of[m[u]] : -1;
            if (b[u] >= cb.bags) b[u] = -1;
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            float v = 0.f;
            if (b[u] >= 0) {
                float wgt = cb.psw != nullptr ? cb.psw[m[u]] : 1.f;
                if (cb.mean) {
                    const i64 cnt = bound_at(cb.offsets, cb.n_off, cb.n, b[u] + 1) -
                                    bound_at(cb.offsets, cb.n_off, cb.n, b[u]);
                    wgt /= (float)(cnt > 0 ? cnt : 1);
                }
                v = wgt * cb.grad_bags[b[u] * DIM + e];
            }
            x[u] = v;
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) acc += x[u];
    }
    return acc;
}

// Whether sorted position j's row is cached (its lookup's slot in [0, capacity)).
__device__ __forceinline__ i64 cached_slot(const i64* perm, i64 n, const i64* slot, i64 capacity,
                                           i64 j) {
    const i64 m = perm[j];
    const i64 c = (m >= 0 && m < n) ? slot[m] : -1;
    return (c >= 0 && c < capacity) ? c : -1;
}

#define CACHE_BATCH_ARGS const K* rows, const i64* perm, i64 n, const i64* bag_of, \
    const i64* offsets, i64 n_off, int include_last, const float* psw, int mean, \
    const float* grad_bags, const i64* slot, i64 capacity
#define CACHE_BATCH {perm, n, bag_of, offsets, n_off, (include_last ? n_off : n_off + 1) - 1, \
    psw, mean, grad_bags}

template <typename K>
__global__ void tt_cache_chunks(CACHE_BATCH_ARGS, float* head, float* tail, const u64* verdict) {
    if (rejected(verdict)) return;
    const CacheBatch cb = CACHE_BATCH;
    const i64 chunks = (n + CACHE_CHUNK - 1) / CACHE_CHUNK;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < chunks * DIM;
         i += (i64)gridDim.x * blockDim.x) {
        const i64 c = i / DIM;
        const int e = (int)(i - c * DIM);
        const i64 first = c * CACHE_CHUNK;
        const i64 last = (first + CACHE_CHUNK < n ? first + CACHE_CHUNK : n) - 1;
        const bool head_open = first > 0 && rows[first] == rows[first - 1];
        const bool tail_open = last + 1 < n && rows[last + 1] == rows[last];
        if (!head_open && !tail_open) continue;
        bool tail_done = false;
        if (head_open && cached_slot(perm, n, slot, capacity, first) >= 0) {
            i64 end = first + 1;
            while (end <= last && rows[end] == rows[first]) ++end;
            const float acc = cache_run_sum(cb, first, end, e);
            head[c * DIM + e] = acc;
            if (end > last && tail_open) {  // one segment fills the chunk
                tail[c * DIM + e] = acc;
                tail_done = true;
            }
        }
        if (tail_open && !tail_done && cached_slot(perm, n, slot, capacity, last) >= 0) {
            i64 begin = last;
            while (begin > first && rows[begin - 1] == rows[last]) --begin;
            if (!(begin == first && head_open))  // else the head's (not cached: unread)
                tail[c * DIM + e] = cache_run_sum(cb, begin, last + 1, e);
        }
    }
}

template <typename K>
__global__ void __launch_bounds__(CACHE_THREADS)
tt_cache_update(CACHE_BATCH_ARGS, const float* head, const float* tail, float* cw, float* e1,
                float* e2, float* rs, i64* st, HYPER_ARGS, const u64* verdict) {
    if (rejected(verdict)) return;
    __shared__ float part[CACHE_G * DIM];
    __shared__ float gs[DIM];
    __shared__ float red[33];
    __shared__ i64 srow[CACHE_CHUNK + 2];  // rows at positions first - 1 .. last + 1 (-1 outside)
    __shared__ i64 sbag[CACHE_CHUNK];      // each position's bag (-1: none) and weight
    __shared__ float sw[CACHE_CHUNK];
    __shared__ i64 starts[CACHE_CHUNK], ends[CACHE_CHUNK], cslots[CACHE_CHUNK];
    __shared__ int found;
    const Hyper h = HYPER;
    const CacheBatch cb = CACHE_BATCH;
    const int e0 = threadIdx.x % CACHE_EW, g = threadIdx.x / CACHE_EW;
    const i64 chunks = (n + CACHE_CHUNK - 1) / CACHE_CHUNK;
    for (i64 c = blockIdx.x; c < chunks; c += gridDim.x) {
        const i64 first = c * CACHE_CHUNK;
        const i64 last = (first + CACHE_CHUNK < n ? first + CACHE_CHUNK : n) - 1;
        const int len = (int)(last - first + 1);
        __syncthreads();  // the previous chunk's lists are no longer read
        if (threadIdx.x == 0) found = 0;
        // The chunk's rows, bags and weights, staged once with independent loads, so a run's
        // sum waits on one load of bag gradients, not on the chain perm -> bag -> gradient.
        for (int t = threadIdx.x; t < CACHE_CHUNK + 2; t += blockDim.x) {
            const i64 j = first - 1 + t;
            srow[t] = (j >= 0 && j < n && j <= last + 1) ? (i64)rows[j] : -1;
        }
        for (int t = threadIdx.x; t < CACHE_CHUNK; t += blockDim.x) {
            const i64 m = t < len ? perm[first + t] : -1;
            i64 b = (m >= 0 && m < n) ? bag_of[m] : -1;
            float wgt = 0.f;
            if (b >= 0 && b < cb.bags) {
                wgt = psw != nullptr ? psw[m] : 1.f;
                if (mean) {
                    const i64 cnt = bound_at(offsets, n_off, n, b + 1) -
                                    bound_at(offsets, n_off, n, b);
                    wgt /= (float)(cnt > 0 ? cnt : 1);
                }
            } else {
                b = -1;
            }
            sbag[t] = b;
            sw[t] = wgt;
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
        for (int r = 0; r < runs; ++r) {
            const i64 j0 = starts[r], end = ends[r], cs = cslots[r];
            const bool spans = end - 1 > last;
            if (g < CACHE_G) {
                for (int e = e0; e < DIM; e += CACHE_EW) {
                    float s = 0.f;
                    if (!spans) {  // inside the chunk: group g a contiguous range, in order
                        const int t0 = (int)(j0 - first), count = (int)(end - j0);
                        const int a = t0 + count * g / CACHE_G, b = t0 + count * (g + 1) / CACHE_G;
#pragma unroll 8
                        for (int t = a; t < b; ++t)
                            if (sbag[t] >= 0) s += sw[t] * grad_bags[sbag[t] * DIM + e];
                    } else {  // heads of chunks c+1 .. c_end, group g a contiguous range
                        const i64 span = (end - 1) / CACHE_CHUNK - c;
                        const i64 d0 = c + 1 + span * g / CACHE_G;
                        const i64 d1 = c + 1 + span * (g + 1) / CACHE_G;
                        for (i64 d = d0; d < d1; d += 8) {
                            float x[8];
#pragma unroll
                            for (int u = 0; u < 8; ++u)
                                x[u] = d + u < d1 && d + u < chunks ? head[(d + u) * DIM + e] : 0.f;
#pragma unroll
                            for (int u = 0; u < 8; ++u) s += x[u];
                        }
                    }
                    part[g * DIM + e] = s;
                }
            }
            __syncthreads();
            for (int e = threadIdx.x; e < DIM; e += blockDim.x) {
                float s = spans ? tail[c * DIM + e] : 0.f;
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
