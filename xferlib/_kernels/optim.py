"""Flat optimizer kernels: one launch updates every parameter of a flat buffer.

A block takes one chunk of one segment (``chunk_seg``, ``chunk_start``, ``chunk_end``) and
reads that segment's scalars from the per-step table: sign (0: no gradient this step, skip),
L2 coefficient, decoupled decay factor, then eight rule-specific scalars
(``xferlib/optim/rules.py`` computes them exactly as torch does, in float64 on the host,
stored as float32). ``flat_scalars`` hands them to the shared per-element rules of
``xferlib/_kernels/rules.py`` (the source starts with that snippet and its ``#define XF_OPT_*``
ids). For Adam/AdamW a second entry point computes those scalars on the device from
device-resident step counts, so a step can live in a CUDA graph. Threads move float4
vectors: segments start on 16-byte boundaries, so every access is a whole aligned vector.
"""

from xferlib._kernels._declare import KernelDecl
from xferlib._kernels._registry import KernelModule
from xferlib._kernels.rules import RULES_KERNEL
from xferlib.optim.rule_rows import adam_hyper_defines, flat_scalar_defines
from xferlib.optim.rules import FLAT_RULES

_HEAD = RULES_KERNEL + flat_scalar_defines() + adam_hyper_defines() + r"""
typedef long long i64;

// Low-precision gradients / parameter copies (mixed precision with float32 master weights),
// as raw bits: conversions go through PTX, so no CUDA header is needed at compile time.
struct bf16 { unsigned short bits; };
struct f16 { unsigned short bits; };
__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16 x) { return __uint_as_float(((unsigned)x.bits) << 16); }
__device__ __forceinline__ float to_f32(f16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}
__device__ __forceinline__ void from_f32(float a, float& out) { out = a; }
__device__ __forceinline__ void from_f32(float a, bf16& out) {
    unsigned int u = __float_as_uint(a);
    if ((u & 0x7fffffffu) > 0x7f800000u) { out.bits = (unsigned short)((u >> 16) | 0x40u); return; }
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    out.bits = (unsigned short)(u >> 16);
}
__device__ __forceinline__ void from_f32(float a, f16& out) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(a));
    out.bits = h;
}
template <typename T> struct alignas(4 * sizeof(T)) vec4 { T v[4]; };
template <typename T>
__device__ __forceinline__ void load4(const T* ptr, i64 i, float* a) {
    const vec4<T> t = *reinterpret_cast<const vec4<T>*>(ptr + i);
    #pragma unroll
    for (int e = 0; e < 4; ++e) a[e] = to_f32(t.v[e]);
}
template <typename T>
__device__ __forceinline__ void store4(T* ptr, i64 i, const float* a) {
    vec4<T> t;
    #pragma unroll
    for (int e = 0; e < 4; ++e) from_f32(a[e], t.v[e]);
    *reinterpret_cast<vec4<T>*>(ptr + i) = t;
}

#define LOAD4(ptr, i, a) { const float4 t_ = *reinterpret_cast<const float4*>((ptr) + (i)); \
    a[0] = t_.x; a[1] = t_.y; a[2] = t_.z; a[3] = t_.w; }
#define STORE4(ptr, i, a) { *reinterpret_cast<float4*>((ptr) + (i)) = \
    make_float4(a[0], a[1], a[2], a[3]); }

// A segment's rule record c (xferlib/optim/rules.py: each rule's NamedTuple, its columns
// XF_<RULE>_<FIELD>) as the shared rules read it; every record starts with the step's size.
// 1 - beta is rounded here, in float, as torch's float32 step does.
template <int KIND>
__device__ __forceinline__ XfScalars<float> flat_scalars(const float* c, float sign, float l2,
                                                         float decay) {
    XfScalars<float> s = xf_neutral<float>();
    s.sign = sign;
    s.l2 = l2;
    s.decay = decay;
    s.lr = c[0];
    if (KIND == XF_OPT_SGD) {
        s.mom = c[XF_SGD_MOMENTUM]; s.keep = c[XF_SGD_KEEP]; s.take = c[XF_SGD_TAKE];
        s.momentum = c[XF_SGD_USE_MOMENTUM] != 0.0f; s.nesterov = c[XF_SGD_NESTEROV] != 0.0f;
    } else if (KIND == XF_OPT_ADAM) {
        s.b1 = c[XF_ADAM_B1]; s.omb1 = 1.0f - c[XF_ADAM_B1]; s.b2 = c[XF_ADAM_B2];
        s.omb2 = 1.0f - c[XF_ADAM_B2]; s.eps = c[XF_ADAM_EPS]; s.bc2 = c[XF_ADAM_BC2_SQRT];
        s.amsgrad = c[XF_ADAM_AMSGRAD] != 0.0f;
    } else if (KIND == XF_OPT_ADAGRAD) {
        s.eps = c[XF_ADAGRAD_EPS];
    } else if (KIND == XF_OPT_RMSPROP) {
        s.b2 = c[XF_RMSPROP_ALPHA]; s.omb2 = 1.0f - c[XF_RMSPROP_ALPHA];
        s.eps = c[XF_RMSPROP_EPS]; s.mom = c[XF_RMSPROP_MOMENTUM];
        s.momentum = c[XF_RMSPROP_MOMENTUM] > 0.0f; s.centered = c[XF_RMSPROP_CENTERED] != 0.0f;
    } else if (KIND == XF_OPT_ADAMAX) {
        s.b1 = c[XF_ADAMAX_B1]; s.omb1 = 1.0f - c[XF_ADAMAX_B1]; s.b2 = c[XF_ADAMAX_B2];
        s.eps = c[XF_ADAMAX_EPS];
    } else if (KIND == XF_OPT_NADAM) {
        s.lr2 = c[XF_NADAM_COEF_AVG]; s.b1 = c[XF_NADAM_B1]; s.omb1 = 1.0f - c[XF_NADAM_B1];
        s.b2 = c[XF_NADAM_B2]; s.omb2 = 1.0f - c[XF_NADAM_B2]; s.bc2 = c[XF_NADAM_BC2];
        s.eps = c[XF_NADAM_EPS];
    } else if (KIND == XF_OPT_RADAM) {
        s.b1 = c[XF_RADAM_B1]; s.omb1 = 1.0f - c[XF_RADAM_B1]; s.b2 = c[XF_RADAM_B2];
        s.omb2 = 1.0f - c[XF_RADAM_B2]; s.eps = c[XF_RADAM_EPS]; s.bc2 = c[XF_RADAM_BC2_SQRT];
        s.rect = c[XF_RADAM_RECT]; s.rectified = c[XF_RADAM_RECTIFIED] != 0.0f;
    } else if (KIND == XF_OPT_LION) {
        s.b1 = c[XF_LION_B1]; s.omb1 = 1.0f - c[XF_LION_B1]; s.b2 = c[XF_LION_B2];
        s.omb2 = 1.0f - c[XF_LION_B2]; s.wd = c[XF_LION_WEIGHT_DECAY];
    }
    return s;
}

// KIND: an XF_OPT_* id (xferlib.optim.rules.OptId); adamw runs XF_OPT_ADAM.
// s0..s2: the rule's state buffers in the order slot_names() gives (null when unused): a
// rule's state is loaded and stored only where its configuration uses it.
// G: the gradients' type; with `lowp` non-null the updated float32 master weights are also
// written there, rounded to G (the model's low-precision parameters). With `updates`
// non-null, params stay and the step (new - old) goes there instead, as an optax
// GradientTransformation returns it (updates may alias grads).
template <int KIND, typename G>
__device__ void update_chunk(float* __restrict__ params, const G* __restrict__ grads,
                             float* __restrict__ s0, float* __restrict__ s1,
                             float* __restrict__ s2, const XfScalars<float>& s,
                             const i64 start, const i64 end, float* __restrict__ updates,
                             G* __restrict__ lowp) {
    // Which slots this configuration reads and writes.
    const bool use0 = KIND != XF_OPT_SGD || s.momentum;
    const bool use1 = KIND == XF_OPT_ADAM || KIND == XF_OPT_ADAMAX || KIND == XF_OPT_NADAM
                      || KIND == XF_OPT_RADAM || (KIND == XF_OPT_RMSPROP && s.momentum);
    const bool use2 = (KIND == XF_OPT_ADAM && s.amsgrad) || (KIND == XF_OPT_RMSPROP && s.centered);
    for (i64 i = start + 4 * (i64)threadIdx.x; i < end; i += 4 * (i64)blockDim.x) {
        float p[4], g[4], a[4], b[4], m[4], old[4];
        LOAD4(params, i, p);
        load4(grads, i, g);
        if (use0) LOAD4(s0, i, a);
        if (use1) LOAD4(s1, i, b);
        if (use2) LOAD4(s2, i, m);
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
            old[e] = p[e];
            xf_preamble(p[e], g[e], s);
            if (KIND == XF_OPT_SGD) xf_sgd(p[e], g[e], a[e], s);
            else if (KIND == XF_OPT_ADAM) xf_adam(p[e], g[e], a[e], b[e], m[e], s);
            else if (KIND == XF_OPT_ADAGRAD) xf_adagrad(p[e], g[e], a[e], s);
            else if (KIND == XF_OPT_RMSPROP) xf_rmsprop(p[e], g[e], a[e], b[e], m[e], s);
            else if (KIND == XF_OPT_ADAMAX) xf_adamax(p[e], g[e], a[e], b[e], s);
            else if (KIND == XF_OPT_NADAM) xf_nadam(p[e], g[e], a[e], b[e], s);
            else if (KIND == XF_OPT_RADAM) xf_radam(p[e], g[e], a[e], b[e], s);
            else if (KIND == XF_OPT_LION) xf_lion(p[e], g[e], a[e], s);
        }
        if (use0) STORE4(s0, i, a);
        if (use1) STORE4(s1, i, b);
        if (use2) STORE4(s2, i, m);
        if (updates != nullptr) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) p[e] -= old[e];
            STORE4(updates, i, p);
        } else {
            STORE4(params, i, p);
            if (lowp != nullptr) store4(lowp, i, p);
        }
    }
}

"""

