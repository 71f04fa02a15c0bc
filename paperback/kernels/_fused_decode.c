/* A decode step through every decoder layer in one call, for models whose linears are all packed.
 *
 * PyTorch pays a few microseconds per op, and a decode step of a small model
 * is some 30 ops a layer: on SmolLM2 (30 layers) that was 4 ms of a 14 ms
 * step, a third of the time, outside the matmuls (docs/weights.md). Here a
 * step is one call: for each layer the norm, q/k/v through _qkernel's
 * gemm_many, q/k norms, RoPE, the new key and value written into the dense
 * cache (fp32, or rounded to its fp16 or bf16), attention through
 * _paged_kernel's dense decode, o, the residual, the second norm, gate/up,
 * the activation, down and the residual again (Gemma's sandwich norms where
 * the model has them). Both kernels come through their
 * capsules (_qkernel.h, _paged_kernel.h), so the arithmetic of the linears
 * and of attention is the module path's own; norms, RoPE and activations are
 * the same formulas in fp32 (not bit-identical: reductions sum in another
 * order). generation/fused_decode.py decides when a model and cache qualify
 * and builds the plan.
 *
 * Every row of x is one sequence of the cache (row b of a (B, Hkv, slots, D)
 * buffer), all at one position, as generate() decodes them.
 *
 * A mixture-of-experts layer's MLP is routed here too, as models/moe.py routes it: the router's fp32 scores
 * (softmax, or DeepSeek's sigmoid with its bias and expert groups), top k, renormalised and scaled, then each
 * expert once over the rows that chose it (one row: the chosen experts' gate and up in one gemm_many call),
 * weighted outputs summed in expert order, then the shared expert (sigmoid-gated where the model has a gate).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "_paged_kernel.h"
#include "_qkernel.h"
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define WIDEST __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define WIDEST
#endif

static const QKernelAPI *qkernel;
static const PagedKernelAPI *paged;

enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };
enum { Q, K, V, O, GATE, UP, DOWN, LINEARS };
enum { NORM_ATTN_IN, NORM_ATTN_OUT, NORM_MLP_IN, NORM_MLP_OUT, NORM_Q, NORM_K, NORMS };

enum { SCORE_SOFTMAX = 0, SCORE_SIGMOID = 1 };

/* A mixture-of-experts MLP (models/moe.py: Router, run_experts, SparseMoE). */
typedef struct {
    const float *router;        /* (experts, hidden) fp32 */
    const float *correction;    /* (experts) fp32 bias that steers the choice (DeepSeek), or NULL */
    const float *shared_gate;   /* (hidden) fp32: the shared expert is scaled by sigmoid(x . gate), or NULL */
    QMatrix *experts;           /* experts x (gate, up, down) */
    QMatrix shared[3];          /* gate, up, down of the shared expert, when shared_inter > 0 */
    int64_t count, top_k, inter, shared_inter, groups, groups_per_token;
    int scoring, normalize;
    float routed_scale;
} MoE;

typedef struct {
    const float *norms[NORMS]; /* NULL: absent (Llama has no post norms and no q/k norms) */
    QMatrix linears[LINEARS];  /* gate, up and down unused where moe is set */
    MoE *moe;                  /* NULL: a dense MLP */
    void *keys, *values;       /* the layer's cache, (batch, kv_heads, slots, dim) in the plan's cache dtype */
    float scaling;
    int64_t window;            /* 0: attends to every cached position */
    int rope;                  /* which of the step's two RoPE tables (Gemma: local, global) */
} Layer;

typedef struct {
    int64_t hidden, heads, kv_heads, dim, inter, batch, slots, count;
    float eps;
    int unit_offset, act;
    int cache_dtype; /* PAGED_FP32, PAGED_FP16 or PAGED_BF16 */
    Layer *layers;
    float *scratch; /* h, q, k, v, attn, o (hidden), gate, up: sized for `batch` rows */
    /* the MoE layers' (sized for the largest): scores (batch, experts), weights and choices (batch, top_k),
     * gathered rows and their outputs (batch, hidden), gate and up (batch x max(top_k x inter, shared)) */
    float *moe_scratch;
    int64_t *chosen;
    int64_t moe_width;
} Plan;

/* Where a step's time goes, when asked (`timing(True)`): seconds per part, summed over steps. */
enum { T_LINEARS, T_ATTENTION, T_CACHE, T_ELEMENTWISE, T_ROUTING, T_PARTS };
static const char *PART_NAMES[T_PARTS] = {"linears", "attention", "kv cache writes", "norms, rope, activations",
                                          "expert routing"};
