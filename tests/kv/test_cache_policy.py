"""The quantized cache reads back what it stores; policies name real layers and real formats."""

import json

import pytest
import torch

from helpers import tiny_hf, tiny_llama_hf
from paperback.errors import ContextLengthError, PaperbackError
from paperback.generation.kv_cache import ContiguousKVCache
from paperback.kv import QuantizedKVCache, build_policy, calibrate_kv_amax, parse_kv_scheme
from paperback.kv.cache import STAGE_BITS
from paperback.kv.codecs import fields_bytes
from paperback.loading import load_model


def load_tiny(tmp_path, hf):
    hf.save_pretrained(tmp_path)
    return load_model(str(tmp_path), with_tokenizer=False).model


@pytest.fixture
def tiny_llama(tmp_path):
    # head_dim 32 so channel groups of 32 fit; max positions long enough for a recent window to slide.
    return load_tiny(tmp_path, tiny_llama_hf(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=512))


def cache_for(model, spec, batch=1, max_len=300, **policy):
    pol = build_policy(model.config, spec, **policy)
    return QuantizedKVCache(model.config, pol, batch, max_len, torch.float32)


def test_fp32_native_cache_equals_the_contiguous_cache(tiny_llama):
    ids = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        outs = []
        for cache in (cache_for(tiny_llama, "fp32", batch=2),
                      ContiguousKVCache(tiny_llama.config, 2, 300, torch.float32)):
            first = tiny_llama(ids[:, :30], 0, cache)
            outs.append(torch.cat((first, tiny_llama(ids[:, 30:], 30, cache)), dim=1))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("spec", ["fp8", "int4", "kivi2", "pnmix", "int8:r=0"])
def test_view_equals_decoding_what_is_stored(tiny_llama, spec):
    """Attention reads the view; the view must be exactly the stored chunks decoded (plus the exact recent window)."""
    cache = cache_for(tiny_llama, spec)
    ids = torch.randint(0, 256, (1, 230))
    with torch.no_grad():
        for lo, hi in ((0, 100), (100, 101), (101, 170), (170, 230)):  # prefill, one decode step, chunks
            tiny_llama(ids[:, lo:hi], lo, cache)
    for store in cache.layers:
        assert store.length == 230
        r, g = store.scheme.residual, store.unit  # encoded a pool block at a time, as the engine does
        assert store.encoded == max(0, (230 - r) // g * g)
        assert 230 - store.encoded >= r
        for values, codec, view in ((False, store.key_codec, store.keys), (True, store.value_codec, store.values)):
            decoded = codec.decode(store.stored(values), torch.float32)
            assert torch.equal(view[:, :, :store.encoded], decoded)


def test_bytes_match_the_schemes_bits(tiny_llama):
    cache = cache_for(tiny_llama, "kivi2")
    with torch.no_grad():
        tiny_llama(torch.randint(0, 256, (1, 288)), 0, cache)
    scheme = parse_kv_scheme("kivi2")
    store = cache.layers[0]
    cfg = tiny_llama.config
    elements_encoded = 2 * cfg.num_kv_heads * store.encoded * cfg.head_dim
    recent = 2 * cfg.num_kv_heads * (288 - store.encoded) * cfg.head_dim
    assert store.encoded == 160  # 288 - 128 recent
    encoded_bytes = sum(fields_bytes(f) for f in store.key_chunks + store.value_chunks)
    assert 8 * encoded_bytes == pytest.approx(elements_encoded * scheme.bits_per_element(cfg.head_dim))
    assert store.nbytes() == encoded_bytes + recent * STAGE_BITS // 8
    assert cache.nbytes() == cfg.num_layers * store.nbytes()


def test_policy_bits_at_a_context_match_the_cache(tiny_llama):
    policy = build_policy(tiny_llama.config, "kivi2", "1")  # layer 1 at fp16
    cache = QuantizedKVCache(tiny_llama.config, policy, 1, 300, torch.float32)
    with torch.no_grad():
        tiny_llama(torch.randint(0, 256, (1, 250)), 0, cache)
    assert policy.bits_at(tiny_llama.config, 250) == pytest.approx(cache.bits_per_element())
    # 96 of 250 tokens encoded at 3 bits, the rest at 16; layer 1 all at 16.
    assert policy.bits_at(tiny_llama.config, 250) == pytest.approx(((96 * 3 + 154 * 16) / 250 + 16) / 2)
    assert policy.bits_per_element(tiny_llama.config) == pytest.approx((3 + 16) / 2)


def test_quantized_cache_changes_logits_only_a_little(tiny_llama):
    ids = torch.randint(0, 256, (1, 200))
    with torch.no_grad():
        ref = tiny_llama(ids)
        errors = {}
        for spec in ("int8:r=0", "int4:r=0", "int2:r=0"):
            cache = cache_for(tiny_llama, spec)
            out = torch.cat([tiny_llama(ids[:, lo:lo + 50], lo, cache) for lo in range(0, 200, 50)], dim=1)
            errors[spec] = ((out - ref).norm() / ref.norm()).item()
    assert errors["int8:r=0"] < 0.01 < errors["int4:r=0"] < errors["int2:r=0"]


def test_cache_refuses_gaps_and_overflow(tiny_llama):
    cache = cache_for(tiny_llama, "int4", max_len=64)
    k = torch.randn(1, 2, 10, 32)
    cache.update(0, k, k, 0)
    with pytest.raises(PaperbackError, match="appends at position 10"):
        cache.update(0, k, k, 20)
    with pytest.raises(ContextLengthError, match="holds 64"):
        cache.update(0, torch.randn(1, 2, 60, 32), torch.randn(1, 2, 60, 32), 10)


def test_pnmix_selects_once_before_the_first_encode(tiny_llama):
    cache = cache_for(tiny_llama, "pnmix:r=32")
    ids = torch.randint(0, 256, (1, 160))
    with torch.no_grad():
        tiny_llama(ids[:, :40], 0, cache)  # inside the recent window: nothing encoded, nothing chosen yet
        assert all(store.key_codec.selection is None for store in cache.layers)
        tiny_llama(ids[:, 40:70], 40, cache)  # 70 - 32 recent = 38 tokens: one group of 32 encoded
        chosen = [store.key_codec.selection.channels.clone() for store in cache.layers]
        tiny_llama(ids[:, 70:], 70, cache)
    for store, before in zip(cache.layers, chosen):
        assert torch.equal(store.key_codec.selection.channels, before)
        assert store.key_codec.selection.channels.shape == (2, 8)  # 4 pairs = 8 channels per KV head


def test_calibrated_fp8_uses_the_observed_range(tiny_llama):
    calib = torch.randint(0, 256, (4, 64))
    amax = calibrate_kv_amax(tiny_llama, calib, progress=False)
    assert set(amax) == set(range(tiny_llama.config.num_layers))
    assert amax[0][0].shape == (2,)
    policy = build_policy(tiny_llama.config, "fp8:scale=calibrated,per_head=1")
    assert policy.needs_fp8_calibration(tiny_llama.config.num_layers)
    cache = QuantizedKVCache(tiny_llama.config, policy, 1, 64, torch.float32, kv_amax=amax)
    key_codec = cache.layers[0].key_codec
    assert torch.allclose(key_codec.scale.flatten(), amax[0][0] / 448)
    with pytest.raises(PaperbackError, match="needs calibration; none was given"):
        QuantizedKVCache(tiny_llama.config, policy, 1, 64, torch.float32)


def test_policy_layers_skip_and_file(tiny_llama, tmp_path):
    cfg = tiny_llama.config
    assert [build_policy(cfg, "kivi2", "1").scheme_for(i).label for i in range(2)] == ["kivi2", "fp16"]
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"default": "int4", "layers": {"0": "int8"}, "skip_layers": [1],
                                "skip_dtype": "bf16"}))
    policy = build_policy(cfg, policy_file=path)
    assert [policy.scheme_for(i).label for i in range(2)] == ["int8", "bf16"]
    assert build_policy(cfg, "int4", policy_file=path).default.label == "int4"


