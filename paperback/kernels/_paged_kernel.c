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
#include "_sum16.h"
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

/* n FP8 bytes (n % 16 == 0) times scale. A normal byte's exponent and mantissa are moved into fp32's fields and
 * its exponent rebased by an integer add; a subnormal byte (exponent 0) is its mantissa times 2^-9 (e4m3) or
 * 2^-16 (e5m2), converted as an integer: both exact, and no subnormal fp32 ever meets the multiplier (which can
 * cost a microcode assist per operand). The sign is put back last.
 * Encoding saturates, so the NaN byte (e4m3's S.1111.111, e5m2's infinities and NaNs) never occurs in a cache;
 * the scalar table handles them. */
__attribute__((target("avx512f"))) static void fp8_rows_avx512(const uint8_t *codes, int e5m2, int64_t n, float scale,
                                                               float *out) {
    const __m512 multiplier = _mm512_set1_ps(scale);
    const __m512 subnormal_step = _mm512_set1_ps(scale * (e5m2 ? 0x1p-16f : 0x1p-9f));
    const __m512i rebase = _mm512_set1_epi32((e5m2 ? 112 : 120) << 23);
    const __m512i exponent_bits = _mm512_set1_epi32(e5m2 ? 0x7c : 0x78);
    const __m512i mantissa_bits = _mm512_set1_epi32(e5m2 ? 3 : 7);
    const int shift = e5m2 ? 21 : 20;
    for (int64_t i = 0; i < n; i += 16) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + i)));
        const __m512i magnitude = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x7f)), shift);
        const __m512 normal = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_add_epi32(magnitude, rebase)), multiplier);
        const __m512 small = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, mantissa_bits)), subnormal_step);
        const __mmask16 is_small = _mm512_testn_epi32_mask(b, exponent_bits);
        const __m512 x = _mm512_mask_blend_ps(is_small, normal, small);
        const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
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

/* ---- scores from integer key codes: the query rounded to int8, VNNI dot products (AVX-512 VNNI + VBMI) ----
 *
 * Decoding a quantized key to fp32 and then multiplying costs more than the fp16 keys it replaces (about eight
 * instructions per sixteen channels before the dot product starts). Here the group's queries are rounded to
 * int8 per span of channels (as llama.cpp rounds Q to its K type's Q8 blocks), and each key's codes meet them
 * as they are: vpdpbusd multiplies four code bytes by four query bytes and sums them into an int32 lane. The
 * codes' scale and minimum are applied once per sum, not once per channel:
 *   per token and group g (INT8 / INT4 / INT2):        q.k = sum_g s_g * sum_{d in g} q_d c_d + m_g * sum_{d in g} q_d
 *   per channel, for a group of tokens (KIVI's keys):  q.k = sum_d (q_d s_d) c_d + sum_d q_d m_d
 * so for KIVI the query is rounded after multiplying by the group's channel scales (once per token group). The
 * minimums meet the unrounded query; 8-bit keys take the query in two rounds (quantize_span); the rounding
 * error's part that the codes' midpoint carries is taken out (int_query_tokens).
 *
 * Sixteen keys go through together with the keys in the lanes: their 64-channel segments (codes spread to one
 * byte each by vpermb and vpmultishiftqb, natural channel order) are transposed as a 16 x 16 matrix of 32-bit
 * words, so word w of every key sits in one vector and one vpdpbusd per query head adds channels 4w..4w+3 of
 * all sixteen keys; the transpose is shared by the group's heads. The result is the fp32 path's up to the
 * query's rounding (tests bound the difference; bench_kv_speed measures the KL it costs). */
#if defined(__x86_64__) && defined(__GNUC__)
#define INTQ __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,fma,f16c")))
#endif

enum { MAX_QUERY_GROUP = 32 }; /* query heads per KV head the integer path takes (more: the fp32 path) */
static int has_int_scores;     /* the CPU (and the SIMD switch) allow the integer paths: scores and values */
static int int_scores_on;      /* the caller chose it (set_kv_scores) */

