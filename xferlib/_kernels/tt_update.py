"""TT embedding kernels' CUDA source, the fused update: ``tt_update`` (the optimizer on every
touched core row, FBGEMM's rules) with its device helpers (``block_sum``, ``Hyper``,
``update_row``), the row cache's update (``tt_cache_update``) spliced in before it.

Spliced last into the TT module's source by :mod:`xferlib._kernels.tt_backward`; it uses the
TT shape's constants and ``rejected`` from :mod:`xferlib._kernels.tt` and the per-element
steps of :mod:`xferlib._kernels.rules`, and is compiled in the TT module, not on its own.
"""

from xferlib._kernels._declare import KernelDecl
from xferlib._kernels.tt_cache import TT_CACHE_UPDATE_KERNEL

# Argument groups of tt_update: one pointer per core to a state slot (e, f, r: two
# elementwise slots and the per-row one); the optimizer's scalars (iter: the global step on
# the device, read when the kernel runs, so a captured CUDA graph's replays see the current
# step; NULL for 1).
HYPER_PARAMS = (("int", "opt"), ("float", "lr"), ("float", "eps"), ("double", "beta1"),
                ("double", "beta2"), ("float", "wd"), ("float", "eta"), ("float", "mom"),
                ("const i64*", "iter"))
HYPER_ARGS = tuple(name for _, name in HYPER_PARAMS)


def state_params(slot: str) -> tuple:
    return tuple(("float*", f"{slot}{k}") for k in range(4))


_UPDATE_HELPERS = r"""// A block-wide sum, returned to every thread (blockDim a multiple of 32; red: 33 floats).
__device__ float block_sum(float v, float* red) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
    __syncthreads();  // red may still be read from the previous call
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.f;
        for (int t = 0; t < (int)((blockDim.x + 31) >> 5); ++t) total += red[t];
        red[32] = total;
    }
    __syncthreads();
    return red[32];
}

struct Hyper {
    int opt;
    float lr, eps;
    double beta1, beta2;
    float wd, eta, mom;
    i64 iter;
};

// The fused optimizer on one parameter row w (width floats) from its gradient g, by the whole
// block (block-uniform call). opt: an XF_OPT_* id (xferlib.optim.rules.OptId): sgd,
// adagrad, rowwise_adagrad, rowwise_adam (elementwise first moment, one second moment and
// step per row), lamb, lars_sgd, partial_rowwise_adam, partial_rowwise_lamb (FBGEMM's rules;
// global step h.iter).
// e1/e2: elementwise state, rs: the row's state, st: its step count (NULL where unused).
// g is overwritten by the LAMB rules (their update direction). Each thread reads and writes
// the same elements of g and w throughout. The row reductions (norms, mean squared gradient)
// and the row scalars they give are computed here; every per-element step is the shared rule
// of xferlib/_kernels/rules.py.
__device__ void update_row(float* w, float* g, int width, float* e1, float* e2, float* rs,
                           i64* st, const Hyper& h, float* red) {
    const int opt = h.opt;
    XfScalars<float> s = xf_neutral<float>();
    s.lr = h.lr;
    s.eps = h.eps;
    s.b1 = (float)h.beta1; s.omb1 = (float)(1.0 - h.beta1);
    s.b2 = (float)h.beta2; s.omb2 = (float)(1.0 - h.beta2);
    s.wd = h.wd;
    s.mom = h.mom;
    if (opt == XF_OPT_SGD) {
        float none = 0.f;  // no momentum buffer
        for (int o = threadIdx.x; o < width; o += blockDim.x) xf_sgd(w[o], g[o], none, s);
        return;
    }
    if (opt == XF_OPT_ADAGRAD) {
        for (int o = threadIdx.x; o < width; o += blockDim.x) xf_adagrad(w[o], g[o], e1[o], s);
        return;
    }
    if (opt == XF_OPT_LARS_SGD) {
        float ww = 0.f, gg = 0.f;
        for (int o = threadIdx.x; o < width; o += blockDim.x) {
            ww += w[o] * w[o];
            gg += g[o] * g[o];
        }
        const float w_norm = sqrtf(block_sum(ww, red)), g_norm = sqrtf(block_sum(gg, red));
        const float den = g_norm + h.wd * w_norm;
        const float scale = den > 0.f ? h.lr * h.eta * w_norm / den : 0.f;
        for (int o = threadIdx.x; o < width; o += blockDim.x) xf_lars(w[o], g[o], e1[o], scale, s);
        return;
    }
    float part = 0.f;
    if (opt != XF_OPT_LAMB)
        for (int o = threadIdx.x; o < width; o += blockDim.x) part += g[o] * g[o];
    const float mean_sq = opt != XF_OPT_LAMB ? block_sum(part, red) / (float)width : 0.f;
    if (opt == XF_OPT_ROWWISE_ADAGRAD) {
        const float sum = rs[0] + mean_sq;
        __syncthreads();  // every thread has read rs[0]
        if (threadIdx.x == 0) rs[0] = sum;
        const float scale = h.lr / (sqrtf(sum) + h.eps);
        for (int o = threadIdx.x; o < width; o += blockDim.x) xf_descend(w[o], g[o], scale);
        return;
    }
    if (opt == XF_OPT_ROWWISE_ADAM) {
        const i64 t = st[0] + 1;
        const float vv = s.b2 * rs[0] + s.omb2 * mean_sq;
        __syncthreads();
        if (threadIdx.x == 0) {
            st[0] = t;
            rs[0] = vv;
        }
        const float den = sqrtf((float)(vv / (1.0 - pow(h.beta2, (double)t)))) + h.eps;
        s.bc1 = (float)(1.0 - pow(h.beta1, (double)t));
        for (int o = threadIdx.x; o < width; o += blockDim.x)
            xf_rowwise_adam(w[o], g[o], e1[o], den, s);
        return;
    }
    // lamb, partial_rowwise_adam, partial_rowwise_lamb: bias corrections from the global step
    s.bc1 = (float)(1.0 - pow(h.beta1, (double)h.iter));
    s.bc2 = (float)(1.0 - pow(h.beta2, (double)h.iter));
    float row_den = 0.f;
    if (opt != XF_OPT_LAMB) {
        const float vv = s.b2 * rs[0] + s.omb2 * mean_sq;
        __syncthreads();
        if (threadIdx.x == 0) rs[0] = vv;
        row_den = sqrtf(vv / s.bc2) + h.eps;
    }
    float ww = 0.f, uu = 0.f;
    for (int o = threadIdx.x; o < width; o += blockDim.x) {
        const float den = opt == XF_OPT_LAMB ? xf_lamb_den(g[o], e2[o], s) : row_den;
        const float u = xf_lamb_direction(w[o], g[o], e1[o], den, s);
        if (opt == XF_OPT_PARTIAL_ROWWISE_ADAM) {
            xf_descend(w[o], u, h.lr);
        } else {
            g[o] = u;
            ww += w[o] * w[o];
            uu += u * u;
        }
    }
    if (opt == XF_OPT_PARTIAL_ROWWISE_ADAM) return;
    const float w_norm = sqrtf(block_sum(ww, red)), u_norm = sqrtf(block_sum(uu, red));
    const float ratio = u_norm > 0.f ? w_norm / u_norm : 0.f;
    for (int o = threadIdx.x; o < width; o += blockDim.x) xf_descend(w[o], g[o], h.lr * ratio);
}

#define HYPER {opt, lr, eps, beta1, beta2, wd, eta, mom, iter != nullptr ? *iter : 1}
"""

