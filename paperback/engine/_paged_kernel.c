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
 *   keys, values  each a source (`kv_source`): (num_blocks, Hkv, block_size, D) rows in fp32, fp16
 *                 or bf16 (a dense cache (B, Hkv, max_len, D) is this with one block of max_len slots
 *                 per sequence), or a quantized format's fields per block, decoded a chunk at a time
 *                 where they lie: FP8 codes (e4m3 / e5m2) times a scale per layer or KV head; integer
 *                 codes packed LSB first (paperback.quantization.packing) with fp16 scale and minimum
 *                 per token and group of channels (INT8 / INT4, KIVI's values) or per channel and group
 *                 of tokens (KIVI's keys), x = code * scale + minimum (paperback.kv.codecs)
 *   tables  int64 (B, width): block ids of each sequence, logical order
 *   stage_tables  int64 (B, width) or none: a staging slot where the sequence's block is held exact
 *                 (16-bit, the quantized formats' sinks and recent window), -1 where it is read from
 *                 the source
 *   lengths int64 (B): tokens in each sequence, the new one included
 * Query head h reads KV head h / (H / Hkv). With window > 0 a query at
 * position p sees keys in (p - window, p] and the first `sink` keys.
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

#include "_paged_kernel.h"
#include "../_sum16.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

enum { DT_FP32 = PAGED_FP32, DT_FP16 = PAGED_FP16, DT_BF16 = PAGED_BF16 };

/* The widest vectors the CPU has, chosen at load time (gcc's function multiversioning). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define WIDEST __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define WIDEST
#endif

typedef uint32_t __attribute__((may_alias)) alias_u32;

#if defined(__x86_64__) && defined(__GNUC__)
static int has_avx512, has_avx2, has_f16c; /* has_avx2: AVX2 and FMA */

/* n fp16 values (n % 16 == 0) to fp32 by vcvtph2ps, exact (AVX-512F has it). */
__attribute__((target("avx512f"))) static void fp16_rows_avx512(const uint16_t *src, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i += 16)
        _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
}

/* The same eight at a time, for CPUs with F16C but no AVX-512 (every AVX2 CPU). */
__attribute__((target("avx,f16c"))) static void fp16_rows_f16c(const uint16_t *src, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
}
#endif

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
#if defined(__x86_64__) && defined(__GNUC__)
    if (has_avx512 && n % 16 == 0) {
        fp16_rows_avx512(src, n, buf);
        return buf;
    }
    if (has_f16c && n % 8 == 0) {
        fp16_rows_f16c(src, n, buf);
        return buf;
    }
#endif
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

enum { SRC_NATIVE = 0, SRC_FP8 = 1, SRC_TOKEN_INT = 2, SRC_CHANNEL_INT = 3 };

/* Where one of keys or values lives and how it is stored. */
typedef struct {
    int kind;                    /* SRC_* */
    int dtype;                   /* native: DT_*; FP8: 0 e4m3, 1 e5m2 */
    int bits;                    /* integer codes: bits per code */
    int64_t group;               /* SRC_TOKEN_INT: channels per scale; SRC_CHANNEL_INT: tokens per scale */
    const void *data;            /* native rows, FP8 codes or packed integer codes */
    const uint16_t *scale, *min; /* integer codes: fp16 */
    const float *fp8_scale;      /* FP8: one per layer, or one per KV head */
    int per_head;
} kv_source;

static float fp8_table[2][256]; /* every FP8 byte's value, e4m3 and e5m2, filled at load time */

static float half_to_float(uint16_t h) {
    uint32_t magnitude = h & 0x7fff, bits = magnitude << 13;
    float f;
    memcpy(&f, &bits, 4);
    f *= 0x1p112f; /* exact, subnormals too */
    if (magnitude >= 0x7c00) {
        bits = 0x7f800000u | ((magnitude & 0x3ff) << 13);
        memcpy(&f, &bits, 4);
    }
    return h & 0x8000 ? -f : f;
}

static void fill_fp8_tables(void) {
    for (int b = 0; b < 256; b++) {
        int e = (b >> 3) & 15, m = b & 7; /* e4m3fn: bias 7, no infinities, S.1111.111 is NaN */
        float v = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf((float)m, -9);
        if (e == 15 && m == 7) v = NAN;
        fp8_table[0][b] = b & 0x80 ? -v : v;
        fp8_table[1][b] = half_to_float((uint16_t)(b << 8)); /* e5m2 is fp16's upper byte */
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
/* Rows [row, row + count) of 2-, 4- or 8-bit integer codes decoded to x = code * scale + minimum, sixteen
 * channels at a time: the codes' bytes widened to 32-bit lanes, each lane given its code's byte (permute),
 * shifted to the code and masked; scales and minimums converted from fp16 by the hardware. `group_row` is the
 * index of row's first scale row: per token (SRC_TOKEN_INT, dim / group scales a row, group % 16 == 0) or per
 * channel (SRC_CHANNEL_INT, dim scales per group of tokens, `slot` the first row's token in its block).
 * dim % 16 == 0. */
__attribute__((target("avx512f,f16c"))) static void int_rows_avx512(const kv_source *src, int64_t row,
                                                                    int64_t head_block, int64_t block_size,
                                                                    int64_t slot, int64_t count, int64_t dim,
                                                                    float *out) {
    const int bits = src->bits;
    const int log_per_byte = bits == 8 ? 0 : bits == 4 ? 1 : 2, log_bits = bits == 8 ? 3 : bits == 4 ? 2 : 1;
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i byte_of = _mm512_srli_epi32(lane, log_per_byte);
    const __m512i shift = _mm512_slli_epi32(_mm512_and_si512(lane, _mm512_set1_epi32((1 << log_per_byte) - 1)),
                                            log_bits);
    const __m512i mask = _mm512_set1_epi32((1 << bits) - 1);
    const int64_t row_bytes = dim * bits / 8;
    for (int64_t r = 0; r < count; r++) {
        const uint8_t *packed = (const uint8_t *)src->data + (row + r) * row_bytes;
        const uint16_t *scale, *min;
        if (src->kind == SRC_TOKEN_INT) {
            scale = src->scale + (row + r) * (dim / src->group);
            min = src->min + (row + r) * (dim / src->group);
        } else {
            const int64_t at = (head_block * (block_size / src->group) + (slot + r) / src->group) * dim;
            scale = src->scale + at;
            min = src->min + at;
        }
        for (int64_t d = 0; d < dim; d += 16) {
            /* exactly the 16 codes' bytes, never past the row's end */
            const uint8_t *at = packed + d * bits / 8;
            const __m128i raw = bits == 8 ? _mm_loadu_si128((const __m128i *)at)
                                : bits == 4 ? _mm_loadl_epi64((const __m128i *)at)
                                            : _mm_cvtsi32_si128(*(const alias_u32 *)at);
            const __m512i wide = _mm512_cvtepu8_epi32(raw);
            const __m512 codes = _mm512_cvtepi32_ps(
                _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(byte_of, wide), shift), mask));
            __m512 s, m;
            if (src->kind == SRC_TOKEN_INT) {
                s = _mm512_set1_ps(_cvtsh_ss(scale[d / src->group]));
                m = _mm512_set1_ps(_cvtsh_ss(min[d / src->group]));
            } else {
                s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scale + d)));
                m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(min + d)));
            }
            _mm512_storeu_ps(out + r * dim + d, _mm512_fmadd_ps(codes, s, m));
        }
    }
}