static int int_scores_supported(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi") &&
           __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

/* Channels per query scale for integer keys of this source (0: the integer path cannot read it): a token
 * format's channel group (16 or 32, or 64 for a multiple of 64), 32 for per-channel keys. */
static int64_t int_span(const kv_source *src, int64_t dim) {
    if (dim % 64 || (src->bits != 2 && src->bits != 4 && src->bits != 8)) return 0;
    if (src->kind == SRC_CHANNEL_INT) return 32;
    if (src->kind != SRC_TOKEN_INT) return 0;
    if (src->group == 16 || src->group == 32) return src->group;
    return src->group % 64 == 0 ? 64 : 0;
}

/* The group's queries as int8 codes for one key source (scratch: int_query_floats). */
typedef struct {
    int8_t *codes, *rest;     /* (group, dim), natural channel order: q ~ codes x scale + rest x rest_scale */
    float *scale, *rest_scale; /* (group, spans): the span's steps times the attention scaling */
    float *sum;               /* (group, spans): per-token keys: scaling x the span's sum of q (fp32) */
    float *shift;             /* (group, spans): per-token keys: the rounding's known part, taken out (x key scale) */
    float *offset;            /* (group): per-channel keys: scaling x sum_d q_d m_d for the current token group */
    int64_t span, spans;
    int rounds;               /* of int8 codes: 2 for 8-bit keys, whose own rounding is fine enough to show one's */
    float center;             /* the codes' midpoint, (2^bits - 1) / 2 */
    int64_t block_row, token_group; /* per-channel keys: whose scales the codes hold (-1: none yet) */
} int_query;

static int64_t int_query_floats(int64_t group, int64_t dim) {
    return (2 * group * dim + 3) / 4 + 4 * group * (dim / 16) + group;
}

static void int_query_init(int_query *iq, float *at, int64_t group, int64_t dim, int64_t span, int bits) {
    iq->codes = (int8_t *)at;
    iq->rest = iq->codes + group * dim;
    iq->scale = at + (2 * group * dim + 3) / 4;
    iq->rest_scale = iq->scale + group * (dim / 16);
    iq->sum = iq->rest_scale + group * (dim / 16);
    iq->shift = iq->sum + group * (dim / 16);
    iq->offset = iq->shift + group * (dim / 16);
    iq->rounds = bits == 8 ? 2 : 1;
    iq->center = ((1 << bits) - 1) / 2.0f;
    iq->span = span;
    iq->spans = dim / span;
    iq->block_row = iq->token_group = -1;
}

#if defined(__x86_64__) && defined(__GNUC__)
/* n (16, 32 or 64) channels of x, times fp16 `mul` where given, as int8 codes: x ~ codes x step, each step
 * mapping the largest magnitude to 127; with two rounds, what the first leaves is rounded again (x ~ codes x step
 * + rest x rest_step), so the query carries about 16 bits: one round, as llama.cpp's Q8 blocks, cost INT8 keys
 * more KL than their own rounding (docs/kv-cache.md). The steps times scaling go to *scale, *rest_scale; scaling
 * x the channels' sum to *sum where asked, and scaling x (rounded sum - sum) to *error. */
INTQ static void quantize_span(const float *x, const uint16_t *mul, int64_t n, float scaling, int rounds,
                               int8_t *codes, int8_t *rest, float *scale, float *rest_scale, float *sum,
                               float *error) {
    __m512 v[4], top = _mm512_setzero_ps(), total = _mm512_setzero_ps();
    for (int64_t i = 0; i < n / 16; i++) {
        v[i] = _mm512_loadu_ps(x + 16 * i);
        if (mul) v[i] = _mm512_mul_ps(v[i], _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mul + 16 * i))));
        top = _mm512_max_ps(top, _mm512_abs_ps(v[i]));
        total = _mm512_add_ps(total, v[i]);
    }
    *scale = *rest_scale = 0.0f;
    __m512 left_sum = _mm512_setzero_ps(); /* what the rounds leave, summed */
    for (int round = 0; round < rounds; round++) {
        const float largest = _mm512_reduce_max_ps(top), inverse = largest > 0.0f ? 127.0f / largest : 0.0f;
        const float step = largest / 127.0f;
        int8_t *out = round ? rest : codes;
        top = left_sum = _mm512_setzero_ps();
        for (int64_t i = 0; i < n / 16; i++) {
            const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], _mm512_set1_ps(inverse)));
            _mm_storeu_si128((__m128i *)(out + 16 * i), _mm512_cvtsepi32_epi8(c));
            v[i] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(c), _mm512_set1_ps(step), v[i]); /* what is left */
            top = _mm512_max_ps(top, _mm512_abs_ps(v[i]));
            left_sum = _mm512_add_ps(left_sum, v[i]);
        }
        *(round ? rest_scale : scale) = step * scaling;
    }
    if (sum) *sum = _mm512_reduce_add_ps(total) * scaling;
    *error = -_mm512_reduce_add_ps(left_sum) * scaling;
}

