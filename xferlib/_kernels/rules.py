"""The optimizer rules' elementwise CUDA math, written once for every kernel family.

``RULES_KERNEL`` is a source snippet of ``__device__ __forceinline__`` functions, one per
rule, templated on the compute type ``T`` (float for the flat and TT kernels, float or double
for host tables). Each takes one element of the weight, its gradient and its state slots, and
an :code:`XfScalars<T>`: the step's scalars (step size, betas and ``1 - beta``, eps, bias
corrections, decay). Where the scalars come from stays each family's business, because that
is what its reference rounds like: the flat kernel reads float32 values the host computed per
segment (``xferlib.optim.rules``), host tables derive them in double on the device from each
row's own step, TT from its hyperparameters and the global or per-row step.

``xferlib/_kernels/optim.py``, ``table.py`` and ``tt.py`` start their sources with this
snippet and call it; none of them writes a rule's arithmetic itself (``tests/core/
test_rules.py`` fails if one does). The snippet starts with the generated ``#define`` block
of :func:`xferlib.optim.rules.cuda_defines` and :func:`~xferlib.optim.rules.cuda_constants`.

Operation order follows torch.optim's single-tensor code (flat, host tables) and FBGEMM's
(the TT rules), so a family that passes the scalars it computed before gets the results it
got before: the same operations on the same operands.

Not in the snippet: FBGEMM's row-wise rules need a reduction over the row first (a warp's in
the host-table kernel, a block's in TT); the families keep the reduction and the row scalar
it gives, and call the per-element part here (``xf_descend``, ``xf_rowwise_adam``,
``xf_lamb_direction``, ``xf_lars``).
"""

from xferlib.optim.rules import cuda_constants, cuda_defines