/* n FP8 bytes (n % 16 == 0) times scale: the byte's exponent and mantissa moved into fp32's fields and rescaled
 * (exact, subnormals too), the sign put back. Encoding saturates, so the NaN byte (e4m3's S.1111.111, e5m2's
 * infinities and NaNs) never occurs in a cache; the scalar table handles them. */
__attribute__((target("avx512f"))) static void fp8_rows_avx512(const uint8_t *codes, int e5m2, int64_t n, float scale,
                                                               float *out) {
    const __m512 rescale = _mm512_set1_ps(scale * (e5m2 ? 0x1p112f : 0x1p120f));
    const int shift = e5m2 ? 21 : 20;
    for (int64_t i = 0; i < n; i += 16) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + i)));
        const __m512i magnitude = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x7f)), shift);
        const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
        const __m512 x = _mm512_mul_ps(_mm512_castsi512_ps(magnitude), rescale);
        _mm512_storeu_ps(out + i, _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x), sign)));
    }
}

/* int_rows_avx512 eight channels at a time, for AVX2 CPUs (dim % 8 == 0; per-token groups % 8 == 0). */
__attribute__((target("avx2,fma,f16c"))) static void int_rows_avx2(const kv_source *src, int64_t row,
                                                                  int64_t head_block, int64_t block_size,
                                                                  int64_t slot, int64_t count, int64_t dim,
                                                                  float *out) {
    const int bits = src->bits;
    const int log_per_byte = bits == 8 ? 0 : bits == 4 ? 1 : 2, log_bits = bits == 8 ? 3 : bits == 4 ? 2 : 1;
    const __m256i lane = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
    const __m256i byte_of = _mm256_srli_epi32(lane, log_per_byte);
    const __m256i shift = _mm256_slli_epi32(_mm256_and_si256(lane, _mm256_set1_epi32((1 << log_per_byte) - 1)),
                                            log_bits);
    const __m256i mask = _mm256_set1_epi32((1 << bits) - 1);
    const int64_t row_bytes = dim * bits / 8, groups = src->kind == SRC_TOKEN_INT ? dim / src->group : 0;
    for (int64_t r = 0; r < count; r++) {
        const uint8_t *packed = (const uint8_t *)src->data + (row + r) * row_bytes;
        const uint16_t *scale, *min;
        if (src->kind == SRC_TOKEN_INT) {
            scale = src->scale + (row + r) * groups;
            min = src->min + (row + r) * groups;
        } else {
            const int64_t at = (head_block * (block_size / src->group) + (slot + r) / src->group) * dim;
            scale = src->scale + at;
            min = src->min + at;
        }
        __m256 s = _mm256_setzero_ps(), m = _mm256_setzero_ps();
        int64_t group_end = 0; /* per token: where the next group's scale starts (no division per step) */
        for (int64_t d = 0; d < dim; d += 8) {
            /* exactly the 8 codes' bytes, never past the row's end */
            const uint8_t *at = packed + d * bits / 8;
            uint64_t word = 0; /* 8 codes of `bits` bits are `bits` bytes; fixed sizes, so no call */
            if (bits == 8)
                memcpy(&word, at, 8);
            else if (bits == 4)
                memcpy(&word, at, 4);
            else
                memcpy(&word, at, 2);
            const __m256i wide = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)word));
            const __m256 codes = _mm256_cvtepi32_ps(
                bits == 8 ? wide
                          : _mm256_and_si256(_mm256_srlv_epi32(_mm256_permutevar8x32_epi32(wide, byte_of), shift),
                                             mask));
            if (src->kind == SRC_TOKEN_INT) {
                if (d == group_end) {
                    s = _mm256_set1_ps(_cvtsh_ss(scale[d / src->group]));
                    m = _mm256_set1_ps(_cvtsh_ss(min[d / src->group]));
                    group_end += src->group;
                }
            } else {
                s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + d)));
                m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(min + d)));
            }
            _mm256_storeu_ps(out + r * dim + d, _mm256_fmadd_ps(codes, s, m));
        }
    }
}