/* Per-token keys: every head's codes, once per (sequence, KV head). The rounding error e (rounded q - q) meets
 * the codes c as sum e c = sum e (c - center) + center sum e, and the last term is known: it is taken out, so
 * what is left weighs the error by codes about their middle (about a quarter of the variance). */
INTQ static void int_query_tokens(int_query *iq, const float *q, int64_t group, int64_t dim, float scaling) {
    for (int64_t h = 0; h < group; h++)
        for (int64_t s = 0; s < iq->spans; s++) {
            float error;
            quantize_span(q + h * dim + s * iq->span, NULL, iq->span, scaling, iq->rounds,
                          iq->codes + h * dim + s * iq->span, iq->rest + h * dim + s * iq->span,
                          iq->scale + h * iq->spans + s, iq->rest_scale + h * iq->spans + s,
                          iq->sum + h * iq->spans + s, &error);
            iq->shift[h * iq->spans + s] = -iq->center * error;
        }
}

/* Per-channel keys: the codes of q times this token group's channel scales, and the minimums' term (with the
 * rounding's known part taken out, as for per-token keys). */
INTQ static void int_query_channels(int_query *iq, const kv_source *src, const float *q, int64_t group, int64_t dim,
                                    float scaling, int64_t block_row, int64_t block_size, int64_t token_group) {
    const int64_t at = (block_row * (block_size / src->group) + token_group) * dim;
    const uint16_t *scale = src->scale + at, *min = src->min + at;
    for (int64_t h = 0; h < group; h++) {
        __m512 offset = _mm512_setzero_ps();
        for (int64_t d = 0; d < dim; d += 16)
            offset = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * dim + d),
                                     _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(min + d))), offset);
        float shift = 0.0f;
        for (int64_t s = 0; s < iq->spans; s++) {
            float error;
            quantize_span(q + h * dim + s * iq->span, scale + s * iq->span, iq->span, scaling, iq->rounds,
                          iq->codes + h * dim + s * iq->span, iq->rest + h * dim + s * iq->span,
                          iq->scale + h * iq->spans + s, iq->rest_scale + h * iq->spans + s, NULL, &error);
            shift -= iq->center * error;
        }
        iq->offset[h] = _mm512_reduce_add_ps(offset) * scaling + shift;
    }
    iq->block_row = block_row;
    iq->token_group = token_group;
}

/* vpermb indices and vpmultishiftqb controls spreading a 64-channel segment's 2- or 4-bit codes to a byte
 * each: qword k of the result gathers the packed bytes holding channels 8k..8k+7, and its byte j takes the
 * bits of channel 8k + j (masked after). Filled at load time. */
static uint8_t spread_index[2][64]; /* [0]: 2-bit, [1]: 4-bit */

static void fill_spread_index(void) {
    for (int j = 0; j < 64; j++) {
        spread_index[0][j] = (uint8_t)(2 * (j / 8) + j % 2);
        spread_index[1][j] = (uint8_t)(4 * (j / 8) + j % 4);
    }
}

/* One row's 64-channel segment of codes (at: its first packed byte) as one byte per channel, natural order. */
INTQ static inline __attribute__((always_inline)) __m512i segment_bytes(const uint8_t *at, int bits) {
    if (bits == 8) return _mm512_loadu_si512(at);
    const __m512i packed = bits == 4 ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)at))
                                     : _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)at));
    const __m512i control = _mm512_set1_epi64(bits == 4 ? 0x1c1814100c080400LL : 0x0e0c0a0806040200LL);
    return _mm512_and_si512(
        _mm512_multishift_epi64_epi8(control, _mm512_permutexvar_epi8(_mm512_loadu_si512(spread_index[bits == 4]),
                                                                      packed)),
        _mm512_set1_epi8(bits == 4 ? 0x0f : 0x03));
}

/* Keys k < live of a run: their 64-channel segment `seg` as one code byte per channel (keys from live on: 0). */
INTQ static inline __attribute__((always_inline)) void load_segment(const uint8_t *rows, int64_t row_bytes, int bits,
                                                                    int64_t seg, int64_t live, __m512i r[16]) {
    for (int k = 0; k < 16; k++)
        r[k] = k < live ? segment_bytes(rows + k * row_bytes + seg * 8 * bits, bits) : _mm512_setzero_si512();
}

