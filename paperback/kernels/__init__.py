"""The kernel floor: paperback's C extensions, their Python bindings and their settings.

`_qkernel` (matmul from packed weights), `_paged_kernel` (decode attention over paged or dense KV storage,
native or quantized) and `_fused_decode` (a whole decode step in one call, through the other two's capsules),
with `_sum16.h` shared by the first two. The bindings (`packed`, `attention`, `fused`) and the one settings
object (`settings`) import nothing of paperback above `paperback.errors`: the models, the engine and the
quantizers all stand on this package, and it on none of them.
"""