/* fp8_rows_avx512 eight at a time (n % 8 == 0). */
__attribute__((target("avx2"))) static void fp8_rows_avx2(const uint8_t *codes, int e5m2, int64_t n, float scale,
                                                         float *out) {
    const __m256 rescale = _mm256_set1_ps(scale * (e5m2 ? 0x1p112f : 0x1p120f));
    const int shift = e5m2 ? 21 : 20;
    for (int64_t i = 0; i < n; i += 8) {
        uint64_t eight;
        memcpy(&eight, codes + i, 8);
        const __m256i b = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)eight));
        const __m256i magnitude = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7f)), shift);
        const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
        const __m256 x = _mm256_mul_ps(_mm256_castsi256_ps(magnitude), rescale);
        _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(x), sign)));
    }
}
#endif

/* codes of one packed row as floats: code j at bit offset bits * j, LSB first. */
static inline __attribute__((always_inline)) void unpack_row(const uint8_t *packed, int bits, int64_t dim,
                                                             float *out) {
    if (bits == 8) {
        for (int64_t d = 0; d < dim; d++) out[d] = packed[d];
    } else if (bits == 4) {
        for (int64_t d = 0; d < dim; d++) out[d] = (packed[d >> 1] >> ((d & 1) * 4)) & 15;
    } else if (bits == 2) {
        for (int64_t d = 0; d < dim; d++) out[d] = (packed[d >> 2] >> ((d & 3) * 2)) & 3;
    } else {
        const uint32_t mask = (1u << bits) - 1;
        for (int64_t d = 0; d < dim; d++) {
            int64_t bit = d * bits, byte = bit >> 3;
            uint32_t word = packed[byte];
            if ((bit & 7) + bits > 8) word |= (uint32_t)packed[byte + 1] << 8; /* the code runs on */
            out[d] = (word >> (bit & 7)) & mask;
        }
    }
}

/* Slots [slot, slot + count) of a block's rows for one KV head, as fp32 (count, dim): in place for fp32 rows,
 * else decoded into buf. */
