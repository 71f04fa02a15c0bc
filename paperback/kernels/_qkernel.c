/* Packed integer weight kernels for QuantLinear on CPU.
 *
 * Layout: _qkernel.h (QMatrix), as qlinear.py packs it.
 *
 * gemm_many() computes y = x W^T (+ bias) for a few rows of x straight from the
 * packed bytes: each thread unpacks one weight row at a time into a small
 * buffer that stays in L1, so memory traffic is the packed size. For many
 * rows (prefill) the caller dequantizes once with dequantize() and uses BLAS.
 *
 * The widest code path the CPU runs is selected at run time: AVX-512
 * (16 lanes), AVX2 + FMA (8 lanes), or portable C for other CPUs. Threads come from OpenMP; the extension links libgomp.so.1,
 * which the dynamic loader resolves to the copy torch already loaded, so
 * torch and these kernels share one thread pool instead of competing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_qkernel.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PB_X86 1
#include "_sum16.h"
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: renormalise */
            exp = 1;
            while (!(mant & 0x400)) { mant <<= 1; exp--; }
            bits = sign | ((exp + 112) << 23) | ((mant & 0x3ff) << 13);
        }
    } else {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Codes start..start+count-1 of a packed row, any bit offset. */
static void unpack_generic(const uint8_t *row, int bits, int64_t start, int64_t count, uint8_t *dst) {
    const unsigned mask = (1u << bits) - 1;
    for (int64_t i = 0; i < count; i++) {
        int64_t bit = (start + i) * bits;
        unsigned v = row[bit >> 3];
        int off = (int)(bit & 7);
        if (off + bits > 8) v |= (unsigned)row[(bit >> 3) + 1] << 8;
        dst[i] = (uint8_t)((v >> off) & mask);
    }
}

static void unpack_row_portable(const uint8_t *row, int bits, int64_t count, uint8_t *dst) {
    int64_t i = 0;
    if (bits == 8) {
        memcpy(dst, row, (size_t)count);
        return;
    }
    if (bits == 4)
        for (; i + 2 <= count; i += 2) {
            dst[i] = row[i >> 1] & 15;
            dst[i + 1] = row[i >> 1] >> 4;
        }
    if (bits == 3)
        for (; i + 8 <= count; i += 8) {
            const uint8_t *p = row + i / 8 * 3;
            uint32_t v = p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16;
            for (int j = 0; j < 8; j++) dst[i + j] = (v >> (3 * j)) & 7;
        }
    unpack_generic(row, bits, i, count - i, dst + i);
}

static void row_scales_portable(const QMatrix *m, int64_t r, float *scale) {
    for (int64_t g = 0; g < m->groups; g++) scale[g] = half_to_float(m->scales[r * m->groups + g]);
}

#ifdef PB_X86
/* F16C: eight scales an instruction (a row of a narrow matrix has few groups, and this runs once per row) */
__attribute__((target("avx2,f16c"))) static void row_scales_f16c(const QMatrix *m, int64_t r, float *scale) {
    const uint16_t *h = m->scales + r * m->groups;
    int64_t g = 0;
    for (; g + 8 <= m->groups; g += 8) _mm256_storeu_ps(scale + g, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + g))));
    for (; g < m->groups; g++) scale[g] = _cvtsh_ss(h[g]);
}
#endif

static int simd_level; /* defined with the levels below; 0 is portable */

static void scales_and_zeros(const QMatrix *m, int64_t r, float *scale, float *zero, uint8_t *zero_codes) {
#ifdef PB_X86
    if (simd_level > 0) /* every SIMD level includes F16C */
        row_scales_f16c(m, r, scale);
    else
#endif
        row_scales_portable(m, r, scale);
    if (m->qzeros) {
        unpack_row_portable(m->qzeros + r * m->zero_row_bytes, m->bits, m->groups, zero_codes);
        for (int64_t g = 0; g < m->groups; g++) zero[g] = (float)zero_codes[g];
    } else {
        for (int64_t g = 0; g < m->groups; g++) zero[g] = (float)(1 << (m->bits - 1));
    }
}

/* ---- portable path ---------------------------------------------------- */

static void dequant_row_portable(const QMatrix *m, const uint8_t *codes, const float *scale, const float *zero,
                                 float *out) {
    for (int64_t g = 0; g < m->groups; g++) {
        int64_t lo = g * m->group_size, hi = lo + m->group_size < m->k ? lo + m->group_size : m->k;
        for (int64_t i = lo; i < hi; i++) out[i] = ((float)codes[i] - zero[g]) * scale[g];
    }
}

static float dot_portable(const float *a, const float *b, int64_t count) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= count; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
    float s = 0;
    for (; i < count; i++) s += a[i] * b[i];
    for (int j = 0; j < 8; j++) s += acc[j];
    return s;
}

/* ---- AVX2 path -------------------------------------------------------- */
#ifdef PB_X86

AVX2 static void unpack_row_avx2(const uint8_t *row, int bits, int64_t count, uint8_t *dst) {
    int64_t i = 0;
    if (bits == 4) {
        const __m128i low4 = _mm_set1_epi8(0x0f);
        for (; i + 32 <= count; i += 32) {
            __m128i v = _mm_loadu_si128((const __m128i *)(row + i / 2));
            __m128i lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
            _mm_storeu_si128((__m128i *)(dst + i), _mm_unpacklo_epi8(lo, hi));
            _mm_storeu_si128((__m128i *)(dst + i + 16), _mm_unpackhi_epi8(lo, hi));
        }
    } else if (bits == 2) {
        const __m128i low2 = _mm_set1_epi8(0x03);
        for (; i + 64 <= count; i += 64) {
            __m128i v = _mm_loadu_si128((const __m128i *)(row + i / 4));
            __m128i c0 = _mm_and_si128(v, low2), c1 = _mm_and_si128(_mm_srli_epi16(v, 2), low2);
            __m128i c2 = _mm_and_si128(_mm_srli_epi16(v, 4), low2), c3 = _mm_and_si128(_mm_srli_epi16(v, 6), low2);
            __m128i a = _mm_unpacklo_epi8(c0, c1), b = _mm_unpacklo_epi8(c2, c3);
            __m128i c = _mm_unpackhi_epi8(c0, c1), d = _mm_unpackhi_epi8(c2, c3);
            _mm_storeu_si128((__m128i *)(dst + i), _mm_unpacklo_epi16(a, b));
            _mm_storeu_si128((__m128i *)(dst + i + 16), _mm_unpackhi_epi16(a, b));
            _mm_storeu_si128((__m128i *)(dst + i + 32), _mm_unpacklo_epi16(c, d));
            _mm_storeu_si128((__m128i *)(dst + i + 48), _mm_unpackhi_epi16(c, d));
        }
    }
    if (i == 0) {
        unpack_row_portable(row, bits, count, dst);
    } else {
        unpack_generic(row, bits, i, count - i, dst + i);
    }
}

AVX2 static float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

AVX2 static __m256 codes8(const uint8_t *c) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)c)));
}

AVX2 static void dequant_row_avx2(const QMatrix *m, const uint8_t *codes, const float *scale, const float *zero,
                                  float *out) {
    for (int64_t g = 0; g < m->groups; g++) {
        int64_t lo = g * m->group_size, hi = lo + m->group_size < m->k ? lo + m->group_size : m->k, i = lo;
        const __m256 s = _mm256_set1_ps(scale[g]), z = _mm256_set1_ps(zero[g]);
        for (; i + 8 <= hi; i += 8) _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_sub_ps(codes8(codes + i), z), s));
        for (; i < hi; i++) out[i] = ((float)codes[i] - zero[g]) * scale[g];
    }
}

AVX2 static float dot_avx2(const float *a, const float *b, int64_t count) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= count; i += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), a1);
    }
    for (; i + 8 <= count; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
    float s = hsum256(_mm256_add_ps(a0, a1));
    for (; i < count; i++) s += a[i] * b[i];
    return s;
}

/* Each level includes the ones below it: avxvnni adds the VEX-encoded vpdpbusd to the AVX2 int8 kernels (Alder
 * Lake and later client CPUs without AVX-512), avx512vnni the 512-bit one for int8 activations, amx its tile
 * multiply (TDPBUSD) for a few rows at once. avxvnni counts only where the CPU has it (set_simd). */
enum { PORTABLE = 0, LEVEL_AVX2 = 1, LEVEL_AVXVNNI = 2, LEVEL_AVX512 = 3, LEVEL_VNNI = 4, LEVEL_AMX = 5, LEVELS = 6 };
static const char *LEVEL_NAMES[] = {"portable", "avx2", "avxvnni", "avx512", "avx512vnni", "amx"};

#if defined(__linux__) && defined(__GNUC__) && __GNUC__ >= 11
#define PB_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

/* AMX-INT8 and AMX-TILE in CPUID, the tile state enabled by the OS (XCR0 bits 17, 18), and this process
 * granted it (Linux asks each process to request the tile data state before its first tile instruction). */
static int amx_usable(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return 0;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 0; /* OSXSAVE: xgetbv is allowed */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return 0;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
}
#else
static int amx_usable(void) { return 0; }
#endif

static int best_level(void) {
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")))
        return PORTABLE;
    if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512vl")))
        return __builtin_cpu_supports("avxvnni") ? LEVEL_AVXVNNI : LEVEL_AVX2;
    if (!__builtin_cpu_supports("avx512vnni")) return LEVEL_AVX512;
    static int amx = -1; /* asked once: the permission is the process's */
    if (amx < 0) amx = amx_usable();
    return amx ? LEVEL_AMX : LEVEL_VNNI;
}
#else
enum { PORTABLE = 0, LEVEL_AVX2 = 1, LEVEL_AVXVNNI = 2, LEVEL_AVX512 = 3, LEVEL_VNNI = 4, LEVEL_AMX = 5, LEVELS = 6 };
static const char *LEVEL_NAMES[] = {"portable", "avx2", "avxvnni", "avx512", "avx512vnni", "amx"};
static int best_level(void) { return PORTABLE; }
#endif

/* The widest code path this CPU runs (tests can force a narrower one). */
static int simd_level = PORTABLE;
#define use_avx2 (simd_level >= LEVEL_AVX2)

static void unpack_row(const uint8_t *row, int bits, int64_t count, uint8_t *dst) {
#ifdef PB_X86
    if (use_avx2) {
        unpack_row_avx2(row, bits, count, dst);
        return;
    }
#endif
    unpack_row_portable(row, bits, count, dst);
}

static void dequant_row(const QMatrix *m, const uint8_t *codes, const float *scale, const float *zero, float *out) {
#ifdef PB_X86
    if (use_avx2) {
        dequant_row_avx2(m, codes, scale, zero, out);
        return;
    }
#endif
    dequant_row_portable(m, codes, scale, zero, out);
}

static float dot(const float *a, const float *b, int64_t count) {
#ifdef PB_X86
    if (use_avx2) return dot_avx2(a, b, count);
#endif
    return dot_portable(a, b, count);
}

/* Per-thread scratch, kept between calls and grown on demand: one unpacked
 * row, its dequantized floats, and the row's scales and zeros. */
typedef struct {
    uint8_t *codes, *zero_codes;
    float *row, *scale, *zero;
    int64_t k, groups;
} Scratch;

static _Thread_local Scratch thread_scratch;

static int scratch_alloc(Scratch *out, const QMatrix *m) {
    Scratch *s = &thread_scratch;
    if (s->k < m->k) {
        free(s->codes), free(s->row);
        s->codes = malloc((size_t)m->k + 64);
        s->row = malloc(sizeof(float) * (size_t)m->k);
        s->k = s->codes && s->row ? m->k : 0;
    }
    if (s->groups < m->groups) {
        free(s->zero_codes), free(s->scale), free(s->zero);
        s->zero_codes = malloc((size_t)m->groups + 64);
        s->scale = malloc(sizeof(float) * (size_t)m->groups);
        s->zero = malloc(sizeof(float) * (size_t)m->groups);
        s->groups = s->zero_codes && s->scale && s->zero ? m->groups : 0;
    }
    *out = *s;
    return s->k >= m->k && s->groups >= m->groups;
}

#ifdef PB_X86
/* One specialised copy of CALL(n) per row count n = 1..8 (an inlined kernel unrolls its loops over rows). */
#define BY_ROW_COUNT(mb, CALL)                                                                                    \
    switch (mb) {                                                                                                 \
    case 1: CALL(1); break;                                                                                       \
    case 2: CALL(2); break;                                                                                       \
    case 3: CALL(3); break;                                                                                       \
    case 4: CALL(4); break;                                                                                       \
    case 5: CALL(5); break;                                                                                       \
    case 6: CALL(6); break;                                                                                       \
    case 7: CALL(7); break;                                                                                       \
    default: CALL(8); break;                                                                                      \
    }

/* y[j] = sum_k w[k] x[j][k] for one weight row and `mb` (1..8) rows of x.
 * Per group, sum_k (c - z) s x = s (sum_k c x - z sum_k x): the codes meet x
 * as plain floats (one convert and one FMA per 8 codes) and the zero point
 * is applied once per group through xsum[j][g], the group sums of x.
 * Inlined per constant mb so the loops over j unroll. */
