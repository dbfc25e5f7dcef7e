"""Host-table kernels: gather the rows a batch touches, sum their gradients, and run a sparse
optimizer on them where they live (pinned host RAM or the GPU hot-row cache).

A batch arrives as sorted positions (``keys`` ascending, ``perm`` back to batch positions,
``run`` the id of each position's run of equal rows; see ``xferlib/rows.py``). A row's weights
and its optimizer state are found by ``locate``: the cache slot the batch's ``slots`` give
its run (``xferlib/_kernels/cache.py``), else the host row. Each distinct row is handled by one warp, so the
per-row step counter (an int64 in the last 8 bytes of the row's state) needs no atomics.
Rows outside the table are skipped, and every kernel does nothing when the batch's verdict
says an index was bad (the host raises after reading it).

The update rules are the shared ones of ``xferlib/_kernels/rules.py`` (torch.optim's
single-tensor code, operation by operation), with the step's scalars computed per row in
double from the row's own step count.
"""

from xferlib._kernels._declare import KernelDecl, defines
from xferlib._kernels._registry import KernelModule
from xferlib._kernels.cache import CACHE_MODULE  # noqa: F401  (registered with the table's)
from xferlib._kernels.cache import HOST_ARGS  # noqa: F401  (the table kernels' too)
from xferlib._kernels.rules import RULES_KERNEL
from xferlib.optim.rules import RULES as _SHARED_RULES
from xferlib.optim.rule_rows import adam_hyper_defines, hyper_defines
from xferlib.optim.rules import TABLE, OptId, optimizers_for

SUM_CHUNK = 32  # sorted positions per thread in the gradient sums' first pass
RUN_TILE = 4 * 1024  # sorted positions per block of the run numbering (1024 threads x 4)

_DEFINES = (adam_hyper_defines() + hyper_defines()
            + defines(SUM_CHUNK=SUM_CHUNK, RUN_TILE=RUN_TILE))
_HEAD = RULES_KERNEL + _DEFINES + r"""
typedef long long i64;

__device__ __forceinline__ bool rejected(const unsigned long long* verdict) {
    return (verdict[0] & verdict[1]) != ~0ull;
}

// One warp per run of equal sorted keys, i.e. per distinct row of a batch (any grid: warps
// stride over the rest). `starts[r]` is run r's first sorted position (xferlib/batch.py,
// run_ids); the number of runs is read on the device (`run[n - 1] + 1`), so launches are
// sized by the batch alone. Every warp gets one row at a time, whatever the batch's
// distribution: a Zipf batch's many singletons do not queue behind one warp. Runs whose row
// is outside the table are skipped, and positions are bounded, so no input makes a kernel
// touch memory outside its arrays. Declares `lane`, `r` (the run id), `j` (its first sorted
// position) and `row` for the body; warp-uniform: every lane of the warp runs the body.
#define FOR_EACH_RUN                                                                          \
    const int lane = threadIdx.x & 31;                                                        \
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);                                     \
    const i64 runs = n > 0 ? min(run[n - 1] + 1, n) : 0;                                      \
    for (i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < runs; r += warps)     \
        if (const i64 j = starts[r]; j >= 0 && j < n)                                         \
            if (const i64 row = (i64)keys[j]; row >= 0 && row < n_rows)

template <typename T> struct Place { T* w; T* s; bool cached; };

// Where a row's state starts in a copy gathered with its weights (gather_unique's `full`):
// after the weights, at the next 16-byte boundary, so the state's int64 step count and its
// 16-byte words stay aligned whatever `dim` is (xferlib/table/device.py lays it out alike).
template <typename T>
__device__ __forceinline__ i64 staged_state_start(i64 dim) {
    return (dim * (i64)sizeof(T) + 15) / 16 * (16 / (i64)sizeof(T));
}

// `slots[r]`: the cache slot of run r's row (xferlib/_kernels/cache.py), -1 for host RAM;
// null when the table has no cache.
template <typename T>
__device__ __forceinline__ Place<T> locate(i64 row, i64 r, T* host_w, i64 w_stride, T* host_s,
                                           i64 s_stride, T* cache, i64 cache_width, i64 s_off,
                                           const int* slots) {
    const int slot = slots != nullptr ? slots[r] : -1;
    Place<T> p;
    p.cached = slot >= 0;
    if (slot >= 0) {
        p.w = cache + (i64)slot * cache_width;
        p.s = p.w + s_off;
    } else {
        p.w = host_w + row * w_stride;
        p.s = host_s + row * s_stride;
    }
    return p;
}

"""

