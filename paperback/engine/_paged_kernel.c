/* Decode attention read in place from a paged KV pool, for a batch of sequences.
 *
 * One new query per sequence attends over the keys and values its block
 * table lists, in the pool's own storage: no gathered copy of any block, no
 * Python work per sequence. This is what vLLM's paged attention kernel does
 * on a GPU; on CPU it removes the per-sequence gather, transpose and kernel
 * launch that otherwise cost as much as the attention arithmetic.
 *
 * Layout (see paged_cache.py):
 *   q       fp32 (B, H, D) contiguous, unscaled (the kernel applies `scaling`)
 *   out     fp32 (B, H, D)
 *   keys, values  (num_blocks, Hkv, block_size, D) in fp32, fp16 or bf16; a dense cache
 *                 (B, Hkv, max_len, D) is this with one block of max_len slots per sequence
 *   tables  int64 (B, width): block ids of each sequence, logical order
 *   lengths int64 (B): tokens in each sequence, the new one included
 * Query head h reads KV head h / (H / Hkv). With window > 0 a query at
 * position p sees keys in (p - window, p].
 *
 * Each (sequence, KV head) pair is one task (OpenMP threads take them): it
 * walks the blocks once, keeps a running maximum, sum and output for each
 * query head of the group (the online softmax), and loads each key and
 * value row once for all of them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

enum { DT_FP32 = 0, DT_FP16 = 1, DT_BF16 = 2 };

/* The widest vectors the CPU has, chosen at load time (gcc's function multiversioning). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define WIDEST __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define WIDEST
#endif

typedef uint32_t __attribute__((may_alias)) alias_u32;

/* Rows [row, row + count) of a pool as fp32: the pool itself for fp32, else converted into buf. Inlined into
 * each of attend_one's clones, so the conversion loops vectorize at the clone's width. */
static inline __attribute__((always_inline)) const float *load_rows(const void *pool, int dtype, int64_t row,
                                                                    int64_t count, int64_t dim, float *buf) {
    if (dtype == DT_FP32) return (const float *)pool + row * dim;
    const uint16_t *src = (const uint16_t *)pool + row * dim;
    alias_u32 *bits = (alias_u32 *)buf;
    int64_t n = count * dim;
    if (dtype == DT_BF16) { /* bf16 is fp32's upper half */
        for (int64_t i = 0; i < n; i++) bits[i] = (uint32_t)src[i] << 16;
        return buf;
    }
    /* fp16: exponent and mantissa moved into fp32's fields, then rescaled by 2^112 (exact, subnormals too);
     * infinities and NaNs set apart, the sign put back. */
    for (int64_t i = 0; i < n; i++) bits[i] = (uint32_t)(src[i] & 0x7fff) << 13;
    for (int64_t i = 0; i < n; i++) buf[i] *= 0x1p112f;
    for (int64_t i = 0; i < n; i++) {
        uint32_t magnitude = src[i] & 0x7fff, b = bits[i];
        if (magnitude >= 0x7c00) b = 0x7f800000u | ((magnitude & 0x3ff) << 13);
        bits[i] = b | ((uint32_t)(src[i] & 0x8000) << 16);
    }
    return buf;
}

/* x[j] = exp(x[j] - shift) for j < count (every x[j] <= shift, so the results lie in [0, 1]); returns their
 * sum. expf one score at a time cost more than the dot products around it; with AVX-512 sixteen at a time:
 * exp(r) by its Taylor series to r^7 on |r| <= ln2/2 (relative error below 2e-8, under fp32's rounding),
 * scaled by 2^n with vscalefps, which also underflows to 0 as exp does. */
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx512f"))) static float exp_shifted_avx512(float *x, int64_t count, float shift) {
    const __m512 log2e = _mm512_set1_ps(1.44269504f), ln2_hi = _mm512_set1_ps(0.693145751953125f),
                 ln2_lo = _mm512_set1_ps(1.428606765330187e-06f), lowest = _mm512_set1_ps(-104.0f),
                 m = _mm512_set1_ps(shift);
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < count; j += 16) {
        const __mmask16 live = count - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (count - j)) - 1);
        const __m512 t = _mm512_max_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, x + j), m), lowest);
        const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(t, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512 r = _mm512_fnmadd_ps(n, ln2_lo, _mm512_fnmadd_ps(n, ln2_hi, t));
        __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
        const __m512 e = _mm512_scalef_ps(p, n);
        _mm512_mask_storeu_ps(x + j, live, e);
        total = _mm512_add_ps(total, _mm512_maskz_mov_ps(live, e));
    }
    return _mm512_reduce_add_ps(total);
}
static int has_avx512;
#endif