static inline __attribute__((always_inline)) const float *load_source(const kv_source *src, int64_t block,
                                                                      int64_t kv_head, int64_t kv_heads,
                                                                      int64_t block_size, int64_t slot,
                                                                      int64_t count, int64_t dim, float *buf) {
    const int64_t row = (block * kv_heads + kv_head) * block_size + slot;
    if (src->kind == SRC_NATIVE) return load_rows(src->data, src->dtype, row, count, dim, buf);
    if (src->kind == SRC_FP8) {
        const uint8_t *codes = (const uint8_t *)src->data + row * dim;
        const float *table = fp8_table[src->dtype];
        const float scale = src->fp8_scale[src->per_head ? kv_head : 0];
#if defined(__x86_64__) && defined(__GNUC__)
        if (has_avx512 && dim % 16 == 0) {
            fp8_rows_avx512(codes, src->dtype, count * dim, scale, buf);
            return buf;
        }
        if (has_avx2 && dim % 8 == 0) {
            fp8_rows_avx2(codes, src->dtype, count * dim, scale, buf);
            return buf;
        }
#endif
        for (int64_t i = 0; i < count * dim; i++) buf[i] = table[codes[i]] * scale;
        return buf;
    }
#if defined(__x86_64__) && defined(__GNUC__)
    if (has_avx512 && dim % 16 == 0 && (src->bits == 2 || src->bits == 4 || src->bits == 8) &&
        (src->kind == SRC_CHANNEL_INT || src->group % 16 == 0)) {
        int_rows_avx512(src, row, block * kv_heads + kv_head, block_size, slot, count, dim, buf);
        return buf;
    }
    if (has_avx2 && dim % 8 == 0 && (src->bits == 2 || src->bits == 4 || src->bits == 8) &&
        (src->kind == SRC_CHANNEL_INT || src->group % 8 == 0)) {
        int_rows_avx2(src, row, block * kv_heads + kv_head, block_size, slot, count, dim, buf);
        return buf;
    }
#endif
    const int64_t row_bytes = (dim * src->bits + 7) / 8;
    if (src->kind == SRC_TOKEN_INT) { /* one scale and minimum per token and group of channels */
        const int64_t groups = dim / src->group;
        for (int64_t r = 0; r < count; r++) {
            float *x = buf + r * dim;
            unpack_row((const uint8_t *)src->data + (row + r) * row_bytes, src->bits, dim, x);
            const uint16_t *scale = src->scale + (row + r) * groups, *min = src->min + (row + r) * groups;
            for (int64_t g = 0; g < groups; g++) {
                const float s = half_to_float(scale[g]), m = half_to_float(min[g]);
                for (int64_t d = g * src->group; d < (g + 1) * src->group; d++) x[d] = x[d] * s + m;
            }
        }
        return buf;
    }
    /* one scale and minimum per channel and group of tokens, converted once per group */
    float scale[dim], min[dim];
    int64_t converted = -1;
    for (int64_t r = 0; r < count; r++) {
        const int64_t token_group = (slot + r) / src->group;
        if (token_group != converted) {
            const int64_t at = ((block * kv_heads + kv_head) * (block_size / src->group) + token_group) * dim;
            for (int64_t d = 0; d < dim; d++) {
                scale[d] = half_to_float(src->scale[at + d]);
                min[d] = half_to_float(src->min[at + d]);
            }
            converted = token_group;
        }
        float *x = buf + r * dim;
        unpack_row((const uint8_t *)src->data + (row + r) * row_bytes, src->bits, dim, x);
        for (int64_t d = 0; d < dim; d++) x[d] = x[d] * scale[d] + min[d];
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
#endif

#if defined(__x86_64__) && defined(__GNUC__)
static float exp_shifted_avx2(float *x, int64_t count, float shift); /* with the AVX2 loops below */
#endif

static float exp_shifted(float *x, int64_t count, float shift) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (has_avx512) return exp_shifted_avx512(x, count, shift);
    if (has_avx2) return exp_shifted_avx2(x, count, shift);
#endif
    float total = 0.0f;
    for (int64_t j = 0; j < count; j++) total += x[j] = expf(x[j] - shift);
    return total;
}

/* score[j] = scaling * q.k_j for j < count; returns the largest of them and `floor`. */
#if defined(__x86_64__) && defined(__GNUC__)
/* q.k for one key as 16 partial sums (dim % 16 == 0). */
__attribute__((target("avx512f"))) static inline __m512 partial_dot(const float *q, const float *k, int64_t dim) {
    __m512 s = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
    for (int64_t d = 16; d < dim; d += 16) s = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + d), s);
    return s;
}

__attribute__((target("avx512f"))) static float block_scores_avx512(const float *q, const float *k, int64_t count,
                                                                    int64_t dim, float scaling, float *score,
                                                                    float floor) {
    __m512 best = _mm512_set1_ps(floor);
    const __m512 scale = _mm512_set1_ps(scaling);
    int64_t j = 0;
    for (; j + 16 <= count; j += 16) { /* sixteen keys, their scores in one vector */
        __m512 partial[16];
        for (int i = 0; i < 16; i++) partial[i] = partial_dot(q, k + (j + i) * dim, dim);
        const __m512 s = _mm512_mul_ps(sum16(partial), scale);
        _mm512_storeu_ps(score + j, s);
        best = _mm512_max_ps(best, s);
    }
    float top = _mm512_reduce_max_ps(best);
    for (; j < count; j++) {
        score[j] = _mm512_reduce_add_ps(partial_dot(q, k + j * dim, dim)) * scaling;
        if (score[j] > top) top = score[j];
    }
    return top;
}

/* a[0:16W) = c a + sum_j p[j] v_j[0:16W) for W = 1..4 vectors, rows j of stride `dim`: each vector of a stays in
 * a register, over even and odd rows apart, so up to eight independent multiply-add chains run where one chain
 * per vector waited on the multiply-add's latency every row. W is a constant in each inlined copy, so the
 * accumulators are registers, not an array in memory. */
__attribute__((target("avx512f"))) static inline __attribute__((always_inline)) void
weighted_span(float *a, float c, const float *p, const float *v, int64_t count, int64_t dim, const int W) {
    __m512 even[4], odd[4];
    for (int b = 0; b < W; b++) {
        even[b] = _mm512_mul_ps(_mm512_loadu_ps(a + 16 * b), _mm512_set1_ps(c));
        odd[b] = _mm512_setzero_ps();
    }
    int64_t j = 0;
    for (; j + 2 <= count; j += 2) {
        const __m512 p0 = _mm512_set1_ps(p[j]), p1 = _mm512_set1_ps(p[j + 1]);
        const float *v0 = v + j * dim, *v1 = v0 + dim;
        for (int b = 0; b < W; b++) {
            even[b] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v0 + 16 * b), even[b]);
            odd[b] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(v1 + 16 * b), odd[b]);
        }
    }
    if (j < count)
        for (int b = 0; b < W; b++)
            even[b] = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), _mm512_loadu_ps(v + j * dim + 16 * b), even[b]);
    for (int b = 0; b < W; b++) _mm512_storeu_ps(a + 16 * b, _mm512_add_ps(even[b], odd[b]));
}