# flags[j] = 1 where a run of equal rows starts (run ids are their inclusive scan - 1).
# tile_count[b] = the runs of equal keys that start inside tile b (4096 sorted positions;
# position 0 not counted), for RUN_IDS's blocks: a block of 1024 threads per tile.
RUN_COUNTS = KernelDecl(
    "run_counts", "template <typename K>",
    (("const K* __restrict__", "keys"), ("i64", "n"), ("i64* __restrict__", "tile_count")),
    r"""
    __shared__ int warp_total[32];
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const i64 j0 = (i64)blockIdx.x * RUN_TILE + 4 * (i64)t;
    int count = 0;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
        const i64 j = j0 + u;
        count += (j < n && j > 0 && keys[j] != keys[j - 1]) ? 1 : 0;
    }
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) count += __shfl_xor_sync(0xffffffffu, count, d);
    if (lane == 0) warp_total[warp] = count;
    __syncthreads();
    if (warp == 0) {
        int w = warp_total[lane];
#pragma unroll
        for (int d = 16; d > 0; d >>= 1) w += __shfl_xor_sync(0xffffffffu, w, d);
        if (lane == 0) tile_count[blockIdx.x] = w;
    }""", launch_bounds="__launch_bounds__(1024)")

# run[j] = the id of position j's run of equal keys (starts at 1..j counted) and
# starts[run] its first position, by blocks of exactly 1024 threads over tiles of 4096
# positions (4 adjacent per thread, so loads coalesce and four are in flight): warp
# shuffles scan the per-thread counts, one shared array of 32 warp totals joins the warps.
# `tile_count` null: ONE block walks every tile, a running carry joining them (one launch);
# else block b numbers tile b, its carry the runs RUN_COUNTS found in the tiles before it
# (two launches at any size; no device-wide scan, no host sync). Each block sums the counts
# before its tile itself: tiles^2 / 2 loads in all, small next to the keys' own traffic up
# to tens of millions of positions (4M: 1k tiles, 0.5M loads; 100M: 0.3G loads, ~1 ms).
RUN_IDS = KernelDecl(
    "run_ids", "template <typename K>",
    (("const K* __restrict__", "keys"), ("i64", "n"), ("i64* __restrict__", "run"),
     ("i64* __restrict__", "starts"), ("const i64* __restrict__", "tile_count")),
    r"""
    __shared__ i64 warp_total[32];
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    i64 carry = 0, first = 0, last = n;
    if (tile_count != nullptr) {
        first = (i64)blockIdx.x * RUN_TILE;
        last = first + RUN_TILE < n ? first + RUN_TILE : n;
        i64 part = 0;
        for (i64 k = t; k < (i64)blockIdx.x; k += blockDim.x) part += tile_count[k];
#pragma unroll
        for (int d = 16; d > 0; d >>= 1) part += __shfl_xor_sync(0xffffffffu, part, d);
        if (lane == 0) warp_total[warp] = part;
        __syncthreads();
        for (int w = 0; w < 32; ++w) carry += warp_total[w];
        __syncthreads();  // warp_total is rewritten below
    }
    for (i64 base = first; base < last; base += RUN_TILE) {
        const i64 j0 = base + 4 * (i64)t;
        int flag[4];
        int count = 0;
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const i64 j = j0 + u;
            flag[u] = (j < n && j > 0 && keys[j] != keys[j - 1]) ? 1 : 0;
            count += flag[u];
        }
        int x = count;  // inclusive scan within the warp
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, x, d);
            if (lane >= d) x += y;
        }
        if (lane == 31) warp_total[warp] = x;
        __syncthreads();
        if (warp == 0) {  // inclusive scan of the 32 warp totals
            i64 w = warp_total[lane];
#pragma unroll
            for (int d = 1; d < 32; d <<= 1) {
                const i64 y = __shfl_up_sync(0xffffffffu, w, d);
                if (lane >= d) w += y;
            }
            warp_total[lane] = w;
        }
        __syncthreads();
        i64 r = carry + (warp > 0 ? warp_total[warp - 1] : 0) + (x - count);
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const i64 j = j0 + u;
            r += flag[u];
            if (j < n) {
                run[j] = r;
                if (flag[u] || j == 0) starts[r] = j;
            }
        }
        carry += warp_total[31];
        __syncthreads();  // warp_total is rewritten by the next tile
    }""", launch_bounds="__launch_bounds__(1024)")