static float exp_shifted(float *x, int64_t count, float shift) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (has_avx512) return exp_shifted_avx512(x, count, shift);
#endif
    float total = 0.0f;
    for (int64_t j = 0; j < count; j++) total += x[j] = expf(x[j] - shift);
    return total;
}

/* score[j] = scaling * q.k_j for j < count; returns the largest of them and `floor`. */
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx512f"))) static float block_scores_avx512(const float *q, const float *k, int64_t count,
                                                                    int64_t dim, float scaling, float *score,
                                                                    float floor) {
    float best = floor;
    for (int64_t j = 0; j < count; j++) {
        const float *kj = k + j * dim;
        __m512 s0 = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(kj)), s1 = _mm512_setzero_ps();
        int64_t d = 16;
        for (; d + 32 <= dim; d += 32) {
            s1 = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(kj + d), s1);
            s0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + d + 16), _mm512_loadu_ps(kj + d + 16), s0);
        }
        if (d < dim) s1 = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(kj + d), s1);
        score[j] = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1)) * scaling;
        if (score[j] > best) best = score[j];
    }
    return best;
}

/* a = c a + sum_j p[j] v_j: each 16 lanes of a stay in a register over the chunk's rows. */
__attribute__((target("avx512f"))) static void weighted_rows_avx512(float *a, float c, const float *p,
                                                                    const float *v, int64_t count, int64_t dim) {
    for (int64_t d = 0; d < dim; d += 16) {
        __m512 r = _mm512_mul_ps(_mm512_loadu_ps(a + d), _mm512_set1_ps(c));
        for (int64_t j = 0; j < count; j++) r = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), _mm512_loadu_ps(v + j * dim + d), r);
        _mm512_storeu_ps(a + d, r);
    }
}
#endif

static float block_scores(const float *q, const float *k, int64_t count, int64_t dim, float scaling, float *score,
                          float floor) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (has_avx512 && dim % 16 == 0) return block_scores_avx512(q, k, count, dim, scaling, score, floor);
#endif
    float best = floor;
    for (int64_t j = 0; j < count; j++) {
        const float *kj = k + j * dim;
        float s = 0.0f;
        for (int64_t d = 0; d < dim; d++) s += q[d] * kj[d];
        score[j] = s * scaling;
        if (score[j] > best) best = score[j];
    }
    return best;
}

static void weighted_rows(float *a, float c, const float *p, const float *v, int64_t count, int64_t dim) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (has_avx512 && dim % 16 == 0) {
        weighted_rows_avx512(a, c, p, v, count, dim);
        return;
    }
#endif
    for (int64_t d = 0; d < dim; d++) a[d] *= c;
    for (int64_t j = 0; j < count; j++)
        for (int64_t d = 0; d < dim; d++) a[d] += p[j] * v[j * dim + d];
}

/* Slots read per step at most: a block is walked in chunks, so a dense cache (one block per sequence, as
 * long as its context) takes this kernel too, with bounded scratch. */
#define CHUNK 64

/* Scratch floats attend_one needs. */
static int64_t scratch_size(int64_t group, int64_t dim, int64_t block_size) {
    const int64_t chunk = block_size < CHUNK ? block_size : CHUNK;
    return group * dim + 2 * group + chunk + 2 * chunk * dim;
}