AVX2 static inline __attribute__((always_inline)) void row_dot_avx2(const QMatrix *m, const uint8_t *codes,
                                                                    const float *scale, const float *zero,
                                                                    const float *x, const float *xsum, int mb,
                                                                    float *out) {
    __m256 total[8];
    float tail[8] = {0};
    for (int j = 0; j < mb; j++) total[j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < m->groups; g++) {
        int64_t lo = g * m->group_size, hi = lo + m->group_size < m->k ? lo + m->group_size : m->k, i = lo;
        const __m256 s = _mm256_set1_ps(scale[g]);
        __m256 acc[8];
        for (int j = 0; j < mb; j++) acc[j] = _mm256_setzero_ps();
        if (mb == 1) { /* four independent chains hide the FMA latency */
            __m256 a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
            for (; i + 32 <= hi; i += 32) {
                acc[0] = _mm256_fmadd_ps(codes8(codes + i), _mm256_loadu_ps(x + i), acc[0]);
                a1 = _mm256_fmadd_ps(codes8(codes + i + 8), _mm256_loadu_ps(x + i + 8), a1);
                a2 = _mm256_fmadd_ps(codes8(codes + i + 16), _mm256_loadu_ps(x + i + 16), a2);
                a3 = _mm256_fmadd_ps(codes8(codes + i + 24), _mm256_loadu_ps(x + i + 24), a3);
            }
            acc[0] = _mm256_add_ps(_mm256_add_ps(acc[0], a1), _mm256_add_ps(a2, a3));
        }
        for (; i + 8 <= hi; i += 8) {
            const __m256 c = codes8(codes + i);
            for (int j = 0; j < mb; j++) acc[j] = _mm256_fmadd_ps(c, _mm256_loadu_ps(x + j * m->k + i), acc[j]);
        }
        for (; i < hi; i++)
            for (int j = 0; j < mb; j++) tail[j] += (float)codes[i] * scale[g] * x[j * m->k + i];
        for (int j = 0; j < mb; j++) {
            total[j] = _mm256_fmadd_ps(acc[j], s, total[j]);
            tail[j] -= zero[g] * scale[g] * xsum[j * m->groups + g];
        }
    }
    for (int j = 0; j < mb; j++) out[j] = hsum256(total[j]) + tail[j];
}

AVX2 static void row_times_x_avx2(const QMatrix *m, const uint8_t *codes, const float *scale, const float *zero,
                                  const float *x, const float *xsum, int mb, float *out) {
#define ROWS_CALL(n) row_dot_avx2(m, codes, scale, zero, x, xsum, n, out)
    BY_ROW_COUNT(mb, ROWS_CALL);
#undef ROWS_CALL
}
#endif

#ifdef PB_X86
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

AVX512 static inline __m512 codes16(const uint8_t *c) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c)));
}

/* row_dot_avx2 with 16 lanes; a group's last partial vector uses masked loads. */
AVX512 static inline __attribute__((always_inline)) void row_dot_avx512(const QMatrix *m, const uint8_t *codes,
                                                                        const float *scale, const float *zero,
                                                                        const float *x, const float *xsum, int mb,
                                                                        float *out) {
    __m512 total[8];
    float tail[8] = {0};
    for (int j = 0; j < mb; j++) total[j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < m->groups; g++) {
        int64_t lo = g * m->group_size, hi = lo + m->group_size < m->k ? lo + m->group_size : m->k, i = lo;
        __m512 acc[8];
        for (int j = 0; j < mb; j++) acc[j] = _mm512_setzero_ps();
        if (mb == 1) {
            __m512 a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
            for (; i + 64 <= hi; i += 64) {
                acc[0] = _mm512_fmadd_ps(codes16(codes + i), _mm512_loadu_ps(x + i), acc[0]);
                a1 = _mm512_fmadd_ps(codes16(codes + i + 16), _mm512_loadu_ps(x + i + 16), a1);
                a2 = _mm512_fmadd_ps(codes16(codes + i + 32), _mm512_loadu_ps(x + i + 32), a2);
                a3 = _mm512_fmadd_ps(codes16(codes + i + 48), _mm512_loadu_ps(x + i + 48), a3);
            }
            acc[0] = _mm512_add_ps(_mm512_add_ps(acc[0], a1), _mm512_add_ps(a2, a3));
        }
        for (; i + 16 <= hi; i += 16) {
            const __m512 c = codes16(codes + i);
            for (int j = 0; j < mb; j++) acc[j] = _mm512_fmadd_ps(c, _mm512_loadu_ps(x + j * m->k + i), acc[j]);
        }
        if (i < hi) {
            const __mmask16 mask = (__mmask16)((1u << (hi - i)) - 1);
            const __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, codes + i)));
            for (int j = 0; j < mb; j++)
                acc[j] = _mm512_fmadd_ps(c, _mm512_maskz_loadu_ps(mask, x + j * m->k + i), acc[j]);
        }
        const __m512 s = _mm512_set1_ps(scale[g]);
        for (int j = 0; j < mb; j++) {
            total[j] = _mm512_fmadd_ps(acc[j], s, total[j]);
            tail[j] -= zero[g] * scale[g] * xsum[j * m->groups + g];
        }
    }
    for (int j = 0; j < mb; j++) out[j] = _mm512_reduce_add_ps(total[j]) + tail[j];
}

AVX512 static void row_times_x_avx512(const QMatrix *m, const uint8_t *codes, const float *scale, const float *zero,
                                      const float *x, const float *xsum, int mb, float *out) {
#define ROWS_CALL(n) row_dot_avx512(m, codes, scale, zero, x, xsum, n, out)
    BY_ROW_COUNT(mb, ROWS_CALL);
#undef ROWS_CALL
}
#endif

/* ---- int8 activations: integer dot products -------------------------------
 *
 * The decode path llama.cpp takes: each activation row is rounded to int8 in
 * blocks of 32 (scale d = max|x| / 127), and the codes meet it as integers,
 * 32 products summed per instruction pair, one float multiply-add per block.
 * Per group g with scale s and zero z (sum over the group's blocks b):
 *     y = s * (sum_b d_b * sum_i c_i q_i  -  z * sum_b d_b * sum_i q_i)
 * The zero term uses the same rounded activations (gsum), so the error is
 * sum (c - z) e, not sum c e. 8-bit codes go in as c - 128 (and z - 128):
 * maddubs multiplies unsigned by signed bytes into saturating int16 pairs,
 * which 255 x 127 x 2 would overflow; |c - 128| <= 128 does not.
 * 4-bit rows are read packed (two codes a byte): a block's 16 bytes give its
 * even codes in the low nibbles and its odd codes in the high ones, so the
 * activations are stored where their codes land (act_offset): in portable C
 * per block, evens then odds; on every SIMD path per pair of blocks, both
 * blocks' evens then both blocks' odds, which is how one 32-byte load gives a
 * pair's 64 codes in two instructions (pair_codes, pair_codes_avx2).
 * Needs k and the group size to be multiples of 32; otherwise the float path. */
#define QBLOCK 32

/* Where position i (0..31) of block b lies in a row of rounded activations (see above). */
static inline int64_t act_offset(const QMatrix *m, int64_t blocks, int64_t b, int i) {
    if (m->bits != 4) return b * QBLOCK + i;
    const int lone = b == blocks - 1 && blocks % 2 == 1; /* an odd count's last block has no partner */
    if (simd_level < LEVEL_AVX2 || lone) return b * QBLOCK + (i & 1) * (QBLOCK / 2) + (i >> 1);
    const int64_t h = b & 1;
    return (b - h) * QBLOCK + (i & 1) * QBLOCK + h * (QBLOCK / 2) + (i >> 1);
}

/* The lanes of a pair's 16 vpdpbusd sums that hold its second block: the high half for 8-bit codes (read as
 * they lie), lanes 4-7 and 12-15 for 4-bit ones (pair_codes). A lone last block fills lanes 0-7 either way. */
static inline unsigned second_block_lanes(const QMatrix *m) { return m->bits == 4 ? 0xF0F0u : 0xFF00u; }

typedef struct {
    int8_t *q;   /* (rows, k): rounded activations, at act_offset */
    float *d;    /* (rows, k / 32): block scales */
    float *gsum; /* (rows, groups): sum over the group of d * q */
    float *dpair; /* (rows, ceil(blocks / 2), 16): blocks 2p and 2p + 1's d in their lanes (VNNI only) */
    /* AMX only, for up to 16 rows: */
    uint8_t *tiles; /* (blocks, 8, 64): block b as TDPBUSD's B operand, [k / 4][row * 4 + k % 4] */
    float *d_by_block;    /* (blocks, 16): block b's d for each row, 0 beyond the rows */
    float *gsum_by_group; /* (groups, 16): gsum for each row, 0 beyond the rows */
} Int8Acts;

static int int8_eligible(const QMatrix *m) { return m->k % QBLOCK == 0 && m->group_size % QBLOCK == 0; }

#ifdef PB_X86
/* quantize_activations with AVX-512, a block a step: the same rounding (vcvtps2dq rounds to nearest even, as
 * lrintf does in the default mode) and the same bytes, stored with each block's evens and odds apart where
 * 4-bit codes need them (act_offset: both halves are 16 contiguous bytes). */
__attribute__((target("avx512f,avx512bw,avx512vl"))) static void quantize_activations_avx512(const QMatrix *m,
                                                                                          const float *x,
                                                                                          int64_t rows,
                                                                                          Int8Acts *a) {
    const int64_t blocks = m->k / QBLOCK, per_group = m->group_size / QBLOCK;
    const __m512i evens = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * m->k;
        int8_t *qr = a->q + r * m->k;
        for (int64_t g = 0; g < m->groups; g++) a->gsum[r * m->groups + g] = 0.0f;
        for (int64_t b = 0; b < blocks; b++) {
            const __m512 x0 = _mm512_loadu_ps(xr + b * QBLOCK), x1 = _mm512_loadu_ps(xr + b * QBLOCK + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
            const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            const __m512i v0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(inv)));
            const __m512i v1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(inv)));
            if (m->bits == 4) {
                _mm_storeu_si128((__m128i *)(qr + act_offset(m, blocks, b, 0)),
                                 _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(v0, evens, v1)));
                _mm_storeu_si128((__m128i *)(qr + act_offset(m, blocks, b, 1)),
                                 _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(v0, odds, v1)));
            } else {
                _mm_storeu_si128((__m128i *)(qr + b * QBLOCK), _mm512_cvtepi32_epi8(v0));
                _mm_storeu_si128((__m128i *)(qr + b * QBLOCK + 16), _mm512_cvtepi32_epi8(v1));
            }
            a->d[r * blocks + b] = d;
            a->gsum[r * m->groups + b / per_group] += d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(v0, v1));
        }
    }
}

/* quantize_activations with AVX2, a block a step: the same rounding (vcvtps2dq, to nearest even, as lrintf)
 * and bytes; the 32 codes are written where act_offset puts them (the evens and odds apart for 4-bit codes). */
AVX2 static void quantize_activations_avx2(const QMatrix *m, const float *x, int64_t rows, Int8Acts *a) {
    const int64_t blocks = m->k / QBLOCK, per_group = m->group_size / QBLOCK;
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * m->k;
        int8_t *qr = a->q + r * m->k;
        for (int64_t g = 0; g < m->groups; g++) a->gsum[r * m->groups + g] = 0.0f;
        for (int64_t b = 0; b < blocks; b++) {
            __m256 v[4], top = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_loadu_ps(xr + b * QBLOCK + 8 * i);
                top = _mm256_max_ps(top, _mm256_and_ps(v[i], magnitude));
            }
            __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
            t = _mm_max_ps(t, _mm_movehl_ps(t, t));
            const float amax = _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
            const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            int32_t codes[QBLOCK];
            __m256i sum = _mm256_setzero_si256();
            for (int i = 0; i < 4; i++) {
                const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
                _mm256_storeu_si256((__m256i *)(codes + 8 * i), c);
                sum = _mm256_add_epi32(sum, c);
            }
            if (m->bits == 4) {
                int8_t *evens = qr + act_offset(m, blocks, b, 0), *odds = qr + act_offset(m, blocks, b, 1);
                for (int i = 0; i < QBLOCK / 2; i++) evens[i] = (int8_t)codes[2 * i], odds[i] = (int8_t)codes[2 * i + 1];
            } else {
                for (int i = 0; i < QBLOCK; i++) qr[b * QBLOCK + i] = (int8_t)codes[i];
            }
            __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
            a->d[r * blocks + b] = d;
            a->gsum[r * m->groups + b / per_group] += d * (float)_mm_cvtsi128_si32(s);
        }
    }
}
#endif