@pytest.mark.parametrize("policy, message", [
    ({"kv": "kivi2", "skip_layers": "7"}, "names layer 7, but the model has 2 layers"),
    ({"kv": "kivi2", "skip_layers": "global"}, "no sliding-window layers"),
    ({"kv": "kivi2", "skip_layers": "x"}, "bad layer selector"),
    ({"kv": "nf4"}, "unknown KV format"),
    ({"kv": "int4:g=48"}, "does not divide the head dimension 32"),
])
def test_bad_policies_fail_before_work(tiny_llama, policy, message):
    with pytest.raises(PaperbackError, match=message):
        build_policy(tiny_llama.config, **policy)


def test_bad_policy_files(tiny_llama, tmp_path):
    path = tmp_path / "p.json"
    for text, message in (("{", "not valid JSON"), ('{"defaults": "int4"}', "unknown: \\['defaults'\\]"),
                          ('{"default": "int4"}', "disagree"), ('{"skip_dtype": "int8"}', "skip_dtype")):
        path.write_text(text)
        with pytest.raises(PaperbackError, match=message):
            build_policy(tiny_llama.config, "kivi2" if "default" in text else None, policy_file=path)
    with pytest.raises(PaperbackError, match="does not exist"):
        build_policy(tiny_llama.config, policy_file=tmp_path / "missing.json")


def test_gemma_global_and_sliding_selectors(tmp_path):
    model = load_tiny(tmp_path, tiny_hf("gemma3"))
    cfg = model.config
    policy = build_policy(cfg, "kivi2", "global")
    kinds = [(cfg.window_of(i) is None, policy.scheme_for(i).label) for i in range(cfg.num_layers)]
    assert all(label == ("fp16" if is_global else "kivi2") for is_global, label in kinds)
    assert any(is_global for is_global, _ in kinds) and not all(is_global for is_global, _ in kinds)


