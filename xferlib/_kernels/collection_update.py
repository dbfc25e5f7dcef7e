"""The collection's update kernel, ``coll_update``: one module per optimizer rule and dtype,
made on first use (a run compiles only the rule it trains with).

Each distinct row of a batch gets a group of lanes (a power of two up to 32: the pooling's
group, which is sized to the widest row's vectors, where the update writes host rows over
the link, else half of it, or a quarter where rows hold no state;
``xferlib/collection/device.py`` picks it) that runs the host tables' rule
(``xferlib/_kernels/table.py``: ``row_consts``, ``update_row``) on its summed gradient where
the row lives: HBM, a host table's GPU cache slot, or host RAM (read from the forward's
staged copy). Row-wise Adagrad's row sum is a reduction over the group's lanes
(``rowwise_adagrad_lanes``, below).
"""

from __future__ import annotations

from xferlib._kernels._declare import KernelDecl
from xferlib._kernels._registry import KernelModule
from xferlib._kernels.collection import (COLLECTION_HEAD, DTYPE_NAMES, RULE_IDS, c_type,
                                         vector_widths)

__all__ = ["UPDATE", "UPDATE_KERNEL", "update_module", "all_update_modules"]

UPDATE = KernelDecl(
    "coll_update", "template <int RULE, int V, typename T>",
    (("T*", "hbm"), ("T*", "host"), ("const i64*", "meta"), ("const void*", "keys"),
     ("int", "key_bytes"),
     ("const i64*", "starts"), ("const i64*", "run"),
     ("const i64*", "run_off"), ("const int*", "run_tab"), ("i64", "n"),
     ("const T*", "summed"), ("i64", "width"), ("const T*", "staged"), ("i64", "stage_width"),
     ("int", "staged_state"), ("T*", "cache"), ("i64", "cache_width"), ("const int*", "slots"),
     ("unsigned char*", "dirty"), ("i64", "n_slots"), ("const double*", "hyper"),
     ("i64", "hyper_width"), ("T*", "pending"), ("i64*", "pending_key"),
     ("i64*", "pending_off"), ("int*", "pending_tab"),
     ("i64*", "pending_count"), ("i64", "pending_rows"), ("i64*", "long_runs"),
     ("int", "group"),
     ("const unsigned long long*", "verdict")),
    r"""
    // A group of `group` lanes per distinct row (a power of two up to 32, each lane taking V
    // elements of the row at a time, in turn across the row; row-wise Adagrad's row sum a
    // reduction over the group's lanes): the table's rule on its summed gradient, where the row
    // lives (HBM; a host table's GPU cache slot, then marked dirty; or host RAM, the row then
    // read from the forward's whole staged copy when given, and only written over the link),
    // with its table's hyperparameters and its own step count. `pending` (given with whole
    // staged rows): a host row read from its copy is written, whole, to pending[r] in HBM
    // instead of over the link (pending_off[r]: its place in host RAM, -1 for a run whose row
    // is not held; pending_key[r]: the run's sorted key; *pending_count: the runs), for the
    // next forward's staging to write back beside its own reads (``coll_stage``); a run past
    // `pending_rows` goes to host RAM as before. `long_runs`: the gradient sums' count of long
    // runs, set back to zero for a next backward of the same lookup (the sums are done: this
    // kernel follows them).
    if (long_runs != nullptr && blockIdx.x == 0 && threadIdx.x == 0) long_runs[0] = 0;
    if (rejected(verdict)) return;
    const int lane = threadIdx.x & (group - 1);
    // the group's lanes in the warp (they run the same rows: the same trips and branches)
    const unsigned mine = group == 32 ? 0xffffffffu
        : ((1u << group) - 1u) << ((threadIdx.x & 31) & ~(group - 1));
    const i64 groups = (i64)gridDim.x * (blockDim.x / group);
    const i64 runs = n > 0 ? min(run[n - 1] + 1, n) : 0;
    if (pending != nullptr && blockIdx.x == 0 && threadIdx.x == 0)
        *pending_count = runs < pending_rows ? runs : pending_rows;
    for (i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / group; r < runs;
         r += groups) {
        const i64 off = run_off[r];
        const i64 tab = run_tab[r];
        const i64* m = meta + tab * COLL_META;
        const int slot = slots != nullptr && m[M_HOST] ? slots[r] : -1;
        const bool on_host = m[M_HOST] != 0 && slot < 0;
        const i64 dim = m[M_DIM], step_off = m[M_STEP_OFF];
        const i64 tail = m[M_STATE_OFFSET] + n_slots * dim;
        const bool from_copy = on_host && staged != nullptr;
        // A host row read from its staged copy: the state's tail (row scalars, step count,
        // padding to the row's end: whole host cache lines) goes out in whole 16-byte words
        // built from the copy, not as the lone scalar and step writes a partial host line
        // costs (the host reads the line and merges it: half the link's write speed).
        const bool whole_tail = from_copy && staged_state && (tail * (i64)sizeof(T)) % 16 == 0;
        // held in `pending`: rows written whole (weights up to the state, then the tail)
        const bool held = pending != nullptr && r < pending_rows && off >= 0 && whole_tail
                          && m[M_STATE_OFFSET] == dim;
        if (pending != nullptr && r < pending_rows && lane == 0) {
            const i64 start = starts[r];
            pending_key[r] = start >= 0 && start < n ? sorted_key(keys, key_bytes, start) : -1;
            pending_off[r] = held ? off : -1;
            pending_tab[r] = (int)tab;
        }
        if (off < 0) continue;
        T* w = slot >= 0 ? cache + (i64)slot * cache_width
             : m[M_HOST] ? (held ? pending + r * stage_width : host + off) : hbm + off;
        T* s = w + m[M_STATE_OFFSET];
        const T* wsrc = from_copy ? staged + r * stage_width : w;
        // the state from the copy when the forward staged whole rows (staged_state), else
        // read over the link here, while this kernel's writes go out the other way
        const T* ssrc = from_copy && staged_state ? wsrc + m[M_STATE_OFFSET] : s;
        const i64 t = *reinterpret_cast<const i64*>(ssrc + step_off) + 1;
        const XfScalars<T> c = row_consts<RULE, T>(hyper + tab * hyper_width, t);
        const T* g = summed + r * width;
        T total = (T)0;
        if (RULE == XF_OPT_ROWWISE_ADAGRAD) {
            total = rowwise_adagrad_lanes<V, T>(w, wsrc, s, ssrc, g, dim, n_slots, c, lane,
                                                group, mine, !whole_tail);
        } else {
            update_row<RULE, V, T>(w, wsrc, s, ssrc, g, dim, n_slots, c, lane, group);
        }
        __syncwarp(mine);  // every lane read the step count before lane 0 writes it
        if (whole_tail) {
            constexpr int W = 16 / sizeof(T);
            const i64 step_at = m[M_STATE_OFFSET] + step_off;  // 8 bytes inside one word
            for (i64 k = tail + (i64)lane * W; k < m[M_ROW_WIDTH]; k += (i64)group * W) {
                words<T, W> word = *reinterpret_cast<const words<T, W>*>(wsrc + k);
                if (RULE == XF_OPT_ROWWISE_ADAGRAD && k == tail) word.v[0] = total;
                if (step_at >= k && step_at < k + W)
                    *reinterpret_cast<i64*>(word.v + (step_at - k)) = t;
                *reinterpret_cast<words<T, W>*>(w + k) = word;
            }
        } else if (lane == 0) {
            *reinterpret_cast<i64*>(s + step_off) = t;
            if (slot >= 0) dirty[slot] = 1;  // written back when evicted or flushed
        }
    }""")