static void quantize_activations(const QMatrix *m, const float *x, int64_t rows, Int8Acts *a) {
    const int64_t blocks = m->k / QBLOCK, per_group = m->group_size / QBLOCK;
#ifdef PB_X86
    if (simd_level >= LEVEL_AVX512) {
        quantize_activations_avx512(m, x, rows, a);
        return;
    }
    if (use_avx2) {
        quantize_activations_avx2(m, x, rows, a);
        return;
    }
#endif
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * m->k;
        int8_t *qr = a->q + r * m->k;
        for (int64_t g = 0; g < m->groups; g++) a->gsum[r * m->groups + g] = 0.0f;
        for (int64_t b = 0; b < blocks; b++) {
            const float *xb = xr + b * QBLOCK;
            float amax = 0.0f;
            for (int i = 0; i < QBLOCK; i++) amax = fmaxf(amax, fabsf(xb[i]));
            const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            int isum = 0;
            for (int i = 0; i < QBLOCK; i++) {
                const int v = (int)lrintf(xb[i] * inv);
                qr[act_offset(m, blocks, b, i)] = (int8_t)v; /* where its code sits */
                isum += v;
            }
            a->d[r * blocks + b] = d;
            a->gsum[r * m->groups + b / per_group] += d * (float)isum;
        }
    }
}

/* a->dpair from a->d: the VNNI kernel weights a pair of blocks' 16 int32 lanes with one vector. */
static void pair_scales(const QMatrix *m, int64_t rows, Int8Acts *a) {
    const int64_t blocks = m->k / QBLOCK, pairs = ceil_div(blocks, 2);
    const unsigned second = second_block_lanes(m);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t p = 0; p < pairs; p++)
            for (int i = 0; i < 16; i++) {
                const int lone = 2 * p + 1 == blocks;
                const float d = lone ? (i < 8 ? a->d[r * blocks + 2 * p] : 0.0f)
                                     : a->d[r * blocks + 2 * p + ((second >> i) & 1)];
                a->dpair[(r * pairs + p) * 16 + i] = d;
            }
}

static float zero_term(const QMatrix *m, float zero) { return m->bits == 8 ? zero - 128.0f : zero; }

static void row_dot_int8_portable(const QMatrix *m, const uint8_t *codes, const float *scale, const float *zero,
                                  const Int8Acts *a, int64_t first, int mb, float *out) {
    const int64_t blocks = m->k / QBLOCK, per_group = m->group_size / QBLOCK;
    const int offset = m->bits == 8 ? 128 : 0;
    for (int j = 0; j < mb; j++) {
        const int64_t r = first + j;
        const int8_t *q = a->q + r * m->k;
        float total = 0.0f;
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t g = b / per_group;
            int isum = 0;
            if (m->bits == 4) { /* codes are unpacked in natural order, q lies at act_offset */
                for (int i = 0; i < QBLOCK; i++) isum += codes[b * QBLOCK + i] * q[act_offset(m, blocks, b, i)];
            } else {
                for (int i = 0; i < QBLOCK; i++) isum += ((int)codes[b * QBLOCK + i] - offset) * q[b * QBLOCK + i];
            }
            total += scale[g] * a->d[r * blocks + b] * (float)isum;
        }
        for (int64_t g = 0; g < m->groups; g++) total -= scale[g] * zero_term(m, zero[g]) * a->gsum[r * m->groups + g];
        out[j] = total;
    }
}

#ifdef PB_X86
/* One block's 32 codes as unsigned bytes: from the packed row (4-bit, nibble
 * order) or from the unpacked codes (2, 3 bits; 8 bits as c - 128, signed). */
AVX2 static inline __m256i block_codes(const QMatrix *m, const uint8_t *packed, const uint8_t *codes, int64_t b) {
    if (m->bits == 4) {
        const __m128i v = _mm_loadu_si128((const __m128i *)(packed + b * (QBLOCK / 2)));
        const __m128i low4 = _mm_set1_epi8(0x0f);
        const __m128i lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
        return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
    }
    const __m256i c = _mm256_loadu_si256((const __m256i *)(codes + b * QBLOCK));
    return m->bits == 8 ? _mm256_xor_si256(c, _mm256_set1_epi8((char)0x80)) : c;
}

/* acc + the sums of four products of unsigned bytes of a by signed bytes of b, in each int32 lane: AVX-VNNI's
 * VEX-encoded vpdpbusd, written as assembly so that the AVX2 kernels need no other target to hold it (they run
 * it only at LEVEL_AVXVNNI). */
AVX2 static inline __attribute__((always_inline)) __m256i dpbusd_vex(__m256i acc, __m256i a, __m256i b) {
    __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(a), "x"(b));
    return acc;
}

/* sum of 32 products of a block, as 8 int32 lanes; with vnni one vpdpbusd for maddubs and madd (the same sums:
 * maddubs never saturates on these operands) */
AVX2 static inline __attribute__((always_inline)) __m256i block_products(int signed_codes, __m256i c, __m256i q,
                                                                         const int vnni) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (signed_codes) { /* |c| times q with c's sign: unsigned x signed, no saturation */
        const __m256i magnitude = _mm256_sign_epi8(c, c), signed_q = _mm256_sign_epi8(q, c);
        if (vnni) return dpbusd_vex(_mm256_setzero_si256(), magnitude, signed_q);
        return _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_q), ones);
    }
    if (vnni) return dpbusd_vex(_mm256_setzero_si256(), c, q);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(c, q), ones);
}

/* sum over groups of s_g z_g gsum[g], for each of the mb rows: the zero points' term, applied once per row. */
AVX2 static inline void zero_terms_avx2(const QMatrix *m, const float *scale, const float *zero, const Int8Acts *a,
                                        int64_t first, int mb, float *sz, float *out) {
    for (int64_t g = 0; g < m->groups; g++) sz[g] = scale[g] * zero_term(m, zero[g]);
    for (int j = 0; j < mb; j++) out[j] = dot_avx2(sz, a->gsum + (first + j) * m->groups, m->groups);
}

AVX2 static inline __attribute__((always_inline)) void row_dot_int8_avx2(const QMatrix *m, const uint8_t *packed,
                                                                         const uint8_t *codes, const float *scale,
                                                                         const float *zero, const Int8Acts *a,
                                                                         int64_t first, int mb, float *sz,
                                                                         float *out, const int vnni) {
    const int64_t blocks = m->k / QBLOCK, per_group = m->group_size / QBLOCK;
    const int signed_codes = m->bits == 8;
    __m256 total[8], total2 = _mm256_setzero_ps();
    for (int j = 0; j < mb; j++) total[j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < m->groups; g++) {
        const int64_t b0 = g * per_group, b1 = b0 + per_group < blocks ? b0 + per_group : blocks;
        const __m256 s = _mm256_set1_ps(scale[g]);
        int64_t b = b0;
        if (mb == 1) { /* two independent chains over alternate blocks hide the latency */
            const int8_t *q = a->q + first * m->k;
            const float *d = a->d + first * blocks;
            for (; b + 2 <= b1; b += 2) {
                const __m256i p0 = block_products(signed_codes, block_codes(m, packed, codes, b),
                                                  _mm256_loadu_si256((const __m256i *)(q + b * QBLOCK)), vnni);
                const __m256i p1 = block_products(signed_codes, block_codes(m, packed, codes, b + 1),
                                                  _mm256_loadu_si256((const __m256i *)(q + (b + 1) * QBLOCK)), vnni);
                total[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_mul_ps(s, _mm256_broadcast_ss(d + b)),
                                           total[0]);
                total2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_mul_ps(s, _mm256_broadcast_ss(d + b + 1)),
                                         total2);
            }
        }
        for (; b < b1; b++) {
            const __m256i c = block_codes(m, packed, codes, b);
            for (int j = 0; j < mb; j++) {
                const int64_t r = first + j;
                const __m256i p = block_products(signed_codes, c,
                                                 _mm256_loadu_si256((const __m256i *)(a->q + r * m->k + b * QBLOCK)),
                                                 vnni);
                total[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p),
                                           _mm256_mul_ps(s, _mm256_broadcast_ss(a->d + r * blocks + b)), total[j]);
            }
        }
    }
    total[0] = _mm256_add_ps(total[0], total2);
    float zeros[8];
    zero_terms_avx2(m, scale, zero, a, first, mb, sz, zeros);
    for (int j = 0; j < mb; j++) out[j] = hsum256(total[j]) - zeros[j];
}

AVX2 static void row_times_int8_avx2(const QMatrix *m, const uint8_t *packed, const uint8_t *codes,
                                     const float *scale, const float *zero, const Int8Acts *a, int64_t first, int mb,
                                     float *sz, float *out) {
#define ROWS_CALL(n) row_dot_int8_avx2(m, packed, codes, scale, zero, a, first, n, sz, out, 0)
#define ROWS_CALL_VNNI(n) row_dot_int8_avx2(m, packed, codes, scale, zero, a, first, n, sz, out, 1)
    if (simd_level == LEVEL_AVXVNNI) {
        BY_ROW_COUNT(mb, ROWS_CALL_VNNI);
    } else {
        BY_ROW_COUNT(mb, ROWS_CALL);
    }
#undef ROWS_CALL_VNNI
#undef ROWS_CALL
}
#endif

/* ---- decoding one token: four weight rows at a time ------------------------
 *
 * With one activation row, a weight row's work is small (K = 576: nine pairs
 * of blocks), so what surrounds it (unpacking scales and zero points into
 * scratch, one reduction chain) cost as much as the products. The quad
 * kernels take four weight rows together: the activations (and their block
 * scales) are loaded once for the four, four independent chains hide the
 * latencies, and each row's scales and zero points are read where they lie
 * (F16C; nibbles). For 4- and 8-bit codes, read packed, with k and the group
 * size multiples of 32; 4-bit activations come in nibble order (below). */
#define QUAD 4

/* Whether a pair of blocks never straddles two groups (group size 32, or a multiple of 64): what the VNNI
 * kernels' per-pair scales assume. */
static int pairs_in_groups(const QMatrix *m) {
    return m->group_size == QBLOCK || (m->group_size / QBLOCK) % 2 == 0;
}

/* The quad and tile kernels' shapes: 4- or 8-bit codes read packed, k and the group size multiples of 32. */
static int tile_eligible(const QMatrix *m) {
    return (m->bits == 4 || m->bits == 8) && m->k % QBLOCK == 0 && m->group_size % QBLOCK == 0;
}

/* The float quad and tile kernels' shapes: 4- or 8-bit codes, groups of whole blocks (or a single group); k
 * need not be a multiple of 32 (a Qwen2-MoE expert's down projection reads 144): the whole blocks go the fast
 * way and the last k % 32 columns, all in the last group (group edges are multiples of 32), as a tail. */
static int float_tile_eligible(const QMatrix *m) {
    return (m->bits == 4 || m->bits == 8) && (m->group_size % QBLOCK == 0 || m->groups == 1);
}



#ifdef PB_X86
/* ---- int8 activations without VNNI (AVX2): a pair of blocks a step, up to four weight rows at a time ----
 *
 * Every AVX2 CPU (and AVX-512 without VNNI) takes these for 4- and 8-bit codes. A 4-bit pair's 32 packed
 * bytes give both blocks' evens (low nibbles) and odds (high nibbles) from one load, one shift and two
 * masks, against activations stored in the VNNI kernels' pair order (act_offset); maddubs sums each into
 * int16 (2 x 15 x 127, twice, fits), one madd into int32 lanes 0-3 for the pair's first block and 4-7 for
 * its second. 8-bit codes go in as c - 128 through the sign trick (block_products), and hadd puts the first
 * block in lanes 0, 1, 4, 5. A step's activations and their block scales are loaded once for the weight
 * rows, the codes unpacked once for the activation rows. */

/* The lanes of a pair's eight int32 sums that hold its second block (pair_dot_avx2). */
#define PAIR4_SECOND 0xF0
#define PAIR8_SECOND 0xCC

/* A pair's codes: 4-bit evens and odds of both blocks; 8-bit the two blocks as c - 128. */
AVX2 static inline void pair_codes_avx2(const QMatrix *m, const uint8_t *row, int64_t p, __m256i *c0, __m256i *c1) {
    if (m->bits == 4) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(row + p * QBLOCK)), low4 = _mm256_set1_epi8(0x0f);
        *c0 = _mm256_and_si256(v, low4), *c1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    } else {
        const __m256i flip = _mm256_set1_epi8((char)0x80);
        *c0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(row + 2 * p * QBLOCK)), flip);
        *c1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(row + 2 * p * QBLOCK + QBLOCK)), flip);
    }
}

/* A pair's products with one activation row q, as eight int32 lanes (the second block's: PAIR*_SECOND); with
 * vnni two vpdpbusd for a 4-bit pair's two maddubs, add and madd (the same sums). */
AVX2 static inline __attribute__((always_inline)) __m256i pair_dot_avx2(const QMatrix *m, __m256i c0, __m256i c1,
                                                                        const int8_t *q, int64_t p, const int vnni) {
    const __m256i q0 = _mm256_loadu_si256((const __m256i *)(q + 2 * p * QBLOCK));
    const __m256i q1 = _mm256_loadu_si256((const __m256i *)(q + 2 * p * QBLOCK + QBLOCK));
    if (m->bits == 4) {
        if (vnni) return dpbusd_vex(dpbusd_vex(_mm256_setzero_si256(), c0, q0), c1, q1);
        return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(c0, q0), _mm256_maddubs_epi16(c1, q1)),
                                 _mm256_set1_epi16(1));
    }
    return _mm256_hadd_epi32(block_products(1, c0, q0, vnni), block_products(1, c1, q1, vnni));
}

