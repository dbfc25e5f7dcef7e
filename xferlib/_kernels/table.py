"""Host-table kernels: gather the rows a batch touches, sum their gradients, and run a sparse
optimizer on them where they live (pinned host RAM or the GPU hot-row cache).

A batch arrives as sorted positions (``keys`` ascending, ``perm`` back to batch positions,
``run`` the id of each position's run of equal rows; see ``xferlib/rows.py``). A row's weights
and its optimizer state are found by ``locate``: the cache slot when ``slot_of_row`` says
the row is cached, else the host row. Each distinct row is handled by one warp, so the
per-row step counter (an int64 in the last 8 bytes of the row's state) needs no atomics.
Rows outside the table are skipped, and every kernel does nothing when the batch's verdict
says an index was bad (the host raises after reading it).

The update rules follow torch.optim's single-tensor code, operation by operation, with
bias corrections computed per row from the row's own step count.
"""

from xferlib._kernels._registry import KernelModule

TABLE_KERNEL = r"""
typedef long long i64;

__device__ __forceinline__ bool rejected(const unsigned long long* verdict) {
    return (verdict[0] & verdict[1]) != ~0ull;
}

template <typename T> struct Place { T* w; T* s; };

template <typename T>
__device__ __forceinline__ Place<T> locate(i64 row, T* host_w, i64 w_stride, T* host_s,
                                           i64 s_stride, T* cache, i64 cache_width, i64 s_off,
                                           const int* slot_of_row) {
    const int slot = slot_of_row != nullptr ? slot_of_row[row] : -1;
    Place<T> p;
    if (slot >= 0) {
        p.w = cache + (i64)slot * cache_width;
        p.s = p.w + s_off;
    } else {
        p.w = host_w + row * w_stride;
        p.s = host_s + row * s_stride;
    }
    return p;
}

// flags[j] = 1 where a run of equal rows starts (run ids are their inclusive scan - 1).
template <typename K>
__global__ void run_starts(const K* __restrict__ keys, i64 n, i64* __restrict__ flags) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 j = (i64)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride)
        flags[j] = (j == 0 || keys[j] != keys[j - 1]) ? 1 : 0;
}

// out[run] = the run's row: its `dim` weights, then (full != 0) its `s_width` state words.
// One warp per run, reading the row once from the cache or the host.
template <typename T, typename K>
__global__ void gather_unique(T* host_w, i64 w_stride, T* host_s, i64 s_stride, i64 n_rows,
                              T* cache, i64 cache_width, i64 s_off,
                              const int* __restrict__ slot_of_row,
                              const K* __restrict__ keys, const i64* __restrict__ run, i64 n,
                              i64 dim, i64 s_width, int full, T* __restrict__ out,
                              const unsigned long long* __restrict__ verdict) {
    if (rejected(verdict)) return;
    const int lane = threadIdx.x & 31;
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    const i64 out_width = full ? dim + s_width : dim;
    for (i64 j = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; j < n; j += warps) {
        if (j > 0 && keys[j] == keys[j - 1]) continue;
        const i64 row = (i64)keys[j];
        if (row < 0 || row >= n_rows) continue;
        Place<T> p = locate(row, host_w, w_stride, host_s, s_stride, cache, cache_width, s_off,
                            slot_of_row);
        T* dst = out + run[j] * out_width;
        for (i64 e = lane; e < dim; e += 32) dst[e] = p.w[e];
        if (full)
            for (i64 e = lane; e < s_width; e += 32) dst[dim + e] = p.s[e];
    }
}

// out[perm[j]] = uniq[run[j]]: every batch position gets its run's row.
template <typename T>
__global__ void expand_rows(const T* __restrict__ uniq, const i64* __restrict__ run,
                            const i64* __restrict__ perm, i64 n, i64 dim, T* __restrict__ out,
                            const unsigned long long* __restrict__ verdict) {
    if (rejected(verdict)) return;
    const i64 total = n * dim;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const i64 j = i / dim, e = i - j * dim;
        out[perm[j] * dim + e] = uniq[run[j] * dim + e];
    }
}

// Deterministic sum of the gradients of each run of equal rows, in sorted-position order,
// in two passes (no atomics, and no warp stuck on a hot row's thousands of repeats).
// Pass 1: thread (c, e) walks chunk c's SUM_CHUNK positions; a run that starts and ends in
// the chunk is written to summed[run]; the segment holding the chunk's first position goes
// to head[c] and the one holding its last position to tail[c] (the same when one run fills
// the chunk), for runs that cross a chunk boundary.
#define SUM_CHUNK 32
template <typename T, typename K>
__global__ void sum_chunks(const T* __restrict__ grads, const K* __restrict__ keys,
                           const i64* __restrict__ run, const i64* __restrict__ perm, i64 n,
                           i64 dim, T* __restrict__ summed, T* __restrict__ head,
                           T* __restrict__ tail) {
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
    }
}

// Pass 2: for each run that crosses chunk boundaries (found at the chunk where it starts),
// add its pieces in order: the start chunk's tail, whole middle chunks, the end chunk's head.
template <typename T, typename K>
__global__ void sum_spans(const K* __restrict__ keys, const i64* __restrict__ run, i64 n,
                          i64 dim, T* __restrict__ summed, const T* __restrict__ head,
                          const T* __restrict__ tail) {
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
        T acc = tail[c * dim + e];
        for (i64 d = c + 1; d < chunks; ++d) {
            acc += head[d * dim + e];
            const i64 d_last = (d + 1) * SUM_CHUNK - 1;
            if (d_last + 1 >= n || keys[d_last + 1] != key) break;  // the run ends in chunk d
        }
        summed[run[last] * dim + e] = acc;
    }
}

// Cache bookkeeping: write the rows held by `slots` back to the host (old_rows[i] < 0: the
// slot was empty), then (fetch != 0) fill the slots with the full host rows `new_rows`.
template <typename T>
__global__ void swap_slots(T* host_w, i64 w_stride, T* host_s, i64 s_stride, i64 n_rows,
                           T* cache, i64 cache_width, i64 dim, i64 s_off,
                           const int* __restrict__ slots,
                           const i64* __restrict__ old_rows, const i64* __restrict__ new_rows,
                           i64 n) {
    const int lane = threadIdx.x & 31;
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    const i64 s_width = cache_width - s_off;
    for (i64 i = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; i < n; i += warps) {
        T* c = cache + (i64)slots[i] * cache_width;
        const i64 old_row = old_rows[i];
        if (old_row >= 0 && old_row < n_rows) {
            T* w = host_w + old_row * w_stride;
            T* s = host_s + old_row * s_stride;
            for (i64 e = lane; e < dim; e += 32) w[e] = c[e];
            for (i64 e = lane; e < s_width; e += 32) s[e] = c[s_off + e];
        }
        const i64 new_row = new_rows != nullptr ? new_rows[i] : -1;
        if (new_row >= 0 && new_row < n_rows) {
            const T* w = host_w + new_row * w_stride;
            const T* s = host_s + new_row * s_stride;
            for (i64 e = lane; e < dim; e += 32) c[e] = w[e];
            for (i64 e = lane; e < s_width; e += 32) c[s_off + e] = s[e];
        }
    }
}

// Refresh prefetched rows the update just changed: for each prefetched run start, look its
// row up among the updated (sorted) rows and re-read its weights when it is there.
template <typename T, typename K>
__global__ void refresh_rows(T* host_w, i64 w_stride, T* host_s, i64 s_stride, i64 n_rows,
                             T* cache, i64 cache_width, i64 s_off,
                             const int* __restrict__ slot_of_row,
                             const K* __restrict__ keys, const i64* __restrict__ run, i64 n,
                             const K* __restrict__ updated, i64 n_updated, i64 dim,
                             T* __restrict__ out) {
    const int lane = threadIdx.x & 31;
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    for (i64 j = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; j < n; j += warps) {
        if (j > 0 && keys[j] == keys[j - 1]) continue;
        const i64 row = (i64)keys[j];
        if (row < 0 || row >= n_rows) continue;
        i64 lo = 0, hi = n_updated;
        while (lo < hi) {
            const i64 mid = (lo + hi) >> 1;
            if ((i64)updated[mid] < row) lo = mid + 1; else hi = mid;
        }
        if (lo == n_updated || (i64)updated[lo] != row) continue;
        Place<T> p = locate(row, host_w, w_stride, host_s, s_stride, cache, cache_width, s_off,
                            slot_of_row);
        T* dst = out + run[j] * dim;
        for (i64 e = lane; e < dim; e += 32) dst[e] = p.w[e];
    }
}

// ------------------------------------------------------------------------ update rules
// RULE: 0 sgd, 1 adam/adamw, 2 adagrad, 3 rowwise_adagrad, 4 adamax, 5 rmsprop, 6 adadelta.
// h: the rule's hyperparameters (xferlib/table.py, _KERNEL_HYPER); s: the row's state, slot k
// at s + k * dim, row scalars after the slots; t: the row's step count after this step.

template <typename T>
__device__ __forceinline__ T lerp_low(T a, T b, T w) {  // torch.lerp for weight < 0.5
    return a + w * (b - a);
}

template <typename T>
__device__ __forceinline__ T warp_sum(T x) {
    #pragma unroll
    for (int d = 16; d > 0; d >>= 1) x += __shfl_xor_sync(0xffffffffu, x, d);
    return x;
}

template <int RULE, typename T>
__device__ void update_row(T* w, T* s, const T* g, i64 dim, i64 t, const double* h, int lane) {
    if (RULE == 0) {  // sgd: lr, momentum, dampening, weight_decay, nesterov, maximize
        const T lr = h[0], mom = h[1], keep = 1.0 - h[2], wd = h[3];
        const bool nesterov = h[4] != 0.0, maximize = h[5] != 0.0;
        for (i64 e = lane; e < dim; e += 32) {
            T gi = maximize ? -g[e] : g[e];
            if (wd != (T)0) gi += wd * w[e];
            if (mom != (T)0) {
                const T b = t == 1 ? gi : mom * s[e] + keep * gi;
                s[e] = b;
                gi = nesterov ? gi + mom * b : b;
            }
            w[e] -= lr * gi;
        }
    } else if (RULE == 1) {  // adam/adamw: lr, b1, b2, eps, wd, decoupled, amsgrad, maximize
        const double bc1 = 1.0 - pow(h[1], (double)t), bc2 = 1.0 - pow(h[2], (double)t);
        const T step_size = h[0] / bc1, bc2_sqrt = sqrt(bc2);
        const T b1c = 1.0 - h[1], b2 = h[2], b2c = 1.0 - h[2], eps = h[3], wd = h[4];
        const T shrink = 1.0 - h[0] * h[4];
        const bool decoupled = h[5] != 0.0, amsgrad = h[6] != 0.0, maximize = h[7] != 0.0;
        for (i64 e = lane; e < dim; e += 32) {
            T gi = maximize ? -g[e] : g[e];
            T p = w[e];
            if (wd != (T)0) {
                if (decoupled) p *= shrink; else gi += wd * p;
            }
            const T m = lerp_low(s[e], gi, b1c);
            const T v = s[dim + e] * b2 + b2c * gi * gi;
            s[e] = m;
            s[dim + e] = v;
            T vmax = v;
            if (amsgrad) {
                vmax = s[2 * dim + e] > v ? s[2 * dim + e] : v;
                s[2 * dim + e] = vmax;
            }
            const T denom = sqrt(vmax) / bc2_sqrt + eps;
            w[e] = p - step_size * (m / denom);
        }
    } else if (RULE == 2) {  // adagrad: lr, lr_decay, wd, eps, maximize
        const T clr = h[0] / (1.0 + (double)(t - 1) * h[1]), wd = h[2], eps = h[3];
        const bool maximize = h[4] != 0.0;
        for (i64 e = lane; e < dim; e += 32) {
            T gi = maximize ? -g[e] : g[e];
            if (wd != (T)0) gi += wd * w[e];
            const T sum = s[e] + gi * gi;
            s[e] = sum;
            w[e] -= clr * (gi / (sqrt(sum) + eps));
        }
    } else if (RULE == 3) {  // rowwise_adagrad: lr, wd, eps, maximize; state: one sum per row
        const T lr = h[0], wd = h[1], eps = h[2];
        const bool maximize = h[3] != 0.0;
        T sq = 0;
        for (i64 e = lane; e < dim; e += 32) {
            T gi = maximize ? -g[e] : g[e];
            if (wd != (T)0) gi += wd * w[e];
            sq += gi * gi;
        }
        const T sum = s[0] + warp_sum(sq) / (T)dim;
        const T scale = lr / (sqrt(sum) + eps);
        for (i64 e = lane; e < dim; e += 32) {
            T gi = maximize ? -g[e] : g[e];
            if (wd != (T)0) gi += wd * w[e];
            w[e] -= scale * gi;
        }
        __syncwarp();
        if (lane == 0) s[0] = sum;
    } else if (RULE == 4) {  // adamax: lr, b1, b2, eps, wd, maximize
        const T clr = h[0] / (1.0 - pow(h[1], (double)t));
        const T b1c = 1.0 - h[1], b2 = h[2], eps = h[3], wd = h[4];
        const bool maximize = h[5] != 0.0;
        for (i64 e = lane; e < dim; e += 32) {
            T gi = maximize ? -g[e] : g[e];
            if (wd != (T)0) gi += wd * w[e];
            const T m = lerp_low(s[e], gi, b1c);
            const T a = s[dim + e] * b2, b = fabs(gi) + eps;
            const T u = a > b ? a : b;
            s[e] = m;
            s[dim + e] = u;
            w[e] -= clr * (m / u);
        }
    } else if (RULE == 5) {  // rmsprop: lr, alpha, eps, wd, momentum, centered, maximize
        const T lr = h[0], alpha = h[1], alphac = 1.0 - h[1], eps = h[2], wd = h[3];
        const T mom = h[4];
        const bool centered = h[5] != 0.0, maximize = h[6] != 0.0;
        const i64 mb = dim, ga = (mom > (T)0 ? 2 : 1) * dim;  // slot offsets
        for (i64 e = lane; e < dim; e += 32) {
            T gi = maximize ? -g[e] : g[e];
            if (wd != (T)0) gi += wd * w[e];
            const T sq = s[e] * alpha + alphac * gi * gi;
            s[e] = sq;
            T avg;
            if (centered) {
                const T a = lerp_low(s[ga + e], gi, alphac);
                s[ga + e] = a;
                avg = sqrt(sq - a * a) + eps;
            } else {
                avg = sqrt(sq) + eps;
            }
            if (mom > (T)0) {
                const T b = s[mb + e] * mom + gi / avg;
                s[mb + e] = b;
                w[e] -= lr * b;
            } else {
                w[e] -= lr * (gi / avg);
            }
        }
    } else if (RULE == 6) {  // adadelta: lr, rho, eps, wd, maximize
        const T lr = h[0], rho = h[1], rhoc = 1.0 - h[1], eps = h[2], wd = h[3];
        const bool maximize = h[4] != 0.0;
        for (i64 e = lane; e < dim; e += 32) {
            T gi = maximize ? -g[e] : g[e];
            if (wd != (T)0) gi += wd * w[e];
            const T sq = s[e] * rho + rhoc * gi * gi;
            const T sd = sqrt(sq + eps);
            const T delta = sqrt(s[dim + e] + eps) / sd * gi;
            s[e] = sq;
            s[dim + e] = s[dim + e] * rho + rhoc * delta * delta;
            w[e] -= lr * delta;
        }
    }
}

// One warp per distinct row: apply the rule to the row with its summed gradient, then count
// the step. `step_off`: where the int64 step count sits in the row's state, in T units.
template <int RULE, typename T, typename K>
__global__ void sparse_update(T* host_w, i64 w_stride, T* host_s, i64 s_stride, i64 n_rows,
                              T* cache, i64 cache_width, i64 s_off,
                              const int* __restrict__ slot_of_row,
                              const K* __restrict__ keys, const i64* __restrict__ run, i64 n,
                              const T* __restrict__ summed, i64 dim, i64 step_off,
                              const double* __restrict__ h,
                              const unsigned long long* __restrict__ verdict) {
    if (rejected(verdict)) return;
    const int lane = threadIdx.x & 31;
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    for (i64 j = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; j < n; j += warps) {
        if (j > 0 && keys[j] == keys[j - 1]) continue;
        const i64 row = (i64)keys[j];
        if (row < 0 || row >= n_rows) continue;
        Place<T> p = locate(row, host_w, w_stride, host_s, s_stride, cache, cache_width, s_off,
                            slot_of_row);
        i64* step = reinterpret_cast<i64*>(p.s + step_off);
        const i64 t = *step + 1;
        update_row<RULE, T>(p.w, p.s, summed + run[j] * dim, dim, t, h, lane);
        __syncwarp();
        if (lane == 0) *step = t;
    }
}
"""