/* t[w] lane k = r[k] lane w: 32-bit pairs, then 64-bit, then 128-bit blocks twice. */
INTQ static inline __attribute__((always_inline)) void transpose16(const __m512i r[16], __m512i t[16]) {
    __m512i a[16], b[16];
    for (int i = 0; i < 8; i++) {
        a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* b[4i + j] block L: rows 4i..4i+3 at word 4L + j */
        b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int j = 0; j < 4; j++) {
        const __m512i c0 = _mm512_shuffle_i32x4(b[j], b[4 + j], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512i c1 = _mm512_shuffle_i32x4(b[j], b[4 + j], _MM_SHUFFLE(3, 2, 3, 2));
        const __m512i c2 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512i c3 = _mm512_shuffle_i32x4(b[8 + j], b[12 + j], _MM_SHUFFLE(3, 2, 3, 2));
        t[j] = _mm512_shuffle_i32x4(c0, c2, _MM_SHUFFLE(2, 0, 2, 0));
        t[4 + j] = _mm512_shuffle_i32x4(c0, c2, _MM_SHUFFLE(3, 1, 3, 1));
        t[8 + j] = _mm512_shuffle_i32x4(c1, c3, _MM_SHUFFLE(2, 0, 2, 0));
        t[12 + j] = _mm512_shuffle_i32x4(c1, c3, _MM_SHUFFLE(3, 1, 3, 1));
    }
}

/* Group g's fp16 scale (or minimum) of `live` (<= 16) consecutive keys, rows of `groups` values from p, as fp32
 * (0 past live). */
INTQ static inline __m512 token_param(const uint16_t *p, int64_t groups, int64_t g, int64_t live) {
    const __mmask16 keys_live = (__mmask16)((1u << live) - 1);
    if (groups == 1) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(keys_live, p));
    if (groups == 2) { /* 32 values, every other one */
        const __mmask32 both = live == 16 ? 0xffffffffu : (__mmask32)((1u << (2 * live)) - 1);
        const __m512i pick = _mm512_add_epi16(
            _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32, 30, 28, 26, 24, 22, 20,
                             18, 16, 14, 12, 10, 8, 6, 4, 2, 0),
            _mm512_set1_epi16((short)g));
        const __m512i values = _mm512_permutexvar_epi16(pick, _mm512_maskz_loadu_epi16(both, p));
        return _mm512_cvtph_ps(_mm512_castsi512_si256(values));
    }
    /* the 32-bit word holding the value: starting at it for the first group, else one value before (so no
     * word reaches past the row's last value), shifted down where the value is the upper half */
    const __m512i keys = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i at = _mm512_add_epi32(_mm512_mullo_epi32(keys, _mm512_set1_epi32((int)groups)),
                                        _mm512_set1_epi32((int)(g ? g - 1 : 0)));
    __m512i words = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), keys_live, at, p, 2);
    if (g) words = _mm512_srli_epi32(words, 16);
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(words));
}

/* One segment of a run for every head: sixteen vpdpbusd a head, their sums per span (spans_per_segment of
 * them, a constant in each inlined copy, so the sums stay in registers) weighted into the heads' scores. */
INTQ static inline __attribute__((always_inline)) void segment_scores(const __m512i t[16], const int_query *iq,
                                                                      int64_t heads, int64_t dim, int64_t seg,
                                                                      const int spans_per_segment,
                                                                      const int per_token, const int rounds,
                                                                      const __m512 *key_scale,
                                                                      const __m512 *key_min, __m512 *score) {
    for (int64_t h = 0; h < heads; h++) {
        __m512i sums[4], rest_sums[4];
        for (int s = 0; s < spans_per_segment; s++) sums[s] = rest_sums[s] = _mm512_setzero_si512();
        const int8_t *quads = iq->codes + h * dim + seg * 64, *rest_quads = iq->rest + h * dim + seg * 64;
#pragma GCC unroll 16
        for (int w = 0; w < 16; w++) {
            int32_t quad, rest_quad;
            memcpy(&quad, quads + 4 * w, 4);
            memcpy(&rest_quad, rest_quads + 4 * w, 4);
            const int s = w * spans_per_segment / 16;
            sums[s] = _mm512_dpbusd_epi32(sums[s], t[w], _mm512_set1_epi32(quad));
            if (rounds == 2) rest_sums[s] = _mm512_dpbusd_epi32(rest_sums[s], t[w], _mm512_set1_epi32(rest_quad));
        }
        __m512 x = score[h];
        for (int s = 0; s < spans_per_segment; s++) {
            const int64_t span = seg * spans_per_segment + s;
            __m512 dot = _mm512_mul_ps(_mm512_cvtepi32_ps(sums[s]), _mm512_set1_ps(iq->scale[h * iq->spans + span]));
            if (rounds == 2)
                dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(rest_sums[s]),
                                      _mm512_set1_ps(iq->rest_scale[h * iq->spans + span]), dot);
            if (per_token) {
                dot = _mm512_add_ps(dot, _mm512_set1_ps(iq->shift[h * iq->spans + span]));
                x = _mm512_fmadd_ps(dot, key_scale[s], x);
                x = _mm512_fmadd_ps(key_min[s], _mm512_set1_ps(iq->sum[h * iq->spans + span]), x);
            } else {
                x = _mm512_add_ps(x, dot);
            }
        }
        score[h] = x;
    }
}