WIDEST static void attend_one(const float *q, float *out, const void *keys, const void *values, int dtype,
                              const int64_t *table, int64_t length, int64_t kv_head, int64_t kv_heads,
                              int64_t group, int64_t dim, int64_t block_size, float scaling, int64_t window,
                              float *scratch) {
    const int64_t chunk = block_size < CHUNK ? block_size : CHUNK;
    float *acc = scratch, *run_max = acc + group * dim, *run_sum = run_max + group, *score = run_sum + group,
          *kbuf = score + chunk, *vbuf = kbuf + chunk * dim;
    for (int64_t g = 0; g < group; g++) {
        run_max[g] = -INFINITY;
        run_sum[g] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * group * dim);
    int64_t lo = window > 0 && length > window ? length - window : 0;
    /* A block's visible slots a chunk at a time: their scores, one rescale, then their values. */
    for (int64_t first = lo; first < length;) {
        int64_t slot = first % block_size, count = block_size - slot;
        if (count > chunk) count = chunk;
        if (first + count > length) count = length - first;
        int64_t row = (table[first / block_size] * kv_heads + kv_head) * block_size + slot;
        const float *k = load_rows(keys, dtype, row, count, dim, kbuf);
        const float *v = load_rows(values, dtype, row, count, dim, vbuf);
        for (int64_t g = 0; g < group; g++) {
            const float *qg = q + g * dim;
            float block_max = block_scores(qg, k, count, dim, scaling, score, run_max[g]);
            float c = expf(run_max[g] - block_max), sum = run_sum[g] * c;
            sum += exp_shifted(score, count, block_max);
            weighted_rows(acc + g * dim, c, score, v, count, dim);
            run_max[g] = block_max;
            run_sum[g] = sum;
        }
        first += count;
    }
    for (int64_t g = 0; g < group; g++) {
        float inv = run_sum[g] > 0.0f ? 1.0f / run_sum[g] : 0.0f;
        for (int64_t d = 0; d < dim; d++) out[g * dim + d] = acc[g * dim + d] * inv;
    }
}

static PyObject *py_decode(PyObject *self, PyObject *args) {
    unsigned long long q_ptr, out_ptr, keys_ptr, values_ptr, tables_ptr, lengths_ptr;
    long long batch, heads, kv_heads, dim, block_size, width, window;
    int dtype;
    float scaling;
    if (!PyArg_ParseTuple(args, "KKKKiKKLLLLLLfL", &q_ptr, &out_ptr, &keys_ptr, &values_ptr, &dtype, &tables_ptr,
                          &lengths_ptr, &batch, &heads, &kv_heads, &dim, &block_size, &width, &scaling, &window))
        return NULL;
    if (dtype < DT_FP32 || dtype > DT_BF16 || kv_heads <= 0 || heads % kv_heads || dim <= 0 || block_size <= 0) {
        PyErr_SetString(PyExc_ValueError, "paged decode: bad dtype or shape");
        return NULL;
    }
    const float *q = (const float *)(uintptr_t)q_ptr;
    float *out = (float *)(uintptr_t)out_ptr;
    const void *keys = (const void *)(uintptr_t)keys_ptr, *values = (const void *)(uintptr_t)values_ptr;
    const int64_t *tables = (const int64_t *)(uintptr_t)tables_ptr, *lengths = (const int64_t *)(uintptr_t)lengths_ptr;
    int64_t group = heads / kv_heads, tasks = batch * kv_heads;
    int64_t scratch_floats = scratch_size(group, dim, block_size);
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel
    {
        float *scratch = malloc(sizeof(float) * scratch_floats);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        } else {
#pragma omp for schedule(dynamic)
            for (int64_t t = 0; t < tasks; t++) {
                int64_t b = t / kv_heads, h = t % kv_heads;
                attend_one(q + (b * heads + h * group) * dim, out + (b * heads + h * group) * dim, keys, values,
                           dtype, tables + b * width, lengths[b], h, kv_heads, group, dim, block_size, scaling,
                           window, scratch);
            }
            free(scratch);
        }
    }
    Py_END_ALLOW_THREADS
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"decode", py_decode, METH_VARARGS,
     "decode(q, out, keys, values, dtype, tables, lengths, B, H, Hkv, D, block_size, width, scaling, window)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_paged_kernel", "Paged decode attention on CPU.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__paged_kernel(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    has_avx512 = __builtin_cpu_supports("avx512f"); /* decided once, before any threads */
#endif
    return PyModule_Create(&module);
}