RULES = ("sgd", "adam", "adagrad", "rowwise_adagrad", "adamax", "rmsprop", "adadelta")
_TYPES = {"float32": "float", "float64": "double"}
_KEYS = {4: "int", 8: "long long"}


def run_starts_name(key_bytes: int) -> str:
    return f"run_starts<{_KEYS[key_bytes]}>"


def gather_unique_name(dtype_name: str, key_bytes: int) -> str:
    return f"gather_unique<{_TYPES[dtype_name]}, {_KEYS[key_bytes]}>"


def refresh_rows_name(dtype_name: str, key_bytes: int) -> str:
    return f"refresh_rows<{_TYPES[dtype_name]}, {_KEYS[key_bytes]}>"


def expand_rows_name(dtype_name: str) -> str:
    return f"expand_rows<{_TYPES[dtype_name]}>"


SUM_CHUNK = 32


def sum_chunks_name(dtype_name: str, key_bytes: int) -> str:
    return f"sum_chunks<{_TYPES[dtype_name]}, {_KEYS[key_bytes]}>"


def sum_spans_name(dtype_name: str, key_bytes: int) -> str:
    return f"sum_spans<{_TYPES[dtype_name]}, {_KEYS[key_bytes]}>"


def swap_slots_name(dtype_name: str) -> str:
    return f"swap_slots<{_TYPES[dtype_name]}>"


def sparse_update_name(rule: int, dtype_name: str, key_bytes: int) -> str:
    return f"sparse_update<{rule}, {_TYPES[dtype_name]}, {_KEYS[key_bytes]}>"


def _all_names():
    for key_bytes in _KEYS:
        yield run_starts_name(key_bytes)
    for dtype_name in _TYPES:
        yield expand_rows_name(dtype_name)
        yield swap_slots_name(dtype_name)
        for key_bytes in _KEYS:
            yield gather_unique_name(dtype_name, key_bytes)
            yield refresh_rows_name(dtype_name, key_bytes)
            yield sum_chunks_name(dtype_name, key_bytes)
            yield sum_spans_name(dtype_name, key_bytes)
            for rule in range(len(RULES)):
                yield sparse_update_name(rule, dtype_name, key_bytes)


TABLE_MODULE = KernelModule("table", TABLE_KERNEL, tuple(_all_names()))