/* a = c a + sum_j p[j] v_j, 64 lanes of a at a time (dim % 16 == 0). */
__attribute__((target("avx512f"))) static void weighted_rows_avx512(float *a, float c, const float *p,
                                                                    const float *v, int64_t count, int64_t dim) {
    for (int64_t d0 = 0; d0 < dim; d0 += 64) {
        switch (dim - d0 < 64 ? (dim - d0) / 16 : 4) {
        case 4: weighted_span(a + d0, c, p, v + d0, count, dim, 4); break;
        case 3: weighted_span(a + d0, c, p, v + d0, count, dim, 3); break;
        case 2: weighted_span(a + d0, c, p, v + d0, count, dim, 2); break;
        default: weighted_span(a + d0, c, p, v + d0, count, dim, 1);
        }
    }
}

/* ---- the same three loops for CPUs with AVX2 and FMA but no AVX-512 (every x86 CPU of the last decade) ---- */

/* Lane i = the sum of v[i]'s 8 lanes, for 8 vectors at once (hadd within 128-bit halves, then across them). */
__attribute__((target("avx2,fma"))) static inline __m256 sum8(const __m256 v[8]) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

__attribute__((target("avx2,fma"))) static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

__attribute__((target("avx2,fma"))) static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* q.k for one key as 8 partial sums (dim % 8 == 0), two chains. */
__attribute__((target("avx2,fma"))) static inline __m256 partial_dot8(const float *q, const float *k, int64_t dim) {
    __m256 s = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k));
    for (int64_t d = 8; d < dim; d += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), s);
    return s;
}

__attribute__((target("avx2,fma"))) static float block_scores_avx2(const float *q, const float *k, int64_t count,
                                                                  int64_t dim, float scaling, float *score,
                                                                  float floor) {
    __m256 best = _mm256_set1_ps(floor);
    const __m256 scale = _mm256_set1_ps(scaling);
    int64_t j = 0;
    for (; j + 8 <= count; j += 8) { /* eight keys, their scores in one vector */
        __m256 partial[8];
        for (int i = 0; i < 8; i++) partial[i] = partial_dot8(q, k + (j + i) * dim, dim);
        const __m256 s = _mm256_mul_ps(sum8(partial), scale);
        _mm256_storeu_ps(score + j, s);
        best = _mm256_max_ps(best, s);
    }
    float top = hmax8(best);
    for (; j < count; j++) {
        score[j] = hsum8(partial_dot8(q, k + j * dim, dim)) * scaling;
        if (score[j] > top) top = score[j];
    }
    return top;
}

/* exp_shifted_avx512's series, eight at a time; 2^n built in the exponent bits, and scores more than 87 below
 * the shift (whose exp fp32 would flush toward 0 anyway, beside the 1 of the largest) give 0. */
__attribute__((target("avx2,fma"))) static float exp_shifted_avx2(float *x, int64_t count, float shift) {
    const __m256 log2e = _mm256_set1_ps(1.44269504f), ln2_hi = _mm256_set1_ps(0.693145751953125f),
                 ln2_lo = _mm256_set1_ps(1.428606765330187e-06f), lowest = _mm256_set1_ps(-87.0f),
                 m = _mm256_set1_ps(shift);
    __m256 total = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= count; j += 8) {
        const __m256 raw = _mm256_sub_ps(_mm256_loadu_ps(x + j), m);
        const __m256 t = _mm256_max_ps(raw, lowest);
        const __m256 n = _mm256_round_ps(_mm256_mul_ps(t, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256 r = _mm256_fnmadd_ps(n, ln2_lo, _mm256_fnmadd_ps(n, ln2_hi, t));
        __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
        const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
        __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
        e = _mm256_and_ps(e, _mm256_cmp_ps(raw, lowest, _CMP_GE_OQ));
        _mm256_storeu_ps(x + j, e);
        total = _mm256_add_ps(total, e);
    }
    float sum = hsum8(total);
    for (; j < count; j++) sum += x[j] = expf(x[j] - shift);
    return sum;
}

/* weighted_span with 8-lane vectors: W = 1..4 of them, even and odd rows apart. */
__attribute__((target("avx2,fma"))) static inline __attribute__((always_inline)) void
weighted_span8(float *a, float c, const float *p, const float *v, int64_t count, int64_t dim, const int W) {
    __m256 even[4], odd[4];
    for (int b = 0; b < W; b++) {
        even[b] = _mm256_mul_ps(_mm256_loadu_ps(a + 8 * b), _mm256_set1_ps(c));
        odd[b] = _mm256_setzero_ps();
    }
    int64_t j = 0;
    for (; j + 2 <= count; j += 2) {
        const __m256 p0 = _mm256_set1_ps(p[j]), p1 = _mm256_set1_ps(p[j + 1]);
        const float *v0 = v + j * dim, *v1 = v0 + dim;
        for (int b = 0; b < W; b++) {
            even[b] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0 + 8 * b), even[b]);
            odd[b] = _mm256_fmadd_ps(p1, _mm256_loadu_ps(v1 + 8 * b), odd[b]);
        }
    }
    if (j < count)
        for (int b = 0; b < W; b++)
            even[b] = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(v + j * dim + 8 * b), even[b]);
    for (int b = 0; b < W; b++) _mm256_storeu_ps(a + 8 * b, _mm256_add_ps(even[b], odd[b]));
}