static int timing;
static double part_seconds[T_PARTS];

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Charges the time since *mark to `part` and moves the mark (a no-op unless timing). */
static inline void charge(int part, double *mark) {
    if (!timing) return;
    const double t = now();
    part_seconds[part] += t - *mark;
    *mark = t;
}

static void plan_destroy(Plan *p) {
    if (!p) return;
    for (int64_t i = 0; p->layers && i < p->count; i++)
        if (p->layers[i].moe) free(p->layers[i].moe->experts), free(p->layers[i].moe);
    free(p->layers), free(p->scratch), free(p->moe_scratch), free(p->chosen), free(p);
}

static void plan_free(PyObject *capsule) { plan_destroy(PyCapsule_GetPointer(capsule, "paperback.fused_decode.Plan")); }

/* ---- elementwise parts: small, one thread, written so gcc vectorizes them at the clone's width ---- */

/* out = x / rms(x) * w (or * (1 + w), Gemma), per row of n. */
WIDEST static void rms_norm(const float *x, const float *w, float *out, int64_t rows, int64_t n, float eps,
                            int unit_offset) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *o = out + r * n;
        float sum = 0.0f;
        for (int64_t i = 0; i < n; i++) sum += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(sum / (float)n + eps);
        if (unit_offset)
            for (int64_t i = 0; i < n; i++) o[i] = xr[i] * inv * (1.0f + w[i]);
        else
            for (int64_t i = 0; i < n; i++) o[i] = w[i] * (xr[i] * inv);
    }
}

/* x (count rows of dim) rotated: x * cos + roll(x, dim / 2) * signed_sin, as apply_rope. */
WIDEST static void rope(float *x, int64_t count, int64_t dim, const float *cos, const float *sin) {
    const int64_t half = dim / 2;
    float rolled[512];
    for (int64_t r = 0; r < count; r++) {
        float *xr = x + r * dim;
        for (int64_t i = 0; i < half; i++) rolled[i] = xr[i + half], rolled[i + half] = xr[i];
        for (int64_t i = 0; i < dim; i++) xr[i] = xr[i] * cos[i] + rolled[i] * sin[i];
    }
}

/* e^x for x <= 0 (and a little above), to about 2 ulp: 2^n times a degree-6 polynomial of the remainder. */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = __builtin_rintf(x * 1.44269504f);
    const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { uint32_t u; float f; } scale = {(uint32_t)((int32_t)n + 127) << 23};
    return p * scale.f;
}

/* gate = act(gate) * up, elementwise. */
WIDEST static void gated_act(float *gate, const float *up, int64_t n, int act) {
    if (act == ACT_SILU) {
        for (int64_t i = 0; i < n; i++) gate[i] = gate[i] / (1.0f + exp_approx(-gate[i])) * up[i];
    } else { /* 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), tanh(y) = 1 - 2 / (e^{2y} + 1) */
        for (int64_t i = 0; i < n; i++) {
            const float g = gate[i], y = 0.7978845608f * (g + 0.044715f * g * g * g);
            const float t = 1.0f - 2.0f / (exp_approx(2.0f * y) + 1.0f);
            gate[i] = 0.5f * g * (1.0f + t) * up[i];
        }
    }
}

WIDEST static void add_into(float *x, const float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] += y[i];
}

/* ---- cache writes: fp32 rows rounded to the cache's 16 bits, to nearest even, as torch's .to() rounds ---- */

static uint16_t float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000, magnitude = x & 0x7fffffff;
    if (magnitude >= 0x7f800000) return (uint16_t)(sign | 0x7c00 | (magnitude > 0x7f800000 ? 0x200 : 0));
    if (magnitude >= 0x477ff000) return (uint16_t)(sign | 0x7c00); /* 65520 and up round to infinity */
    if (magnitude < 0x38800000) { /* below 2^-14: a subnormal half; adding 0.5 rounds at 2^-24 in hardware */
        float a;
        memcpy(&a, &magnitude, 4);
        a += 0.5f;
        uint32_t r;
        memcpy(&r, &a, 4);
        return (uint16_t)(sign | (r - 0x3f000000));
    }
    /* rebias the exponent (-112 << 23, modulo 2^32) and round the 13 dropped bits to nearest even */
    const uint32_t rounded = magnitude + 0xc8000fffu + ((magnitude >> 13) & 1);
    return (uint16_t)(sign | (rounded >> 13));
}

