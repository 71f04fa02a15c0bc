"""compressed-tensors export, checked by its real consumers: the compressed-tensors package and transformers."""

import json

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from transformers import AutoModelForCausalLM, CompressedTensorsConfig

from paperback.cli import main
from paperback.errors import PaperbackError
from paperback.export.compressed_tensors_export import export_compressed_tensors, pack_int32
from paperback.loading import load_model
from paperback.quantization import QuantScheme

from test_gguf_export import quantized_checkpoint, refuses_quantization_config


@pytest.mark.parametrize("bits, cols", [(2, 64), (4, 128), (4, 72), (8, 40)])
def test_packing_is_the_libraries_own(bits, cols):
    codes = torch.randint(0, 2 ** bits, (6, cols), dtype=torch.uint8)
    signed = (codes.to(torch.int16) - 2 ** (bits - 1)).to(torch.int8)  # the format stores signed + offset
    assert torch.equal(pack_int32(codes, bits), pack_to_int32(signed, bits))
    assert torch.equal(unpack_from_int32(pack_int32(codes, bits), bits, codes.shape), signed)


def transformers_logits(path, ids, dequantize):
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=CompressedTensorsConfig(
        dequantize=dequantize))
    with torch.no_grad():
        return model(ids).logits


def library_decompressed(out):
    """{module: weight} as compressed-tensors' own pack-quantized decompressor reads the export."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file

    config = json.loads((out / "config.json").read_text())["quantization_config"]
    state = load_file(out / "model.safetensors")
    weights = {}
    for module in {k.rsplit(".", 1)[0] for k in state if k.endswith(".weight_packed")}:
        group = next(g for g in config["config_groups"].values()
                     if "Linear" in g["targets"] or module in g["targets"])
        scheme = QuantizationScheme(targets=group["targets"], weights=group["weights"])
        local = {k.rsplit(".", 1)[1]: v for k, v in state.items() if k.rsplit(".", 1)[0] == module}
        weights[module] = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
    return weights


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("scheme", [QuantScheme(4, 32), QuantScheme(4, 64, True), QuantScheme(8, None, True)])
def test_the_export_decompresses_to_paperbacks_weights_and_transformers_runs_it(tmp_path, scheme, tied):
    ckpt, _ = quantized_checkpoint(tmp_path, scheme, QuantScheme(8, None, True), tied)
    out = tmp_path / "ct"
    summary = export_compressed_tensors(ckpt, out, "float32", progress=False)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["format"] == "pack-quantized" and config["quant_method"] == "compressed-tensors"
    assert ("lm_head" in config["ignore"]) == tied  # untied, the head is a packed W8 linear (a second group)
    assert len(config["config_groups"]) == (1 if tied or scheme == QuantScheme(8, None, True) else 2)
    assert summary["dense"] == ["model.embed_tokens"]
    # Every packed module, read by the library's own decompressor, is paperback's weight bit for bit.
    paperback = load_model(str(ckpt), with_tokenizer=False).model
    decompressed = library_decompressed(out)
    assert len(decompressed) == 14 + (0 if tied else 1)
    for module, weight in decompressed.items():
        assert torch.equal(weight, paperback.get_submodule(module).dequantized_weight()), module
    # transformers loads it and computes paperback's logits: dequantized at load (it takes one scheme for every
    # dense layer, so a mixed export cannot load that way), or kept packed (symmetric only: in transformers
    # 5.24 + compressed-tensors 0.20 the packed empty model expects zero points unpacked, (out, groups),
    # while the format, and the library's own compressor, pack them).
    modes = ([True] if len(config["config_groups"]) == 1 else []) + ([False] if scheme.symmetric else [])
    ids = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        mine = paperback(ids)
    for dequantize in modes:
        assert torch.allclose(transformers_logits(out, ids, dequantize), mine, atol=1e-5, rtol=1e-5)
    if modes:  # float16 (the default, for GPUs): scales exact, norms and the dense embedding rounded
        export_compressed_tensors(ckpt, tmp_path / "ct16", progress=False)
        half = transformers_logits(tmp_path / "ct16", ids, modes[0]).float()
        assert (half - mine).abs().max() <= 2e-2 * mine.abs().max()


def test_schemes_the_format_cannot_hold_are_refused_before_writing(tmp_path, capsys):
    ckpt, _ = quantized_checkpoint(tmp_path, QuantScheme(3, 64), QuantScheme(8, None, True))
    with pytest.raises(PaperbackError, match="W3a-g64: compressed-tensors pack-quantized holds 2, 4 or 8 bits"):
        export_compressed_tensors(ckpt, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.partial*"))
    (tmp_path / "b").mkdir()
    ckpt, _ = quantized_checkpoint(tmp_path / "b", QuantScheme(4, 96), QuantScheme(8, None, True))
    assert main(["export", str(ckpt), "--format", "compressed-tensors", "-o", str(tmp_path / "out")]) == 2
    assert "groups that divide the row (here: g32, g64, g128" in capsys.readouterr().err
    assert main(["export", str(ckpt), "--format", "gguf", "--dtype", "float32", "-o", str(tmp_path / "o")]) == 2
    assert "--dtype applies to compressed-tensors" in capsys.readouterr().err


@pytest.mark.slow
def test_smollm2_export_scores_wikitext_as_paperback_does_in_transformers(tmp_path, capsys):
    ckpt = tmp_path / "smol"
    assert main(["quantize", "smollm2", "--method", "rtn", "--group-size", "64", "-o", str(ckpt), "--json"]) == 0
    capsys.readouterr()
    out = tmp_path / "smol-ct"
    assert main(["export", str(ckpt), "--format", "compressed-tensors", "--dtype", "float32", "-o", str(out),
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["schemes"] == {"W4a-g64": 210}
    from paperback.evaluation import load_text

    fitted = load_model(str(ckpt))
    ids = torch.tensor([fitted.tokenizer.encode(load_text("wikitext2"), add_special_tokens=False)[:512]])
    with torch.no_grad():
        mine = fitted.model(ids)
    theirs = transformers_logits(out, ids, True)
    assert (theirs - mine).abs().max() <= 1e-3 * mine.abs().max()


@pytest.mark.parametrize("scheme", [QuantScheme(4, 32), QuantScheme(4, 64, True), QuantScheme(2, 32)])
def test_export_then_import_is_lossless(tmp_path, scheme):
    """paperback reads the export back into packed layers: the same codes, scales and zero points, bit for bit."""
    from paperback.quantization.qlinear import QuantEmbedding, QuantLinear

    ckpt, _ = quantized_checkpoint(tmp_path, scheme, QuantScheme(8, None, True), tied=False)
    export_compressed_tensors(ckpt, tmp_path / "ct", "float16", progress=False)
    original = load_model(str(ckpt), with_tokenizer=False).model
    imported = load_model(str(tmp_path / "ct"), with_tokenizer=False).model
    layers = {n: m for n, m in original.named_modules() if isinstance(m, QuantLinear)
              and not isinstance(m, QuantEmbedding)}
    assert len(layers) == 15  # 14 block linears and the untied head
    for name, layer in layers.items():
        other = imported.get_submodule(name)
        assert isinstance(other, QuantLinear) and other.scheme == layer.scheme
        for buffer in ("qweight", "scales", "qzeros"):
            mine, theirs = getattr(layer, buffer), getattr(other, buffer)
            assert (mine is None and theirs is None) or torch.equal(mine, theirs), (name, buffer)
    ids = torch.randint(0, 256, (2, 24))
    with torch.no_grad():  # the norms and the dense embedding went through fp16
        a, b = original(ids), imported(ids)
    assert (a - b).abs().max() <= 2e-2 * a.abs().max()


def test_checkpoints_paperback_cannot_run_are_refused_by_name(tmp_path, capsys):
    ckpt, _ = quantized_checkpoint(tmp_path, QuantScheme(4, 32), QuantScheme(8, None, True), tied=False)
    out = tmp_path / "ct"
    export_compressed_tensors(ckpt, out, progress=False)
    refused = refuses_quantization_config(out, capsys)

    refused(lambda q: q.update(quant_method="bitsandbytes"), "quantization method 'bitsandbytes' is not supported")
    refused(lambda q: q.update(format="marlin-24"), "compression format 'marlin-24'")
    refused(lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 8}),
            "quantizes input activations")
    refused(lambda q: q["config_groups"]["group_0"]["weights"].update(actorder="group"), "activation order 'group'")
    refused(lambda q: q["config_groups"]["group_0"]["weights"].update(type="float"), "stores float weights")
    refused(lambda q: q.update(config_groups={}), "has no config_groups")


def with_kv_policy(ckpt, spec):
    recipe = json.loads((ckpt / "recipe.json").read_text())
    (ckpt / "recipe.json").write_text(json.dumps({**recipe, "kv_policy": spec}))


def test_an_fp8_kv_policy_is_written_as_llm_compressor_writes_it(tmp_path):
    ckpt, _ = quantized_checkpoint(tmp_path, QuantScheme(4, 32, True), QuantScheme(8, None, True))
    with_kv_policy(ckpt, {"default": "fp8"})
    summary = export_compressed_tensors(ckpt, tmp_path / "ct", "float32", progress=False)
    config = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert config["kv_cache_scheme"] == {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                         "symmetric": True}
    from safetensors.torch import load_file

    state = load_file(tmp_path / "ct" / "model.safetensors")
    for i in range(2):
        assert state[f"model.layers.{i}.self_attn.k_scale"].item() == 1.0
        assert state[f"model.layers.{i}.self_attn.v_scale"].item() == 1.0
    assert summary["kv_cache"] == "FP8 E4M3 KV cache"
    # transformers loads the scales with the weights (it computes attention exactly; vLLM stores the cache in FP8).
    ids = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        assert torch.allclose(transformers_logits(tmp_path / "ct", ids, True),
                              load_model(str(ckpt), with_tokenizer=False).model(ids), atol=1e-5, rtol=1e-5)
    # Anything else has no compressed-tensors form: the export says so and writes no KV scheme.
    with_kv_policy(ckpt, {"default": "int8", "layers": {"0": "fp16"}})
    summary = export_compressed_tensors(ckpt, tmp_path / "ct2", progress=False)
    assert json.loads((tmp_path / "ct2" / "config.json").read_text())["quantization_config"]["kv_cache_scheme"] is None
    assert "has no compressed-tensors form" in summary["kv_cache"]


@pytest.mark.slow
def test_calibrated_fp8_scales_are_the_layers_largest_values_over_448(tmp_path, capsys):
    from paperback.engine.llm import default_kv_amax

    ckpt = tmp_path / "smol"
    assert main(["quantize", "smollm2", "--method", "rtn", "--group-size", "64", "--sym", "-o", str(ckpt),
                 "--json"]) == 0
    capsys.readouterr()
    with_kv_policy(ckpt, {"default": "fp8:scale=calibrated"})
    export_compressed_tensors(ckpt, tmp_path / "ct", progress=False)
    from safetensors.torch import load_file

    state = load_file(tmp_path / "ct" / "model.safetensors")
    amax = default_kv_amax(load_model(str(ckpt)))
    for i in (0, 29):
        assert state[f"model.layers.{i}.self_attn.k_scale"].item() == pytest.approx(amax[i][0].max().item() / 448)
        assert state[f"model.layers.{i}.self_attn.v_scale"].item() == pytest.approx(amax[i][1].max().item() / 448)


def mixed_checkpoint(tmp_path, schemes: dict[str, QuantScheme], tied=True, intermediate_size=256):
    """A tiny checkpoint whose block linears take `schemes` ({"0.self_attn.q_proj": scheme, ...}, the rest W8s-ch),
    as a fit's units leave them: one scheme per unit, schemes differing between units and layers."""
    from helpers import tiny_llama_hf, write_llama_gguf
    from paperback.quantization.checkpoint import save_checkpoint, swap_in_quantized
    from paperback.quantization.model_pass import (EMBED_PARAM, HEAD_PARAM, QuantizeConfig, parse_targets,
                                                   quantize_model)

    hf = tiny_llama_hf(num_hidden_layers=2, hidden_size=128, intermediate_size=intermediate_size,
                       tie_word_embeddings=tied)
    source = write_llama_gguf(hf, tmp_path / "tiny.gguf")
    lm = load_model(str(source), with_tokenizer=False)
    w8 = QuantScheme(8, None, True)
    layer_schemes = {f"model.layers.{k}.weight": s for k, s in schemes.items()}
    layer_schemes.update({EMBED_PARAM: w8, HEAD_PARAM: w8})
    config = QuantizeConfig("rtn", w8, targets=parse_targets("blocks,embed,head"), layer_schemes=layer_schemes)
    results = quantize_model(lm.model, config, progress=False)
    swap_in_quantized(lm.model, results)
    recipe = {"source_model": str(source), "layers": {n: {"scheme": q.scheme.to_dict()} for n, q in results.items()}}
    return save_checkpoint(lm.model, None, recipe, tmp_path / "ckpt")


