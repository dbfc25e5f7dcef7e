"""The embedding collection's gradient sums: each distinct row's gradient from the pooled
gradient, in sorted order, in two passes (deterministic, no atomics, no warp held up by a hot
row). Part of the collection's kernel module (``collection.py``), launched by
``xferlib/collection/device.py`` between the forward's plan and ``coll_update``.

Pass 1 (``coll_sum_chunks``) walks chunks of ``SUM_CHUNK`` sorted positions: a run inside a
chunk is summed there; a run crossing chunks leaves pieces (a chunk's last segment in
``tail``, its first in ``head``). Pass 2 (``coll_sum_spans``) adds each crossing run's
pieces in order: a lane group per chunk for a run across up to ``LONG_SPAN`` more chunks,
a block per longer run (a hot row's, listed by pass 1) whose threads split its chunks.

An H200, 26 tables x 64 at batch 16,384 (DLRM's shape, 425,984 lookups of 86,642 rows,
Zipf): the second pass 7.6 us, where one thread per (chunk, column) walking each run's heads
took 29.
"""

from __future__ import annotations

from xferlib._kernels._declare import KernelDecl

__all__ = ["SUM_CHUNK", "LONG_SPAN", "ADD_HEADS", "SUM_CHUNKS", "SUM_SPANS", "long_runs_size",
           "long_runs_capacity"]

SUM_CHUNK = 32  # sorted positions per warp in the first pass
# Chunks past its first that a run may cross and still be summed by one lane group of the
# second pass (longer: listed by the first pass, summed by a block each).
LONG_SPAN = 16