RULES_KERNEL = cuda_defines() + cuda_constants() + r"""
// ---------------------------------------------------------------- optimizer rules (shared)
// One step's scalars for one rule, in the compute type T. Each family fills the fields its
// rule reads (xf_neutral() gives the rest: no sign flip, no decay, no flags).
template <typename T> struct XfScalars {
    T sign;        // gradient multiplier: -1 for maximize (the flat device path folds its
                   // unscale / clipping factor in)
    T l2;          // L2 coefficient added to the gradient (0: none)
    T decay;       // decoupled decay factor multiplied into the weight (1: none)
    T lr;          // the step size (lr / (1 - beta1^t) where torch folds the bias correction
                   // in); nadam: the gradient's coefficient
    T lr2;         // nadam: the first moment's coefficient
    T b1, omb1;    // first-moment beta and 1 - beta1 (each family rounds its own 1 - beta)
    T b2, omb2;    // second-moment beta (rmsprop's alpha, adadelta's rho) and 1 - beta2
    T eps;
    T bc1;         // 1 - beta1^t where the rule divides by it per element (TT's FBGEMM rules)
    T bc2;         // adam, radam: sqrt(1 - beta2^t); nadam, lamb: 1 - beta2^t
    T rect;        // radam's rectification term
    T mom;         // sgd, rmsprop, lars: momentum
    T keep, take;  // sgd: what the momentum buffer keeps of itself and takes of the gradient
                   // (0 and 1 on torch's first step, which copies the gradient)
    T wd;          // lion, lamb, lars: weight decay inside the rule
    bool momentum, nesterov, amsgrad, centered, rectified;
};

template <typename T> __device__ __forceinline__ XfScalars<T> xf_neutral() {
    XfScalars<T> s;
    s.sign = (T)1; s.l2 = (T)0; s.decay = (T)1;
    s.lr = s.lr2 = s.b1 = s.omb1 = s.b2 = s.omb2 = s.eps = (T)0;
    s.bc1 = s.bc2 = (T)1; s.rect = s.mom = s.keep = s.wd = (T)0; s.take = (T)1;
    s.momentum = s.nesterov = s.amsgrad = s.centered = s.rectified = false;
    return s;
}

// torch.lerp(m, g, w) for w < 0.5, torch's first moment: m + (g - m) w.
template <typename T> __device__ __forceinline__ T xf_lerp(T m, T g, T w) {
    return m + (g - m) * w;
}

// torch's second moment, v.mul_(b).addcmul_(g, g, value=omb): v b + omb g g.
template <typename T> __device__ __forceinline__ T xf_sq_avg(T v, T g, T b, T omb) {
    return v * b + omb * g * g;
}

// FBGEMM's moving average: b x + omb g.
template <typename T> __device__ __forceinline__ T xf_ema(T x, T g, T b, T omb) {
    return b * x + omb * g;
}

// max(kept, fresh); a NaN fresh value propagates (torch.maximum / amax do).
template <typename T> __device__ __forceinline__ T xf_max(T kept, T fresh) {
    return kept > fresh ? kept : fresh;
}

// w -= scale d: the last step of every rule once its direction and step size are known.
template <typename T> __device__ __forceinline__ void xf_descend(T& w, T d, T scale) {
    w -= scale * d;
}

// maximize and weight decay, as torch applies them before a rule: the gradient times sign,
// then the weight times the decoupled decay (AdamW), or L2 added to the gradient.
template <typename T>
__device__ __forceinline__ void xf_preamble(T& w, T& g, const XfScalars<T>& s) {
    g *= s.sign;
    if (s.decay != (T)1) w *= s.decay;
    if (s.l2 != (T)0) g += s.l2 * w;
}

// SGD: buf <- keep buf + take g; direction buf, or g + mom buf (nesterov).
template <typename T>
__device__ __forceinline__ void xf_sgd(T& w, T g, T& buf, const XfScalars<T>& s) {
    if (s.momentum) {
        buf = buf * s.keep + s.take * g;
        g = s.nesterov ? g + s.mom * buf : buf;
    }
    xf_descend(w, g, s.lr);
}

// Adam / AdamW (decay in the preamble): w -= lr/bc1 m / (sqrt(v) / sqrt(bc2) + eps), v the
// running max of the second moment with amsgrad.
template <typename T>
__device__ __forceinline__ void xf_adam(T& w, T g, T& m, T& v, T& vmax,
                                        const XfScalars<T>& s) {
    m = xf_lerp(m, g, s.omb1);
    v = xf_sq_avg(v, g, s.b2, s.omb2);
    T den = v;
    if (s.amsgrad) {
        vmax = xf_max(vmax, v);
        den = vmax;
    }
    xf_descend(w, m / (sqrt(den) / s.bc2 + s.eps), s.lr);
}

// Adagrad: sum += g^2; w -= clr g / (sqrt(sum) + eps).
template <typename T>
__device__ __forceinline__ void xf_adagrad(T& w, T g, T& sum, const XfScalars<T>& s) {
    sum += g * g;
    xf_descend(w, g / (sqrt(sum) + s.eps), s.lr);
}

// RMSprop: sq <- alpha sq + (1 - alpha) g^2; centered subtracts the squared mean gradient;
// with momentum the buffer takes g / avg.
template <typename T>
__device__ __forceinline__ void xf_rmsprop(T& w, T g, T& sq, T& buf, T& gavg,
                                           const XfScalars<T>& s) {
    sq = xf_sq_avg(sq, g, s.b2, s.omb2);
    T avg;
    if (s.centered) {
        gavg = xf_lerp(gavg, g, s.omb2);
        avg = sqrt(sq - gavg * gavg) + s.eps;
    } else {
        avg = sqrt(sq) + s.eps;
    }
    if (s.momentum) {
        buf = buf * s.mom + g / avg;
        xf_descend(w, buf, s.lr);
    } else {
        xf_descend(w, g / avg, s.lr);
    }
}

// Adamax: u <- max(b2 u, |g| + eps); w -= lr/bc1 m / u.
template <typename T>
__device__ __forceinline__ void xf_adamax(T& w, T g, T& m, T& u, const XfScalars<T>& s) {
    m = xf_lerp(m, g, s.omb1);
    u = xf_max(u * s.b2, fabs(g) + s.eps);
    xf_descend(w, m / u, s.lr);
}

// NAdam (Dozat 2016, torch's momentum schedule in the host scalars lr and lr2, both
// negative): w += lr g / den + lr2 m / den, den = sqrt(v / bc2) + eps.
template <typename T>
__device__ __forceinline__ void xf_nadam(T& w, T g, T& m, T& v, const XfScalars<T>& s) {
    m = xf_lerp(m, g, s.omb1);
    v = xf_sq_avg(v, g, s.b2, s.omb2);
    const T den = sqrt(v / s.bc2) + s.eps;
    w += s.lr * (g / den);
    w += s.lr2 * (m / den);
}

// RAdam (Liu et al. 2020): the adaptive step only once the variance is tractable (rectified).
template <typename T>
__device__ __forceinline__ void xf_radam(T& w, T g, T& m, T& v, const XfScalars<T>& s) {
    m = xf_lerp(m, g, s.omb1);
    v = xf_sq_avg(v, g, s.b2, s.omb2);
    if (s.rectified) {
        const T adaptive = s.bc2 / (sqrt(v) + s.eps);
        w -= s.lr * m * adaptive * s.rect;
    } else {
        w -= s.lr * m;
    }
}

// Lion (optax): update = sign(b1 m + (1 - b1) g) + wd w; m <- b2 m + (1 - b2) g.
template <typename T>
__device__ __forceinline__ void xf_lion(T& w, T g, T& m, const XfScalars<T>& s) {
    const T mix = xf_ema(m, g, s.b1, s.omb1);
    T update = (T)((mix > (T)0) - (mix < (T)0));
    m = xf_ema(m, g, s.b2, s.omb2);
    update += s.wd * w;
    xf_descend(w, update, s.lr);
}

// Adadelta: delta = sqrt(acc + eps) / sqrt(sq + eps) g; both averages with rho (b2).
template <typename T>
__device__ __forceinline__ void xf_adadelta(T& w, T g, T& sq, T& acc, const XfScalars<T>& s) {
    const T sqv = xf_sq_avg(sq, g, s.b2, s.omb2);
    const T sd = sqrt(sqv + s.eps);
    const T delta = sqrt(acc + s.eps) / sd * g;
    sq = sqv;
    acc = xf_sq_avg(acc, delta, s.b2, s.omb2);
    xf_descend(w, delta, s.lr);
}

// FBGEMM's row-wise rules, per element once the row's reduction gave its scalar. Row-wise
// Adagrad is xf_descend(w, g, lr / (sqrt(row sum) + eps)).

// Row-wise Adam: elementwise first moment, the row's denominator den.
template <typename T>
__device__ __forceinline__ void xf_rowwise_adam(T& w, T g, T& m, T den, const XfScalars<T>& s) {
    m = xf_ema(m, g, s.b1, s.omb1);
    w -= s.lr * (m / s.bc1) / den;
}

// LAMB's elementwise denominator sqrt(v / bc2) + eps (the partial rules use the row's).
template <typename T>
__device__ __forceinline__ T xf_lamb_den(T g, T& v, const XfScalars<T>& s) {
    v = xf_sq_avg(v, g, s.b2, s.omb2);
    return sqrt(v / s.bc2) + s.eps;
}

// LAMB / partial row-wise Adam's direction m / bc1 / den + wd w (LAMB then scales it by the
// row's trust ratio).
template <typename T>
__device__ __forceinline__ T xf_lamb_direction(T w, T g, T& m, T den, const XfScalars<T>& s) {
    m = xf_ema(m, g, s.b1, s.omb1);
    return m / s.bc1 / den + s.wd * w;
}

// LARS-SGD: m <- mom m + scale (g + wd w); w -= m, scale the row's trust ratio times lr.
template <typename T>
__device__ __forceinline__ void xf_lars(T& w, T g, T& m, T scale, const XfScalars<T>& s) {
    m = s.mom * m + scale * (g + s.wd * w);
    w -= m;
}
// ------------------------------------------------------------ end of the optimizer rules
"""
