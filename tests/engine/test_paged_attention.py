"""Paged attention equals dense attention for any block layout, GQA, windows, and quantized blocks."""

import pytest
import torch
import torch.nn.functional as F

from paperback.engine.paged_attention import paged_attention
from paperback.kv.schemes import parse_kv_scheme
from paperback.models.layers import attend


def scatter_into_blocks(k, v, block_size, num_blocks, seed=0):
    """k, v (Hkv, S, D) written into random physical blocks of a pool; returns pools and the block table."""
    kv_heads, seq_len, dim = k.shape
    n = -(-seq_len // block_size)
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[:n]
    k_pool = torch.full((num_blocks, kv_heads, block_size, dim), float("nan"))  # unwritten slots must not be read
    v_pool = torch.full_like(k_pool, float("nan"))
    for b in range(n):
        lo, hi = b * block_size, min((b + 1) * block_size, seq_len)
        k_pool[table[b], :, : hi - lo] = k[:, lo:hi]
        v_pool[table[b], :, : hi - lo] = v[:, lo:hi]
    return k_pool, v_pool, table


@pytest.mark.parametrize("seq_len, num_new, heads, kv_heads, window, per_step", [
    (37, 1, 4, 4, None, 32), (37, 1, 4, 2, None, 2), (64, 64, 4, 1, None, 3), (50, 7, 6, 2, None, 1),
    (100, 1, 4, 2, 16, 2), (100, 30, 4, 2, 16, 4), (17, 17, 2, 2, 5, 1),
])
def test_matches_dense_attention(seq_len, num_new, heads, kv_heads, window, per_step):
    torch.manual_seed(0)
    dim, block_size = 16, 8
    q = torch.randn(heads, num_new, dim)
    k = torch.randn(kv_heads, seq_len, dim)
    v = torch.randn(kv_heads, seq_len, dim)
    k_pool, v_pool, table = scatter_into_blocks(k, v, block_size, 40)
    out = paged_attention(q, lambda ids: (k_pool[ids], v_pool[ids]), table, seq_len, block_size, 0.25, window,
                          blocks_per_step=per_step)
    ref = attend(q[None], k[None], v[None], seq_len - num_new, 0.25, window)[0]
    assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()


def test_reads_only_a_bounded_number_of_blocks_per_step():
    torch.manual_seed(0)
    k = torch.randn(2, 100, 16)
    k_pool, v_pool, table = scatter_into_blocks(k, k, 8, 20)
    sizes = []

    def reader(ids):
        sizes.append(len(ids))
        return k_pool[ids], v_pool[ids]

    paged_attention(torch.randn(2, 1, 16), reader, table, 100, 8, 0.25, blocks_per_step=4)
    assert max(sizes) == 4 and sum(sizes) == 13
    sizes.clear()
    paged_attention(torch.randn(2, 1, 16), reader, table, 100, 8, 0.25, window=10, blocks_per_step=4)
    assert sum(sizes) == 2  # positions 90..99 live in blocks 11 and 12 only


@pytest.mark.parametrize("spec", ["int4:r=0", "fp8", "kivi2:r=0,g=8"])
def test_quantized_blocks_decode_inside_the_reader(spec):
    """Blocks stored encoded (fields per block) give the attention of the decoded keys and values."""
    torch.manual_seed(0)
    dim, block_size, seq_len = 32, 8, 40
    key_codec, value_codec = parse_kv_scheme(spec).codecs()
    k, v = torch.randn(2, seq_len, dim), torch.randn(2, seq_len, dim)
    blocks = [(key_codec.encode(k[:, lo:lo + block_size]), value_codec.encode(v[:, lo:lo + block_size]))
              for lo in range(0, seq_len, block_size)]
    table = torch.arange(len(blocks))

    def reader(ids):
        keys = torch.stack([key_codec.decode(blocks[i][0], torch.float32) for i in ids.tolist()])
        values = torch.stack([value_codec.decode(blocks[i][1], torch.float32) for i in ids.tolist()])
        return keys, values

    q = torch.randn(4, 1, dim)
    out = paged_attention(q, reader, table, seq_len, block_size, 0.2, blocks_per_step=2)
    dk = torch.cat([key_codec.decode(b[0], torch.float32) for b in blocks], dim=1)
    dv = torch.cat([value_codec.decode(b[1], torch.float32) for b in blocks], dim=1)
    ref = F.scaled_dot_product_attention(q[None], dk[None], dv[None], scale=0.2, enable_gqa=True)[0]
    assert torch.allclose(out, ref, atol=1e-5)


def test_plain_fallback_equals_the_fused_kernel():
    """Devices without the fused CPU kernel take plain tensor code: same outputs and log-sum-exps."""
    from paperback.engine.paged_attention import _attention_with_lse

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 6, 16), torch.randn(1, 4, 9, 16), torch.randn(1, 4, 9, 16)
    visible = torch.rand(6, 9) > 0.3
    visible[0] = False  # a row that sees nothing: output 0, log-sum-exp -inf after _fused_attention
    mask = torch.zeros(6, 9).masked_fill(~visible, float("-inf"))
    fused_out, fused_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=mask, scale=0.3)
    plain_out, plain_lse = _attention_with_lse(q, k, v, mask, 0.3)
    assert torch.allclose(fused_out[:, :, 1:], plain_out[:, :, 1:], atol=1e-5)
    assert torch.allclose(fused_lse[:, :, 1:], plain_lse[:, :, 1:], atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 20])