def unit_schemes(by_unit: dict[tuple[int, str], QuantScheme]) -> dict[str, QuantScheme]:
    units = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
             "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}
    return {f"{layer}.{linear}": scheme for (layer, unit), scheme in by_unit.items() for linear in units[unit]}


W4S32, W4S64, W8S, W4A64 = QuantScheme(4, 32, True), QuantScheme(4, 64, True), QuantScheme(8, None, True), \
    QuantScheme(4, 64)
FIT_LIKE = unit_schemes({(0, "qkv"): W4S32, (0, "o"): W8S, (0, "gate_up"): W4S64, (0, "down"): W8S,
                         (1, "qkv"): W8S, (1, "o"): W4S32, (1, "gate_up"): W8S, (1, "down"): W4A64})


@pytest.mark.parametrize("symmetric", [True, False])
def test_a_mixed_fit_exports_one_group_per_scheme_read_bit_for_bit(tmp_path, symmetric):
    schemes = FIT_LIKE if not symmetric else {k: (W4S64 if s == W4A64 else s) for k, s in FIT_LIKE.items()}
    ckpt = mixed_checkpoint(tmp_path, schemes)
    out = tmp_path / "ct"
    summary = export_compressed_tensors(ckpt, out, "float32", progress=False)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    groups = {json.dumps(g["weights"], sort_keys=True): g["targets"] for g in config["config_groups"].values()}
    assert len(groups) == len(set(schemes.values()))  # one group per scheme, its modules named explicitly
    for key, scheme in schemes.items():
        module = f"model.layers.{key}"
        owners = [targets for targets in groups.values() if module in targets]
        assert len(owners) == 1, module
    # The library's own decompressor reads every packed module as paperback's weight, bit for bit.
    paperback = load_model(str(ckpt), with_tokenizer=False).model
    decompressed = library_decompressed(out)
    assert set(decompressed) == {f"model.layers.{k}" for k in schemes}
    for module, weight in decompressed.items():
        assert torch.equal(weight, paperback.get_submodule(module).dequantized_weight()), module
    # transformers runs a symmetric mix packed (its dequantizing path takes one scheme for every layer, and
    # its packed path expects zero points unpacked: an asymmetric mix loads in neither).
    if symmetric:
        ids = torch.randint(0, 256, (2, 24))
        with torch.no_grad():
            mine = paperback(ids)
        assert torch.allclose(transformers_logits(out, ids, False), mine, atol=1e-5, rtol=1e-5)
    # What vLLM needs: 4 or 8 bits, Marlin's groups, q/k/v and gate/up each sharing a scheme: all met here.
    vllm = summary["vllm"]
    assert vllm["loads"] and not vllm["blockers"]
    # 4 heads (2 KV heads, replicated at 4); o_proj's 128 inputs and down_proj's 256 split into whole groups
    assert vllm["tensor_parallel_sizes"] == [1, 2, 4]
    assert any("CPU backend runs 4-bit layers only" in n for n in vllm["notes"])