def long_runs_size(n: int) -> int:
    """int64 words of the first pass's list of long runs for ``n`` sorted positions: a count,
    then a (run, chunk, width) triple for at most one run a ``LONG_SPAN + 1`` chunks."""
    chunks = -(-int(n) // SUM_CHUNK)
    return 1 + 3 * (1 + chunks // (LONG_SPAN + 1))


def long_runs_capacity(size: int) -> int:
    """The long runs a list of ``size`` int64 words (:func:`long_runs_size`) can hold.

    >>> long_runs_capacity(long_runs_size(65_536))
    121
    """
    return (int(size) - 1) // 3

SUM_CHUNKS = KernelDecl(
    "coll_sum_chunks", "template <int V, typename T, typename K>",
    (("const T*", "grad"), ("const K*", "keys"), ("const i64*", "run"), ("const i64*", "perm"),
     ("const i64*", "bag_of"), ("const i64*", "offsets"), ("const i64*", "meta"),
     ("const T*", "psw"), ("int", "mean"), ("i64", "B"), ("i64", "grad_stride"), ("i64", "n"),
     ("i64", "width"), ("T*", "summed"), ("T*", "head"), ("T*", "tail"), ("i64*", "cross"),
     ("i64*", "long_runs"), ("const unsigned long long*", "verdict")),
    r"""
    // Pass 1 (as the host tables' sum_chunks): chunk c's COLL_SUM_CHUNK (= 32) sorted
    // positions, summed per column in position order; a run inside the chunk goes to
    // summed[run], the segment at the chunk's start to head[c], the one at its end to
    // tail[c]. A warp per (chunk, 32 x V columns), V adjacent columns a lane (one 16-byte
    // load where the gradient's rows allow): lane k first finds position k's records
    // (gradient source, factor, width, key, run), then the warp walks the positions with
    // every record at hand from a shuffle, so the gradient loads of the walk do not wait on
    // each other. Columns past a table's width are skipped (every width is a multiple of
    // V). `width`: the widest table (summed's row stride, a multiple of V). The run that
    // begins in the chunk and leaves it: across up to COLL_LONG_SPAN more chunks, its run
    // and width in cross[2c], cross[2c + 1] (else -1: none), for coll_sum_spans; longer,
    // listed in `long_runs` (a count, zeroed by the caller, then (run, chunk, width)
    // triples; at most one a COLL_LONG_SPAN + 1 chunks), its blocks first.
    if (rejected(verdict)) return;
    const int lane = threadIdx.x & 31;
    const i64 chunks = (n + COLL_SUM_CHUNK - 1) / COLL_SUM_CHUNK;
    const i64 slices = (width + 32 * V - 1) / (32 * V);
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    for (i64 w = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; w < chunks * slices;
         w += warps) {
        const i64 c = w / slices, e = ((w - c * slices) * 32 + lane) * V;
        const i64 first = c * COLL_SUM_CHUNK;
        const int count = (int)(first + COLL_SUM_CHUNK < n ? COLL_SUM_CHUNK : n - first);
        const i64 mine_j = first + (lane < count ? lane : count - 1);
        // My position's record: where its lookup's gradient starts in the pooled gradient
        // (its bag's row, `grad_stride` elements apart, then its table's columns), its
        // factor and its table's width (0 for padding, bag -1: no gradient).
        i64 my_src = 0;
        T my_scale = (T)0;
        int my_dim = 0;
        {
            const i64 l = perm[mine_j];
            const i64 bag = l >= 0 && l < n ? bag_of[l] : -1;
            if (bag >= 0) {
                const i64 t = bag <= 0x7fffffffLL && B <= 0x7fffffffLL
                              ? (i64)((unsigned)bag / (unsigned)B) : bag / B;
                const i64* m = meta + t * COLL_META;
                my_src = (bag - t * B) * grad_stride + m[M_D_OFF];
                my_dim = (int)m[M_DIM];
                my_scale = (T)1;
                if (psw != nullptr || mean) {
                    i64 lo, hi;
                    bag_range(offsets, bag, n, lo, hi);
                    my_scale = lookup_scale<T>(psw, l, mean, hi - lo);
                }
            }
        }
        const i64 my_run = run[mine_j];
        // Does a segment end at my position (the next key differs, or the chunk ends)?
        const bool my_end = lane >= count - 1 || keys[mine_j + 1] != keys[mine_j];
        const bool head_open = first > 0 && keys[first] == keys[first - 1];
        const bool tail_open = first + count < n && keys[first + count] == keys[first + count - 1];
        // the run leaving the chunk still runs past COLL_LONG_SPAN more chunks (sorted keys:
        // equal at a later position, equal all the way there)
        const i64 far = first + (COLL_LONG_SPAN + 1) * (i64)COLL_SUM_CHUNK;
        const bool far_equal = far < n && keys[far] == keys[first + count - 1];
        const bool long_tail = tail_open && far_equal;
        i64 crossing = -1;  // the run that begins here and leaves the chunk (short ones)
        const unsigned ends = __ballot_sync(0xffffffffu, my_end && lane < count);
        vec<T, V> acc;
        #pragma unroll
        for (int q = 0; q < V; ++q) acc.v[q] = (T)0;
        int begin = 0;
        // AHEAD positions' gradient loads issued before the first is added: the walk is
        // bound by load latency, not bandwidth (26 tables x 64, 425,984 lookups, an H200:
        // 63 us with one load at a time; 8M x 128, 65,536 lookups, a replayed step about
        // 2 us faster at 8 than at 4 loads of 16 bytes, slower at 16). AHEAD divides 32, so k
        // stays a lane of the warp.
        constexpr int AHEAD = 8;
        for (int k0 = 0; k0 < count; k0 += AHEAD) {
            vec<T, V> g[AHEAD];
            T scale[AHEAD];
            int dim[AHEAD];
            #pragma unroll
            for (int u = 0; u < AHEAD; ++u) {
                const int k = k0 + u;
                const i64 src = __shfl_sync(0xffffffffu, my_src, k);
                scale[u] = __shfl_sync(0xffffffffu, my_scale, k);
                dim[u] = k < count ? __shfl_sync(0xffffffffu, my_dim, k) : 0;
                if (e < dim[u]) g[u] = *reinterpret_cast<const vec<T, V>*>(grad + src + e);
            }
            #pragma unroll
            for (int u = 0; u < AHEAD; ++u) {
                const int k = k0 + u;
                if (k >= count) break;  // the same for every lane
                if (e < dim[u]) {
                    #pragma unroll
                    for (int q = 0; q < V; ++q) acc.v[q] += g[u].v[q] * scale[u];
                }
                if ((ends >> k) & 1u) {  // the segment [begin, k] ends here
                    const i64 rk = __shfl_sync(0xffffffffu, my_run, k);
                    const bool is_head = begin == 0 && head_open;
                    const bool is_tail = k == count - 1 && tail_open;
                    if (e < dim[u]) {
                        if (is_head) *reinterpret_cast<vec<T, V>*>(head + c * width + e) = acc;
                        if (is_tail) *reinterpret_cast<vec<T, V>*>(tail + c * width + e) = acc;
                        if (!is_head && !is_tail && rk >= 0 && rk < n)
                            *reinterpret_cast<vec<T, V>*>(summed + rk * width + e) = acc;
                    }
                    // a run that begins here and leaves the chunk: a short one's record
                    // for coll_sum_spans, a long one listed for its blocks (by the
                    // chunk's first warp)
                    if (is_tail && !is_head && rk >= 0 && rk < n) {
                        if (!long_tail) crossing = rk;
                        else if (e == 0) {
                            const i64 at = 1 + 3 * (i64)atomicAdd(
                                reinterpret_cast<unsigned long long*>(long_runs), 1ull);
                            long_runs[at] = rk;
                            long_runs[at + 1] = c;
                            long_runs[at + 2] = dim[u];
                        }
                    }
                    #pragma unroll
                    for (int q = 0; q < V; ++q) acc.v[q] = (T)0;
                    begin = k + 1;
                }
            }
        }
        const int last_dim = __shfl_sync(0xffffffffu, my_dim, count - 1);
        if (e == 0) {
            cross[2 * c] = crossing;
            cross[2 * c + 1] = last_dim;
        }
    }""")

# acc += head[d][e .. e + V) for d = first, first + step, ... up to last, in that order, the
# loads issued U at a time (both of pass 2's walks over a run's chunk heads)
ADD_HEADS = r"""
template <int U, int V, typename T>
__device__ __forceinline__ void add_heads(vec<T, V>& acc, const T* head, i64 width, i64 e,
                                          i64 first, i64 last, i64 step) {
    for (i64 d0 = first; d0 <= last; d0 += U * step) {
        vec<T, V> h[U];
        #pragma unroll
        for (int u = 0; u < U; ++u)
            if (d0 + u * step <= last)
                h[u] = *reinterpret_cast<const vec<T, V>*>(head + (d0 + u * step) * width + e);
        #pragma unroll
        for (int u = 0; u < U; ++u)
            if (d0 + u * step <= last) {
                #pragma unroll
                for (int q = 0; q < V; ++q) acc.v[q] += h[u].v[q];
            }
    }
}
"""

SUM_SPANS = KernelDecl(
    "coll_sum_spans", "template <int V, typename T>",
    (("const i64*", "run"), ("const i64*", "starts"), ("const i64*", "cross"),
     ("const i64*", "long_runs"), ("i64", "n"), ("i64", "width"), ("T*", "summed"),
     ("const T*", "head"), ("const T*", "tail"), ("int", "group"),
     ("const unsigned long long*", "verdict")),
    r"""
    // Pass 2: each run that crosses chunks gets its pieces added in order into summed[run]
    // (its first chunk's tail, then the next chunks' heads up to its last). Runs inside one
    // chunk have their sums from pass 1.
    // - Block b < the number pass 1 listed takes long run b (run, first chunk, width: it
    //   crosses more than COLL_LONG_SPAN chunks, a hot row's up to thousands): its threads
    //   (slice, lane group) sum a slice of its heads each (chunks c + 1 + slice, then every
    //   `slices` on), and the slices are added in order after the tail: a fixed order, a
    //   chain of ~chunks / slices loads instead of chunks.
    // - Then a group of `group` lanes per chunk (V columns a lane) takes the shorter run
    //   pass 1 recorded there (cross[2c], its width cross[2c + 1]; -1: none).
    __shared__ vec<T, V> part[256];
    if (rejected(verdict)) return;
    const int lane = threadIdx.x & (group - 1), slice = threadIdx.x / group;
    const int slices = blockDim.x / group;
    const i64 chunks = (n + COLL_SUM_CHUNK - 1) / COLL_SUM_CHUNK;
    const i64 runs = n > 0 ? min(run[n - 1] + 1, n) : 0;
    const i64 listed = (i64)*reinterpret_cast<const unsigned long long*>(long_runs);
    if ((i64)blockIdx.x < listed) {
        const i64* entry = long_runs + 1 + 3 * (i64)blockIdx.x;
        const i64 rl = entry[0], c = entry[1], dim = entry[2];
        if (rl >= 0 && rl < runs && c >= 0 && c < chunks) {  // the same for the block
            i64 c_end = (rl + 1 < runs ? starts[rl + 1] - 1 : n - 1) / COLL_SUM_CHUNK;
            c_end = c_end >= chunks ? chunks - 1 : c_end;
            for (i64 e0 = 0; e0 < dim; e0 += (i64)group * V) {
                const i64 e = e0 + (i64)V * lane;
                vec<T, V> acc;
                #pragma unroll
                for (int q = 0; q < V; ++q) acc.v[q] = (T)0;
                if (e < dim) add_heads<4>(acc, head, width, e, c + 1 + slice, c_end, slices);
                part[threadIdx.x] = acc;
                __syncthreads();
                if (slice == 0 && e < dim) {
                    vec<T, V> total = *reinterpret_cast<const vec<T, V>*>(tail + c * width + e);
                    for (int k = 0; k < slices; ++k) {
                        #pragma unroll
                        for (int q = 0; q < V; ++q) total.v[q] += part[k * group + lane].v[q];
                    }
                    *reinterpret_cast<vec<T, V>*>(summed + rl * width + e) = total;
                }
                __syncthreads();
            }
        }
    }
    const i64 c = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / group;
    if (c >= chunks) return;
    const i64 r = cross[2 * c], dim = cross[2 * c + 1];
    if (r < 0 || r >= runs) return;
    i64 c_end = (r + 1 < runs ? starts[r + 1] - 1 : n - 1) / COLL_SUM_CHUNK;
    c_end = c_end > c + COLL_LONG_SPAN ? c + COLL_LONG_SPAN : c_end;
    c_end = c_end >= chunks ? chunks - 1 : c_end;
    for (i64 e = (i64)V * lane; e < dim; e += (i64)group * V) {
        vec<T, V> acc = *reinterpret_cast<const vec<T, V>*>(tail + c * width + e);
        add_heads<8>(acc, head, width, e, c + 1, c_end, 1);
        *reinterpret_cast<vec<T, V>*>(summed + r * width + e) = acc;
    }""", launch_bounds="__launch_bounds__(256)")