/* Scaled scores of keys [slot, slot + count) of one block (its rows for this KV head from block_row) for the
 * group's `heads` queries q: score[h * stride + j]; best[h] raised to their largest. */
INTQ static void int_key_scores(const kv_source *src, int_query *iq, const float *q, float scaling,
                                int64_t block_row, int64_t block_size, int64_t slot, int64_t count, int64_t heads,
                                int64_t dim, float *score, int64_t stride, float *best) {
    const int bits = src->bits, per_token = src->kind == SRC_TOKEN_INT;
    const int64_t row_bytes = dim * bits / 8, first_row = block_row * block_size + slot;
    const int64_t groups = per_token ? dim / src->group : 0, spans_per_segment = 64 / (iq->span < 64 ? iq->span : 64);
    __m512 top[MAX_QUERY_GROUP], x[MAX_QUERY_GROUP];
    for (int64_t h = 0; h < heads; h++) top[h] = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < count;) {
        int64_t live = count - j < 16 ? count - j : 16;
        if (!per_token) { /* a run stays in one token group: one set of channel scales */
            const int64_t token_group = (slot + j) / src->group, end = (token_group + 1) * src->group - slot;
            if (live > end - j) live = end - j;
            if (iq->block_row != block_row || iq->token_group != token_group)
                int_query_channels(iq, src, q, heads, dim, scaling, block_row, block_size, token_group);
        }
        for (int64_t h = 0; h < heads; h++) x[h] = per_token ? _mm512_setzero_ps() : _mm512_set1_ps(iq->offset[h]);
        const uint8_t *rows = (const uint8_t *)src->data + (first_row + j) * row_bytes;
        for (int64_t seg = 0; seg < dim / 64; seg++) {
            __m512i r[16], t[16];
            __m512 key_scale[4], key_min[4];
            load_segment(rows, row_bytes, bits, seg, live, r);
            transpose16(r, t);
            if (per_token)
                for (int64_t s = 0; s < spans_per_segment; s++) {
                    const int64_t g = (seg * 64 + s * iq->span) / src->group;
                    key_scale[s] = token_param(src->scale + (first_row + j) * groups, groups, g, live);
                    key_min[s] = token_param(src->min + (first_row + j) * groups, groups, g, live);
                }
            /* a constant (spans, per token, rounds) in each copy, so the sums stay in registers */
            switch ((spans_per_segment * 2 + per_token) * 2 + (iq->rounds == 2)) {
            case 4: segment_scores(t, iq, heads, dim, seg, 1, 0, 1, key_scale, key_min, x); break;
            case 5: segment_scores(t, iq, heads, dim, seg, 1, 0, 2, key_scale, key_min, x); break;
            case 6: segment_scores(t, iq, heads, dim, seg, 1, 1, 1, key_scale, key_min, x); break;
            case 7: segment_scores(t, iq, heads, dim, seg, 1, 1, 2, key_scale, key_min, x); break;
            case 8: segment_scores(t, iq, heads, dim, seg, 2, 0, 1, key_scale, key_min, x); break;
            case 9: segment_scores(t, iq, heads, dim, seg, 2, 0, 2, key_scale, key_min, x); break;
            case 10: segment_scores(t, iq, heads, dim, seg, 2, 1, 1, key_scale, key_min, x); break;
            case 11: segment_scores(t, iq, heads, dim, seg, 2, 1, 2, key_scale, key_min, x); break;
            case 16: segment_scores(t, iq, heads, dim, seg, 4, 0, 1, key_scale, key_min, x); break;
            case 17: segment_scores(t, iq, heads, dim, seg, 4, 0, 2, key_scale, key_min, x); break;
            case 18: segment_scores(t, iq, heads, dim, seg, 4, 1, 1, key_scale, key_min, x); break;
            default: segment_scores(t, iq, heads, dim, seg, 4, 1, 2, key_scale, key_min, x);
            }
        }
        const __mmask16 keys_live = (__mmask16)((1u << live) - 1);
        for (int64_t h = 0; h < heads; h++) {
            _mm512_mask_storeu_ps(score + h * stride + j, keys_live, x[h]);
            top[h] = _mm512_mask_max_ps(top[h], keys_live, top[h], x[h]);
        }
        j += live;
    }
    for (int64_t h = 0; h < heads; h++) {
        const float largest = _mm512_reduce_max_ps(top[h]);
        if (largest > best[h]) best[h] = largest;
    }
}
#endif