/* Two per-block values spread over a pair's lanes. */
AVX2 static inline __m256 pair_spread_avx2(const QMatrix *m, float first, float second) {
    const __m256 a = _mm256_set1_ps(first), b = _mm256_set1_ps(second);
    return m->bits == 4 ? _mm256_blend_ps(a, b, PAIR4_SECOND) : _mm256_blend_ps(a, b, PAIR8_SECOND);
}

/* sum_g s_g z_g sums_g for row r (8-bit: z - 128, as the codes went in), eight groups a step. */
AVX2 static float zero_term_avx2(const QMatrix *m, int64_t r, const float *sums) {
    const uint16_t *scale = m->scales + r * m->groups;
    const uint8_t *z = m->qzeros ? m->qzeros + r * m->zero_row_bytes : NULL;
    if (!z && m->bits == 8) return 0.0f; /* symmetric 8-bit: z - 128 = 0 */
    const float offset = m->bits == 8 ? 128.0f : 0.0f, symmetric = (float)(1 << (m->bits - 1));
    __m256 acc = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= m->groups; g += 8) {
        __m256 zero = _mm256_set1_ps(symmetric);
        if (z && m->bits == 4) { /* four bytes, low nibble first, back into group order */
            uint32_t packed;
            memcpy(&packed, z + g / 2, 4);
            const __m128i v = _mm_cvtsi32_si128((int)packed), low4 = _mm_set1_epi8(0x0f);
            const __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(v, low4), _mm_and_si128(_mm_srli_epi16(v, 4), low4));
            zero = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes));
        } else if (z) {
            zero = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(z + g)))),
                                 _mm256_set1_ps(offset));
        }
        const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + g)));
        acc = _mm256_fmadd_ps(_mm256_mul_ps(s, zero), _mm256_loadu_ps(sums + g), acc);
    }
    float total = hsum256(acc);
    for (; g < m->groups; g++) {
        const float zero = !z ? symmetric : (float)(m->bits == 4 ? (z[g / 2] >> (4 * (g & 1))) & 15 : z[g]) - offset;
        total += _cvtsh_ss(scale[g]) * zero * sums[g];
    }
    return total;
}

/* NR (1..4) weight rows from r0 for R (1 or 2) activation rows from j0. With one activation row and groups of
 * whole pairs (g64 and up), a group's pairs are summed weighted by the activations' block scales and the
 * weight's group scale applied once; otherwise each pair's products take weight scale x block scale, the
 * pair's two groups' scales spread over its halves where it straddles two (g32, Q4_1's layout). */
AVX2 static inline __attribute__((always_inline)) void tile_int8_avx2_body(const QMatrix *m, int64_t r0, const int NR,
                                                                           const Int8Acts *a, int64_t j0, const int R,
                                                                           float *y, const int vnni) {
    const int64_t blocks = m->k / QBLOCK, pairs = blocks / 2, per_group = m->group_size / QBLOCK;
    const int grouped = R == 1 && per_group % 2 == 0;
    const uint8_t *rows[QUAD];
    const uint16_t *scales[QUAD];
    const int8_t *q[2];
    const float *d[2];
    __m256 total[QUAD][2], acc[QUAD];
    for (int i = 0; i < NR; i++) {
        rows[i] = m->qweight + (r0 + i) * m->row_bytes, scales[i] = m->scales + (r0 + i) * m->groups;
        for (int j = 0; j < R; j++) total[i][j] = _mm256_setzero_ps();
        acc[i] = _mm256_setzero_ps();
    }
    for (int j = 0; j < R; j++) q[j] = a->q + (j0 + j) * m->k, d[j] = a->d + (j0 + j) * blocks;
    int64_t g0 = 0, left = per_group; /* the group of block 2p, and its blocks from 2p on: no division */
    for (int64_t p = 0; p < pairs; p++) {
        __m256 dv[2];
        for (int j = 0; j < R; j++) dv[j] = pair_spread_avx2(m, d[j][2 * p], d[j][2 * p + 1]);
        if (grouped) {
            if (left == per_group)
                for (int i = 0; i < NR; i++) acc[i] = _mm256_setzero_ps();
            for (int i = 0; i < NR; i++) {
                __m256i c0, c1;
                pair_codes_avx2(m, rows[i], p, &c0, &c1);
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pair_dot_avx2(m, c0, c1, q[0], p, vnni)), dv[0], acc[i]);
            }
            left -= 2;
            if (left == 0 || p == pairs - 1) {
                for (int i = 0; i < NR; i++)
                    total[i][0] = _mm256_fmadd_ps(acc[i], _mm256_set1_ps(_cvtsh_ss(scales[i][g0])), total[i][0]);
                left = per_group, g0++;
            }
        } else {
            const int64_t g1 = left > 1 ? g0 : g0 + 1; /* the group of block 2p + 1 */
            for (int i = 0; i < NR; i++) {
                __m256i c0, c1;
                pair_codes_avx2(m, rows[i], p, &c0, &c1);
                const __m256 s = pair_spread_avx2(m, _cvtsh_ss(scales[i][g0]), _cvtsh_ss(scales[i][g1]));
                for (int j = 0; j < R; j++)
                    total[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pair_dot_avx2(m, c0, c1, q[j], p, vnni)),
                                                  _mm256_mul_ps(s, dv[j]), total[i][j]);
            }
            left -= 2;
            while (left <= 0) left += per_group, g0++;
        }
    }
    if (blocks % 2) { /* an odd count's last block: its activations lie as a lone block's (act_offset) */
        const int64_t b = blocks - 1, g = b / per_group;
        for (int i = 0; i < NR; i++) {
            const __m256i c = block_codes(m, rows[i], rows[i], b);
            const float s = _cvtsh_ss(scales[i][g]);
            for (int j = 0; j < R; j++) {
                const __m256i prod = block_products(m->bits == 8, c,
                                                    _mm256_loadu_si256((const __m256i *)(q[j] + b * QBLOCK)), vnni);
                total[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(prod), _mm256_set1_ps(s * d[j][b]), total[i][j]);
            }
        }
    }
    for (int i = 0; i < NR; i++)
        for (int j = 0; j < R; j++)
            y[(j0 + j) * m->n + r0 + i] = hsum256(total[i][j]) -
                                          zero_term_avx2(m, r0 + i, a->gsum + (j0 + j) * m->groups) +
                                          (m->bias ? m->bias[r0 + i] : 0.0f);
}

/* Weight rows [r0, r0 + nr) (nr <= 4) for every row of int8 activations, two activation rows at a time; with
 * AVX-VNNI where the level allows. */
AVX2 static void tile_int8_avx2(const QMatrix *m, int64_t r0, int nr, const Int8Acts *a, int64_t rows, float *y) {
    const int vnni = simd_level == LEVEL_AVXVNNI;
#define TILE_CALL(NR, R)                                                                                           \
    if (vnni)                                                                                                      \
        tile_int8_avx2_body(m, r0, NR, a, j0, R, y, 1);                                                            \
    else                                                                                                           \
        tile_int8_avx2_body(m, r0, NR, a, j0, R, y, 0)
#define BY_WEIGHT_ROWS(R)                                                                                          \
    switch (nr) {                                                                                                  \
    case 1: TILE_CALL(1, R); break;                                                                                \
    case 2: TILE_CALL(2, R); break;                                                                                \
    case 3: TILE_CALL(3, R); break;                                                                                \
    default: TILE_CALL(4, R); break;                                                                               \
    }
    for (int64_t j0 = 0; j0 < rows; j0 += 2) {
        if (rows - j0 >= 2) {
            BY_WEIGHT_ROWS(2)
        } else {
            BY_WEIGHT_ROWS(1)
        }
    }
#undef BY_WEIGHT_ROWS
#undef TILE_CALL
}
#endif

/* x in the order a 4-bit block's packed bytes give its codes: evens (low nibbles), then odds; a tail shorter
 * than a block stays in its own order (float_tail unpacks it so). */
static void nibble_order(const float *x, int64_t k, float *out) {
    int64_t b = 0;
    for (; b + QBLOCK <= k; b += QBLOCK)
        for (int i = 0; i < QBLOCK; i++) out[b + (i & 1) * (QBLOCK / 2) + (i >> 1)] = x[b + i];
    for (; b < k; b++) out[b] = x[b];
}

#ifdef PB_X86
/* Groups [g, g + 16) of row r: scale times zero point, 0 beyond the row's groups. */
AVX512 static inline __m512 scaled_zeros16(const QMatrix *m, int64_t r, int64_t g) {
    const int64_t left = m->groups - g < 16 ? m->groups - g : 16;
    const __mmask16 live = (__mmask16)((1u << left) - 1);
    const __m512 scale = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, m->scales + r * m->groups + g));
    if (!m->qzeros) return _mm512_mul_ps(scale, _mm512_set1_ps((float)(1 << (m->bits - 1))));
    const uint8_t *z = m->qzeros + r * m->zero_row_bytes;
    __m128i codes;
    if (m->bits == 4) { /* ceil(left / 2) bytes, low nibble first: interleaved back to group order */
        const __m128i low4 = _mm_set1_epi8(0x0f);
        codes = _mm_maskz_loadu_epi8((__mmask16)((1u << ((left + 1) / 2)) - 1), z + g / 2);
        codes = _mm_unpacklo_epi8(_mm_and_si128(codes, low4), _mm_and_si128(_mm_srli_epi16(codes, 4), low4));
    } else {
        codes = _mm_maskz_loadu_epi8(live, z + g);
    }
    return _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes)));
}

/* sum_g s_g z_g sums_g for row r: the zero points' term, sixteen groups a step (at g32 a row has 18). */
AVX512 static float zero_term_avx512(const QMatrix *m, int64_t r, const float *sums) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t g = 0; g < m->groups; g += 16) {
        const __mmask16 live = m->groups - g >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (m->groups - g)) - 1);
        acc = _mm512_fmadd_ps(scaled_zeros16(m, r, g), _mm512_maskz_loadu_ps(live, sums + g), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

/* Block b of a packed 4- or 8-bit row as two 16-byte halves of unsigned codes: a 4-bit block's evens and odds
 * (its low and high nibbles), an 8-bit block's first and last 16. */
AVX512 static inline void block_halves(const QMatrix *m, const uint8_t *row, int64_t b, __m128i *c0, __m128i *c1) {
    if (m->bits == 4) {
        const __m128i v = _mm_loadu_si128((const __m128i *)(row + b * (QBLOCK / 2))), low4 = _mm_set1_epi8(0x0f);
        *c0 = _mm_and_si128(v, low4), *c1 = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
    } else {
        *c0 = _mm_loadu_si128((const __m128i *)(row + b * QBLOCK));
        *c1 = _mm_loadu_si128((const __m128i *)(row + b * QBLOCK + 16));
    }
}

/* The codes of a row's last k % 32 columns (past its whole blocks) as floats in column order, two halves of
 * sixteen, zero beyond k. */
AVX512 static inline void tail_codes(const QMatrix *m, const uint8_t *row, __m512 *c0, __m512 *c1) {
    const int64_t first = m->k / QBLOCK * QBLOCK, count = m->k - first;
    __m128i lo, hi;
    if (m->bits == 4) { /* ceil(count / 2) bytes, low nibble first: interleaved back to column order */
        const __m128i low4 = _mm_set1_epi8(0x0f);
        const __m128i v = _mm_maskz_loadu_epi8((__mmask16)((1u << ((count + 1) / 2)) - 1), row + first / 2);
        const __m128i evens = _mm_and_si128(v, low4), odds = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
        lo = _mm_unpacklo_epi8(evens, odds), hi = _mm_unpackhi_epi8(evens, odds);
    } else {
        lo = _mm_maskz_loadu_epi8((__mmask16)((1u << (count < 16 ? count : 16)) - 1), row + first);
        hi = _mm_maskz_loadu_epi8((__mmask16)((1u << (count > 16 ? count - 16 : 0)) - 1), row + first + 16);
    }
    *c0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), *c1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi));
}

/* The activations of the tail's columns, zero beyond k (so a 4-bit tail's padding nibble adds nothing). */
AVX512 static inline void tail_acts(const QMatrix *m, const float *x, __m512 *x0, __m512 *x1) {
    const int64_t first = m->k / QBLOCK * QBLOCK, count = m->k - first;
    *x0 = _mm512_maskz_loadu_ps((__mmask16)((1u << (count < 16 ? count : 16)) - 1), x + first);
    *x1 = _mm512_maskz_loadu_ps((__mmask16)((1u << (count > 16 ? count - 16 : 0)) - 1), x + first + 16);
}

/* Four rows' y from float activations: 16 codes become floats and meet x in one multiply-add; per group
 * the scale is applied once and the zero point through the group sum of x (xsum). */
