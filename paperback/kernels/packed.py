"""Matmul from packed weights: the C kernel on CPU, PyTorch on other devices.

On CPU, a few rows of activations (decoding) go through `_qkernel.gemm`,
which reads the packed bytes directly, so a 4-bit layer moves about an
eighth of the bytes of an fp32 one. Many rows (prefill) are compute-bound,
so the kernel dequantizes the matrix once into a temporary and BLAS does the
product. Elsewhere (CUDA, or a CPU build without the extension) the PyTorch
reference dequantizes and multiplies; it is what the kernel is tested against.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import torch
import torch.nn.functional as F

from paperback.errors import PaperbackError
from paperback.kernels.settings import checked, settings

log = logging.getLogger(__name__)

try:  # torch is imported first so the extension shares torch's libgomp (one thread pool)
    from paperback.kernels import _qkernel
except ImportError as exc:  # built without a C compiler: reference path only
    _qkernel = None
    _IMPORT_ERROR = str(exc)

# Activations with more rows than this are multiplied by BLAS after one
# dequantization (benchmarks/bench_qkernel.py measures the crossover).
GEMV_MAX_ROWS = 16

# Decode steps of more rows than GEMV_MAX_ROWS (a batch of many sequences) still take the packed kernel with int8
# activations, sixteen rows a call, up to this many rows by code path: each call's AMX panels (or VNNI tiles) beat
# dequantizing the whole matrix for one GEMM there (benchmarks/bench_int8_chunked.py: a step's linears at 17-64 rows
# 1.3-2.9x faster with AMX, 1.2x at 96; with VNNI alone 1.4-2.0x to 32, level at 64). Other paths dequantize above
# GEMV_MAX_ROWS.
INT8_CHUNKED_MAX_ROWS = {"amx": 96, "avx512vnni": 32}

# Prefill dequantizes this many bytes of fp32 weight rows at a time into a
# reused buffer: it stays in cache and costs no page faults per call.
DEQUANT_TILE_BYTES = 4 << 20

_warned = False
_scratch = threading.local()


# settings.simd caps the kernel's code path (amx, avx512vnni, avx512, avxvnni, avx2, portable; default: the widest
# this CPU runs), to measure one path against another or to step around one.
if _qkernel is not None and settings.simd:
    try:
        _qkernel.set_simd(settings.simd)
    except ValueError as exc:
        raise PaperbackError(f"PAPERBACK_SIMD: {exc}") from None

# settings.decode_activations: how decode rows meet the packed codes: "fp32" (the exact reference: codes converted
# to floats) or "int8" (activations rounded to int8 in blocks of 32 and multiplied with integer dot products, as
# llama.cpp's Q8 blocks are; layers whose inputs or groups are not multiples of 32 stay fp32).
# settings.prefill_matmul: how prefill rows (more than GEMV_MAX_ROWS) meet the weights: "fp32" (tiles dequantized
# to fp32, fp32 BLAS: the exact reference) or "bf16" (tiles dequantized and rounded to bf16, activations rounded
# to bf16, a bf16 GEMM accumulating in fp32: what a bf16 model's matmuls do, fast where the CPU has AVX-512 BF16
# or AMX).


def set_decode_activations(mode: str) -> str:
    """Choose how decode rows meet the packed codes ("fp32" or "int8"); returns the previous mode."""
    previous, settings.decode_activations = settings.decode_activations, checked("decode_activations", mode)
    return previous


def set_prefill_matmul(mode: str) -> str:
    """Choose how prefill rows meet the packed weights ("fp32" or "bf16"); returns the previous mode."""
    previous, settings.prefill_matmul = settings.prefill_matmul, checked("prefill_matmul", mode, "prefill matmul")
    return previous


@contextlib.contextmanager
def kernel_modes(decode: str | None = None, prefill: str | None = None):
    """Decode activations and prefill matmul in these modes inside the block (None: leave one as it is),
    restored after."""
    previous = (set_decode_activations(decode) if decode is not None else None,
                set_prefill_matmul(prefill) if prefill is not None else None)
    try:
        yield
    finally:
        if previous[0] is not None:
            set_decode_activations(previous[0])
        if previous[1] is not None:
            set_prefill_matmul(previous[1])


def kernel_available() -> bool:
    return _qkernel is not None and settings.packed_matmul


def kernel_simd() -> str:
    """'amx', 'avx512vnni', 'avx512', 'avxvnni', 'avx2', 'portable', or 'unavailable'."""
    return _qkernel.simd() if _qkernel is not None else "unavailable"


def _warn_once() -> None:
    global _warned
    if not _warned and _qkernel is None:
        log.warning("paperback's packed-weight kernel is not built (%s); quantized layers use the slow "
                    "PyTorch reference path. Reinstall with a C compiler available.", _IMPORT_ERROR)
        _warned = True


def _matrix_args(layer, first_row: int = 0) -> tuple:
    """Pointers to the packed rows of `layer` starting at `first_row`."""
    groups = layer.scales.shape[1]
    qzeros = 0
    if layer.qzeros is not None:
        qzeros = layer.qzeros.data_ptr() + first_row * layer.qzeros.shape[1]
    return (layer.qweight.data_ptr() + first_row * layer.qweight.shape[1],
            layer.scales.data_ptr() + first_row * groups * 2, qzeros)


def _check_buffers(layer) -> None:
    for name in ("qweight", "scales", "qzeros"):
        t = getattr(layer, name)
        if t is not None and not t.is_contiguous():
            setattr(layer, name, t.contiguous())
    if layer.scales.dtype != torch.float16:
        raise TypeError(f"packed scales must be float16, got {layer.scales.dtype}")


def _dequantize_rows(layer, first_row: int, out: torch.Tensor) -> None:
    """Rows [first_row, first_row + len(out)) of the fp32 weight into `out` (contiguous)."""
    _qkernel.dequantize(out.data_ptr(), *_matrix_args(layer, first_row), out.shape[0], layer.in_features,
                        layer.scheme.bits, layer.scheme.group_size or layer.in_features, torch.get_num_threads())


def dequantize_cpu(layer) -> torch.Tensor:
    """fp32 (out, in) weight of a CPU QuantLinear via the kernel."""
    _check_buffers(layer)
    out = torch.empty(layer.out_features, layer.in_features)
    _dequantize_rows(layer, 0, out)
    return out


def _tile_buffer(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    name = f"buf_{dtype}"
    buf = getattr(_scratch, name, None)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype)
        setattr(_scratch, name, buf)
    return buf[:numel]


def _dequantized_tile(layer, first: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """Weight rows [first, first + rows) dequantized into a reused buffer, in fp32 or rounded to `dtype`."""
    k = layer.in_features
    w = _tile_buffer(rows * k).view(rows, k)
    _dequantize_rows(layer, first, w)
    if dtype == torch.float32:
        return w
    return _tile_buffer(rows * k, dtype).view(rows, k).copy_(w)


def _dequantize_matmul(layer, x2: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x2 @ W^T for many rows: BLAS on tiles of W dequantized into a reused buffer (`prefill_matmul`: fp32
    tiles, or bf16 tiles and activations with an fp32 result)."""
    n, k = layer.out_features, layer.in_features
    dtype = torch.bfloat16 if settings.prefill_matmul == "bf16" else torch.float32
    if dtype != torch.float32:
        x2, bias = x2.to(dtype), bias.to(dtype) if bias is not None else None
    tile = max(1, min(n, DEQUANT_TILE_BYTES // (4 * k)))
    if tile == n:
        return F.linear(x2, _dequantized_tile(layer, 0, n, dtype), bias).float()
    y = torch.empty(x2.shape[0], n)
    for first in range(0, n, tile):
        rows = min(tile, n - first)
        y[:, first:first + rows] = F.linear(x2, _dequantized_tile(layer, first, rows, dtype),
                                            bias[first:first + rows] if bias is not None else None)
    return y


def _kernel_args(layer) -> tuple:
    """(qweight, scales, qzeros, n, k, bits, group_size) for _qkernel, cached on the layer.

    Recomputed when the buffers move (a new qweight pointer), e.g. after loading.
    """
    cached = layer.__dict__.get("_kernel_args")
    if cached is None or cached[0] != layer.qweight.data_ptr():
        _check_buffers(layer)
        cached = (*_matrix_args(layer), layer.out_features, layer.in_features, layer.scheme.bits,
                  layer.scheme.group_size or layer.in_features)
        layer.__dict__["_kernel_args"] = cached
    return cached


def _fp32_rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """x as a contiguous fp32 (rows, in_features) matrix (no copy when it already is one)."""
    x2 = x.reshape(-1, in_features)
    if x2.dtype != torch.float32 or not x2.is_contiguous():
        x2 = x2.to(torch.float32).contiguous()
    return x2


def _fp32_bias(layer) -> torch.Tensor | None:
    bias = layer.bias
    return bias.float() if bias is not None and bias.dtype != torch.float32 else bias


def _gemv(layers, x2: torch.Tensor) -> list[torch.Tensor]:
    """x2 @ W^T for each layer, straight from the packed bytes, in one parallel region."""
    first = layers[0]
    outputs, mats = [], []
    for layer in layers:
        args, bias = _kernel_args(layer), _fp32_bias(layer)
        y = torch.empty(x2.shape[0], layer.out_features)
        outputs.append(y)
        mats.append((y.data_ptr(), *args[:3], bias.data_ptr() if bias is not None else 0, layer.out_features))
    _qkernel.gemm_many(x2.data_ptr(), x2.shape[0], first.in_features, first.scheme.bits,
                       first.scheme.group_size or first.in_features, torch.get_num_threads(), mats,
                       settings.decode_activations == "int8")
    return outputs


def _int8_chunked(rows: int, layer) -> bool:
    """Whether `rows` rows above GEMV_MAX_ROWS still take the kernel, sixteen at a time (INT8_CHUNKED_MAX_ROWS)."""
    return (GEMV_MAX_ROWS < rows <= INT8_CHUNKED_MAX_ROWS.get(kernel_simd(), 0) and settings.decode_activations == "int8"
            and _qkernel.int8_eligible(layer.in_features, layer.scheme.group_size or layer.in_features))


def _gemv_rows(layers, x2: torch.Tensor) -> list[torch.Tensor]:
    """_gemv over x2's rows GEMV_MAX_ROWS at a time (one call where they fit)."""
    if x2.shape[0] <= GEMV_MAX_ROWS:
        return _gemv(layers, x2)
    parts = [_gemv(layers, x2[first:first + GEMV_MAX_ROWS]) for first in range(0, x2.shape[0], GEMV_MAX_ROWS)]
    return [torch.cat(outputs) for outputs in zip(*parts)]


def _like_input(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (y if y.dtype == x.dtype else y.to(x.dtype)).view(*x.shape[:-1], y.shape[1])


def packed_linear(layer, x: torch.Tensor) -> torch.Tensor:
    """layer(x) for a QuantLinear, by the fastest path available for x's device."""
    if x.device.type != "cpu" or not kernel_available():
        if x.device.type == "cpu":
            _warn_once()
        return reference_linear(layer, x)
    x2 = _fp32_rows(x, layer.in_features)
    if x2.shape[0] > GEMV_MAX_ROWS and not _int8_chunked(x2.shape[0], layer):
        _check_buffers(layer)
        y = _dequantize_matmul(layer, x2, _fp32_bias(layer))
    else:
        (y,) = _gemv_rows([layer], x2)
    return _like_input(y, x)


def packed_linears(layers, x: torch.Tensor) -> list[torch.Tensor]:
    """[layer(x) for layer in layers]: one kernel call when they can share it.

    Layers that read the same input with one scheme (q, k and v; gate and up)
    run in one parallel region: fewer calls, and the work splits evenly over
    threads even when one matrix is small.
    """
    first = layers[0]
    rows = x.numel() // first.in_features
    shareable = (x.device.type == "cpu" and kernel_available()
                 and (rows <= GEMV_MAX_ROWS or _int8_chunked(rows, first))
                 and all(layer.in_features == first.in_features and layer.scheme == first.scheme for layer in layers))
    if not shareable:
        return [layer(x) for layer in layers]
    return [_like_input(y, x) for y in _gemv_rows(layers, _fp32_rows(x, first.in_features))]


def reference_linear(layer, x: torch.Tensor) -> torch.Tensor:
    """Dequantize with PyTorch ops on x's device, then multiply."""
    return F.linear(x, layer.dequantized_weight(x.dtype), layer.bias)
