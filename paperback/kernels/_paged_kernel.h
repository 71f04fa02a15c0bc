/* What other C extensions may call in _paged_kernel, through a capsule:
 *     const PagedKernelAPI *api = PyCapsule_Import(PAGED_KERNEL_CAPSULE, 0); */
#ifndef PAPERBACK_PAGED_KERNEL_H
#define PAPERBACK_PAGED_KERNEL_H

#include <stdint.h>

#define PAGED_KERNEL_CAPSULE "paperback.kernels._paged_kernel._C_API"

/* How a dense cache stores its keys and values. */
enum { PAGED_FP32 = 0, PAGED_FP16 = 1, PAGED_BF16 = 2 };

typedef struct {
    /* One query per row over a dense cache, as dense_decode_attention: q, out (batch, heads, dim) fp32; keys,
     * values (batch, kv_heads, slots, dim) in `dtype` (PAGED_*) with the first `length` slots of each row read;
     * a window > 0 reads only the last `window` of them. 0, or -1 out of memory (or a bad dtype). Call with the
     * GIL released. */
    int (*dense_decode)(const float *q, float *out, const void *keys, const void *values, int dtype,
                        int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim, int64_t slots, int64_t length,
                        float scaling, int64_t window);
} PagedKernelAPI;

#endif