AVX512 static void quad_float_avx512(const QMatrix *m, int64_t r0, const float *x, const float *xsum, float *y) {
    const int64_t blocks_per_group = m->group_size / QBLOCK, blocks = m->k / QBLOCK;
    const uint8_t *rows[QUAD];
    __m512 total[QUAD];
    for (int i = 0; i < QUAD; i++) rows[i] = m->qweight + (r0 + i) * m->row_bytes, total[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < m->groups; g++) {
        const int64_t b1 = (g + 1) * blocks_per_group < blocks ? (g + 1) * blocks_per_group : blocks;
        __m512 acc[QUAD];
        for (int i = 0; i < QUAD; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t b = g * blocks_per_group; b < b1; b++) {
            const __m512 x0 = _mm512_loadu_ps(x + b * QBLOCK), x1 = _mm512_loadu_ps(x + b * QBLOCK + 16);
            for (int i = 0; i < QUAD; i++) {
                __m128i c0, c1;
                block_halves(m, rows[i], b, &c0, &c1);
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c0)), x0, acc[i]);
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c1)), x1, acc[i]);
            }
        }
        if (g == m->groups - 1 && m->k % QBLOCK) { /* the tail lies in the last group */
            __m512 x0, x1;
            tail_acts(m, x, &x0, &x1);
            for (int i = 0; i < QUAD; i++) {
                __m512 c0, c1;
                tail_codes(m, rows[i], &c0, &c1);
                acc[i] = _mm512_fmadd_ps(c1, x1, _mm512_fmadd_ps(c0, x0, acc[i]));
            }
        }
        for (int i = 0; i < QUAD; i++)
            total[i] = _mm512_fmadd_ps(acc[i], _mm512_set1_ps(_cvtsh_ss(m->scales[(r0 + i) * m->groups + g])), total[i]);
    }
    for (int i = 0; i < QUAD; i++)
        y[r0 + i] = _mm512_reduce_add_ps(total[i]) - zero_term_avx512(m, r0 + i, xsum) + (m->bias ? m->bias[r0 + i] : 0.0f);
}

/* ---- a few rows at once (batched decode): tiles of four weight rows by up to four activation rows ----
 *
 * The row kernels above unpack a weight row and meet each activation row in turn, so every product pays a
 * load of the activations and a reduction of its own; at batch 8 the linears ran at a tenth of the
 * arithmetic's speed. A tile takes four weight rows and R <= 4 activation rows: a block's codes are
 * unpacked (and scaled) once for the R rows, an activation block is loaded once for the four weight rows,
 * the 16 products accumulate in registers, the zero points' terms are subtracted lane-wise (16 groups a
 * step), and the 16 sums are reduced together (sum16). */
#define TILE_ROWS 4

/* total[4 i + j] -= sum_g s_ig z_ig sums_j[g] for the tile's rows (sums: a row's group sums of x, or of the
 * rounded activations), then y[j0 + j, r0 + i] = the reduced total (+ bias). */
AVX512 static inline __attribute__((always_inline)) void tile_finish(const QMatrix *m, int64_t r0, const float *sums,
                                                                     int64_t j0, const int R, __m512 *total,
                                                                     float *y) {
    for (int64_t g = 0; g < m->groups; g += 16) {
        const __mmask16 live = m->groups - g >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (m->groups - g)) - 1);
        __m512 sz[TILE_ROWS];
        for (int i = 0; i < TILE_ROWS; i++) sz[i] = scaled_zeros16(m, r0 + i, g);
        for (int j = 0; j < R; j++) {
            const __m512 gs = _mm512_maskz_loadu_ps(live, sums + (j0 + j) * m->groups + g);
            for (int i = 0; i < TILE_ROWS; i++) total[4 * i + j] = _mm512_fnmadd_ps(sz[i], gs, total[4 * i + j]);
        }
    }
    float out[16];
    _mm512_storeu_ps(out, sum16(total));
    for (int i = 0; i < TILE_ROWS; i++)
        for (int j = 0; j < R; j++)
            y[(j0 + j) * m->n + r0 + i] = out[4 * i + j] + (m->bias ? m->bias[r0 + i] : 0.0f);
}

/* Float activations (x in nibble order for 4-bit codes): a block's codes become floats times their group's
 * scale once per weight row, then meet each activation row in two multiply-adds. */
AVX512 static inline __attribute__((always_inline)) void tile_float_body(const QMatrix *m, int64_t r0,
                                                                         const float *x, const float *xsum,
                                                                         int64_t j0, const int R, float *y) {
    const int64_t blocks = m->k / QBLOCK, per_group = m->group_size / QBLOCK;
    const uint8_t *rows[TILE_ROWS];
    const uint16_t *scales[TILE_ROWS];
    __m512 total[16];
    for (int t = 0; t < 16; t++) total[t] = _mm512_setzero_ps();
    for (int i = 0; i < TILE_ROWS; i++)
        rows[i] = m->qweight + (r0 + i) * m->row_bytes, scales[i] = m->scales + (r0 + i) * m->groups;
    for (int64_t b = 0, g = 0, left = per_group; b < blocks; b++) {
        __m512 c0[TILE_ROWS], c1[TILE_ROWS];
        for (int i = 0; i < TILE_ROWS; i++) {
            __m128i v0, v1;
            block_halves(m, rows[i], b, &v0, &v1);
            const __m512 s = _mm512_set1_ps(_cvtsh_ss(scales[i][g]));
            c0[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v0)), s);
            c1[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v1)), s);
        }
        for (int j = 0; j < R; j++) {
            const float *xj = x + (j0 + j) * m->k + b * QBLOCK;
            const __m512 x0 = _mm512_loadu_ps(xj), x1 = _mm512_loadu_ps(xj + 16);
            for (int i = 0; i < TILE_ROWS; i++)
                total[4 * i + j] = _mm512_fmadd_ps(c1[i], x1, _mm512_fmadd_ps(c0[i], x0, total[4 * i + j]));
        }
        if (--left == 0) left = per_group, g++;
    }
    if (m->k % QBLOCK) { /* the tail, in the last group */
        __m512 c0[TILE_ROWS], c1[TILE_ROWS];
        for (int i = 0; i < TILE_ROWS; i++) {
            const __m512 s = _mm512_set1_ps(_cvtsh_ss(scales[i][m->groups - 1]));
            tail_codes(m, rows[i], &c0[i], &c1[i]);
            c0[i] = _mm512_mul_ps(c0[i], s), c1[i] = _mm512_mul_ps(c1[i], s);
        }
        for (int j = 0; j < R; j++) {
            __m512 x0, x1;
            tail_acts(m, x + (j0 + j) * m->k, &x0, &x1);
            for (int i = 0; i < TILE_ROWS; i++)
                total[4 * i + j] = _mm512_fmadd_ps(c1[i], x1, _mm512_fmadd_ps(c0[i], x0, total[4 * i + j]));
        }
    }
    tile_finish(m, r0, xsum, j0, R, total, y);
}

/* Four weight rows from r0 for every row of x (float activations), four activation rows at a time. */
AVX512 static void tile_float_avx512(const QMatrix *m, int64_t r0, const float *x, const float *xsum, int64_t rows,
                                     float *y) {
    for (int64_t j0 = 0; j0 < rows; j0 += 4) {
        switch (rows - j0 < 4 ? rows - j0 : 4) {
        case 1: tile_float_body(m, r0, x, xsum, j0, 1, y); break;
        case 2: tile_float_body(m, r0, x, xsum, j0, 2, y); break;
        case 3: tile_float_body(m, r0, x, xsum, j0, 3, y); break;
        default: tile_float_body(m, r0, x, xsum, j0, 4, y);
        }
    }
}
#endif

#ifdef PB_X86
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

/* Two blocks' 64 codes as unsigned bytes, in the activations' order. vpdpbusd
 * sums four unsigned x signed byte products into an int32 without saturating,
 * so 8-bit codes go in as they are (no c - 128) and the zero term is plain z.
 * 4-bit: the pair's 32 packed bytes, loaded into both halves, give their low
 * nibbles in the low half and their high ones in the high half (a shift by 0
 * or 4 per half, one mask): [evens b, evens b+1 | odds b, odds b+1], as
 * act_offset stores the activations; no shuffle. */
VNNI static inline __m512i pair_codes(const QMatrix *m, const uint8_t *packed, const uint8_t *codes, int64_t b) {
    if (m->bits == 4) {
        const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(packed + b * (QBLOCK / 2))));
        const __m512i shifts = _mm512_set_epi64(0x0004000400040004, 0x0004000400040004, 0x0004000400040004,
                                                0x0004000400040004, 0, 0, 0, 0);
        return _mm512_and_si512(_mm512_srlv_epi16(v, shifts), _mm512_set1_epi8(0x0f));
    }
    return _mm512_loadu_si512((const void *)(codes + b * QBLOCK));
}

/* permutexvar indices that put a pair's two scales (lanes 0 and 1) over its blocks' lanes; a lone last
 * block's scale everywhere (its high lanes' products are 0). */
VNNI static inline __m512i pair_spread(const QMatrix *m, int whole) {
    return _mm512_maskz_mov_epi32((__mmask16)(whole ? second_block_lanes(m) : 0u), _mm512_set1_epi32(1));
}

/* The last block of an odd count, in the low half (the high half's activations are zero). */
VNNI static inline __m512i last_codes(const QMatrix *m, const uint8_t *packed, const uint8_t *codes, int64_t b) {
    if (m->bits == 4) {
        const __m128i v = _mm_loadu_si128((const __m128i *)(packed + b * (QBLOCK / 2)));
        const __m128i low4 = _mm_set1_epi8(0x0f);
        const __m128i lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
        return _mm512_castsi256_si512(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
    }
    return _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(codes + b * QBLOCK)));
}

/* row_dot_int8_avx2 with vpdpbusd: two blocks per instruction. The pair's activation scales come
 * pre-broadcast (a->dpair: d_b and d_b+1 in their blocks' lanes), so a pair costs one dot, one convert
 * and one multiply-add. When a group holds whole pairs (group size a multiple of 64), a group's pairs
 * are summed first and its scale applied once; otherwise (g32, or odd block counts) each half of a pair
 * takes its own group's scale. */
VNNI static inline __m512i pair_acts(const Int8Acts *a, const QMatrix *m, int64_t r, int64_t b, int whole) {
    const int8_t *q = a->q + r * m->k + b * QBLOCK;
    return whole ? _mm512_loadu_si512((const void *)q) : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, q);
}

VNNI static inline __attribute__((always_inline)) void row_dot_int8_vnni(const QMatrix *m, const uint8_t *packed,
                                                                         const uint8_t *codes, const float *scale,
                                                                         const float *zero, const Int8Acts *a,
                                                                         int64_t first, int mb, float *sz,
                                                                         float *out) {
    const int64_t blocks = m->k / QBLOCK, pairs = (blocks + 1) / 2, per_group = m->group_size / QBLOCK;
    __m512 total[8];
    for (int j = 0; j < mb; j++) total[j] = _mm512_setzero_ps();
    if (per_group % 2 == 0) {
        const int64_t group_pairs = per_group / 2;
        for (int64_t g = 0; g < m->groups; g++) {
            const int64_t p1 = (g + 1) * group_pairs < pairs ? (g + 1) * group_pairs : pairs;
            __m512 acc[8], acc2 = _mm512_setzero_ps();
            for (int j = 0; j < mb; j++) acc[j] = _mm512_setzero_ps();
            for (int64_t p = g * group_pairs; p < p1; p++) {
                const int whole = 2 * p + 1 < blocks;
                const __m512i c = whole ? pair_codes(m, packed, codes, 2 * p) : last_codes(m, packed, codes, 2 * p);
                for (int j = 0; j < mb; j++) {
                    const int64_t r = first + j;
                    const __m512 prod = _mm512_cvtepi32_ps(
                        _mm512_dpbusd_epi32(_mm512_setzero_si512(), c, pair_acts(a, m, r, 2 * p, whole)));
                    const __m512 d = _mm512_loadu_ps(a->dpair + (r * pairs + p) * 16);
                    if (mb == 1 && (p & 1)) /* a second chain over alternate pairs hides the FMA latency */
                        acc2 = _mm512_fmadd_ps(prod, d, acc2);
                    else
                        acc[j] = _mm512_fmadd_ps(prod, d, acc[j]);
                }
            }
            acc[0] = _mm512_add_ps(acc[0], acc2);
            const __m512 s = _mm512_set1_ps(scale[g]);
            for (int j = 0; j < mb; j++) total[j] = _mm512_fmadd_ps(acc[j], s, total[j]);
        }
    } else {
        int64_t g0 = 0, left = per_group; /* the group of block 2p, and its blocks from 2p on: no division */
        for (int64_t p = 0; p < pairs; p++) {
            const int whole = 2 * p + 1 < blocks;
            const int64_t g1 = left > 1 ? g0 : g0 + 1; /* the group of block 2p + 1 */
            const __m512i c = whole ? pair_codes(m, packed, codes, 2 * p) : last_codes(m, packed, codes, 2 * p);
            const __m512 s = _mm512_mask_blend_ps((__mmask16)(whole ? second_block_lanes(m) : 0u),
                                                  _mm512_set1_ps(scale[g0]), _mm512_set1_ps(scale[g1]));
            for (int j = 0; j < mb; j++) {
                const int64_t r = first + j;
                const __m512 prod = _mm512_cvtepi32_ps(
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), c, pair_acts(a, m, r, 2 * p, whole)));
                total[j] = _mm512_fmadd_ps(prod, _mm512_mul_ps(s, _mm512_loadu_ps(a->dpair + (r * pairs + p) * 16)),
                                           total[j]);
            }
            left -= 2;
            while (left <= 0) left += per_group, g0++;
        }
    }
    for (int64_t g = 0; g < m->groups; g++) sz[g] = scale[g] * zero[g];
    for (int j = 0; j < mb; j++)
        out[j] = _mm512_reduce_add_ps(total[j]) - dot_avx2(sz, a->gsum + (first + j) * m->groups, m->groups);
}