# One block per chunk of a segment; the segment's scalars come from the per-step table:
# sign (0: no gradient this step, skip), L2 coefficient, decoupled decay factor, then eight
# rule-specific scalars.
FLAT_UPDATE = KernelDecl(
    "flat_update", "template <int KIND, typename G>",
    (("float* __restrict__", "params"), ("const G* __restrict__", "grads"),
     ("float* __restrict__", "s0"), ("float* __restrict__", "s1"),
     ("float* __restrict__", "s2"), ("const float* __restrict__", "table"),
     ("const int* __restrict__", "chunk_seg"), ("const i64* __restrict__", "chunk_start"),
     ("const i64* __restrict__", "chunk_end"), ("int", "ncols"),
     ("float* __restrict__", "updates"), ("G* __restrict__", "lowp")),
    r"""
    const float* r = table + (i64)chunk_seg[blockIdx.x] * ncols;
    if (r[0] == 0.0f) return;  // no gradient for this segment this step
    const XfScalars<float> s = flat_scalars<KIND>(r + 3, r[0], r[1], r[2]);
    update_chunk<KIND, G>(params, grads, s0, s1, s2, s, chunk_start[blockIdx.x],
                          chunk_end[blockIdx.x], updates, lowp);""")

# Adam/AdamW with the step's scalars computed on the device from per-segment step counts
# and per-group hyperparameters (lr, beta1, beta2, eps, weight_decay, decoupled, amsgrad,
# maximize): nothing is copied from the host per step, so the step can be captured in a CUDA
# graph and replayed. advance_steps runs after it and counts the step.
FLAT_ADAM_DEVICE_SCALARS = KernelDecl(
    "flat_adam_device_scalars", "template <typename G>",
    (("float* __restrict__", "params"), ("const G* __restrict__", "grads"),
     ("float* __restrict__", "s0"), ("float* __restrict__", "s1"),
     ("float* __restrict__", "s2"), ("const float* __restrict__", "hyper"),
     ("const int* __restrict__", "seg_group"), ("const float* __restrict__", "steps"),
     ("const unsigned char* __restrict__", "active"), ("const int* __restrict__", "chunk_seg"),
     ("const i64* __restrict__", "chunk_start"), ("const i64* __restrict__", "chunk_end"),
     ("G* __restrict__", "lowp"), ("const float* __restrict__", "grad_mul"),
     ("const float* __restrict__", "grad_scale"), ("const float* __restrict__", "found_inf")),
    r"""
    // GradScaler: on inf/NaN gradients (found_inf != 0) nothing is written, parameters and
    // state alike; otherwise gradients are unscaled here (1 / grad_scale), and multiplied by
    // grad_mul (a global-norm clipping factor computed on the device), with no extra pass.
    if (found_inf != nullptr && *found_inf != 0.0f) return;
    const int seg = chunk_seg[blockIdx.x];
    if (!active[seg]) return;
    float gmul = grad_mul != nullptr ? *grad_mul : 1.0f;
    if (grad_scale != nullptr) gmul *= 1.0f / *grad_scale;
    const float* h = hyper + XF_AH_WIDTH * seg_group[seg];
    const float lr = h[XF_AH_LR], b1 = h[XF_AH_BETA1], b2 = h[XF_AH_BETA2], eps = h[XF_AH_EPS],
                wd = h[XF_AH_WEIGHT_DECAY];
    const bool decoupled = h[XF_AH_DECOUPLED] != 0.0f;
    const float t = steps[seg] + 1.0f;
    float c[XF_SCALARS];  // Adam's record (AdamScalars), computed here on the device
    c[XF_ADAM_STEP_SIZE] = lr / (1.0f - powf(b1, t));
    c[XF_ADAM_B1] = b1;
    c[XF_ADAM_B2] = b2;
    c[XF_ADAM_EPS] = eps;
    c[XF_ADAM_BC2_SQRT] = sqrtf(1.0f - powf(b2, t));
    c[XF_ADAM_AMSGRAD] = h[XF_AH_AMSGRAD];
    c[6] = 0.0f;
    c[7] = 0.0f;
    const XfScalars<float> s = flat_scalars<XF_OPT_ADAM>(
        c, (h[XF_AH_MAXIMIZE] != 0.0f ? -1.0f : 1.0f) * gmul, decoupled ? 0.0f : wd,
        decoupled ? 1.0f - lr * wd : 1.0f);
    update_chunk<XF_OPT_ADAM, G>(params, grads, s0, s1, s2, s, chunk_start[blockIdx.x],
                                 chunk_end[blockIdx.x], nullptr, lowp);""")