def test_decode_kernel_equals_one_call_per_sequence(dtype, window):
    """The C kernel reads each sequence's blocks in place: the same as paged_attention per sequence."""
    from paperback.kernels.attention import decode_kernel_available, paged_decode_attention

    torch.manual_seed(0)
    heads, kv_heads, dim, bs, num_blocks = 6, 2, 16, 4, 40
    keys = torch.randn(num_blocks, kv_heads, bs, dim).to(dtype)
    values = torch.randn(num_blocks, kv_heads, bs, dim).to(dtype)
    if not decode_kernel_available(keys):
        pytest.skip("the paged decode kernel was not built (no C compiler at install)")
    lengths = torch.tensor([1, 7, 33, 16])
    order = torch.randperm(num_blocks)
    tables, start = [], 0
    for n in lengths.tolist():  # disjoint random blocks per sequence
        need = -(-n // bs)
        tables.append(order[start:start + need])
        start += need
        last = tables[-1][-1]
        keys[last, :, (n - 1) % bs + 1:] = float("nan")  # unwritten slots of the last block are never read
        values[last, :, (n - 1) % bs + 1:] = float("nan")
    padded = torch.full((len(tables), max(map(len, tables))), int(order[-1]))  # padding: never read
    keys[order[-1]] = values[order[-1]] = float("nan")
    for i, t in enumerate(tables):
        padded[i, :len(t)] = t
    q = torch.randn(len(tables), heads, dim)
    together = paged_decode_attention(q, keys, values, padded, lengths, 0.25, window)
    assert not together.isnan().any()
    for i, (t, n) in enumerate(zip(tables, lengths.tolist())):
        alone = paged_attention(q[i][:, None], lambda ids: (keys[ids].float(), values[ids].float()), t, n, bs, 0.25,
                                window, blocks_per_step=3)
        assert torch.allclose(together[i], alone[:, 0], atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_kernel_reads_16_bit_values_exactly(dtype, kernel_path):
    """With one key the output is that value row: every 16-bit value (subnormals, extremes) converts exactly."""
    from paperback.kernels.attention import decode_kernel_available, paged_decode_attention

    info = torch.finfo(dtype)
    row = torch.tensor([info.tiny / 4, -info.tiny / 3, info.tiny, info.max, -info.max, 0.0, -0.0, 1.5,
                        -2.75, 1e-3, 3.0, -7.0, 0.1, 65.0, -1e-2, 2.0], dtype=dtype)
    values = row.reshape(1, 1, 1, 16).repeat(1, 1, 4, 1)
    keys = torch.ones_like(values)
    if not decode_kernel_available(keys):
        pytest.skip("the paged decode kernel was not built (no C compiler at install)")
    out = paged_decode_attention(torch.ones(1, 2, 16), keys, values, torch.zeros(1, 1, dtype=torch.long),
                                 torch.tensor([1]), 0.25)
    assert torch.equal(out[0, 0], row.float()) and torch.equal(out[0, 1], row.float())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("seq_len, num_new, window", [(37, 1, None), (64, 64, None), (100, 30, 16), (100, 1, 16)])
def test_matches_dense_attention_on_cuda(seq_len, num_new, window):
    """On a GPU the same block walk runs the plain-tensor attention with log-sum-exp merging."""
    torch.manual_seed(0)
    q, k, v = torch.randn(4, num_new, 16), torch.randn(2, seq_len, 16), torch.randn(2, seq_len, 16)
    k_pool, v_pool, table = scatter_into_blocks(k, v, 8, 40)
    k_pool, v_pool, table = k_pool.cuda(), v_pool.cuda(), table.cuda()
    out = paged_attention(q.cuda(), lambda ids: (k_pool[ids], v_pool[ids]), table, seq_len, 8, 0.25, window,
                          blocks_per_step=3)
    ref = attend(q[None], k[None], v[None], seq_len - num_new, 0.25, window)[0]
    assert out.device.type == "cuda" and torch.allclose(out.cpu(), ref, atol=1e-4)


@pytest.mark.parametrize("dim", [64, 24])
@pytest.mark.parametrize("scaling", [0.01, 3.0, 40.0])
def test_decode_kernel_softmax_holds_from_flat_to_one_hot_scores(scaling, dim, kernel_path):
    """The kernel's vectorised exp: nearly equal scores, and scores so far apart that all but one underflow; a
    head of 24 takes the 8-lane (AVX2) loops even where the CPU has AVX-512."""
    from paperback.kernels.attention import paged_decode_attention

    torch.manual_seed(1)
    keys, values = torch.randn(8, 2, 16, dim), torch.randn(8, 2, 16, dim)
    q = torch.randn(1, 6, dim)
    got = paged_decode_attention(q, keys, values, torch.arange(8)[None], torch.tensor([121]), scaling)
    k = keys.transpose(0, 1).reshape(2, 128, dim)[:, :121].double()  # (Hkv, S, D), in fp64 as the reference
    v = values.transpose(0, 1).reshape(2, 128, dim)[:, :121].double()
    want = torch.softmax(q[0].double().view(2, 3, dim) @ k.transpose(1, 2) * scaling, -1) @ v
    assert torch.allclose(got[0].double(), want.view(6, dim), atol=1e-5)  # what fp32 SDPA also misses by


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dense_cache_decode_reads_the_cache_in_place(dtype):
    """A decode query over a preallocated dense cache's views (what ContiguousKVCache returns) takes the C
    kernel, one block per row, and gives what SDPA gives; a layout it cannot read is left to SDPA."""
    from paperback.kernels.attention import dense_decode_attention

    torch.manual_seed(0)
    cache_k, cache_v = torch.randn(2, 3, 300, 64).to(dtype), torch.randn(2, 3, 300, 64).to(dtype)
    cache_k[:, :, 130:] = cache_v[:, :, 130:] = float("nan")  # not yet written: never read
    q = torch.randn(2, 9, 1, 64)
    k, v = cache_k[:, :, :130], cache_v[:, :, :130]
    got = dense_decode_attention(q, k, v, 0.125)
    if got is None:
        pytest.skip("the paged decode kernel was not built (no C compiler at install)")
    want = torch.nn.functional.scaled_dot_product_attention(q, k.float(), v.float(), scale=0.125, enable_gqa=True)
    assert torch.allclose(got, want, atol=1e-5)
    assert dense_decode_attention(q, k.transpose(2, 3), v.transpose(2, 3), 0.125) is None


@pytest.mark.parametrize("dim", [16, 48, 80, 128, 144])
@pytest.mark.parametrize("length", [5, 16, 37, 130])
def test_dense_decode_over_head_dims_and_lengths(dim, length, kernel_path):
    """Head dims of 1 to 4 vectors and past 64 lanes (the value side's register spans), lengths below, at and
    past a 16-key score tile and a 64-slot chunk, with the tile's tail: what SDPA gives."""
    from paperback.kernels.attention import dense_decode_attention

    torch.manual_seed(dim + length)
    cache_k, cache_v = torch.randn(3, 2, 200, dim) * 2, torch.randn(3, 2, 200, dim)
    q = torch.randn(3, 6, 1, dim)
    k, v = cache_k[:, :, :length], cache_v[:, :, :length]
    got = dense_decode_attention(q, k, v, dim ** -0.5)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=dim ** -0.5, enable_gqa=True)
    assert torch.allclose(got, want, atol=2e-5)


def _quantized_codecs(name):
    from paperback.kv.codecs import ChannelIntCodec, FP8Codec, TokenIntCodec

    return {"int8": TokenIntCodec(8, 32), "int4": TokenIntCodec(4, 16), "int3": TokenIntCodec(3, 32),
            "int2": TokenIntCodec(2, 32), "kivi2 keys": ChannelIntCodec(2, 32), "kivi4 keys": ChannelIntCodec(4, 16),
            "kivi3 keys": ChannelIntCodec(3, 8), "fp8-e4m3": FP8Codec("e4m3", 0.05),
            "fp8-e5m2 per head": FP8Codec("e5m2", torch.tensor([0.5, 2.0]).view(2, 1, 1))}[name]


@pytest.fixture(params=[True, False], ids=["simd", "portable"])
def kernel_path(request):
    """The paged kernel's SIMD paths (AVX-512, AVX2, F16C) where the CPU has them, then its portable C."""
    from paperback.kernels.attention import _paged_kernel as kernel

    if kernel is None:
        pytest.skip("the paged decode kernel was not built (no C compiler at install)")
    previous = kernel.use_avx512(request.param)
    yield request.param
    kernel.use_avx512(previous)


@pytest.mark.parametrize("name", ["int8", "int4", "int3", "int2", "kivi2 keys", "kivi4 keys", "kivi3 keys", "fp8-e4m3",
                                  "fp8-e5m2 per head"])
@pytest.mark.parametrize("window, sink", [(None, 0), (70, 32)])
def test_decode_kernel_reads_quantized_blocks_where_they_lie(name, window, sink, kernel_path):
    """Encoded blocks are decoded inside the kernel's loop exactly as the codec decodes them; blocks a staging table
    names are read exact from staging instead; a window with sinks sees both spans."""
    from paperback.kernels.attention import ExactStaging, decode_kernel_available, paged_decode_attention

    torch.manual_seed(2)
    heads, kv_heads, dim, bs, num_blocks = 6, 2, 64, 32, 14
    codec = _quantized_codecs(name)
    raw_k, raw_v = torch.randn(num_blocks, kv_heads, bs, dim) * 3, torch.randn(num_blocks, kv_heads, bs, dim)
    key_fields = {n: t.contiguous() for n, t in codec.encode(raw_k).items()}
    value_fields = {n: t.contiguous() for n, t in codec.encode(raw_v).items()}
    keys, values = codec.decode(key_fields, torch.float32), codec.decode(value_fields, torch.float32)
    stage_k, stage_v = torch.randn(5, kv_heads, bs, dim).half(), torch.randn(5, kv_heads, bs, dim).half()
    if codec.kernel_source(key_fields) is None or not decode_kernel_available(stage_k):
        pytest.skip("the paged decode kernel was not built (no C compiler at install)")
    lengths = [200, 77, 1]
    tables = torch.full((3, 7), -1)
    stage_tables = torch.full((3, 7), -1)
    order = torch.randperm(num_blocks)
    tables[0], tables[1, :3], tables[2, :1] = order[:7], order[7:10], order[10:11]
    stage_tables[0, 0], stage_tables[0, 6], stage_tables[1, 2], stage_tables[2, 0] = 3, 0, 4, 1  # sinks, recent
    q = torch.randn(3, heads, dim)
    got = paged_decode_attention(q, codec.kernel_source(key_fields), codec.kernel_source(value_fields), tables,
                                 torch.tensor(lengths), 0.125, window, sink,
                                 ExactStaging(stage_k, stage_v, stage_tables), num_kv_heads=kv_heads, block_size=bs)
    for i, n in enumerate(lengths):
        blocks = -(-n // bs)
        rows = [(stage_k[s], stage_v[s]) if s >= 0 else (keys[b], values[b])
                for b, s in zip(tables[i, :blocks].tolist(), stage_tables[i, :blocks].tolist())]
        k = torch.cat([r[0].float() for r in rows], 1)[:, :n]  # (Hkv, n, D)
        v = torch.cat([r[1].float() for r in rows], 1)[:, :n]
        seen = torch.ones(n, dtype=torch.bool)
        if window:
            pos = torch.arange(n)
            seen = (pos > n - 1 - window) | (pos < sink)
        scores = (q[i].view(kv_heads, 3, dim) @ k.transpose(1, 2)) * 0.125
        want = torch.softmax(scores.masked_fill(~seen, float("-inf")), -1) @ v
        assert torch.allclose(got[i], want.reshape(heads, dim), atol=2e-5), name


@pytest.mark.parametrize("threads", [2, 4])
@pytest.mark.parametrize("kv_heads, lengths", [(1, [1500]), (2, [600]), (1, [700, 9])])
@pytest.mark.parametrize("window, sink", [(None, 0), (300, 32), (100, 0)])
def test_decode_kernel_splits_long_sequences_over_threads_as_one_softmax(threads, kv_heads, lengths, window, sink,
                                                                         kernel_path):
    """Fewer (sequence, KV head) tasks than two per thread: each is split along its positions (cuts at multiples
    of 64, some of them holding no visible key under a window) and the parts merged by their maxima and sums:
    what one softmax over the visible keys gives."""
    from paperback.kernels.attention import paged_decode_attention

    torch.manual_seed(kv_heads + len(lengths) + (window or 0))
    heads, dim, bs = 3 * kv_heads, 64, 16
    width = -(-max(lengths) // bs)
    num_blocks = width * len(lengths)
    keys, values = torch.randn(num_blocks, kv_heads, bs, dim) * 2, torch.randn(num_blocks, kv_heads, bs, dim)
    tables = torch.randperm(num_blocks).view(len(lengths), width)
    q = torch.randn(len(lengths), heads, dim)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = paged_decode_attention(q, keys, values, tables, torch.tensor(lengths), 0.125, window, sink)
    finally:
        torch.set_num_threads(previous)
    for i, n in enumerate(lengths):
        k = keys[tables[i]].transpose(0, 1).reshape(kv_heads, -1, dim)[:, :n]
        v = values[tables[i]].transpose(0, 1).reshape(kv_heads, -1, dim)[:, :n]
        pos = torch.arange(n)
        seen = (pos > n - 1 - window) | (pos < sink) if window else torch.ones(n, dtype=torch.bool)
        scores = (q[i].view(kv_heads, 3, dim) @ k.transpose(1, 2)) * 0.125
        want = torch.softmax(scores.masked_fill(~seen, float("-inf")), -1) @ v
        assert torch.allclose(got[i], want.reshape(heads, dim), atol=2e-5), (n, window, sink)


def _int8_query_scores(q, codec, fields, block, scaling):
    """Scores of one KV head's queries q (group, D) against every slot of an encoded block, as the kernel's int8 path
    computes them: q rounded to int8 per span of channels (half to even, the span's largest magnitude to 127), for
    8-bit keys in two rounds (what the first leaves, rounded again), for KIVI keys after multiplying by the token
    group's channel scales; the rounding error times the codes' midpoint taken out; the codes' minimums meet the
    unrounded q."""
    from paperback.kv.codecs import TokenIntCodec
    from paperback.quantization.packing import unpack_codes

    dim = q.shape[-1]
    codes = unpack_codes(fields["codes"][block], codec.bits, dim).float()  # (bs, D)
    scale, low = fields["scale"][block].float(), fields["min"][block].float()

    def rounded(x, span):
        spans, out = x.unflatten(-1, (-1, span)), 0
        for _ in range(2 if codec.bits == 8 else 1):
            largest = spans.abs().amax(-1, keepdim=True)
            step = torch.round(spans * torch.where(largest > 0, 127 / largest, 0)) * (largest / 127)
            out, spans = out + step, spans - step
        return out.flatten(-2)

    center = (2 ** codec.bits - 1) / 2  # the rounding error's known part, error x center, is taken out
    if isinstance(codec, TokenIntCodec):
        span = codec.group if codec.group in (16, 32) else 64
        expand = lambda x: x.repeat_interleave(codec.group, -1)  # (bs, D / g) -> (bs, D)
        q_rounded = rounded(q, span)
        return (q_rounded @ (codes * expand(scale)).T - center * (q_rounded - q) @ expand(scale).T
                + q @ expand(low).T) * scaling
    token_group = codec.token_group
    out = []
    for t in range(codes.shape[0]):  # per token group its own channel scales
        s, m = scale[t // token_group], low[t // token_group]
        q_rounded = rounded(q * s, 32)
        out.append(q_rounded @ codes[t] - center * (q_rounded - q * s).sum(-1) + q @ m)
    return torch.stack(out, -1) * scaling


@pytest.mark.parametrize("name, codec_args", [("int8", (8, 32)), ("int4", (4, 16)), ("int2", (2, 32)),
                                              ("int8 g64", (8, 64)), ("int4 g128", (4, 128)), ("kivi2", (2, 32)),
                                              ("kivi4", (4, 16)), ("kivi8", (8, 32))])
@pytest.mark.parametrize("dim, heads, kv_heads", [(64, 9, 3), (256, 4, 1), (128, 8, 2)])
@pytest.mark.parametrize("window, sink", [(None, 0), (70, 32)])
def test_int8_query_scores_are_the_rounded_query_against_the_codes(name, codec_args, dim, heads, kv_heads, window,
                                                                   sink):
    """--kv-scores int8: encoded keys meet the query rounded to int8 by integer dot products, sixteen keys at a
    time (runs cut short at a sequence's end, a window's edge and KIVI's token groups), with staged blocks still
    read exact: what the same rounding does in PyTorch, to fp32 rounding; and near the fp32 path."""
    from paperback.kernels.attention import ExactStaging, paged_decode_attention, set_kv_scores
    from paperback.kernels.attention import _paged_kernel as kernel
    from paperback.kv.codecs import ChannelIntCodec, TokenIntCodec

    if kernel is None or not kernel.int_scores_available():
        pytest.skip("int8 KV scores need the kernel and a CPU with AVX-512 VNNI and VBMI")
    codec = (ChannelIntCodec if name.startswith("kivi") else TokenIntCodec)(*codec_args)
    if dim % getattr(codec, "group", 1):
        pytest.skip("channel group wider than the head")
    torch.manual_seed(dim + codec_args[0])
    bs, num_blocks, scaling = 32, 16, dim ** -0.5
    raw_k, raw_v = torch.randn(num_blocks, kv_heads, bs, dim) * 3, torch.randn(num_blocks, kv_heads, bs, dim)
    raw_k[..., 5] += 10  # an outlier channel, as real keys have
    key_fields = {n: t.contiguous() for n, t in codec.encode(raw_k).items()}
    value_fields = {n: t.contiguous() for n, t in codec.encode(raw_v).items()}
    values = codec.decode(value_fields, torch.float32)
    stage_k, stage_v = torch.randn(3, kv_heads, bs, dim).half(), torch.randn(3, kv_heads, bs, dim).half()
    lengths = [200, 77, 1, 33]
    tables = torch.stack([torch.randperm(num_blocks)[:7] for _ in lengths])
    stage_tables = torch.full((4, 7), -1)
    stage_tables[0, 0], stage_tables[1, 2] = 2, 0
    q = torch.randn(len(lengths), heads, dim)
    call = lambda: paged_decode_attention(q, codec.kernel_source(key_fields), codec.kernel_source(value_fields),
                                          tables, torch.tensor(lengths), scaling, window, sink,
                                          ExactStaging(stage_k, stage_v, stage_tables), num_kv_heads=kv_heads,
                                          block_size=bs)
    previous = set_kv_scores("fp32")
    try:
        exact = call()
        set_kv_scores("int8")
        got = call()
    finally:
        set_kv_scores(previous)
    group = heads // kv_heads
    for i, n in enumerate(lengths):
        blocks = -(-n // bs)
        for h in range(kv_heads):
            qh = q[i, h * group:(h + 1) * group]
            scores, v = [], []
            for b, s in zip(tables[i, :blocks].tolist(), stage_tables[i, :blocks].tolist()):
                if s >= 0:
                    scores.append(qh @ stage_k[s, h].float().T * scaling)
                    v.append(stage_v[s, h].float())
                else:
                    fields = {f: t[:, h] for f, t in key_fields.items()}
                    scores.append(_int8_query_scores(qh, codec, fields, b, scaling))
                    v.append(values[b, h])
            scores, v = torch.cat(scores, -1)[:, :n], torch.cat(v)[:n]
            if window:
                pos = torch.arange(n)
                scores = scores.masked_fill(~((pos > n - 1 - window) | (pos < sink)), float("-inf"))
            want = torch.softmax(scores, -1) @ v
            assert torch.allclose(got[i, h * group:(h + 1) * group], want, atol=1e-4), (name, i, h)
    assert (got - exact).abs().max() < 0.15 * exact.abs().max()  # the rounding moves the output a little


@pytest.mark.parametrize("variant", ["e4m3", "e5m2"])
def test_decode_kernel_reads_every_fp8_byte_exactly(variant, kernel_path):
    """Every finite FP8 byte, subnormals and both zeros included, as the codec decodes it: values read one-hot (a
    single key seen) come back as the byte's value times the scale."""
    from paperback.kernels.attention import paged_decode_attention
    from paperback.kv.codecs import FP8Codec

    codec = FP8Codec(variant, 0.75)
    dtype = codec.dtype
    finite = [b for b in range(256) if torch.isfinite(torch.tensor([b], dtype=torch.uint8).view(dtype).float())]
    dim, bs = 16, 1
    rows = torch.tensor(finite + finite[:(-len(finite)) % dim], dtype=torch.uint8).view(-1, 1, bs, dim)
    blocks = rows.shape[0]
    key_fields = {"codes": torch.zeros(blocks, 1, bs, dim, dtype=torch.uint8).view(dtype)}
    value_fields = {"codes": rows.view(dtype).contiguous()}
    q = torch.zeros(blocks, 1, dim)
    got = paged_decode_attention(q, codec.kernel_source(key_fields), codec.kernel_source(value_fields),
                                 torch.arange(blocks).view(blocks, 1), torch.ones(blocks, dtype=torch.int64), 1.0,
                                 num_kv_heads=1, block_size=bs)
    want = codec.decode(value_fields, torch.float32).view(blocks, 1, dim)
    assert torch.equal(got, want)


def test_kv_scores_choice_is_checked_and_restorable():
    """set_kv_scores takes fp32 or int8 (anything else is refused by name) and returns what was chosen before;
    PAPERBACK_KV_SCORES is checked the same way at import."""
    import subprocess
    import sys

    from paperback.errors import PaperbackError
    from paperback.kernels.attention import _paged_kernel, kv_scores_in_effect, set_kv_scores

    with pytest.raises(PaperbackError, match="KV scores must be one of fp32, int8"):
        set_kv_scores("int4")
    previous = set_kv_scores("int8")
    try:
        assert kv_scores_in_effect() == ("int8" if _paged_kernel and _paged_kernel.int_scores_available() else "fp32")
        assert set_kv_scores("fp32") == ("int8" if _paged_kernel else "fp32")  # the kernel keeps the choice
        assert kv_scores_in_effect() == "fp32"
    finally:
        set_kv_scores(previous)
    bad = subprocess.run([sys.executable, "-c", "import paperback.kernels.attention"], capture_output=True,
                         text=True, env={**__import__("os").environ, "PAPERBACK_KV_SCORES": "fast"})
    assert bad.returncode != 0 and "PAPERBACK_KV_SCORES must be one of fp32, int8, got 'fast'" in bad.stderr