static uint16_t float_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffff) > 0x7f800000) return (uint16_t)((x >> 16) | 0x40); /* NaN stays a (quiet) NaN */
    return (uint16_t)((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

#if defined(__x86_64__) && defined(__GNUC__)
static int has_f16c; /* set at load; use_f16c(False) tests the portable rounding */

/* n % 8 == 0 values by vcvtps2ph, round to nearest even (every AVX2 CPU has F16C). */
__attribute__((target("avx,f16c"))) static void halves_f16c(const float *src, int64_t n, uint16_t *out) {
    for (int64_t i = 0; i < n; i += 8)
        _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
}
#endif

/* n values of src into the cache at dst, in its dtype. */
static void write_cache_row(void *dst, const float *src, int64_t n, int dtype) {
    if (dtype == PAGED_FP32) {
        memcpy(dst, src, sizeof(float) * n);
        return;
    }
    uint16_t *out = dst;
    if (dtype == PAGED_BF16) {
        for (int64_t i = 0; i < n; i++) out[i] = float_to_bf16(src[i]);
        return;
    }
#if defined(__x86_64__) && defined(__GNUC__)
    if (n % 8 == 0 && has_f16c) {
        halves_f16c(src, n, out);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) out[i] = float_to_half(src[i]);
}

/* ys[i] = x W_i^T for several matrices reading x: one gemm_many call when they share bits and groups. */
static int linears(const QMatrix *ms, int count, const float *x, int64_t rows, float *const *ys, int threads,
                   int int8) {
    int shared = 1;
    for (int i = 1; i < count; i++)
        shared &= ms[i].bits == ms[0].bits && ms[i].group_size == ms[0].group_size;
    if (shared) return qkernel->gemm_many(ms, count, x, rows, ys, threads, int8);
    for (int i = 0; i < count; i++)
        if (qkernel->gemm_many(ms + i, 1, x, rows, ys + i, threads, int8) < 0) return -1;
    return 0;
}

/* ---- mixture-of-experts MLPs ---- */

WIDEST static float dot(const float *a, const float *b, int64_t n) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* best[0..k): the k highest of n scores, highest first (ties to the lower index). */
static void top_k(const float *scores, int64_t n, int64_t k, int64_t *best) {
    for (int64_t j = 0; j < k; j++) {
        int64_t arg = -1;
        for (int64_t e = 0; e < n; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j && !taken; i++) taken = best[i] == e;
            if (!taken && (arg < 0 || scores[e] > scores[arg])) arg = e;
        }
        best[j] = arg;
    }
}

/* Each row's experts (chosen, rows x top_k) and routing weights, as Router.forward: softmax scores, or sigmoid
 * scores chosen by score + correction within the best groups (a group scores as its two best), weighed by the
 * plain score; renormalised where asked, then scaled. */
static void route(const MoE *m, const float *h, int64_t rows, int64_t hidden, float *scores, float *choice,
                  float *weights, int64_t *chosen) {
    const int64_t n = m->count, k = m->top_k, per_group = n / m->groups;
    for (int64_t r = 0; r < rows; r++) {
        float *s = scores + r * n, *w = weights + r * k;
        int64_t *best = chosen + r * k;
        for (int64_t e = 0; e < n; e++) s[e] = dot(m->router + e * hidden, h + r * hidden, hidden);
        if (m->scoring == SCORE_SOFTMAX) {
            float top = s[0], sum = 0.0f;
            for (int64_t e = 1; e < n; e++) top = s[e] > top ? s[e] : top;
            for (int64_t e = 0; e < n; e++) s[e] = expf(s[e] - top), sum += s[e];
            for (int64_t e = 0; e < n; e++) s[e] /= sum;
            top_k(s, n, k, best);
        } else {
            for (int64_t e = 0; e < n; e++) {
                s[e] = 1.0f / (1.0f + expf(-s[e]));
                choice[e] = m->correction ? s[e] + m->correction[e] : s[e];
            }
            if (m->groups > 1) {
                float group_scores[4096];
                int64_t pair[2], kept[4096];
                for (int64_t g = 0; g < m->groups; g++) {
                    top_k(choice + g * per_group, per_group, 2, pair);
                    group_scores[g] = choice[g * per_group + pair[0]] + choice[g * per_group + pair[1]];
                }
                top_k(group_scores, m->groups, m->groups_per_token, kept);
                for (int64_t g = 0; g < m->groups; g++) {
                    int keep = 0;
                    for (int64_t i = 0; i < m->groups_per_token; i++) keep |= kept[i] == g;
                    if (!keep)
                        for (int64_t e = g * per_group; e < (g + 1) * per_group; e++) choice[e] = -INFINITY;
                }
            }
            top_k(choice, n, k, best);
        }
        for (int64_t j = 0; j < k; j++) w[j] = s[best[j]];
        if (m->normalize) {
            float sum = 0.0f;
            for (int64_t j = 0; j < k; j++) sum += w[j];
            sum += m->scoring == SCORE_SIGMOID ? 1e-20f : 0.0f;
            for (int64_t j = 0; j < k; j++) w[j] /= sum;
        }
        if (m->routed_scale != 1.0f)
            for (int64_t j = 0; j < k; j++) w[j] *= m->routed_scale;
    }
}

/* out (rows, hidden) = the MoE MLP of h: each expert once over the rows that chose it, its output times their
 * weights added in expert order (as run_experts), then the (gated) shared expert. */
static int moe_mlp(const Plan *p, const MoE *m, const float *h, float *out, int threads, int int8, double *mark) {
    const int64_t rows = p->batch, c = p->hidden, n = m->count, k = m->top_k, inter = m->inter;
    float *scores = p->moe_scratch, *weights = scores + rows * n, *choice = weights + rows * k,
          *taken_weights = choice + n, *xe = taken_weights + rows, *ye = xe + rows * c, *gate = ye + rows * c,
          *up = gate + rows * p->moe_width;
    int64_t *chosen = p->chosen, *taken_rows = chosen + rows * k;
    route(m, h, rows, c, scores, choice, weights, chosen);
    memset(out, 0, sizeof(float) * rows * c);
    charge(T_ROUTING, mark);
    if (rows == 1) { /* every chosen expert reads the one row: their gates and ups in one call */
        int64_t order[64];
        for (int64_t j = 0; j < k; j++) order[j] = j;
        for (int64_t i = 1; i < k; i++) /* by expert index, the order run_experts adds them in */
            for (int64_t j = i; j > 0 && chosen[order[j]] < chosen[order[j - 1]]; j--) {
                const int64_t t = order[j];
                order[j] = order[j - 1], order[j - 1] = t;
            }
        _Static_assert(QKERNEL_MAX_MATRICES >= 2 * 64, "one gemm_many call takes the gates and ups of 64 experts");
        QMatrix ms[2 * 64]; /* top_k <= 64 */
        float *ys[2 * 64];
        for (int64_t j = 0; j < k; j++) {
            const QMatrix *e = m->experts + 3 * chosen[order[j]];
            ms[2 * j] = e[0], ms[2 * j + 1] = e[1];
            ys[2 * j] = gate + j * inter, ys[2 * j + 1] = up + j * inter;
        }
        if (linears(ms, (int)(2 * k), h, 1, ys, threads, int8) < 0) return -1;
        charge(T_LINEARS, mark);
        gated_act(gate, up, k * inter, p->act);
        charge(T_ELEMENTWISE, mark);
        for (int64_t j = 0; j < k; j++) {
            float *y[1] = {ye};
            if (linears(m->experts + 3 * chosen[order[j]] + 2, 1, gate + j * inter, 1, y, threads, int8) < 0)
                return -1;
            const float w = weights[order[j]];
            for (int64_t i = 0; i < c; i++) out[i] += ye[i] * w;
        }
        charge(T_LINEARS, mark);
    } else {
        for (int64_t e = 0; e < n; e++) {
            int64_t count = 0;
            for (int64_t r = 0; r < rows; r++)
                for (int64_t j = 0; j < k; j++)
                    if (chosen[r * k + j] == e) {
                        taken_rows[count] = r, taken_weights[count] = weights[r * k + j];
                        memcpy(xe + count * c, h + r * c, sizeof(float) * c);
                        count++;
                    }
            if (!count) continue;
            charge(T_ROUTING, mark);
            float *gu[2] = {gate, up}, *y[1] = {ye};
            if (linears(m->experts + 3 * e, 2, xe, count, gu, threads, int8) < 0) return -1;
            charge(T_LINEARS, mark);
            gated_act(gate, up, count * inter, p->act);
            charge(T_ELEMENTWISE, mark);
            if (linears(m->experts + 3 * e + 2, 1, gate, count, y, threads, int8) < 0) return -1;
            charge(T_LINEARS, mark);
            for (int64_t i = 0; i < count; i++) {
                float *o = out + taken_rows[i] * c;
                const float *yi = ye + i * c, w = taken_weights[i];
                for (int64_t t = 0; t < c; t++) o[t] += yi[t] * w;
            }
            charge(T_ROUTING, mark);
        }
    }
    if (m->shared_inter) {
        float *gu[2] = {gate, up}, *y[1] = {ye};
        if (linears(m->shared, 2, h, rows, gu, threads, int8) < 0) return -1;
        charge(T_LINEARS, mark);
        gated_act(gate, up, rows * m->shared_inter, p->act);
        charge(T_ELEMENTWISE, mark);
        if (linears(m->shared + 2, 1, gate, rows, y, threads, int8) < 0) return -1;
        charge(T_LINEARS, mark);
        for (int64_t r = 0; r < rows; r++) {
            const float g = m->shared_gate ? 1.0f / (1.0f + expf(-dot(m->shared_gate, h + r * c, c))) : 1.0f;
            for (int64_t t = 0; t < c; t++) out[r * c + t] += g * ye[r * c + t];
        }
        charge(T_ROUTING, mark);
    }
    return 0;
}

/* Every layer for x (batch, hidden) at position pos; x is updated in place (the residual stream). */
static int step(const Plan *p, float *x, int64_t pos, const float *const *cos, const float *const *sin, int threads,
                int int8) {
    const int64_t rows = p->batch, c = p->hidden, d = p->dim, hq = p->heads, hkv = p->kv_heads;
    float *h = p->scratch, *q = h + rows * c, *k = q + rows * hq * d, *v = k + rows * hkv * d,
          *attn = v + rows * hkv * d, *o = attn + rows * hq * d, *gate = o + rows * c, *up = gate + rows * p->inter;
    double mark = timing ? now() : 0.0;
    for (int64_t li = 0; li < p->count; li++) {
        const Layer *L = &p->layers[li];
        rms_norm(x, L->norms[NORM_ATTN_IN], h, rows, c, p->eps, p->unit_offset);
        charge(T_ELEMENTWISE, &mark);
        float *qkv[3] = {q, k, v};
        if (linears(&L->linears[Q], 3, h, rows, qkv, threads, int8) < 0) return -1;
        charge(T_LINEARS, &mark);
        if (L->norms[NORM_Q]) {
            rms_norm(q, L->norms[NORM_Q], q, rows * hq, d, p->eps, p->unit_offset);
            rms_norm(k, L->norms[NORM_K], k, rows * hkv, d, p->eps, p->unit_offset);
        }
        rope(q, rows * hq, d, cos[L->rope], sin[L->rope]);
        rope(k, rows * hkv, d, cos[L->rope], sin[L->rope]);
        charge(T_ELEMENTWISE, &mark);
        const int64_t item = p->cache_dtype == PAGED_FP32 ? 4 : 2;
        for (int64_t b = 0; b < rows; b++)
            for (int64_t j = 0; j < hkv; j++) {
                const int64_t at = ((b * hkv + j) * p->slots + pos) * d * item;
                write_cache_row((char *)L->keys + at, k + (b * hkv + j) * d, d, p->cache_dtype);
                write_cache_row((char *)L->values + at, v + (b * hkv + j) * d, d, p->cache_dtype);
            }
        charge(T_CACHE, &mark);
        if (paged->dense_decode(q, attn, L->keys, L->values, p->cache_dtype, rows, hq, hkv, d, p->slots, pos + 1,
                                L->scaling, L->window) < 0)
            return -1;
        charge(T_ATTENTION, &mark);
        float *out[2] = {o, NULL};
        if (linears(&L->linears[O], 1, attn, rows, out, threads, int8) < 0) return -1;
        charge(T_LINEARS, &mark);
        if (L->norms[NORM_ATTN_OUT]) rms_norm(o, L->norms[NORM_ATTN_OUT], o, rows, c, p->eps, p->unit_offset);
        add_into(x, o, rows * c);
        rms_norm(x, L->norms[NORM_MLP_IN], h, rows, c, p->eps, p->unit_offset);
        charge(T_ELEMENTWISE, &mark);
        if (L->moe) {
            if (moe_mlp(p, L->moe, h, o, threads, int8, &mark) < 0) return -1;
        } else {
            float *gu[2] = {gate, up};
            if (linears(&L->linears[GATE], 2, h, rows, gu, threads, int8) < 0) return -1;
            charge(T_LINEARS, &mark);
            gated_act(gate, up, rows * p->inter, p->act);
            charge(T_ELEMENTWISE, &mark);
            if (linears(&L->linears[DOWN], 1, gate, rows, out, threads, int8) < 0) return -1;
            charge(T_LINEARS, &mark);
        }
        if (L->norms[NORM_MLP_OUT]) rms_norm(o, L->norms[NORM_MLP_OUT], o, rows, c, p->eps, p->unit_offset);
        add_into(x, o, rows * c);
        charge(T_ELEMENTWISE, &mark);
    }
    return 0;
}

/* ---- Python bindings: pointers as integers, checked in fused_decode.py ---- */

/* A matrix (qweight, scales, qzeros, bias, n, k, bits, group_size) of shape (n, k). */
static int parse_matrix(PyObject *tuple, QMatrix *m, int64_t n, int64_t k) {
    unsigned long long qweight, scales, qzeros, bias;
    long long rows, cols, group;
    int bits;
    if (!PyArg_ParseTuple(tuple, "KKKKLLiL", &qweight, &scales, &qzeros, &bias, &rows, &cols, &bits, &group))
        return -1;
    if (!qweight || !scales ||
        qkernel->init_matrix(m, (const uint8_t *)(uintptr_t)qweight, (const uint16_t *)(uintptr_t)scales,
                             (const uint8_t *)(uintptr_t)qzeros, (const float *)(uintptr_t)bias, rows, cols, bits,
                             group) < 0) {
        PyErr_SetString(PyExc_ValueError, "fused decode: invalid packed matrix");
        return -1;
    }
    if (m->n != n || m->k != k) {
        PyErr_SetString(PyExc_ValueError, "fused decode: a linear's shape does not match the model");
        return -1;
    }
    return 0;
}

/* (router, correction, shared_gate, experts, top_k, inter, shared_inter, scoring, normalize, routed_scale, groups,
 * groups_per_token, (experts x (gate, up, down) matrices), (shared gate, up, down) or ()) -> a MoE */
static MoE *parse_moe(PyObject *tuple, int64_t hidden) {
    unsigned long long router, correction, shared_gate;
    PyObject *experts, *shared;
    MoE head = {0};
    if (!PyArg_ParseTuple(tuple, "KKKLLLLiifLLOO", &router, &correction, &shared_gate, &head.count, &head.top_k,
                          &head.inter, &head.shared_inter, &head.scoring, &head.normalize, &head.routed_scale,
                          &head.groups, &head.groups_per_token, &experts, &shared))
        return NULL;
    if (!router || head.count < 1 || head.count > 4096 || head.top_k < 1 || head.top_k > 64 ||
        head.top_k > head.count || head.inter < 1 || head.shared_inter < 0 || head.groups < 1 ||
        head.count % head.groups || head.groups_per_token < 1 || head.groups_per_token > head.groups ||
        (head.groups > 1 && head.count / head.groups < 2) || (head.scoring != SCORE_SOFTMAX &&
        head.scoring != SCORE_SIGMOID) || !PyTuple_Check(experts) || PyTuple_GET_SIZE(experts) != 3 * head.count ||
        !PyTuple_Check(shared) || PyTuple_GET_SIZE(shared) != (head.shared_inter ? 3 : 0) ||
        (shared_gate && !head.shared_inter)) {
        PyErr_SetString(PyExc_ValueError, "fused decode: bad mixture-of-experts layer");
        return NULL;
    }
    head.router = (const float *)(uintptr_t)router;
    head.correction = (const float *)(uintptr_t)correction;
    head.shared_gate = (const float *)(uintptr_t)shared_gate;
    MoE *m = malloc(sizeof(MoE));
    if (m) *m = head, m->experts = malloc(sizeof(QMatrix) * 3 * head.count);
    if (!m || !m->experts) {
        if (m) free(m);
        PyErr_NoMemory();
        return NULL;
    }
    for (int64_t i = 0; i < 3 * head.count; i++)
        if (parse_matrix(PyTuple_GET_ITEM(experts, i), &m->experts[i], i % 3 == 2 ? hidden : head.inter,
                         i % 3 == 2 ? head.inter : hidden) < 0) {
            free(m->experts), free(m);
            return NULL;
        }
    for (int64_t i = 0; i < (head.shared_inter ? 3 : 0); i++)
        if (parse_matrix(PyTuple_GET_ITEM(shared, i), &m->shared[i], i == 2 ? hidden : head.shared_inter,
                         i == 2 ? head.shared_inter : hidden) < 0) {
            free(m->experts), free(m);
            return NULL;
        }
    return m;
}

static int parse_layer(PyObject *tuple, Layer *L, const Plan *p) {
    PyObject *norms, *mats, *moe;
    unsigned long long keys, values;
    long long window;
    if (!PyArg_ParseTuple(tuple, "OOKKfLiO", &norms, &mats, &keys, &values, &L->scaling, &window, &L->rope, &moe))
        return -1;
    unsigned long long n[NORMS];
    if (!PyArg_ParseTuple(norms, "KKKKKK", &n[0], &n[1], &n[2], &n[3], &n[4], &n[5])) return -1;
    for (int i = 0; i < NORMS; i++) L->norms[i] = (const float *)(uintptr_t)n[i];
    const int count = moe == Py_None ? LINEARS : GATE; /* an MoE layer's MLP matrices are its experts' */
    if (!PyTuple_Check(mats) || PyTuple_GET_SIZE(mats) != count) {
        PyErr_SetString(PyExc_ValueError, "fused decode: a layer has 7 linears (q k v o gate up down), an MoE "
                                          "layer 4 (q k v o) and its experts");
        return -1;
    }
    const int64_t c = p->hidden, qd = p->heads * p->dim, kvd = p->kv_heads * p->dim;
    const int64_t shapes[LINEARS][2] = {{qd, c}, {kvd, c}, {kvd, c}, {c, qd}, {p->inter, c}, {p->inter, c},
                                        {c, p->inter}};
    for (int i = 0; i < count; i++)
        if (parse_matrix(PyTuple_GET_ITEM(mats, i), &L->linears[i], shapes[i][0], shapes[i][1]) < 0) return -1;
    if (!L->norms[NORM_ATTN_IN] || !L->norms[NORM_MLP_IN] || !L->norms[NORM_Q] != !L->norms[NORM_K] ||
        !L->norms[NORM_ATTN_OUT] != !L->norms[NORM_MLP_OUT] || !keys || !values || window < 0 || L->rope < 0 ||
        L->rope > 1) {
        PyErr_SetString(PyExc_ValueError, "fused decode: bad norms, cache or window");
        return -1;
    }
    L->keys = (void *)(uintptr_t)keys, L->values = (void *)(uintptr_t)values, L->window = window;
    if (moe != Py_None && !(L->moe = parse_moe(moe, c))) return -1;
    return 0;
}

/* The MoE layers' scratch, sized for the largest of them; 0, or -1 out of memory. */
static int moe_scratch(Plan *p) {
    int64_t experts = 0, top_k = 0, width = 0;
    for (int64_t i = 0; i < p->count; i++) {
        const MoE *m = p->layers[i].moe;
        if (!m) continue;
        experts = m->count > experts ? m->count : experts;
        top_k = m->top_k > top_k ? m->top_k : top_k;
        width = m->top_k * m->inter > width ? m->top_k * m->inter : width;
        width = m->shared_inter > width ? m->shared_inter : width;
    }
    if (!experts) return 0;
    const int64_t rows = p->batch;
    p->moe_width = width;
    p->moe_scratch = malloc(sizeof(float) * (rows * experts + rows * top_k + experts + rows + 2 * rows * p->hidden +
                                             2 * rows * width));
    p->chosen = malloc(sizeof(int64_t) * (rows * top_k + rows));
    return p->moe_scratch && p->chosen ? 0 : -1;
}

/* plan((hidden, heads, kv_heads, dim, inter, batch, slots, eps, unit_offset, act, cache_dtype), [layer, ...])
 * -> capsule,
 * a layer being ((6 norm pointers), (7 matrices, or q k v o), keys, values, scaling, window, rope, moe or None)
 * and a matrix (qweight, scales, qzeros, bias, n, k, bits, group_size). */
static PyObject *py_plan(PyObject *self, PyObject *args) {
    PyObject *model, *layers;
    Plan head = {0};
    if (!PyArg_ParseTuple(args, "OO", &model, &layers) ||
        !PyArg_ParseTuple(model, "LLLLLLLfiii", &head.hidden, &head.heads, &head.kv_heads, &head.dim, &head.inter,
                          &head.batch, &head.slots, &head.eps, &head.unit_offset, &head.act, &head.cache_dtype))
        return NULL;
    if (head.hidden < 1 || head.kv_heads < 1 || head.heads % head.kv_heads || head.dim < 2 || head.dim % 2 ||
        head.dim > 512 || head.inter < 1 || head.batch < 1 || head.batch > 64 || head.slots < 1 ||
        (head.act != ACT_SILU && head.act != ACT_GELU_TANH) || head.cache_dtype < PAGED_FP32 ||
        head.cache_dtype > PAGED_BF16) {
        PyErr_SetString(PyExc_ValueError, "fused decode: bad model shape");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(layers, "fused decode: layers must be a sequence");
    if (!seq) return NULL;
    head.count = PySequence_Fast_GET_SIZE(seq);
    /* scratch: h, q, k, v, attn, o, gate, up for `batch` rows */
    const int64_t floats = head.batch * (2 * head.hidden + 2 * head.heads * head.dim + 2 * head.kv_heads * head.dim +
                                         2 * head.inter);
    Plan *p = calloc(1, sizeof(Plan));
    if (p) {
        *p = head;
        p->layers = calloc(head.count ? head.count : 1, sizeof(Layer));
        p->scratch = malloc(sizeof(float) * floats);
    }
    if (!p || !p->layers || !p->scratch) {
        Py_DECREF(seq);
        plan_destroy(p);
        return PyErr_NoMemory();
    }
    for (int64_t i = 0; i < head.count; i++)
        if (parse_layer(PySequence_Fast_GET_ITEM(seq, i), &p->layers[i], p) < 0) {
            Py_DECREF(seq);
            plan_destroy(p);
            return NULL;
        }
    Py_DECREF(seq);
    if (moe_scratch(p) < 0) {
        plan_destroy(p);
        return PyErr_NoMemory();
    }
    PyObject *capsule = PyCapsule_New(p, "paperback.fused_decode.Plan", plan_free);
    if (!capsule) plan_destroy(p);
    return capsule;
}

/* step(plan, x, pos, (cos0, cos1), (sin0, sin1), threads, int8): x (batch, hidden) fp32, updated in place. */
static PyObject *py_step(PyObject *self, PyObject *args) {
    PyObject *capsule;
    unsigned long long x, c0, c1, s0, s1;
    long long pos;
    int threads, int8;
    if (!PyArg_ParseTuple(args, "OKL(KK)(KK)ip", &capsule, &x, &pos, &c0, &c1, &s0, &s1, &threads, &int8)) return NULL;
    Plan *p = PyCapsule_GetPointer(capsule, "paperback.fused_decode.Plan");
    if (!p) return NULL;
    if (!x || pos < 0 || pos >= p->slots || !c0 || !s0 || !c1 || !s1) {
        PyErr_SetString(PyExc_ValueError, "fused decode: bad activations, position or RoPE tables");
        return NULL;
    }
    const float *cos[2] = {(const float *)(uintptr_t)c0, (const float *)(uintptr_t)c1};
    const float *sin[2] = {(const float *)(uintptr_t)s0, (const float *)(uintptr_t)s1};
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = step(p, (float *)(uintptr_t)x, pos, cos, sin, threads < 1 ? 1 : threads, int8);
    Py_END_ALLOW_THREADS if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* write_cache(src, dst, n, dtype): n fp32 values at src written at dst as a cache write does (for tests). */
static PyObject *py_write_cache(PyObject *self, PyObject *args) {
    unsigned long long src, dst;
    long long n;
    int dtype;
    if (!PyArg_ParseTuple(args, "KKLi", &src, &dst, &n, &dtype)) return NULL;
    if (!src || !dst || n < 0 || dtype < PAGED_FP32 || dtype > PAGED_BF16) {
        PyErr_SetString(PyExc_ValueError, "write_cache: bad pointers, count or dtype");
        return NULL;
    }
    write_cache_row((void *)(uintptr_t)dst, (const float *)(uintptr_t)src, n, dtype);
    Py_RETURN_NONE;
}

/* use_f16c(flag): fp16 cache writes by F16C (where the CPU has it) or by portable C; returns the old flag. */
static PyObject *py_use_f16c(PyObject *self, PyObject *args) {
    int flag;
    if (!PyArg_ParseTuple(args, "p", &flag)) return NULL;
#if defined(__x86_64__) && defined(__GNUC__)
    const int previous = has_f16c;
    has_f16c = flag && __builtin_cpu_supports("f16c");
    return PyBool_FromLong(previous);
#else
    return PyBool_FromLong(0);
#endif
}

/* timing(flag): time the parts of each step from now on (or stop), and zero the sums; returns the old flag. */
static PyObject *py_timing(PyObject *self, PyObject *args) {
    int flag;
    if (!PyArg_ParseTuple(args, "p", &flag)) return NULL;
    const int previous = timing;
    timing = flag;
    memset(part_seconds, 0, sizeof(part_seconds));
    return PyBool_FromLong(previous);
}

/* timings() -> {part: seconds} summed over the steps since timing(True). */
static PyObject *py_timings(PyObject *self, PyObject *noargs) {
    PyObject *out = PyDict_New();
    for (int i = 0; out && i < T_PARTS; i++) {
        PyObject *value = PyFloat_FromDouble(part_seconds[i]);
        if (!value || PyDict_SetItemString(out, PART_NAMES[i], value) < 0) {
            Py_XDECREF(value);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(value);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"plan", py_plan, METH_VARARGS, "plan(model, layers) -> a capsule holding the layers' pointers"},
    {"write_cache", py_write_cache, METH_VARARGS, "write_cache(src, dst, n, dtype): fp32 values as a cache write"},
    {"use_f16c", py_use_f16c, METH_VARARGS, "use_f16c(flag) -> the previous flag; fp16 cache writes by F16C"},
    {"timing", py_timing, METH_VARARGS, "timing(flag) -> the previous flag; time each step's parts (sums zeroed)"},
    {"timings", py_timings, METH_NOARGS, "timings() -> {part: seconds} since timing(True)"},
    {"step", py_step, METH_VARARGS, "step(plan, x, pos, (cos0, cos1), (sin0, sin1), threads, int8)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fused_decode",
                                    "A decode step through every packed decoder layer in one call.", -1, methods};

PyMODINIT_FUNC PyInit__fused_decode(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    has_f16c = __builtin_cpu_supports("f16c");
#endif
    qkernel = PyCapsule_Import(QKERNEL_CAPSULE, 0);
    if (!qkernel) return NULL;
    paged = PyCapsule_Import(PAGED_KERNEL_CAPSULE, 0);
    if (!paged) return NULL;
    return PyModule_Create(&module);
}