ADVANCE_STEPS = KernelDecl(
    "advance_steps", "",
    (("float* __restrict__", "steps"), ("const unsigned char* __restrict__", "active"),
     ("int", "n"), ("const float* __restrict__", "found_inf")),
    r"""
    if (found_inf != nullptr && *found_inf != 0.0f) return;  // a skipped step is not counted
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && active[i]) steps[i] += 1.0f;""")

OPTIM_KERNEL = _HEAD + "".join(d.source() for d in (FLAT_UPDATE, FLAT_ADAM_DEVICE_SCALARS,
                                                    ADVANCE_STEPS))

# The chunk table's three arrays (xferlib.optim.step.chunk_table), in its order.
CHUNK_ARGS = ("chunk_seg", "chunk_start", "chunk_end")

# State buffers of each flat rule, in the kernel's s0, s1, s2 order (the rules' slots).
_SLOTS = {int(r.kind): r.slots for r in FLAT_RULES.values()}
KINDS = tuple(sorted(_SLOTS))  # the ids flat_update is compiled for


def slot_names(kind: int) -> tuple:
    return _SLOTS[int(kind)]


# Gradient / low-precision parameter types, by NumPy dtype name.
GRAD_TYPES = {"float32": "float", "bfloat16": "bf16", "float16": "f16"}


def update_name(kind: int, grad_dtype: str = "float32") -> str:
    return FLAT_UPDATE.instance(int(kind), GRAD_TYPES[grad_dtype])


def device_scalars_name(grad_dtype: str = "float32") -> str:
    return FLAT_ADAM_DEVICE_SCALARS.instance(GRAD_TYPES[grad_dtype])


OPTIM_MODULE = KernelModule(
    "optim", OPTIM_KERNEL,
    tuple(update_name(k, g) for k in KINDS for g in GRAD_TYPES)
    + tuple(device_scalars_name(g) for g in GRAD_TYPES) + (ADVANCE_STEPS.instance(),))