@pytest.mark.parametrize("spec", ["kivi2:r=16", "pnmix:r=16", "fp8"])
def test_gemma_sliding_layers_read_their_window_from_the_cache(tmp_path, spec):
    model = load_tiny(tmp_path, tiny_hf("gemma3"))
    ids = torch.randint(0, 256, (1, 120))
    with torch.no_grad():
        ref = model(ids)
        exact = cache_for(model, "fp32", max_len=120)
        chunked = torch.cat([model(ids[:, lo:lo + 24], lo, exact) for lo in range(0, 120, 24)], dim=1)
        lossy = cache_for(model, spec, max_len=120)
        out = torch.cat([model(ids[:, lo:lo + 24], lo, lossy) for lo in range(0, 120, 24)], dim=1)
    assert torch.allclose(chunked, ref, atol=1e-4)
    assert 0 < (out - ref).abs().max() < ref.abs().max()


@pytest.mark.parametrize("spec", ["kivi2:sink=32", "kivi2:sink=32,window=160", "fp16:window=100,sink=16",
                                  "int4:r=32,window=64"])
def test_retention_bits_match_the_cache(tiny_llama, spec):
    """Exact sinks count at 16 bits; evicted tokens count nothing, in the policy and in the cache."""
    policy = build_policy(tiny_llama.config, spec)
    cache = QuantizedKVCache(tiny_llama.config, policy, 1, 300, torch.float32)
    with torch.no_grad():
        for lo in range(0, 250, 50):
            tiny_llama(torch.randint(0, 256, (1, 50)), lo, cache)
    assert policy.bits_at(tiny_llama.config, 250) == pytest.approx(cache.bits_per_element(), rel=1e-3)
    name, _, settings = spec.partition(":")
    kept = ",".join(s for s in settings.split(",") if not s.startswith("window"))
    every_token = build_policy(tiny_llama.config, f"{name}:{kept}" if kept else name)
    if "window" in spec:  # fewer tokens held
        assert policy.bits_at(tiny_llama.config, 250) < every_token.bits_at(tiny_llama.config, 250)
    else:  # the sinks held exact cost bits
        assert policy.bits_at(tiny_llama.config, 250) > build_policy(tiny_llama.config, name).bits_at(
            tiny_llama.config, 250)


@pytest.mark.parametrize("spec, error", [("kivi2:sink=8", "multiple of 16"), ("kivi2:sink=48", "32-token groups"),
                                         ("int4:window=128", "must exceed"), ("kivi2:sink=-32", ">= 0")])
def test_bad_retention_is_refused(spec, error):
    with pytest.raises(PaperbackError, match=error):
        parse_kv_scheme(spec)


def test_retention_labels():
    assert parse_kv_scheme("kivi2:sink=32,window=1024").label == "kivi2+sink32+win1024"
    assert parse_kv_scheme("kivi2:sink=32").format_label == "kivi2"


def test_a_retention_window_on_a_sliding_layer_is_refused(tmp_path):
    config = load_tiny(tmp_path, tiny_hf("gemma3")).config
    with pytest.raises(PaperbackError, match="already attends a sliding window"):
        build_policy(config, "kivi2:window=1024")
    build_policy(config, spec={"default": "kivi2", "layers": {"global": "kivi2:window=1024"}})


def test_a_new_family_is_one_registry_entry(tiny_llama, monkeypatch):
    """A format added to paperback.kv.families alone is parsed, stored, served in pages and counted."""
    from paperback.engine.paged_cache import PagedKVPool
    from paperback.engine.pool_layout import pool_layout
    from paperback.kv import families
    from paperback.kv.codecs import TokenIntCodec

    family = families.KVFamily("int3sym", lambda s, amax: (TokenIntCodec(3, 16), TokenIntCodec(3, 16)),
                               lambda s: "int3sym", {"int3sym": {"bits": 3, "residual": 16}})
    monkeypatch.setitem(families.FAMILIES, "int3sym", family)
    monkeypatch.setitem(families.NAMED, "int3sym", ("int3sym", family.named["int3sym"]))
    policy = build_policy(tiny_llama.config, "int3sym")
    assert policy.default.label == "int3sym" and policy.bits_per_element(tiny_llama.config) == pytest.approx(5.0)
    cache = QuantizedKVCache(tiny_llama.config, policy, 1, 100, torch.float32)
    with torch.no_grad():
        tiny_llama(torch.randint(0, 256, (1, 80)), 0, cache)
    assert policy.bits_at(tiny_llama.config, 80) == pytest.approx(cache.bits_per_element())
    pool = PagedKVPool(tiny_llama.config, policy, pool_layout(tiny_llama.config, policy, num_blocks=4, max_num_seqs=1),
                       torch.float32)
    encoded = TokenIntCodec(3, 16).encode(torch.zeros(1, tiny_llama.config.num_kv_heads, 16, 32))
    assert {n: t.shape[1:] for n, t in pool.layers[0].key_fields.items()} == {
        n: t.shape[1:] for n, t in encoded.items()}