/* ---- values from integer codes, weighted in place (per-token formats: INT8 / INT4 / INT2, KIVI's values) ----
 *
 * out_h += sum_t p_ht v_t with v_t = code_t x s_tg + m_tg over channel groups g: the scale folds into the
 * weight (p_ht s_tg, sixteen tokens at a time) and the minimum into one term per group (sum_t p_ht m_tg), so
 * each token's codes are turned to floats once for every head and meet the accumulators with one FMA per
 * sixteen channels, where decoding them to an fp32 row first cost a scale, a minimum, a store and a load
 * more. Exact in fp32 up to the order of the sums. */

/* Whether the fused path reads this value source: per-token integer codes, 64-channel segments, groups of
 * at least sixteen channels. */
static int fused_values(const kv_source *src, int64_t dim) {
    return src->kind == SRC_TOKEN_INT && dim % 64 == 0 && src->group % 16 == 0 &&
           (src->bits == 2 || src->bits == 4 || src->bits == 8);
}

/* Floats weighted_codes needs (the weights, then the minimums' terms). */
static int64_t weighted_codes_floats(int64_t group, int64_t dim, int64_t chunk) {
    return group * (dim / 16) * chunk + group * (dim / 16);
}

#if defined(__x86_64__) && defined(__GNUC__)
/* One row's 64-channel segment of codes as four vectors of floats, natural channel order. */
INTQ static inline __attribute__((always_inline)) void segment_floats(const uint8_t *at, int bits, __m512 x[4]) {
    if (bits == 8) { /* straight from memory: a widening load a vector */
        for (int v = 0; v < 4; v++)
            x[v] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(at + 16 * v))));
        return;
    }
    const __m512i bytes = segment_bytes(at, bits);
    x[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_castsi512_si128(bytes)));
    x[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(bytes, 1)));
    x[2] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(bytes, 2)));
    x[3] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(bytes, 3)));
}

/* Heads [h0, h0 + NH) over one segment: their 4 x NH accumulators in registers for every token. */
INTQ static inline __attribute__((always_inline)) void weighted_segment(float *acc, const float *weight,
                                                                        const uint8_t *rows, int64_t row_bytes,
                                                                        int bits, int64_t count, int64_t dim,
                                                                        int64_t groups, int64_t group_size,
                                                                        int64_t chunk, int64_t seg, int64_t h0,
                                                                        const int NH) {
    __m512 a[4][4];
    int64_t g[4];
    for (int v = 0; v < 4; v++) g[v] = (seg * 64 + 16 * v) / group_size;
    for (int h = 0; h < NH; h++)
        for (int v = 0; v < 4; v++) a[h][v] = _mm512_loadu_ps(acc + (h0 + h) * dim + seg * 64 + 16 * v);
    for (int64_t t = 0; t < count; t++) {
        __m512 x[4];
        segment_floats(rows + t * row_bytes + seg * 8 * bits, bits, x);
        for (int h = 0; h < NH; h++) {
            const float *w = weight + ((h0 + h) * groups) * chunk + t; /* w[g * chunk]: token t, group g */
            for (int v = 0; v < 4; v++) a[h][v] = _mm512_fmadd_ps(_mm512_set1_ps(w[g[v] * chunk]), x[v], a[h][v]);
        }
    }
    for (int h = 0; h < NH; h++)
        for (int v = 0; v < 4; v++) _mm512_storeu_ps(acc + (h0 + h) * dim + seg * 64 + 16 * v, a[h][v]);
}

/* acc_h = c_h acc_h + sum_t p[h * p_stride + t] v_t for the group's heads, v_t the value rows [first_row,
 * first_row + count) decoded on the fly; scratch: weighted_codes_floats. */