/* quad_float_avx512 with vpdpbusd on int8 activations, two blocks per instruction. When a group holds
 * whole pairs of blocks its pairs are summed first and its scale applied once; at g32 (Q4_1's layout)
 * each pair's two scales are converted together and spread over its two halves. */
VNNI static void quad_int8_vnni(const QMatrix *m, int64_t r0, const Int8Acts *a, float *y) {
    const int64_t blocks = m->k / QBLOCK, pairs = (blocks + 1) / 2, per_group = m->group_size / QBLOCK;
    const uint8_t *rows[QUAD];
    const uint16_t *scales[QUAD];
    __m512 total[QUAD];
    for (int i = 0; i < QUAD; i++) {
        rows[i] = m->qweight + (r0 + i) * m->row_bytes, scales[i] = m->scales + (r0 + i) * m->groups;
        total[i] = _mm512_setzero_ps();
    }
    if (per_group == 1) {
        for (int64_t p = 0; p < pairs; p++) {
            const int whole = 2 * p + 1 < blocks;
            const __m512i q = pair_acts(a, m, 0, 2 * p, whole);
            const __m512 d = _mm512_loadu_ps(a->dpair + p * 16);
            const __m512i spread = pair_spread(m, whole);
            for (int i = 0; i < QUAD; i++) {
                const __m512i c = whole ? pair_codes(m, rows[i], rows[i], 2 * p) : last_codes(m, rows[i], rows[i], 2 * p);
                /* the pair's two fp16 scales (a lone last block has one; its d is 0 beyond) */
                const uint32_t two = scales[i][2 * p] | (whole ? (uint32_t)scales[i][2 * p + 1] << 16 : 0u);
                const __m512 sd = _mm512_mul_ps(
                    _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128((int)two)))), d);
                total[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), c, q)), sd,
                                           total[i]);
            }
        }
    } else {
        const int64_t group_pairs = per_group / 2;
        for (int64_t g = 0; g < m->groups; g++) {
            const int64_t p1 = (g + 1) * group_pairs < pairs ? (g + 1) * group_pairs : pairs;
            __m512 acc[QUAD];
            for (int i = 0; i < QUAD; i++) acc[i] = _mm512_setzero_ps();
            for (int64_t p = g * group_pairs; p < p1; p++) {
                const int whole = 2 * p + 1 < blocks;
                const __m512i q = pair_acts(a, m, 0, 2 * p, whole);
                const __m512 d = _mm512_loadu_ps(a->dpair + p * 16);
                for (int i = 0; i < QUAD; i++) {
                    const __m512i c = whole ? pair_codes(m, rows[i], rows[i], 2 * p) : last_codes(m, rows[i], rows[i], 2 * p);
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), c, q)), d,
                                             acc[i]);
                }
            }
            for (int i = 0; i < QUAD; i++)
                total[i] = _mm512_fmadd_ps(acc[i], _mm512_set1_ps(_cvtsh_ss(scales[i][g])), total[i]);
        }
    }
    for (int i = 0; i < QUAD; i++)
        y[r0 + i] = _mm512_reduce_add_ps(total[i]) - zero_term_avx512(m, r0 + i, a->gsum) +
                    (m->bias ? m->bias[r0 + i] : 0.0f);
}

/* The tile with int8 activations and vpdpbusd, two blocks a step: a pair's codes are unpacked once for the
 * R activation rows, and each product is weighted by the weight's group scale times the activations' block
 * scales (at g32 the pair's two scales spread over its halves, as in quad_int8_vnni). */
VNNI static inline __attribute__((always_inline)) void tile_int8_body(const QMatrix *m, int64_t r0,
                                                                      const Int8Acts *a, int64_t j0, const int R,
                                                                      const int g32, float *y) {
    const int64_t blocks = m->k / QBLOCK, pairs = (blocks + 1) / 2, per_group = m->group_size / QBLOCK;
    const uint8_t *rows[TILE_ROWS];
    const uint16_t *scales[TILE_ROWS];
    __m512 total[16];
    for (int t = 0; t < 16; t++) total[t] = _mm512_setzero_ps();
    for (int i = 0; i < TILE_ROWS; i++)
        rows[i] = m->qweight + (r0 + i) * m->row_bytes, scales[i] = m->scales + (r0 + i) * m->groups;
    for (int64_t p = 0; p < pairs; p++) {
        const int whole = 2 * p + 1 < blocks;
        const int64_t g = g32 ? 2 * p : 2 * p / per_group;
        const __m512i spread = pair_spread(m, whole);
        __m512i c[TILE_ROWS];
        __m512 s[TILE_ROWS];
        for (int i = 0; i < TILE_ROWS; i++) {
            c[i] = whole ? pair_codes(m, rows[i], rows[i], 2 * p) : last_codes(m, rows[i], rows[i], 2 * p);
            if (g32) {
                const uint32_t two = scales[i][g] | (whole ? (uint32_t)scales[i][g + 1] << 16 : 0u);
                s[i] = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128((int)two))));
            } else {
                s[i] = _mm512_set1_ps(_cvtsh_ss(scales[i][g]));
            }
        }
        for (int j = 0; j < R; j++) {
            const __m512i q = pair_acts(a, m, j0 + j, 2 * p, whole);
            const __m512 d = _mm512_loadu_ps(a->dpair + ((j0 + j) * pairs + p) * 16);
            for (int i = 0; i < TILE_ROWS; i++)
                total[4 * i + j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), c[i], q)),
                                                   _mm512_mul_ps(s[i], d), total[4 * i + j]);
        }
    }
    tile_finish(m, r0, a->gsum, j0, R, total, y);
}

/* ---- one activation row, sixteen weight rows a task (int8, VNNI) ----------------------------------------
 *
 * At K = 576 a quad's four rows have nine pairs of blocks each: its scales converted one at a time, its four
 * reductions and four zero terms cost as much as its 36 dot products. Here a task takes sixteen rows: their
 * scales are converted to floats sixteen at a time first, each pair's activations and block scales are
 * loaded once for the sixteen, each product is weighted by d times its row's scale (a broadcast from that
 * table), the zero terms are subtracted lane-wise, and the sixteen sums are reduced together (sum16). */
#define HEX 16

/* The scales of rows r0..r0+15 as floats, row i's at scale[i * groups]. */
AVX512 static void hex_scales(const QMatrix *m, int64_t r0, float *scale) {
    for (int i = 0; i < HEX; i++)
        for (int64_t g = 0; g < m->groups; g += 16) {
            const __mmask16 live = m->groups - g >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (m->groups - g)) - 1);
            _mm512_mask_storeu_ps(scale + i * m->groups + g, live,
                                  _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, m->scales + (r0 + i) * m->groups + g)));
        }
}

/* total[i] -= sum_g s_ig z_ig sums[g] for the sixteen rows; then y[r0 + i] = their reduced sums (+ bias). */
AVX512 static inline __attribute__((always_inline)) void hex_finish(const QMatrix *m, int64_t r0, const float *sums,
                                                                    __m512 *total, float *y) {
    for (int64_t g = 0; g < m->groups; g += 16) {
        const __mmask16 live = m->groups - g >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (m->groups - g)) - 1);
        const __m512 gs = _mm512_maskz_loadu_ps(live, sums + g);
        for (int i = 0; i < HEX; i++) total[i] = _mm512_fnmadd_ps(scaled_zeros16(m, r0 + i, g), gs, total[i]);
    }
    __m512 out = sum16(total);
    if (m->bias) out = _mm512_add_ps(out, _mm512_loadu_ps(m->bias + r0));
    _mm512_storeu_ps(y + r0, out);
}

VNNI static inline __attribute__((always_inline)) void hex_int8_body(const QMatrix *m, int64_t r0, const Int8Acts *a,
                                                                     const float *scale, const int g32, float *y) {
    const int64_t blocks = m->k / QBLOCK, pairs = (blocks + 1) / 2, per_group = m->group_size / QBLOCK;
    const int64_t groups = m->groups;
    const uint8_t *rows = m->qweight + r0 * m->row_bytes;
    __m512 total[HEX];
    for (int i = 0; i < HEX; i++) total[i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        const int whole = 2 * p + 1 < blocks;
        const __m512i q = pair_acts(a, m, 0, 2 * p, whole);
        const __m512 d = _mm512_loadu_ps(a->dpair + p * 16);
        const int64_t g = g32 ? 2 * p : 2 * p / per_group;
        const __mmask16 second = (__mmask16)(whole ? second_block_lanes(m) : 0u);
#pragma GCC unroll 16
        for (int i = 0; i < HEX; i++) {
            const uint8_t *row = rows + i * m->row_bytes;
            const __m512i c = whole ? pair_codes(m, row, row, 2 * p) : last_codes(m, row, row, 2 * p);
            __m512 s = _mm512_set1_ps(scale[i * groups + g]);
            if (g32) s = _mm512_mask_blend_ps(second, s, _mm512_set1_ps(scale[i * groups + g + whole]));
            total[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), c, q)),
                                       _mm512_mul_ps(d, s), total[i]);
        }
    }
    hex_finish(m, r0, a->gsum, total, y);
}

/* Sixteen weight rows from r0 for one row of int8 activations; scale: 16 groups floats of scratch. */
VNNI static void hex_int8_vnni(const QMatrix *m, int64_t r0, const Int8Acts *a, float *scale, float *y) {
    hex_scales(m, r0, scale);
    if (m->group_size == QBLOCK)
        hex_int8_body(m, r0, a, scale, 1, y);
    else
        hex_int8_body(m, r0, a, scale, 0, y);
}

/* Four weight rows from r0 for every activation row, four at a time (group size 32 or a multiple of 64). */
VNNI static void tile_int8_vnni(const QMatrix *m, int64_t r0, const Int8Acts *a, int64_t rows, float *y) {
    const int g32 = m->group_size == QBLOCK;
    for (int64_t j0 = 0; j0 < rows; j0 += 4) {
#define TILE_CALL(n) (g32 ? tile_int8_body(m, r0, a, j0, n, 1, y) : tile_int8_body(m, r0, a, j0, n, 0, y))
        switch (rows - j0 < 4 ? rows - j0 : 4) {
        case 1: TILE_CALL(1); break;
        case 2: TILE_CALL(2); break;
        case 3: TILE_CALL(3); break;
        default: TILE_CALL(4);
        }
#undef TILE_CALL
    }
}

#ifdef PB_AMX
/* ---- AMX: the tile multiply for 5..16 rows of int8 activations ---------------------------------------
 *
 * TDPBUSD multiplies a 16 x 32 tile of unsigned bytes (sixteen weight rows' codes for one block of 32)
 * by a block of every activation row (signed bytes, laid out as its B operand: a->tiles) into 16 x rows
 * int32 sums in one instruction, where vpdpbusd takes 64 products. Each block's sums are stored, converted
 * and weighted by the weight's group scale and the block's activation scales (a vector over the rows), so
 * the activations keep their per-block scales and the result is the VNNI tile's. 4-bit codes are first
 * unpacked to bytes in nibble order (as the activations are stored), a panel of sixteen rows at a time;
 * 8-bit codes are read in place. Two blocks are in flight (tiles 0-2 and 3-5), so the conversion of one
 * overlaps the multiply of the next. */
#define AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

/* The packed bytes of rows [r0, r0 + count) into L2, where they exist: a panel's work is long enough to hide
 * the next panel's fetch, which the hardware prefetchers, seeing sixteen short rows, start late. */
static void prefetch_rows(const QMatrix *m, int64_t r0, int64_t count) {
    if (r0 >= m->n) return;
    if (r0 + count > m->n) count = m->n - r0;
    const char *p = (const char *)(m->qweight + r0 * m->row_bytes), *end = p + count * m->row_bytes;
    for (; p < end; p += 64) __builtin_prefetch(p, 0, 2);
}
#define PANEL 16
/* Fewer rows take the VNNI tile: a panel's cost (unpacking, weighing sixteen rows of sums a block) hardly
 * depends on the rows, and at four the tile is faster (benchmarks/bench_qkernel.py). */