# Row-wise Adagrad on a group of lanes (the host tables' kernel gives it a whole warp and
# reads a row element by element): at 64 floats a row, 16 lanes of 16-byte loads, two rows a
# warp (26 tables x 64, an H200: the update 118 us a step on whole warps).
_ROWWISE_LANES = r"""
// FBGEMM's row-wise Adagrad on `group` lanes (`mine`: their mask), V adjacent elements a lane:
// the row's mean squared gradient (a butterfly over the group), then the per-element step.
// Returns the row's new accumulator; `write_total` false leaves storing it to the caller.
template <int V, typename T>
__device__ T rowwise_adagrad_lanes(T* w, const T* wsrc, T* s, const T* ssrc, const T* g,
                                   i64 dim, i64 n_slots, const XfScalars<T>& c, int lane,
                                   int group, unsigned mine, bool write_total) {
    T sq = 0;
    for (i64 base = (i64)V * lane; base < dim; base += (i64)group * V) {
        const vec<T, V> wv = *reinterpret_cast<const vec<T, V>*>(wsrc + base);
        const vec<T, V> gv = *reinterpret_cast<const vec<T, V>*>(g + base);
        #pragma unroll
        for (int q = 0; q < V; ++q) {
            T wi = wv.v[q], gi = gv.v[q];
            xf_preamble(wi, gi, c);
            sq += gi * gi;
        }
    }
    for (int d = group >> 1; d > 0; d >>= 1) sq += __shfl_xor_sync(mine, sq, d);
    const T sum = ssrc[n_slots * dim] + sq / (T)dim;
    const T scale = c.lr / (sqrt(sum) + c.eps);
    for (i64 base = (i64)V * lane; base < dim; base += (i64)group * V) {
        vec<T, V> wv = *reinterpret_cast<const vec<T, V>*>(wsrc + base);
        const vec<T, V> gv = *reinterpret_cast<const vec<T, V>*>(g + base);
        #pragma unroll
        for (int q = 0; q < V; ++q) {
            T gi = gv.v[q];
            xf_preamble(wv.v[q], gi, c);
            xf_descend(wv.v[q], gi, scale);
        }
        *reinterpret_cast<vec<T, V>*>(w + base) = wv;
    }
    __syncwarp(mine);
    if (lane == 0 && write_total) s[n_slots * dim] = sum;
    return sum;
}
"""

UPDATE_KERNEL = COLLECTION_HEAD + _ROWWISE_LANES + UPDATE.source()


_UPDATE_MODULES = {}


def update_module(rule: int, dtype_name: str) -> KernelModule:
    """The update kernels of one rule and dtype (every vector width and key type), made on
    first use: a run compiles only the rule it trains with."""
    key = (int(rule), dtype_name)
    module = _UPDATE_MODULES.get(key)
    if module is None:
        names = [UPDATE.instance(int(rule), V, c_type(dtype_name))
                 for V in vector_widths(dtype_name)]
        module = _UPDATE_MODULES[key] = KernelModule(
            f"collection-update-{int(rule)}-{dtype_name}", UPDATE_KERNEL, names)
    return module


def all_update_modules():
    """Every update module a collection can use (the GPU compile test builds them all)."""
    return tuple(update_module(rule, d) for rule in RULE_IDS for d in DTYPE_NAMES)


# Registered at import (nothing is compiled before a launch), so the compile test sees them.
all_update_modules()