_COPY_WORDS = r"""
template <typename T, int V> struct alignas(sizeof(T) * V) words { T v[V]; };

// Copy `len` elements (a multiple of V) with V-element words: 16-byte accesses for V = 4.
template <int V, typename T>
__device__ __forceinline__ void copy_words(T* __restrict__ dst, const T* __restrict__ src,
                                           i64 len, int lane) {
    typedef words<T, V> W;
    for (i64 e = (i64)V * lane; e < len; e += 32 * V)
        *reinterpret_cast<W*>(dst + e) = *reinterpret_cast<const W*>(src + e);
}

"""

# out[run] = the run's row: its `dim` weights, then (full != 0) its `s_width` state words.
# One warp per run, reading the row once from the cache or the host. which: 0 every row,
# 1 the rows in host RAM only (a prefetch), 2 the cached rows only (the lookup after it).
GATHER_UNIQUE = KernelDecl(
    "gather_unique", "template <int V, typename T, typename K>",
    (("T*", "host_w"), ("i64", "w_stride"), ("T*", "host_s"), ("i64", "s_stride"),
     ("i64", "n_rows"), ("T*", "cache"), ("i64", "cache_width"), ("i64", "s_off"),
     ("const int* __restrict__", "slots"), ("const K* __restrict__", "keys"),
     ("const i64* __restrict__", "run"), ("const i64* __restrict__", "starts"), ("i64", "n"),
     ("i64", "dim"), ("i64", "s_width"), ("int", "full"), ("int", "which"),
     ("T* __restrict__", "out"), ("const unsigned long long* __restrict__", "verdict")),
    r"""
    if (rejected(verdict)) return;
    const i64 s_start = staged_state_start<T>(dim);
    const i64 out_width = full ? s_start + s_width : dim;
    FOR_EACH_RUN {
        Place<T> p = locate(row, r, host_w, w_stride, host_s, s_stride, cache,
                            cache_width, s_off, slots);
        if ((which == 1 && p.cached) || (which == 2 && !p.cached)) continue;
        T* dst = out + r * out_width;
        copy_words<V>(dst, p.w, dim, lane);
        if (full) copy_words<V>(dst + s_start, p.s, s_width, lane);
    }""")

# out[perm[j]] = uniq[run[j]]: every batch position gets its run's row (the first `dim` of
# the `u_stride` elements of uniq's rows). One warp per position (any grid: warps stride
# over the rest), 16-byte words where every row start is 16-byte aligned: no index division
# per element, one run/perm read per row.
EXPAND_ROWS = KernelDecl(
    "expand_rows", "template <typename T>",
    (("const T* __restrict__", "uniq"), ("i64", "u_stride"),
     ("const i64* __restrict__", "run"), ("const i64* __restrict__", "perm"), ("i64", "n"),
     ("i64", "dim"), ("T* __restrict__", "out"),
     ("const unsigned long long* __restrict__", "verdict")),
    r"""
    if (rejected(verdict)) return;
    constexpr int V = 16 / sizeof(T);
    const bool wide = dim % V == 0 && u_stride % V == 0 && (size_t)uniq % 16 == 0 &&
                      (size_t)out % 16 == 0;
    const int lane = threadIdx.x & 31;
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    for (i64 j = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; j < n; j += warps) {
        const T* src = uniq + run[j] * u_stride;
        T* dst = out + perm[j] * dim;
        if (wide) copy_words<V>(dst, src, dim, lane);
        else copy_words<1>(dst, src, dim, lane);
    }""")