#define AMX_MIN_ROWS 5

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Tiles 0 and 3: weight codes (16 x 32 bytes); 1 and 4: activations (8 x 4 * rows); 2 and 5: sums (16 x rows). */
AMX static void amx_configure(int64_t rows) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 6; t += 3) {
        c.rows[t] = PANEL, c.colsb[t] = QBLOCK;
        c.rows[t + 1] = QBLOCK / 4, c.colsb[t + 1] = (uint16_t)(4 * rows);
        c.rows[t + 2] = PANEL, c.colsb[t + 2] = (uint16_t)(4 * rows);
    }
    __asm__ volatile("" : : "m"(c) : "memory"); /* gcc 12 drops the stores otherwise: the builtin does not say it reads c */
    _tile_loadconfig(&c);
}

AMX static void amx_release(void) { _tile_release(); }

/* a->tiles, d_by_block and gsum_by_group from the rounded activations (rows <= 16). */
static void amx_layout(const QMatrix *m, int64_t rows, Int8Acts *a) {
    const int64_t blocks = m->k / QBLOCK;
    memset(a->tiles, 0, (size_t)blocks * 512);
    /* column c of a block's weight tile holds code c of unpack_panel's order (4-bit: the block's evens, then
     * its odds; 8-bit: natural), so row r's byte for it is its activation at that position */
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const int8_t *q = a->q + r * m->k;
            /* codes 0-15 of the order: the block's evens (4-bit) or its first 16; 16-31: its odds or last 16 */
            const int8_t *half[2] = {q + act_offset(m, blocks, b, 0),
                                     q + (m->bits == 4 ? act_offset(m, blocks, b, 1) : b * QBLOCK + 16)};
            for (int c = 0; c < QBLOCK; c += 4)
                memcpy(a->tiles + b * 512 + (c / 4) * 64 + r * 4, half[c / 16] + c % 16, 4);
        }
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t r = 0; r < PANEL; r++) a->d_by_block[b * PANEL + r] = r < rows ? a->d[r * blocks + b] : 0.0f;
    for (int64_t g = 0; g < m->groups; g++)
        for (int64_t r = 0; r < PANEL; r++)
            a->gsum_by_group[g * PANEL + r] = r < rows ? a->gsum[r * m->groups + g] : 0.0f;
}

/* Sixteen 4-bit rows from r0 as bytes, each block in nibble order (its 16 low nibbles, then its 16 high). */
AMX static void unpack_panel(const QMatrix *m, int64_t r0, uint8_t *out) {
    const int64_t blocks = m->k / QBLOCK;
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    const __m512i first = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), second = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
    for (int i = 0; i < PANEL; i++) {
        const uint8_t *row = m->qweight + (r0 + i) * m->row_bytes;
        uint8_t *o = out + i * m->k;
        int64_t b = 0;
        for (; b + 4 <= blocks; b += 4) { /* four blocks: 64 packed bytes */
            const __m512i v = _mm512_loadu_si512((const void *)(row + b * (QBLOCK / 2)));
            const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            _mm512_storeu_si512((void *)(o + b * QBLOCK), _mm512_permutex2var_epi64(lo, first, hi));
            _mm512_storeu_si512((void *)(o + b * QBLOCK + 64), _mm512_permutex2var_epi64(lo, second, hi));
        }
        for (; b < blocks; b++) {
            const __m128i v = _mm_loadu_si128((const __m128i *)(row + b * (QBLOCK / 2)));
            const __m128i lo = _mm_and_si128(v, _mm512_castsi512_si128(low4));
            const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm512_castsi512_si128(low4));
            _mm_storeu_si128((__m128i *)(o + b * QBLOCK), lo);
            _mm_storeu_si128((__m128i *)(o + b * QBLOCK + 16), hi);
        }
    }
}

/* acc[i] += sums[i] * s[i][g] * d (lanes: activation rows) for the panel's sixteen weight rows. */
AMX static inline __attribute__((always_inline)) void amx_weigh(const int32_t *sums, const float *scale, int64_t groups,
                                                                int64_t g, __m512 d, __m512 *acc) {
#pragma GCC unroll 16
    for (int i = 0; i < PANEL; i++)
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void *)(sums + i * 16))),
                                 _mm512_mul_ps(_mm512_set1_ps(scale[i * groups + g]), d), acc[i]);
}

/* Sixteen weight rows from r0 for `rows` (AMX_MIN_ROWS..16) activation rows; scratch: 16 k bytes (4-bit codes) and
 * 16 groups floats (the rows' scales). The tile configuration must be loaded (amx_configure(rows)). */
AMX static void panel_int8_amx(const QMatrix *m, int64_t r0, const Int8Acts *a, int64_t rows, uint8_t *codes,
                               float *scale, float *y) {
    const int64_t blocks = m->k / QBLOCK, per_group = m->group_size / QBLOCK, groups = m->groups;
    const uint8_t *w = m->qweight + r0 * m->row_bytes;
    int64_t stride = m->row_bytes;
    prefetch_rows(m, r0 + PANEL, PANEL);
    if (m->bits == 4) {
        unpack_panel(m, r0, codes);
        w = codes, stride = m->k;
    }
    hex_scales(m, r0, scale);
    int32_t sums[2][PANEL * 16] __attribute__((aligned(64)));
    __m512 acc[PANEL];
    for (int i = 0; i < PANEL; i++) acc[i] = _mm512_setzero_ps();
    /* A two-stage pipeline: block b's sums are stored and the multiply of b + 2 issued into the same tiles
     * before b's sums are weighed, while b + 1's multiply runs. */
#define PB_ISSUE(A, B, C, blk)                                                                                    \
    do {                                                                                                          \
        _tile_zero(C);                                                                                            \
        _tile_loadd(A, w + (blk) * QBLOCK, stride);                                                               \
        _tile_loadd(B, a->tiles + (blk) * 512, 64);                                                               \
        _tile_dpbusd(C, A, B);                                                                                    \
    } while (0)
    PB_ISSUE(0, 1, 2, 0);
    if (blocks > 1) PB_ISSUE(3, 4, 5, 1);
    for (int64_t b = 0; b < blocks; b += 2) {
        _tile_stored(2, sums[0], 64);
        if (b + 2 < blocks) PB_ISSUE(0, 1, 2, b + 2);
        amx_weigh(sums[0], scale, groups, b / per_group, _mm512_loadu_ps(a->d_by_block + b * PANEL), acc);
        if (b + 1 < blocks) {
            _tile_stored(5, sums[1], 64);
            if (b + 3 < blocks) PB_ISSUE(3, 4, 5, b + 3);
            amx_weigh(sums[1], scale, groups, (b + 1) / per_group, _mm512_loadu_ps(a->d_by_block + (b + 1) * PANEL), acc);
        }
    }
#undef PB_ISSUE
    /* the zero points' terms: acc[i] -= sum_g s_ig z_ig gsum[g] (gsum a vector over the rows), 16 groups'
     * s z at a time */
    for (int64_t g0 = 0; g0 < groups; g0 += 16) {
        const int64_t count = groups - g0 < 16 ? groups - g0 : 16;
        for (int i = 0; i < PANEL; i++) {
            float sz[16];
            _mm512_storeu_ps(sz, scaled_zeros16(m, r0 + i, g0));
            for (int64_t g = 0; g < count; g++)
                acc[i] = _mm512_fnmadd_ps(_mm512_set1_ps(sz[g]), _mm512_loadu_ps(a->gsum_by_group + (g0 + g) * PANEL),
                                          acc[i]);
        }
    }
    float out[PANEL][16];
    for (int i = 0; i < PANEL; i++) _mm512_storeu_ps(out[i], acc[i]);
    for (int64_t j = 0; j < rows; j++)
        for (int i = 0; i < PANEL; i++) y[j * m->n + r0 + i] = out[i][j] + (m->bias ? m->bias[r0 + i] : 0.0f);
}
#endif

VNNI static void row_times_int8_vnni(const QMatrix *m, const uint8_t *packed, const uint8_t *codes,
                                     const float *scale, const float *zero, const Int8Acts *a, int64_t first, int mb,
                                     float *sz, float *out) {
#define ROWS_CALL(n) row_dot_int8_vnni(m, packed, codes, scale, zero, a, first, n, sz, out)
    BY_ROW_COUNT(mb, ROWS_CALL);
#undef ROWS_CALL
}
#endif

/* Rows of x handled together per weight row: each dequantized weight vector
 * is reused from registers this many times. */
#define ROW_BLOCK 8

#define MAX_MATRICES QKERNEL_MAX_MATRICES

/* Output row r of matrix m for every row of x, from float activations (x and its group sums xsum). */
static void float_row(const QMatrix *m, int64_t r, const float *x, const float *xsum, int64_t rows, Scratch *s,
                      float *y) {
    unpack_row(m->qweight + r * m->row_bytes, m->bits, m->k, s->codes);
    scales_and_zeros(m, r, s->scale, s->zero, s->zero_codes);
    const float b = m->bias ? m->bias[r] : 0.0f;
#ifdef PB_X86
    if (use_avx2) {
        float out[ROW_BLOCK];
        for (int64_t i0 = 0; i0 < rows; i0 += ROW_BLOCK) {
            int mb = rows - i0 < ROW_BLOCK ? (int)(rows - i0) : ROW_BLOCK;
            if (simd_level >= LEVEL_AVX512)
                row_times_x_avx512(m, s->codes, s->scale, s->zero, x + i0 * m->k, xsum + i0 * m->groups, mb, out);
            else
                row_times_x_avx2(m, s->codes, s->scale, s->zero, x + i0 * m->k, xsum + i0 * m->groups, mb, out);
            for (int j = 0; j < mb; j++) y[(i0 + j) * m->n + r] = out[j] + b;
        }
        return;
    }
#endif
    dequant_row(m, s->codes, s->scale, s->zero, s->row);
    for (int64_t i = 0; i < rows; i++) y[i * m->n + r] = dot(s->row, x + i * m->k, m->k) + b;
}

/* Output row r of matrix m for every row of x, from int8 activations. */
static void int8_row(const QMatrix *m, int64_t r, const Int8Acts *a, int64_t rows, Scratch *s, float *y) {
    const uint8_t *packed = m->qweight + r * m->row_bytes;
    if (!(use_avx2 && m->bits == 4)) unpack_row(packed, m->bits, m->k, s->codes); /* 4-bit: read packed */
    scales_and_zeros(m, r, s->scale, s->zero, s->zero_codes);
    const float b = m->bias ? m->bias[r] : 0.0f;
    float out[ROW_BLOCK];
    for (int64_t i0 = 0; i0 < rows; i0 += ROW_BLOCK) {
        int mb = rows - i0 < ROW_BLOCK ? (int)(rows - i0) : ROW_BLOCK;
#ifdef PB_X86
        if (simd_level >= LEVEL_VNNI)
            row_times_int8_vnni(m, packed, s->codes, s->scale, s->zero, a, i0, mb, s->row, out);
        else if (use_avx2)
            row_times_int8_avx2(m, packed, s->codes, s->scale, s->zero, a, i0, mb, s->row, out);
        else
#endif
            row_dot_int8_portable(m, s->codes, s->scale, s->zero, a, i0, mb, out);
        for (int j = 0; j < mb; j++) y[(i0 + j) * m->n + r] = out[j] + b;
    }
}

/* The calling thread's buffers for one gemm_many call (rounded activations, their scales, group sums), kept
 * between calls and grown on demand: a decode step makes over a hundred calls, each of which allocated and
 * freed them. Thread-local to the caller, so two Python threads never share one; the OpenMP workers only
 * read them within the call. NULL when an allocation fails. */
typedef struct {
    void *data;
    size_t bytes;
} CallBuffer;

static _Thread_local CallBuffer call_buffers[9];

static void *grown(CallBuffer *b, size_t bytes) {
    if (b->bytes < bytes) {
        free(b->data);
        b->data = malloc(bytes);
        b->bytes = b->data ? bytes : 0;
    }
    return b->data;
}

static void *call_buffer(int which, size_t bytes) { return grown(&call_buffers[which], bytes); }

/* Output rows [r0, r1) of m (at most QUAD of them; a tile kernel takes a whole quad where the shape allows). */
static void quad_rows(const QMatrix *m, int64_t r0, int64_t r1, const float *x, const float *xq, const float *xsum,
                      const Int8Acts *a, int use_int8, int64_t rows, Scratch *s, float *y) {
#ifdef PB_X86
    if (r1 - r0 == QUAD && (use_int8 ? tile_eligible(m) : float_tile_eligible(m))) {
        if (use_int8 && simd_level >= LEVEL_VNNI && pairs_in_groups(m)) {
            if (rows == 1)
                quad_int8_vnni(m, r0, a, y);
            else
                tile_int8_vnni(m, r0, a, rows, y);
            return;
        }
        if (!use_int8 && simd_level >= LEVEL_AVX512) {
            if (rows == 1)
                quad_float_avx512(m, r0, m->bits == 4 ? xq : x, xsum, y);
            else
                tile_float_avx512(m, r0, m->bits == 4 ? xq : x, xsum, rows, y);
            return;
        }
    }
    if (use_int8 && use_avx2 && simd_level < LEVEL_VNNI && tile_eligible(m)) {
        tile_int8_avx2(m, r0, (int)(r1 - r0), a, rows, y);
        return;
    }
#endif
    for (int64_t r = r0; r < r1; r++) {
        if (use_int8)
            int8_row(m, r, a, rows, s, y);
        else
            float_row(m, r, x, xsum, rows, s, y);
    }
}