def test_what_vllm_cannot_load_is_named(tmp_path, capsys):
    split = {**FIT_LIKE, "0.self_attn.k_proj": W8S, "1.self_attn.o_proj": QuantScheme(2, 32, True),
             "1.mlp.down_proj": QuantScheme(8, None)}
    ckpt = mixed_checkpoint(tmp_path, split, intermediate_size=160)  # down_proj: 160 inputs, not a multiple of 64
    assert main(["export", str(ckpt), "--format", "compressed-tensors", "--dtype", "float32", "-o",
                 str(tmp_path / "ct")]) == 0
    err = " ".join(capsys.readouterr().err.split())  # as printed, wrapped to the terminal
    assert "vLLM cannot load this: model.layers.0.self_attn.qkv_proj mixes schemes across its shards" in err
    assert "W2s-g32: vLLM's kernels run 4 and 8 bits" in err
    assert "model.layers.1.mlp.down_proj is W8a-ch: 8-bit zero points run only on Machete" in err
    assert "(here 160 -> 128)" in err
    # the export itself is still correct for the compressed-tensors package
    decompressed = library_decompressed(tmp_path / "ct")
    paperback = load_model(str(ckpt), with_tokenizer=False).model
    assert all(torch.equal(w, paperback.get_submodule(m).dequantized_weight()) for m, w in decompressed.items())