# Deterministic sum of the gradients of each run of equal rows, in sorted-position order,
# in two passes (no atomics, and no warp stuck on a hot row's thousands of repeats).
# Pass 1: thread (c, e) walks chunk c's SUM_CHUNK positions; a run that starts and ends in
# the chunk is written to summed[run]; the segment holding the chunk's first position goes
# to head[c] and the one holding its last position to tail[c] (the same when one run fills
# the chunk), for runs that cross a chunk boundary.
SUM_CHUNKS = KernelDecl(
    "sum_chunks", "template <typename T, typename K>",
    (("const T* __restrict__", "grads"), ("const K* __restrict__", "keys"),
     ("const i64* __restrict__", "run"), ("const i64* __restrict__", "perm"), ("i64", "n"),
     ("i64", "dim"), ("T* __restrict__", "summed"), ("T* __restrict__", "head"),
     ("T* __restrict__", "tail")),
    r"""
    const i64 chunks = (n + SUM_CHUNK - 1) / SUM_CHUNK;
    const i64 total = chunks * dim;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const i64 c = i / dim, e = i - c * dim;
        const i64 first = c * SUM_CHUNK;
        const i64 last = (first + SUM_CHUNK < n ? first + SUM_CHUNK : n) - 1;
        const bool head_open = first > 0 && keys[first] == keys[first - 1];
        const bool tail_open = last + 1 < n && keys[last + 1] == keys[last];
        T acc = 0;
        i64 begin = first;
        for (i64 j = first; j <= last; ++j) {
            acc += grads[perm[j] * dim + e];
            if (j == last || keys[j + 1] != keys[j]) {  // the segment [begin, j] ends here
                const bool is_head = begin == first && head_open;
                const bool is_tail = j == last && tail_open;
                if (is_head) head[c * dim + e] = acc;
                if (is_tail) tail[c * dim + e] = acc;
                if (!is_head && !is_tail) summed[run[j] * dim + e] = acc;
                acc = 0;
                begin = j + 1;
            }
        }
    }""")

# Pass 2: for each run that crosses chunk boundaries (found at the chunk where it starts),
# add its pieces in order: the start chunk's tail, whole middle chunks, the end chunk's head.
SUM_SPANS = KernelDecl(
    "sum_spans", "template <typename T, typename K>",
    (("const K* __restrict__", "keys"), ("const i64* __restrict__", "run"), ("i64", "n"),
     ("i64", "dim"), ("T* __restrict__", "summed"), ("const T* __restrict__", "head"),
     ("const T* __restrict__", "tail")),
    r"""
    const i64 chunks = (n + SUM_CHUNK - 1) / SUM_CHUNK;
    const i64 total = chunks * dim;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const i64 c = i / dim, e = i - c * dim;
        const i64 first = c * SUM_CHUNK;
        const i64 last = first + SUM_CHUNK - 1;
        if (last + 1 >= n || keys[last + 1] != keys[last]) continue;  // no run leaves c
        const K key = keys[last];
        if (keys[first] == key && first > 0 && keys[first - 1] == key) continue;  // began earlier
        // A hot row's run crosses thousands of chunks: load the next 8 chunks' heads (and
        // whether the run goes on past each) at once, then add them in order: the same sum
        // in the same order as one chunk at a time, with 8 loads in flight instead of 1.
        T acc = tail[c * dim + e];
        bool ended = false;
        for (i64 d0 = c + 1; d0 < chunks && !ended; d0 += 8) {
            T h[8];
            bool goes_on[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const i64 d = d0 + u < chunks ? d0 + u : chunks - 1;
                const i64 d_last = (d + 1) * SUM_CHUNK - 1;
                h[u] = head[d * dim + e];
                goes_on[u] = d0 + u < chunks && d_last + 1 < n && keys[d_last + 1] == key;
            }
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                if (!ended && d0 + u < chunks) {
                    acc += h[u];
                    ended = !goes_on[u];  // the run ends in chunk d0 + u
                }
            }
        }
        summed[run[last] * dim + e] = acc;
    }""")