/* Each thread's scratch for the sixteen-row kernels (their scales as floats; the AMX kernel's unpacked
 * codes), grown on demand. */
static _Thread_local CallBuffer panel_codes, panel_scales;

/* y_i = x W_i^T (+ b_i) for several matrices that read the same x (q, k and v;
 * gate and up): one parallel region over all their rows instead of one each.
 * All matrices share k, bits and group size. int8_acts: round x to int8 blocks
 * first (where k and the group size allow) and use integer dot products. */
static int gemm_many(const QMatrix *ms, int count, const float *x, int64_t rows, float *const *ys, int threads,
                     int int8_acts) {
    const QMatrix *m0 = &ms[0];
    int failed = 0;
    const int use_int8 = int8_acts && int8_eligible(m0);
#ifdef PB_AMX
    const int use_amx = use_int8 && simd_level >= LEVEL_AMX && tile_eligible(m0) && rows >= AMX_MIN_ROWS && rows <= PANEL;
#else
    const int use_amx = 0;
#endif
    const int use_hex = use_int8 && simd_level >= LEVEL_VNNI && tile_eligible(m0) && rows == 1 && pairs_in_groups(m0);
    const int64_t span = use_amx || use_hex ? 16 : QUAD; /* output rows per task: sixteen, or a quad */
    int64_t first_tile[MAX_MATRICES + 1] = {0}; /* tasks of `span` output rows, none across two matrices */
    for (int i = 0; i < count; i++) first_tile[i + 1] = first_tile[i] + ceil_div(ms[i].n, span);
    Int8Acts a = {NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    float *xsum = NULL, *xq = NULL; /* xq: x in nibble order, for the 4-bit quad and tile kernels */
    if (use_int8) {
        const int64_t blocks = m0->k / QBLOCK;
        a.q = call_buffer(0, (size_t)(rows * m0->k));
        a.d = call_buffer(1, sizeof(float) * (size_t)(rows * blocks));
        a.gsum = call_buffer(2, sizeof(float) * (size_t)(rows * m0->groups));
        /* the VNNI kernels' pair scales; AMX panels that cover every output row do without */
        int need_dpair = simd_level >= LEVEL_VNNI && !use_amx;
        for (int i = 0; i < count; i++) need_dpair |= simd_level >= LEVEL_VNNI && ms[i].n % 16 != 0;
        if (need_dpair) a.dpair = call_buffer(3, sizeof(float) * 16 * (size_t)(rows * ceil_div(blocks, 2)));
        if (!a.q || !a.d || !a.gsum || (need_dpair && !a.dpair)) return -1;
        quantize_activations(m0, x, rows, &a);
        if (a.dpair) pair_scales(m0, rows, &a);
#ifdef PB_AMX
        if (use_amx) {
            a.tiles = call_buffer(6, (size_t)blocks * 512);
            a.d_by_block = call_buffer(7, sizeof(float) * PANEL * (size_t)blocks);
            a.gsum_by_group = call_buffer(8, sizeof(float) * PANEL * (size_t)m0->groups);
            if (!a.tiles || !a.d_by_block || !a.gsum_by_group) return -1;
            amx_layout(m0, rows, &a);
        }
#endif
    } else { /* group sums of x, for applying zero points once per group */
        xsum = call_buffer(4, sizeof(float) * (size_t)(rows * m0->groups));
        if (!xsum) return -1;
        if (float_tile_eligible(m0) && m0->bits == 4 && simd_level >= LEVEL_AVX512) {
            xq = call_buffer(5, sizeof(float) * (size_t)(rows * m0->k));
            if (!xq) return -1;
            for (int64_t i = 0; i < rows; i++) nibble_order(x + i * m0->k, m0->k, xq + i * m0->k);
        }
        for (int64_t i = 0; i < rows; i++)
            for (int64_t g = 0; g < m0->groups; g++) {
                int64_t lo = g * m0->group_size, hi = lo + m0->group_size < m0->k ? lo + m0->group_size : m0->k;
                double acc = 0;
                for (int64_t j = lo; j < hi; j++) acc += x[i * m0->k + j];
                xsum[i * m0->groups + g] = (float)acc;
            }
    }
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        Scratch s;
        int ok = scratch_alloc(&s, m0);
        float *scales = use_amx || use_hex ? grown(&panel_scales, sizeof(float) * 16 * (size_t)m0->groups) : NULL;
        ok = ok && (scales || !(use_amx || use_hex));
#ifdef PB_AMX
        uint8_t *codes = NULL;
        if (use_amx) {
            codes = grown(&panel_codes, (size_t)(PANEL * m0->k));
            ok = ok && codes;
            /* configured here, in the thread that runs the tiles, on every call: other code on this thread
             * (oneDNN's AMX kernels under torch) loads its own configuration and releases it */
            if (ok) amx_configure(rows);
        }
#endif
        failed = !ok;
        /* every thread must reach the work-sharing loop, even one without scratch */
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < first_tile[count]; tile++) {
            if (!ok) continue;
            int which = 0;
            while (tile >= first_tile[which + 1]) which++;
            const QMatrix *m = &ms[which];
            const int64_t r0 = (tile - first_tile[which]) * span, r1 = r0 + span < m->n ? r0 + span : m->n;
#ifdef PB_AMX
            if (use_amx && r1 - r0 == PANEL) {
                panel_int8_amx(m, r0, &a, rows, codes, scales, ys[which]);
                continue;
            }
#endif
#ifdef PB_X86
            if (use_hex && r1 - r0 == HEX) {
                hex_int8_vnni(m, r0, &a, scales, ys[which]);
                continue;
            }
#endif
            for (int64_t q0 = r0; q0 < r1; q0 += QUAD)
                quad_rows(m, q0, q0 + QUAD < r1 ? q0 + QUAD : r1, x, xq, xsum, &a, use_int8, rows, &s, ys[which]);
        }
#ifdef PB_AMX
        if (use_amx && ok) amx_release();
#endif
    }
    return failed ? -1 : 0;
}

static int dequantize(const QMatrix *m, float *out, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        Scratch s;
        int ok = scratch_alloc(&s, m);
        failed = !ok;
        /* every thread must reach the work-sharing loop, even one without scratch */
#pragma omp for schedule(static)
            for (int64_t r = 0; r < m->n; r++) {
                if (!ok) continue;
                unpack_row(m->qweight + r * m->row_bytes, m->bits, m->k, s.codes);
                scales_and_zeros(m, r, s.scale, s.zero, s.zero_codes);
                dequant_row(m, s.codes, s.scale, s.zero, out + r * m->k);
            }
    }
    return failed ? -1 : 0;
}

/* ---- Python bindings: raw pointers from torch tensors (checked in Python) ---- */

static int init_matrix(QMatrix *m, const uint8_t *qweight, const uint16_t *scales, const uint8_t *qzeros,
                       const float *bias, int64_t n, int64_t k, int bits, int64_t group_size) {
    if (n < 1 || k < 1 || group_size < 1 || !(bits == 2 || bits == 3 || bits == 4 || bits == 8)) return -1;
    m->qweight = qweight, m->scales = scales, m->qzeros = qzeros, m->bias = bias;
    m->n = n, m->k = k, m->bits = bits, m->group_size = group_size;
    m->groups = ceil_div(k, group_size);
    m->row_bytes = ceil_div(k * bits, 8);
    m->zero_row_bytes = ceil_div(m->groups * bits, 8);
    return 0;
}

static int parse_matrix(QMatrix *m, Py_ssize_t qweight, Py_ssize_t scales, Py_ssize_t qzeros, Py_ssize_t bias,
                        Py_ssize_t n, Py_ssize_t k, Py_ssize_t bits, Py_ssize_t group_size) {
    if (init_matrix(m, (const uint8_t *)qweight, (const uint16_t *)scales, (const uint8_t *)qzeros,
                    (const float *)bias, n, k, (int)bits, group_size) < 0) {
        PyErr_SetString(PyExc_ValueError, "invalid quantized matrix shape or bits");
        return -1;
    }
    return 0;
}

static PyObject *py_gemm_many(PyObject *self, PyObject *args) {
    Py_ssize_t x, rows, k, bits, group_size, threads;
    int int8_acts = 0;
    PyObject *mats;
    if (!PyArg_ParseTuple(args, "nnnnnnO|p", &x, &rows, &k, &bits, &group_size, &threads, &mats, &int8_acts))
        return NULL;
    PyObject *seq = PySequence_Fast(mats, "matrices must be a sequence of (y, qweight, scales, qzeros, bias, n)");
    if (!seq) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    if (count < 1 || count > MAX_MATRICES) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "between 1 and %d matrices, got %zd", MAX_MATRICES, count);
        return NULL;
    }
    QMatrix ms[MAX_MATRICES];
    float *ys[MAX_MATRICES];
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t y, qweight, scales, qzeros, bias, n;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "nnnnnn", &y, &qweight, &scales, &qzeros, &bias, &n) ||
            parse_matrix(&ms[i], qweight, scales, qzeros, bias, n, k, bits, group_size) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        ys[i] = (float *)y;
    }
    Py_DECREF(seq);
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = gemm_many(ms, (int)count, (const float *)x, rows, ys, threads < 1 ? 1 : (int)threads,
                                          int8_acts);
    Py_END_ALLOW_THREADS if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_dequantize(PyObject *self, PyObject *args) {
    Py_ssize_t out, qweight, scales, qzeros, n, k, bits, group_size, threads;
    if (!PyArg_ParseTuple(args, "nnnnnnnnn", &out, &qweight, &scales, &qzeros, &n, &k, &bits, &group_size, &threads))
        return NULL;
    QMatrix m;
    if (parse_matrix(&m, qweight, scales, qzeros, 0, n, k, bits, group_size) < 0) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = dequantize(&m, (float *)out, threads < 1 ? 1 : (int)threads);
    Py_END_ALLOW_THREADS if (rc < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_int8_eligible(PyObject *self, PyObject *args) {
    Py_ssize_t k, group_size;
    if (!PyArg_ParseTuple(args, "nn", &k, &group_size)) return NULL;
    return PyBool_FromLong(k % QBLOCK == 0 && group_size % QBLOCK == 0);
}

static PyObject *py_set_simd(PyObject *self, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    int wanted = -1;
    for (int i = 0; i < LEVELS; i++)
        if (strcmp(name, LEVEL_NAMES[i]) == 0) wanted = i;
    if (strcmp(name, "best") == 0) wanted = LEVELS - 1;
    if (wanted < 0) {
        PyErr_Format(PyExc_ValueError, "unknown SIMD level '%s' (portable, avx2, avxvnni, avx512, avx512vnni, amx, best)",
                     name);
        return NULL;
    }
    int best = best_level();
    simd_level = wanted < best ? wanted : best;
#ifdef PB_X86
    if (simd_level == LEVEL_AVXVNNI && !__builtin_cpu_supports("avxvnni")) simd_level = LEVEL_AVX2; /* AVX-512 alone */
#endif
    return PyUnicode_FromString(LEVEL_NAMES[simd_level]);
}

static PyObject *py_simd(PyObject *self, PyObject *noargs) { return PyUnicode_FromString(LEVEL_NAMES[simd_level]); }

static PyMethodDef methods[] = {
    {"gemm_many", py_gemm_many, METH_VARARGS,
     "gemm_many(x, rows, k, bits, group_size, threads, [(y, qweight, scales, qzeros, bias, n), ...], "
     "int8_acts=False): gemm for several matrices that read the same x, in one parallel region; int8_acts rounds "
     "x to int8 in blocks of 32 and multiplies with integer dot products (k and group_size multiples of 32)"},
    {"int8_eligible", py_int8_eligible, METH_VARARGS,
     "int8_eligible(k, group_size) -> whether gemm_many's int8 path takes this shape"},
    {"dequantize", py_dequantize, METH_VARARGS,
     "dequantize(out, qweight, scales, qzeros, n, k, bits, group_size, threads): fp32 (n, k) weight"},
    {"set_simd", py_set_simd, METH_VARARGS,
     "set_simd(level) -> the code path now in use: the narrower of `level` and what the CPU runs"},
    {"simd", py_simd, METH_NOARGS,
     "the code path in use: 'amx', 'avx512vnni', 'avx512', 'avxvnni', 'avx2' or 'portable'"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_qkernel", "Packed integer weight kernels.", -1, methods};

static const QKernelAPI c_api = {gemm_many, init_matrix};

PyMODINIT_FUNC PyInit__qkernel(void) {
    simd_level = best_level();
    PyObject *mod = PyModule_Create(&module);
    if (!mod) return NULL;
    /* The C entry points for other extensions (_qkernel.h); the capsule points at a static table. */
    PyObject *capsule = PyCapsule_New((void *)&c_api, QKERNEL_CAPSULE, NULL);
    if (!capsule || PyModule_AddObject(mod, "_C_API", capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
