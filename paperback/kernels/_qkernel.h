/* What other C extensions may call in _qkernel: the packed matrix type and gemm_many, through a capsule.
 *
 * A caller imports it once with
 *     const QKernelAPI *api = PyCapsule_Import(QKERNEL_CAPSULE, 0);
 * and calls api->gemm_many(...) with the GIL released, as the Python binding does. */
#ifndef PAPERBACK_QKERNEL_H
#define PAPERBACK_QKERNEL_H

#include <stdint.h>

/* An N x K packed weight in groups of `group_size` input features (G = ceil(K / group_size) per row):
 *   qweight  uint8 (N, ceil(K * bits / 8))  codes packed LSB first along K
 *   scales   fp16  (N, G)
 *   qzeros   uint8 (N, ceil(G * bits / 8))  packed the same way; NULL means symmetric, zero = 2^(bits - 1)
 * and w[n, k] = (code - zero[g]) * scale[g]. */
typedef struct {
    const uint8_t *qweight;
    const uint16_t *scales;
    const uint8_t *qzeros; /* NULL: symmetric */
    const float *bias;     /* NULL: none */
    int64_t n, k, groups, group_size, row_bytes, zero_row_bytes;
    int bits;
} QMatrix;

#define QKERNEL_CAPSULE "paperback.kernels._qkernel._C_API"
#define QKERNEL_MAX_MATRICES 128 /* matrices one gemm_many call takes (an MoE step: gate and up of 64 experts) */

typedef struct {
    /* ys[i] (rows, ms[i].n) = x (rows, k) ms[i]^T (+ bias) for `count` (1..QKERNEL_MAX_MATRICES) matrices sharing
     * k, bits and group size;
     * int8_acts: activations rounded to int8 blocks where k and the group size allow. 0, or -1 out of memory. */
    int (*gemm_many)(const QMatrix *ms, int count, const float *x, int64_t rows, float *const *ys, int threads,
                     int int8_acts);
    /* Fills m's derived fields from the pointers and shape; 0, or -1 for an invalid shape or bits. */
    int (*init_matrix)(QMatrix *m, const uint8_t *qweight, const uint16_t *scales, const uint8_t *qzeros,
                       const float *bias, int64_t n, int64_t k, int bits, int64_t group_size);
} QKernelAPI;

#endif