/* a = c a + sum_j p[j] v_j, 32 lanes of a at a time (dim % 8 == 0). */
__attribute__((target("avx2,fma"))) static void weighted_rows_avx2(float *a, float c, const float *p, const float *v,
                                                                  int64_t count, int64_t dim) {
    for (int64_t d0 = 0; d0 < dim; d0 += 32) {
        switch (dim - d0 < 32 ? (dim - d0) / 8 : 4) {
        case 4: weighted_span8(a + d0, c, p, v + d0, count, dim, 4); break;
        case 3: weighted_span8(a + d0, c, p, v + d0, count, dim, 3); break;
        case 2: weighted_span8(a + d0, c, p, v + d0, count, dim, 2); break;
        default: weighted_span8(a + d0, c, p, v + d0, count, dim, 1);
        }
    }
}
#endif

static float block_scores(const float *q, const float *k, int64_t count, int64_t dim, float scaling, float *score,
                          float floor) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (has_avx512 && dim % 16 == 0) return block_scores_avx512(q, k, count, dim, scaling, score, floor);
    if (has_avx2 && dim % 8 == 0) return block_scores_avx2(q, k, count, dim, scaling, score, floor);
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
    if (has_avx2 && dim % 8 == 0) {
        weighted_rows_avx2(a, c, p, v, count, dim);
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

/* Exact (16-bit) blocks of quantized layers, by staging slot: (slots, Hkv, block_size, D). */
typedef struct {
    const void *keys, *values;
    int dtype;
} kv_stage;

/* One (sequence, KV head) over the visible keys in positions [from, to): into out normalized, or, where partial
 * is given, its unnormalized output, running maxima and sums there (group * dim + 2 * group floats) for
 * merge_splits. */
WIDEST static void attend_one(const float *q, float *out, const kv_source *keys, const kv_source *values,
                              const kv_stage *stage, const int64_t *table, const int64_t *stage_table,
                              int64_t length, int64_t kv_head, int64_t kv_heads, int64_t group, int64_t dim,
                              int64_t block_size, float scaling, int64_t window, int64_t sink, int64_t from,
                              int64_t to, float *scratch, float *partial) {
    const int64_t chunk = block_size < CHUNK ? block_size : CHUNK;
    float *acc = scratch, *run_max = acc + group * dim, *run_sum = run_max + group, *score = run_sum + group,
          *kbuf = score + chunk, *vbuf = kbuf + chunk * dim;
    for (int64_t g = 0; g < group; g++) {
        run_max[g] = -INFINITY;
        run_sum[g] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * group * dim);
    /* Visible keys: [0, sink) and [lo, length), the window's start lo; one span where the sinks reach it. */
    const int64_t start = window > 0 && length > window ? length - window : 0, lo = sink >= start ? 0 : start;
    int64_t spans[2][2] = {{0, sink < lo ? sink : 0}, {lo, length}};
    for (int span = 0; span < 2; span++) { /* this task's part of them */
        if (spans[span][0] < from) spans[span][0] = from;
        if (spans[span][1] > to) spans[span][1] = to;
    }
    for (int span = 0; span < 2; span++) {
        /* The visible slots of a block a chunk at a time: their scores, one rescale, then their values. */
        for (int64_t first = spans[span][0]; first < spans[span][1];) {
            const int64_t logical = first / block_size, slot = first % block_size;
            int64_t count = block_size - slot;
            if (count > chunk) count = chunk;
            if (first + count > spans[span][1]) count = spans[span][1] - first;
            const float *k, *v;
            if (stage_table && stage_table[logical] >= 0) {
                const int64_t row = (stage_table[logical] * kv_heads + kv_head) * block_size + slot;
                k = load_rows(stage->keys, stage->dtype, row, count, dim, kbuf);
                v = load_rows(stage->values, stage->dtype, row, count, dim, vbuf);
            } else {
                k = load_source(keys, table[logical], kv_head, kv_heads, block_size, slot, count, dim, kbuf);
                v = load_source(values, table[logical], kv_head, kv_heads, block_size, slot, count, dim, vbuf);
            }
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
    }
    if (partial) {
        memcpy(partial, acc, sizeof(float) * (group * dim + 2 * group)); /* acc, run_max, run_sum lie together */
        return;
    }
    for (int64_t g = 0; g < group; g++) {
        float inv = run_sum[g] > 0.0f ? 1.0f / run_sum[g] : 0.0f;
        for (int64_t d = 0; d < dim; d++) out[g * dim + d] = acc[g * dim + d] * inv;
    }
}

/* out = the softmax-weighted merge of `splits` partial results of one (sequence, KV head): each split's output
 * and sum rescaled by e^(its max - the overall max), as flash-decoding combines them. */
static void merge_splits(const float *partial, int64_t splits, int64_t group, int64_t dim, float *out) {
    const int64_t stride = group * dim + 2 * group;
    for (int64_t g = 0; g < group; g++) {
        float top = -INFINITY, total = 0.0f;
        for (int64_t s = 0; s < splits; s++) top = fmaxf(top, partial[s * stride + group * dim + g]);
        for (int64_t d = 0; d < dim; d++) out[g * dim + d] = 0.0f;
        for (int64_t s = 0; s < splits; s++) {
            const float *p = partial + s * stride, m = p[group * dim + g];
            if (m == -INFINITY) continue; /* no visible key in this split */
            const float w = expf(m - top);
            total += p[group * dim + group + g] * w;
            for (int64_t d = 0; d < dim; d++) out[g * dim + d] += p[g * dim + d] * w;
        }
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (int64_t d = 0; d < dim; d++) out[g * dim + d] *= inv;
    }
}

/* A source from its Python tuple (kind, dtype, bits, group, data, scale, min, fp8 scale, per head). */
static int parse_source(PyObject *tuple, kv_source *src, int64_t dim, int64_t block_size) {
    unsigned long long data, scale, min, fp8_scale;
    long long group;
    if (!PyArg_ParseTuple(tuple, "iiiLKKKKi", &src->kind, &src->dtype, &src->bits, &group, &data, &scale, &min,
                          &fp8_scale, &src->per_head))
        return -1;
    src->group = group;
    src->data = (const void *)(uintptr_t)data;
    src->scale = (const uint16_t *)(uintptr_t)scale;
    src->min = (const uint16_t *)(uintptr_t)min;
    src->fp8_scale = (const float *)(uintptr_t)fp8_scale;
    int ok = data != 0;
    switch (src->kind) {
    case SRC_NATIVE: ok = ok && src->dtype >= DT_FP32 && src->dtype <= DT_BF16; break;
    case SRC_FP8: ok = ok && (src->dtype == 0 || src->dtype == 1) && fp8_scale; break;
    case SRC_TOKEN_INT: ok = ok && src->bits >= 1 && src->bits <= 8 && group > 0 && dim % group == 0 && scale && min; break;
    case SRC_CHANNEL_INT: ok = ok && src->bits >= 1 && src->bits <= 8 && group > 0 && block_size % group == 0 && scale && min; break;
    default: ok = 0;
    }
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "paged decode: bad key or value source");
        return -1;
    }
    return 0;
}

