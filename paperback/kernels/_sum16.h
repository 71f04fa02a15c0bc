/* Sixteen horizontal sums at once, shared by the C kernels (_paged_kernel, _qkernel). */
#ifndef PAPERBACK_SUM16_H
#define PAPERBACK_SUM16_H

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

/* Lane i = the sum of v[i]'s 16 lanes, for 16 vectors at once: 45 shuffles and adds instead of 16 horizontal
 * reductions of about 10 each, which made the score loop arithmetic-bound. Pairs first within 128-bit blocks
 * (unpack, then shuffle), then across the four blocks (shuffle_f32x4). */
__attribute__((target("avx512f"))) static inline __m512 sum16(const __m512 v[16]) {
    __m512 c[8], d[4];
    for (int i = 0; i < 8; i++)
        c[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 f01 = _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 f23 = _mm512_add_ps(_mm512_shuffle_f32x4(d[2], d[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(d[2], d[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(f01, f23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(f01, f23, _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

#endif