_UPDATE_RULES = r"""
// ------------------------------------------------------------------------ update rules
// RULE: an XF_OPT_* id (xferlib.optim.rules.OptId): sgd, adam (adamw too), adagrad,
// rowwise_adagrad, adamax, rmsprop, adadelta.
// h: the rule's device row of hyperparameters (xferlib.optim.rule_rows.device_hyper: a record
// per rule, columns XF_H_<RULE>_<FIELD> / XF_AH_<FIELD>); a row's state slot k sits at
// s + k * dim, row scalars after the slots; t: the row's step count after this step.
// row_consts turns h and t into the row's scalars (bias corrections and 1 - beta in double,
// as torch's Python scalars, then rounded to T); elem applies the shared rule
// (xferlib/_kernels/rules.py) to one element w with its slot values st[].

template <typename T>
__device__ __forceinline__ T warp_sum(T x) {
    #pragma unroll
    for (int d = 16; d > 0; d >>= 1) x += __shfl_xor_sync(0xffffffffu, x, d);
    return x;
}

template <int RULE, typename T>
__device__ __forceinline__ XfScalars<T> row_consts(const double* h, i64 t) {
    XfScalars<T> s = xf_neutral<T>();
    if (RULE == XF_OPT_SGD) {
        s.lr = h[XF_H_SGD_LR]; s.mom = h[XF_H_SGD_MOMENTUM]; s.l2 = h[XF_H_SGD_WEIGHT_DECAY];
        s.keep = t == 1 ? 0.0 : h[XF_H_SGD_MOMENTUM];  // torch's first step copies the gradient
        s.take = t == 1 ? 1.0 : 1.0 - h[XF_H_SGD_DAMPENING];
        s.momentum = (T)h[XF_H_SGD_MOMENTUM] != (T)0;
        s.nesterov = (T)h[XF_H_SGD_NESTEROV] != (T)0;
        s.sign = (T)h[XF_H_SGD_MAXIMIZE] != (T)0 ? -1.0 : 1.0;
    } else if (RULE == XF_OPT_ADAM) {  // adam(w): the AdamHyper row (XF_AH_*)
        const double bc1 = 1.0 - pow(h[XF_AH_BETA1], (double)t),
                     bc2 = 1.0 - pow(h[XF_AH_BETA2], (double)t);
        s.lr = h[XF_AH_LR] / bc1; s.bc2 = sqrt(bc2); s.omb1 = 1.0 - h[XF_AH_BETA1];
        s.b2 = h[XF_AH_BETA2]; s.omb2 = 1.0 - h[XF_AH_BETA2]; s.eps = h[XF_AH_EPS];
        if ((T)h[XF_AH_WEIGHT_DECAY] != (T)0) {
            if ((T)h[XF_AH_DECOUPLED] != (T)0) s.decay = 1.0 - h[XF_AH_LR] * h[XF_AH_WEIGHT_DECAY];
            else s.l2 = h[XF_AH_WEIGHT_DECAY];
        }
        s.amsgrad = (T)h[XF_AH_AMSGRAD] != (T)0;
        s.sign = (T)h[XF_AH_MAXIMIZE] != (T)0 ? -1.0 : 1.0;
    } else if (RULE == XF_OPT_ADAGRAD) {
        s.lr = h[XF_H_ADAGRAD_LR] / (1.0 + (double)(t - 1) * h[XF_H_ADAGRAD_LR_DECAY]);
        s.l2 = h[XF_H_ADAGRAD_WEIGHT_DECAY]; s.eps = h[XF_H_ADAGRAD_EPS];
        s.sign = (T)h[XF_H_ADAGRAD_MAXIMIZE] != (T)0 ? -1.0 : 1.0;
    } else if (RULE == XF_OPT_ADAMAX) {
        s.lr = h[XF_H_ADAMAX_LR] / (1.0 - pow(h[XF_H_ADAMAX_BETA1], (double)t));
        s.omb1 = 1.0 - h[XF_H_ADAMAX_BETA1]; s.b2 = h[XF_H_ADAMAX_BETA2];
        s.eps = h[XF_H_ADAMAX_EPS]; s.l2 = h[XF_H_ADAMAX_WEIGHT_DECAY];
        s.sign = (T)h[XF_H_ADAMAX_MAXIMIZE] != (T)0 ? -1.0 : 1.0;
    } else if (RULE == XF_OPT_RMSPROP) {
        s.lr = h[XF_H_RMSPROP_LR]; s.b2 = h[XF_H_RMSPROP_ALPHA];
        s.omb2 = 1.0 - h[XF_H_RMSPROP_ALPHA]; s.eps = h[XF_H_RMSPROP_EPS];
        s.l2 = h[XF_H_RMSPROP_WEIGHT_DECAY]; s.mom = h[XF_H_RMSPROP_MOMENTUM];
        s.momentum = (T)h[XF_H_RMSPROP_MOMENTUM] > (T)0;
        s.centered = (T)h[XF_H_RMSPROP_CENTERED] != (T)0;
        s.sign = (T)h[XF_H_RMSPROP_MAXIMIZE] != (T)0 ? -1.0 : 1.0;
    } else if (RULE == XF_OPT_ADADELTA) {
        s.lr = h[XF_H_ADADELTA_LR]; s.b2 = h[XF_H_ADADELTA_RHO];
        s.omb2 = 1.0 - h[XF_H_ADADELTA_RHO]; s.eps = h[XF_H_ADADELTA_EPS];
        s.l2 = h[XF_H_ADADELTA_WEIGHT_DECAY];
        s.sign = (T)h[XF_H_ADADELTA_MAXIMIZE] != (T)0 ? -1.0 : 1.0;
    } else if (RULE == XF_OPT_ROWWISE_ADAGRAD) {
        s.lr = h[XF_H_ROWWISE_ADAGRAD_LR]; s.l2 = h[XF_H_ROWWISE_ADAGRAD_WEIGHT_DECAY];
        s.eps = h[XF_H_ROWWISE_ADAGRAD_EPS];
        s.sign = h[XF_H_ROWWISE_ADAGRAD_MAXIMIZE] != 0.0 ? -1.0 : 1.0;
    }
    return s;
}

// The row's state slots in the rule's buffer order (xferlib/table/rules.py): rmsprop's
// grad_avg follows momentum_buffer only when there is one.
template <int RULE, typename T>
__device__ __forceinline__ void elem(T& w, T* st, T g, const XfScalars<T>& s) {
    xf_preamble(w, g, s);
    if (RULE == XF_OPT_SGD) xf_sgd(w, g, st[0], s);
    else if (RULE == XF_OPT_ADAM) xf_adam(w, g, st[0], st[1], st[2], s);
    else if (RULE == XF_OPT_ADAGRAD) xf_adagrad(w, g, st[0], s);
    else if (RULE == XF_OPT_ADAMAX) xf_adamax(w, g, st[0], st[1], s);
    else if (RULE == XF_OPT_RMSPROP) xf_rmsprop(w, g, st[0], st[1], st[s.momentum ? 2 : 1], s);
    else if (RULE == XF_OPT_ADADELTA) xf_adadelta(w, g, st[0], st[1], s);
}

// Row-wise Adagrad (FBGEMM's EXACT_ROWWISE_ADAGRAD): one accumulator per row, fed the mean
// squared gradient (the warp's reduction), then the shared per-element step.
// Returns the row's new accumulator; `write_total` false leaves storing it to the caller.
template <typename T>
__device__ T rowwise_adagrad_row(T* w, const T* wsrc, T* s, const T* ssrc, const T* g,
                                 i64 dim, i64 n_slots, const XfScalars<T>& c, int lane,
                                 bool write_total = true) {
    T sq = 0;
    for (i64 e = lane; e < dim; e += 32) {
        T wi = wsrc[e], gi = g[e];
        xf_preamble(wi, gi, c);
        sq += gi * gi;
    }
    T* total = s + n_slots * dim;
    const T sum = ssrc[n_slots * dim] + warp_sum(sq) / (T)dim;
    const T scale = c.lr / (sqrt(sum) + c.eps);
    for (i64 e = lane; e < dim; e += 32) {
        T wi = wsrc[e], gi = g[e];
        xf_preamble(wi, gi, c);
        xf_descend(wi, gi, scale);
        w[e] = wi;
    }
    __syncwarp();
    if (lane == 0 && write_total) *total = sum;
    return sum;
}

template <typename T, int V> struct alignas(sizeof(T) * V) vec { T v[V]; };

// V consecutive elements per lane: 16-byte loads (V = 4 floats) when the caller checked the
// alignment, so each lane keeps three or four independent loads in flight over PCIe. The
// weights and state are read from `wsrc` / `ssrc` (the row itself, or its copy staged in HBM
// by the lookup) and written to `w` / `s`; no __restrict__ on those, which may be the same.
// `lanes`: the lanes sharing the row (`lane` is one of 0 .. lanes - 1).
template <int RULE, int V, typename T>
__device__ __forceinline__ void update_row(T* w, const T* wsrc, T* s, const T* ssrc,
                                           const T* __restrict__ g, i64 dim, i64 n_slots,
                                           const XfScalars<T>& c, int lane, int lanes = 32) {
    for (i64 base = (i64)V * lane; base < dim; base += (i64)lanes * V) {
        vec<T, V> wv = *reinterpret_cast<const vec<T, V>*>(wsrc + base);
        const vec<T, V> gv = *reinterpret_cast<const vec<T, V>*>(g + base);
        vec<T, V> sv[XF_MAX_SLOTS];
        #pragma unroll
        for (int k = 0; k < XF_MAX_SLOTS; ++k)
            if (k < n_slots) sv[k] = *reinterpret_cast<const vec<T, V>*>(ssrc + k * dim + base);
        #pragma unroll
        for (int q = 0; q < V; ++q) {
            T st[XF_MAX_SLOTS];
            #pragma unroll
            for (int k = 0; k < XF_MAX_SLOTS; ++k) st[k] = sv[k].v[q];
            elem<RULE, T>(wv.v[q], st, gv.v[q], c);
            #pragma unroll
            for (int k = 0; k < XF_MAX_SLOTS; ++k) sv[k].v[q] = st[k];
        }
        *reinterpret_cast<vec<T, V>*>(w + base) = wv;
        #pragma unroll
        for (int k = 0; k < XF_MAX_SLOTS; ++k)
            if (k < n_slots) *reinterpret_cast<vec<T, V>*>(s + k * dim + base) = sv[k];
    }
}

"""