INTQ static void weighted_codes(float *acc, const float *c, const float *p, int64_t p_stride, const kv_source *src,
                                int64_t first_row, int64_t count, int64_t heads, int64_t dim, int64_t chunk,
                                float *scratch) {
    const int bits = src->bits;
    const int64_t groups = dim / src->group, row_bytes = dim * bits / 8;
    float *weight = scratch, *mins = weight + heads * groups * chunk; /* weight[(h, g), t]; mins[h, g] */
    for (int64_t h = 0; h < heads; h++)
        for (int64_t d = 0; d < dim; d += 16)
            _mm512_storeu_ps(acc + h * dim + d,
                             _mm512_mul_ps(_mm512_loadu_ps(acc + h * dim + d), _mm512_set1_ps(c[h])));
    for (int64_t g = 0; g < groups; g++) { /* sixteen tokens at a time: weights p s and the sums of p m */
        __m512 low[MAX_QUERY_GROUP];
        for (int64_t h = 0; h < heads; h++) low[h] = _mm512_setzero_ps();
        for (int64_t t = 0; t < count; t += 16) {
            const int64_t live = count - t < 16 ? count - t : 16;
            const __mmask16 keys_live = (__mmask16)((1u << live) - 1);
            const __m512 s = token_param(src->scale + (first_row + t) * groups, groups, g, live);
            const __m512 m = token_param(src->min + (first_row + t) * groups, groups, g, live);
            for (int64_t h = 0; h < heads; h++) {
                const __m512 ph = _mm512_maskz_loadu_ps(keys_live, p + h * p_stride + t);
                _mm512_mask_storeu_ps(weight + (h * groups + g) * chunk + t, keys_live, _mm512_mul_ps(ph, s));
                low[h] = _mm512_fmadd_ps(ph, m, low[h]);
            }
        }
        for (int64_t h = 0; h < heads; h++) mins[h * groups + g] = _mm512_reduce_add_ps(low[h]);
    }
    const uint8_t *rows = (const uint8_t *)src->data + first_row * row_bytes;
#define SEGMENT_CALL(NH) weighted_segment(acc, weight, rows, row_bytes, bits, count, dim, groups, src->group, chunk, \
                                         seg, h0, NH)
    for (int64_t seg = 0; seg < dim / 64; seg++)
        for (int64_t h0 = 0; h0 < heads; h0 += 4) {
            switch (heads - h0 < 4 ? heads - h0 : 4) {
            case 1: SEGMENT_CALL(1); break;
            case 2: SEGMENT_CALL(2); break;
            case 3: SEGMENT_CALL(3); break;
            default: SEGMENT_CALL(4);
            }
        }
#undef SEGMENT_CALL
    for (int64_t h = 0; h < heads; h++)
        for (int64_t d = 0; d < dim; d += 16)
            _mm512_storeu_ps(acc + h * dim + d, _mm512_add_ps(_mm512_loadu_ps(acc + h * dim + d),
                                                               _mm512_set1_ps(mins[h * groups + d / src->group])));
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
    return group * dim + 3 * group + group * chunk + 2 * chunk * dim + int_query_floats(group, dim) +
           weighted_codes_floats(group, dim, chunk) + group;
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
    float *acc = scratch, *run_max = acc + group * dim, *run_sum = run_max + group, *best = run_sum + group,
          *score = best + group, *kbuf = score + group * chunk, *vbuf = kbuf + chunk * dim;
    for (int64_t g = 0; g < group; g++) {
        run_max[g] = -INFINITY;
        run_sum[g] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * group * dim);
    /* Encoded keys meet the queries rounded to int8 where chosen and the CPU allows (int_key_scores). */
    int_query iq;
    const int64_t query_span = int_scores_on && has_int_scores && group <= MAX_QUERY_GROUP ? int_span(keys, dim) : 0;
    /* Integer value codes are weighted where they lie (weighted_codes) where the CPU allows. */
    const int fused = has_int_scores && group <= MAX_QUERY_GROUP && fused_values(values, dim);
    float *value_scratch = vbuf + chunk * dim + int_query_floats(group, dim), *rescale = value_scratch +
                           weighted_codes_floats(group, dim, chunk);
    if (query_span) {
        int_query_init(&iq, vbuf + chunk * dim, group, dim, query_span, keys->bits);
#if defined(__x86_64__) && defined(__GNUC__)
        if (keys->kind == SRC_TOKEN_INT) int_query_tokens(&iq, q, group, dim, scaling);
#endif
    }
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
            const float *k = NULL, *v = NULL;
            const int staged = stage_table && stage_table[logical] >= 0;
            if (staged) {
                const int64_t row = (stage_table[logical] * kv_heads + kv_head) * block_size + slot;
                k = load_rows(stage->keys, stage->dtype, row, count, dim, kbuf);
                v = load_rows(stage->values, stage->dtype, row, count, dim, vbuf);
            } else {
                if (query_span) {
                    for (int64_t g = 0; g < group; g++) best[g] = run_max[g];
#if defined(__x86_64__) && defined(__GNUC__)
                    int_key_scores(keys, &iq, q, scaling, table[logical] * kv_heads + kv_head, block_size, slot,
                                   count, group, dim, score, chunk, best);
#endif
                } else {
                    k = load_source(keys, table[logical], kv_head, kv_heads, block_size, slot, count, dim, kbuf);
                }
                if (!fused)
                    v = load_source(values, table[logical], kv_head, kv_heads, block_size, slot, count, dim, vbuf);
            }
            for (int64_t g = 0; g < group; g++) {
                float *scores = score + g * chunk;
                float block_max = k ? block_scores(q + g * dim, k, count, dim, scaling, scores, run_max[g]) : best[g];
                float c = expf(run_max[g] - block_max), sum = run_sum[g] * c;
                sum += exp_shifted(scores, count, block_max);
                if (v)
                    weighted_rows(acc + g * dim, c, scores, v, count, dim);
                else
                    rescale[g] = c;
                run_max[g] = block_max;
                run_sum[g] = sum;
            }