/* A (sequence, KV head) is split along its positions when there are fewer of them than two per thread (a
 * sequence or two, and few KV heads: SmolLM2 has 3, Gemma 3 one), so every thread has work; a split keeps
 * at least this many positions. */
#define SPLIT_MIN 256

static int64_t split_count(int64_t tasks, const int64_t *lengths, int64_t batch, int threads) {
    int64_t longest = 0;
    for (int64_t b = 0; b < batch; b++) longest = lengths[b] > longest ? lengths[b] : longest;
    if (threads < 2 || tasks >= 2 * threads || longest < 2 * SPLIT_MIN) return 1;
    int64_t splits = (2 * threads + tasks - 1) / tasks;
    return splits < longest / SPLIT_MIN ? splits : longest / SPLIT_MIN;
}

/* Every sequence's new query over its blocks, one task per (sequence, KV head), or per part of its positions
 * (split_count) merged after; 0, or -1 out of memory. */
static int decode_batch(const float *q, float *out, const kv_source *keys, const kv_source *values,
                        const kv_stage *stage, const int64_t *tables, const int64_t *stage_tables,
                        const int64_t *lengths, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
                        int64_t block_size, int64_t width, float scaling, int64_t window, int64_t sink) {
    int64_t group = heads / kv_heads, tasks = batch * kv_heads;
    int64_t scratch_floats = scratch_size(group, dim, block_size);
#ifdef _OPENMP
    const int threads = omp_get_max_threads();
#else
    const int threads = 1;
#endif
    const int64_t splits = split_count(tasks, lengths, batch, threads), stride = group * dim + 2 * group;
    float *partials = splits > 1 ? malloc(sizeof(float) * (size_t)(tasks * splits * stride)) : NULL;
    if (splits > 1 && !partials) return -1;
    int failed = 0;
#pragma omp parallel
    {
        float *scratch = malloc(sizeof(float) * scratch_floats);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic)
        for (int64_t t = 0; t < tasks * splits; t++) {
            if (!scratch) continue;
            const int64_t task = t / splits, s = t % splits, b = task / kv_heads, h = task % kv_heads;
            /* part s of [0, length), cut at multiples of 64 positions (the kernel's chunk) */
            const int64_t from = lengths[b] * s / splits / CHUNK * CHUNK;
            const int64_t to = s + 1 == splits ? lengths[b] : lengths[b] * (s + 1) / splits / CHUNK * CHUNK;
            attend_one(q + (b * heads + h * group) * dim, out + (b * heads + h * group) * dim, keys, values,
                       stage, tables + b * width, stage_tables ? stage_tables + b * width : NULL, lengths[b],
                       h, kv_heads, group, dim, block_size, scaling, window, sink, from, to, scratch,
                       partials ? partials + t * stride : NULL);
        }
        if (partials) {
#pragma omp for schedule(static)
            for (int64_t task = 0; task < tasks; task++) {
                const int64_t b = task / kv_heads, h = task % kv_heads;
                merge_splits(partials + task * splits * stride, splits, group, dim,
                             out + (b * heads + h * group) * dim);
            }
        }
        free(scratch);
    }
    free(partials);
    return failed ? -1 : 0;
}