# One warp per distinct row: apply the rule to the row with its summed gradient, then count
# the step. `step_off`: where the int64 step count sits in the row's state, in T units.
# `staged` (or null): the batch's rows as its lookup gathered them (run r at r *
# staged_width: the weights, then with `staged_state` the row's state), known by the host to
# be current (no write to the table since). A row in host RAM is then read from HBM and only
# written over the link: no read waits behind the kernel's own writes on the link (PCIe keeps
# a read behind earlier writes), half the traffic. Cached rows are read from the cache.
# `s_tail` (0: unused): the host row's length from its state's start to its end, padding
# included; the step count then sits alone at the start of a 16-byte word, and the words from
# it to the row's end go out in one store, so the host cache line they fill is written whole
# (a partial-line write from the GPU makes the host read the line and merge it).
SPARSE_UPDATE = KernelDecl(
    "sparse_update", "template <int RULE, int V, typename T, typename K>",
    (("T*", "host_w"), ("i64", "w_stride"), ("T*", "host_s"), ("i64", "s_stride"),
     ("i64", "n_rows"), ("T*", "cache"), ("i64", "cache_width"), ("i64", "s_off"),
     ("const int* __restrict__", "slots"), ("unsigned char* __restrict__", "dirty"),
     ("const K* __restrict__", "keys"), ("const i64* __restrict__", "run"),
     ("const i64* __restrict__", "starts"), ("i64", "n"), ("const T* __restrict__", "summed"),
     ("const T* __restrict__", "staged"), ("i64", "staged_width"), ("int", "staged_state"),
     ("i64", "dim"), ("i64", "n_slots"), ("i64", "step_off"), ("i64", "s_tail"),
     ("const double* __restrict__", "h"),
     ("const unsigned long long* __restrict__", "verdict")),
    r"""
    if (rejected(verdict)) return;
    FOR_EACH_RUN {
        Place<T> p = locate(row, r, host_w, w_stride, host_s, s_stride, cache,
                            cache_width, s_off, slots);
        const bool from_copy = staged != nullptr && !p.cached;
        const T* wsrc = from_copy ? staged + r * staged_width : p.w;
        const T* ssrc = from_copy && staged_state ? wsrc + staged_state_start<T>(dim) : p.s;
        i64* step = reinterpret_cast<i64*>(p.s + step_off);
        const i64 t = *reinterpret_cast<const i64*>(ssrc + step_off) + 1;
        const T* g = summed + r * dim;
        const XfScalars<T> c = row_consts<RULE, T>(h, t);
        if (RULE == XF_OPT_ROWWISE_ADAGRAD) {
            rowwise_adagrad_row<T>(p.w, wsrc, p.s, ssrc, g, dim, n_slots, c, lane);
        } else {
            update_row<RULE, V, T>(p.w, wsrc, p.s, ssrc, g, dim, n_slots, c, lane);
        }
        __syncwarp();
        if (s_tail > 0 && !p.cached) {
            typedef words<T, 16 / sizeof(T)> Word;
            const i64 k = step_off + (i64)lane * (16 / (i64)sizeof(T));
            if (k < s_tail) {
                Word word = {};
                if (lane == 0) *reinterpret_cast<i64*>(word.v) = t;
                *reinterpret_cast<Word*>(p.s + k) = word;
            }
        } else if (lane == 0) {
            *step = t;
            if (p.cached) dirty[slots[r]] = 1;  // written back when evicted or flushed
        }
    }""")