#if defined(__x86_64__) && defined(__GNUC__)
            if (!v)
                weighted_codes(acc, rescale, score, chunk, values,
                               (table[logical] * kv_heads + kv_head) * block_size + slot, count, group, dim, chunk,
                               value_scratch);
#endif
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
    has_int_scores = flag && int_scores_supported();
    return PyBool_FromLong(previous);
#else
    return PyBool_FromLong(0);
#endif
}

/* set_kv_scores(int8): encoded keys scored against int8-rounded queries (int_key_scores) or decoded to fp32 (the
 * exact reference); returns the previous choice. Call between decodes, never during one. */
static PyObject *py_set_kv_scores(PyObject *self, PyObject *args) {
    int flag;
    if (!PyArg_ParseTuple(args, "p", &flag)) return NULL;
    const int previous = int_scores_on;
    int_scores_on = flag;
    return PyBool_FromLong(previous);
}

/* Whether int8 scores are chosen (they run where int_scores_available also holds). */
static PyObject *py_kv_scores_chosen(PyObject *self, PyObject *args) { return PyBool_FromLong(int_scores_on); }

/* Whether int8 scores run here: the CPU has AVX-512 VNNI and VBMI and the SIMD paths are on. */
static PyObject *py_int_scores_available(PyObject *self, PyObject *args) {
    return PyBool_FromLong(has_int_scores);
}

static PyMethodDef methods[] = {
    {"set_kv_scores", py_set_kv_scores, METH_VARARGS,
     "set_kv_scores(int8) -> whether int8 query scores were chosen (encoded keys; where the CPU has VNNI + VBMI)"},
    {"int_scores_available", py_int_scores_available, METH_NOARGS, "whether int8 query scores can run here"},
    {"kv_scores_chosen", py_kv_scores_chosen, METH_NOARGS, "whether int8 query scores are chosen"},
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
    has_int_scores = int_scores_supported();
#endif
    fill_fp8_tables();
    fill_spread_index();
    PyObject *mod = PyModule_Create(&module);
    if (!mod) return NULL;
    /* What a source's kind and dtype numbers mean, for Python to read here rather than keep a copy of */
    if (PyModule_AddIntConstant(mod, "SOURCE_NATIVE", SRC_NATIVE) < 0 || PyModule_AddIntConstant(mod, "SOURCE_FP8", SRC_FP8) < 0
        || PyModule_AddIntConstant(mod, "SOURCE_TOKEN_INT", SRC_TOKEN_INT) < 0
        || PyModule_AddIntConstant(mod, "SOURCE_CHANNEL_INT", SRC_CHANNEL_INT) < 0
        || PyModule_AddIntConstant(mod, "DTYPE_FP32", DT_FP32) < 0 || PyModule_AddIntConstant(mod, "DTYPE_FP16", DT_FP16) < 0
        || PyModule_AddIntConstant(mod, "DTYPE_BF16", DT_BF16) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    static const PagedKernelAPI c_api = {dense_decode}; /* for other extensions: _paged_kernel.h */
    PyObject *capsule = PyCapsule_New((void *)&c_api, PAGED_KERNEL_CAPSULE, NULL);
    if (!capsule || PyModule_AddObject(mod, "_C_API", capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