/* A dense cache as one block per row (PagedKernelAPI.dense_decode). */
#define DENSE_MAX_BATCH 64
static int dense_decode(const float *q, float *out, const void *keys, const void *values, int dtype, int64_t batch,
                        int64_t heads, int64_t kv_heads, int64_t dim, int64_t slots, int64_t length, float scaling,
                        int64_t window) {
    if (batch > DENSE_MAX_BATCH || dtype < DT_FP32 || dtype > DT_BF16) return -1;
    int64_t tables[DENSE_MAX_BATCH], lengths[DENSE_MAX_BATCH];
    for (int64_t b = 0; b < batch; b++) tables[b] = b, lengths[b] = length;
    const kv_source k = {SRC_NATIVE, dtype, 0, 0, keys, NULL, NULL, NULL, 0};
    const kv_source v = {SRC_NATIVE, dtype, 0, 0, values, NULL, NULL, NULL, 0};
    const kv_stage stage = {NULL, NULL, DT_FP32};
    return decode_batch(q, out, &k, &v, &stage, tables, NULL, lengths, batch, heads, kv_heads, dim, slots, 1,
                        scaling, window, 0);
}

static PyObject *py_decode(PyObject *self, PyObject *args) {
    unsigned long long q_ptr, out_ptr, tables_ptr, stage_tables_ptr, lengths_ptr, stage_keys, stage_values;
    long long batch, heads, kv_heads, dim, block_size, width, window, sink;
    int stage_dtype;
    float scaling;
    PyObject *key_tuple, *value_tuple;
    if (!PyArg_ParseTuple(args, "KKOO(KKi)KKKLLLLLLfLL", &q_ptr, &out_ptr, &key_tuple, &value_tuple, &stage_keys,
                          &stage_values, &stage_dtype, &tables_ptr, &stage_tables_ptr, &lengths_ptr, &batch, &heads,
                          &kv_heads, &dim, &block_size, &width, &scaling, &window, &sink))
        return NULL;
    if (kv_heads <= 0 || heads % kv_heads || dim <= 0 || block_size <= 0 || window < 0 || sink < 0 ||
        (stage_tables_ptr && (!stage_keys || !stage_values || stage_dtype < DT_FP32 || stage_dtype > DT_BF16))) {
        PyErr_SetString(PyExc_ValueError, "paged decode: bad shape or staging");
        return NULL;
    }
    kv_source keys, values;
    if (parse_source(key_tuple, &keys, dim, block_size) || parse_source(value_tuple, &values, dim, block_size))
        return NULL;
    const kv_stage stage = {(const void *)(uintptr_t)stage_keys, (const void *)(uintptr_t)stage_values, stage_dtype};
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = decode_batch((const float *)(uintptr_t)q_ptr, (float *)(uintptr_t)out_ptr, &keys, &values, &stage,
                          (const int64_t *)(uintptr_t)tables_ptr, (const int64_t *)(uintptr_t)stage_tables_ptr,
                          (const int64_t *)(uintptr_t)lengths_ptr, batch, heads, kv_heads, dim, block_size, width,
                          scaling, window, sink);
    Py_END_ALLOW_THREADS
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* use_avx512(flag): the AVX-512, AVX2 and F16C paths on (where the CPU has them) or off (the portable C, which tests
 * run too); returns whether they were on. Call between decodes, never during one. */
static PyObject *py_use_avx512(PyObject *self, PyObject *args) {
    int flag;
    if (!PyArg_ParseTuple(args, "p", &flag)) return NULL;
#if defined(__x86_64__) && defined(__GNUC__)
    const int previous = has_avx512 || has_avx2 || has_f16c;
    has_avx512 = flag && __builtin_cpu_supports("avx512f");
    has_avx2 = flag && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    has_f16c = flag && __builtin_cpu_supports("f16c");
    return PyBool_FromLong(previous);
#else
    return PyBool_FromLong(0);
#endif
}

static PyMethodDef methods[] = {
    {"use_avx512", py_use_avx512, METH_VARARGS, "use_avx512(flag) -> whether the SIMD (AVX-512, AVX2, F16C) paths were on"},
    {"decode", py_decode, METH_VARARGS,
     "decode(q, out, key_source, value_source, (stage_keys, stage_values, stage_dtype), tables, stage_tables, "
     "lengths, B, H, Hkv, D, block_size, width, scaling, window, sink); a source is (kind, dtype, bits, group, "
     "data, scale, min, fp8_scale, per_head), pointers as integers (0: none)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_paged_kernel", "Paged decode attention on CPU.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__paged_kernel(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    has_avx512 = __builtin_cpu_supports("avx512f"); /* decided once, before any threads */
    has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    has_f16c = __builtin_cpu_supports("f16c");
#endif
    fill_fp8_tables();
    PyObject *mod = PyModule_Create(&module);
    if (!mod) return NULL;
    static const PagedKernelAPI c_api = {dense_decode}; /* for other extensions: _paged_kernel.h */
    PyObject *capsule = PyCapsule_New((void *)&c_api, PAGED_KERNEL_CAPSULE, NULL);
    if (!capsule || PyModule_AddObject(mod, "_C_API", capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