TABLE_KERNEL = (_HEAD + "".join(d.source() for d in (RUN_COUNTS, RUN_IDS))
                + _COPY_WORDS
                + "".join(d.source() for d in (GATHER_UNIQUE, EXPAND_ROWS, SUM_CHUNKS, SUM_SPANS))
                + _UPDATE_RULES + SPARSE_UPDATE.source())

# The rules this family compiles, and their ids: one per id of the host tables' optimizers
# (adamw runs adam's rule).
RULE_IDS = tuple(dict.fromkeys(int(_SHARED_RULES[name].kind) for name in optimizers_for(TABLE)))
RULES = tuple(OptId(kind).name.lower() for kind in RULE_IDS)
_TYPES = {"float32": "float", "float64": "double"}
_KEYS = {4: "int", 8: "long long"}

# The cache arguments of gather_unique and sparse_update in the order DeviceSide._cache_args
# gives them (the cache, its row width, the state's offset in a cached row, the slots);
# HOST_ARGS: the host side's (xferlib/_kernels/cache.py).
CACHE_ARGS = ("cache", "cache_width", "s_off", "slots")

# Up to this many positions one block numbers the runs (run_ids); above, flags + cumsum
# (H100: one block 3.1 vs 6.9 us at 2,048 positions, 55 vs 8.7 us at 65,536).
RUN_IDS_MAX = RUN_TILE  # one block numbers a batch of up to one tile


def c_type(dtype_name: str) -> str:
    """The C type of a table's dtype (the kernels' ``T``)."""
    return _TYPES[dtype_name]


def key_type(key_bytes: int) -> str:
    """The C type of sorted keys of ``key_bytes`` bytes (the kernels' ``K``)."""
    return _KEYS[key_bytes]


def vector_widths(dtype_name: str) -> tuple:
    """Elements per lane access the kernels are built for: 16-byte words, or one element."""
    return (1, 4) if dtype_name == "float32" else (1, 2)


def _all_names():
    for K in _KEYS.values():
        yield RUN_COUNTS.instance(K)
        yield RUN_IDS.instance(K)
    for dtype_name, T in _TYPES.items():
        yield EXPAND_ROWS.instance(T)
        for K in _KEYS.values():
            yield SUM_CHUNKS.instance(T, K)
            yield SUM_SPANS.instance(T, K)
            for vec in vector_widths(dtype_name):
                yield GATHER_UNIQUE.instance(vec, T, K)
                for rule in RULE_IDS:
                    yield SPARSE_UPDATE.instance(rule, vec, T, K)


TABLE_MODULE = KernelModule("table", TABLE_KERNEL, tuple(_all_names()))