# The fused optimizer on every touched core row (one block per core row) and, in the blocks
# past them, on the row cache's hit rows (tt_cache_update; cseg == NULL: no cache). The cache
# arguments: the sorted batch (rows, perm, n), each lookup's slot among capacity cached rows,
# tt_bwd_pieces' segment sums, the dense rows cw and their state, the batch's verdict.
TT_UPDATE = KernelDecl(
    "tt_update", "template <typename K>",
    (("float*", "c0"), ("float*", "c1"), ("float*", "c2"), ("float*", "c3"),
     *state_params("e"), *state_params("f"), *state_params("r"), ("i64*", "s0"),
     ("i64*", "s1"), ("i64*", "s2"), ("i64*", "s3"), ("float*", "grad"),
     ("const int*", "touched"), *HYPER_PARAMS, ("const K*", "rows"), ("const i64*", "perm"),
     ("i64", "n"), ("const i64*", "slot"), ("i64", "capacity"), ("const float*", "cseg"),
     ("float*", "cw"), ("float*", "ce1"), ("float*", "ce2"), ("float*", "crs"),
     ("i64*", "cst"), ("const u64*", "verdict")),
    r"""
    __shared__ float red[33];
    const i64 b = blockIdx.x;
    if (b >= ROFF(D)) {  // a cache block (block-uniform)
        if (cseg == nullptr || cw == nullptr || slot == nullptr || rows == nullptr ||
            perm == nullptr || verdict == nullptr || rejected(verdict) ||
            blockDim.x != UPDATE_THREADS)
            return;
        const Hyper hc = HYPER;
        tt_cache_update<K>(rows, perm, n, slot, capacity, cseg, cw, ce1, ce2, crs, cst, hc, red,
                           b - ROFF(D), (i64)gridDim.x - ROFF(D));
        return;
    }
    int k = 0;
    while (k < D - 1 && b >= ROFF(k + 1)) ++k;
    const i64 i = b - ROFF(k);
    if (i < 0 || i >= P(k) || !touched[b]) return;
    const int width = W(k);
    float* cores[4] = {c0, c1, c2, c3};
    float* elem[4] = {e0, e1, e2, e3};
    float* elem2[4] = {f0, f1, f2, f3};
    float* rowst[4] = {r0, r1, r2, r3};
    i64* steps[4] = {s0, s1, s2, s3};
    const Hyper h = HYPER;
    update_row(cores[k] + i * width, grad + GOFF(k) + i * width, width,
               elem[k] ? elem[k] + i * width : nullptr, elem2[k] ? elem2[k] + i * width : nullptr,
               rowst[k] ? rowst[k] + i : nullptr, steps[k] ? steps[k] + i : nullptr, h, red);""",
    launch_bounds="__launch_bounds__(UPDATE_THREADS)")

TT_UPDATE_KERNEL = _UPDATE_HELPERS + TT_CACHE_UPDATE_KERNEL + TT_UPDATE.source()
