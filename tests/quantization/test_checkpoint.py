import json

import pytest
import torch

from helpers import tiny_llama_hf, write_llama_gguf
from paperback.cli import main
from paperback.errors import PaperbackError, UnsupportedModelError
from paperback.loading import load_model
from paperback.quantization import QuantScheme
from paperback.quantization.checkpoint import RECIPE_FILE, save_checkpoint, swap_in_quantized
from paperback.quantization.model_pass import QuantizeConfig, quantize_model
from paperback.quantization.qlinear import QuantLinear


@pytest.fixture
def tiny_gguf(tmp_path):
    return str(write_llama_gguf(tiny_llama_hf(num_hidden_layers=2, hidden_size=128, intermediate_size=200),
                                tmp_path / "tiny.gguf"))


def quantized_tiny(path, scheme):
    lm = load_model(path, with_tokenizer=False)
    results = quantize_model(lm.model, QuantizeConfig("rtn", scheme), progress=False)
    return lm, results


@pytest.mark.parametrize("scheme", [QuantScheme(4, 64), QuantScheme(3, 48), QuantScheme(8, None, True)])
def test_saved_checkpoint_reloads_bit_identically(tmp_path, tiny_gguf, scheme):
    lm, results = quantized_tiny(tiny_gguf, scheme)
    ids = torch.randint(0, 256, (2, 17))
    with torch.no_grad():
        in_memory = lm.model(ids)
    swap_in_quantized(lm.model, results)
    save_checkpoint(lm.model, None, {"method": "rtn", "layers": {
        n: {"scheme": q.scheme.to_dict()} for n, q in results.items()}}, tmp_path / "out")
    loaded = load_model(str(tmp_path / "out"), with_tokenizer=False)
    assert isinstance(loaded.model.model.layers[0].mlp.down_proj, QuantLinear)
    with torch.no_grad():
        assert torch.equal(loaded.model(ids), in_memory)


def test_incompatible_recipe_version_is_refused(tmp_path, tiny_gguf):
    lm, results = quantized_tiny(tiny_gguf, QuantScheme(4, 64))
    swap_in_quantized(lm.model, results)
    out = save_checkpoint(lm.model, None, {"layers": {n: {"scheme": q.scheme.to_dict()} for n, q in results.items()}},
                          tmp_path / "out")
    recipe = json.loads((out / RECIPE_FILE).read_text())
    (out / RECIPE_FILE).write_text(json.dumps({**recipe, "format_version": 99}))
    with pytest.raises(UnsupportedModelError, match="format 99"):
        load_model(str(out), with_tokenizer=False)


def test_existing_output_is_not_overwritten_and_failures_leave_nothing(tmp_path, tiny_gguf):
    lm, results = quantized_tiny(tiny_gguf, QuantScheme(4, 64))
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(PaperbackError, match="--overwrite"):
        save_checkpoint(lm.model, None, {}, out)
    assert (out / "keep.txt").read_text() == "mine"

    class Exploding:
        class hf:
            @staticmethod
            def save_pretrained(path):
                raise OSError("disk full")

    target = tmp_path / "new"
    with pytest.raises(OSError):
        save_checkpoint(lm.model, Exploding(), {}, target)
    assert not target.exists() and not list(tmp_path.glob("new.partial*"))


def test_cli_quantize_then_every_command_accepts_the_directory(tmp_path, capsys):
    out = tmp_path / "smol-w4"
    assert main(["quantize", "smollm2", "--method", "rtn", "--bits", "4", "--group-size", "64", "-o", str(out),
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    # 210 block linears at W4 g64 and the tied embedding/head at 8 bits per channel, by default.
    assert summary["layers"] == 211 and summary["scheme"] == "W4a-g64, edges W8s-ch"
    recipe = json.loads((out / RECIPE_FILE).read_text())
    assert recipe["method"] == "rtn" and recipe["scheme"]["group_size"] == 64 and recipe["paperback_version"]
    assert recipe["layers"]["model.embed_tokens.weight"]["scheme"] == {"bits": 8, "group_size": None,
                                                                        "symmetric": True}
    # Smaller than the GGUF it came from, and readable by anyone (safetensors alone writes 0600).
    from paperback.loading.sources import resolve_model

    stored = sum(f.stat().st_size for f in out.iterdir())
    assert stored < resolve_model("smollm2").path.stat().st_size
    assert {oct(f.stat().st_mode & 0o777) for f in out.iterdir()} == {"0o644"}
    assert oct(out.stat().st_mode & 0o777) == "0o755"
    # Through a quantized cache too: with the tied head packed, nothing may ask it for a plain weight (it has none).
    assert main(["eval", str(out), "--context", "128", "--max-windows", "2", "--json", "--kv", "int8",
                 "--reference", "smollm2"]) == 0
    result = json.loads(capsys.readouterr().out)["results"][0]
    assert 0 < result["kl_divergence"] < 0.5 and result["top1_agreement"] > 0.6
    assert main(["generate", str(out), "Hello", "--max-tokens", "3", "--json"]) == 0
    capsys.readouterr()
    # the integer decode path, for this command only
    from paperback.kernels.settings import settings

    assert main(["generate", str(out), "Hello", "--max-tokens", "3", "--json", "--decode-activations", "int8"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 3 and settings.decode_activations == "fp32"
    assert main(["generate", str(out), "Hello", "--max-tokens", "3", "--json", "--kv-cache-dtype", "fp16"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 3
    assert main(["info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["parameters"] == 134_515_008  # packed layers count their weights, not their bytes
    weights_file = out / "model.safetensors"
    header = int.from_bytes(weights_file.read_bytes()[:8], "little")
    assert info["quantization"] == {"method": "rtn", "schemes": "W4a-g64, W8s-ch", "layers": 211,
                                    "bits_per_weight": pytest.approx(summary["bits_per_weight"]),
                                    "stored_bytes": weights_file.stat().st_size - 8 - header, "kv_policy": None}
    # plan counts the checkpoint's weights as info does: the file's tensor bytes.
    assert main(["plan", str(out), "--memory", "1GiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"][0]["weight_bytes"] == info["quantization"]["stored_bytes"]


def test_edge_scheme_none_and_same_and_a_bad_one(tmp_path, capsys):
    out = tmp_path / "blocks-only"
    assert main(["quantize", "smollm2", "--method", "rtn", "--edge-scheme", "none", "-o", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layers"] == 210
    assert main(["quantize", "smollm2", "--method", "rtn", "--edge-scheme", "fp16", "-o", str(tmp_path / "x")]) == 2
    assert "--edge-scheme fp16 is not a quantization scheme" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_embedding_and_head_as_targets_round_trip(tmp_path, tied, method):
    from paperback.quantization.model_pass import parse_targets
    from paperback.quantization.qlinear import QuantEmbedding

    hf = tiny_llama_hf(num_hidden_layers=2, hidden_size=128, intermediate_size=200, tie_word_embeddings=tied)
    lm = load_model(str(write_llama_gguf(hf, tmp_path / "tiny.gguf")), with_tokenizer=False)
    calibration = torch.randint(0, 256, (4, 32))
    config = QuantizeConfig(method, QuantScheme(4, 32), targets=parse_targets("blocks,embed,head"))
    results = quantize_model(lm.model, config, calibration, progress=False)
    expected = {"model.embed_tokens.weight"} | ({"lm_head.weight"} if not tied else set())
    assert expected <= set(results) and len(results) == 14 + len(expected)
    if method == "gptq":  # the head is weighed by its input Hessian, the embedding only rounded
        head = results["model.embed_tokens.weight" if tied else "lm_head.weight"]
        assert head.method == "gptq"
        if not tied:
            assert results["model.embed_tokens.weight"].method == "rtn"
    ids = torch.randint(0, 256, (2, 17))
    with torch.no_grad():
        fake_quant = lm.model(ids)
        swap_in_quantized(lm.model, results)
        packed_prefill, packed_decode = lm.model(ids), lm.model(ids[:1, :1])
    assert isinstance(lm.model.model.embed_tokens, QuantEmbedding)
    assert torch.allclose(packed_prefill, fake_quant, atol=1e-4, rtol=1e-4)
    save_checkpoint(lm.model, None, {"layers": {n: {"scheme": q.scheme.to_dict()} for n, q in results.items()}},
                    tmp_path / "out")
    loaded = load_model(str(tmp_path / "out"), with_tokenizer=False)
    assert isinstance(loaded.model.model.embed_tokens, QuantEmbedding)
    assert (loaded.model.lm_head is None) == tied
    with torch.no_grad():
        assert torch.equal(loaded.model(ids), packed_prefill)
        assert torch.equal(loaded.model(ids[:1, :1]), packed_decode)


def test_unknown_target_is_refused():
    from paperback.quantization.model_pass import parse_targets

    assert parse_targets("q_proj,head") == ("self_attn.q_proj", "head")
    with pytest.raises(PaperbackError, match="unknown quantization target 'lm_head'"):
        parse_targets("blocks,lm_head")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_every_method_quantizes_gemma3_from_the_cli(tmp_path, capsys, method):
    """End to end on the second bundled model: quantize, save, reload, evaluate against the full model."""
    out = tmp_path / f"gemma-{method}"
    assert main(["quantize", "gemma3", "--method", method, "--bits", "4", "--group-size", "128", "-o", str(out),
                 "--calib-samples", "16", "--calib-len", "256", "--awq-samples", "8", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    # 126 block linears at W4 g128, and the tied 262,144 x 640 embedding/head (62% of the weights) at W8.
    assert summary["layers"] == 18 * 7 + 1 and 6.3 < summary["bits_per_weight"] < 6.8
    assert main(["eval", str(out), "--context", "256", "--max-windows", "2", "--json",
                 "--reference", "gemma3"]) == 0
    result = json.loads(capsys.readouterr().out)["results"][0]
    assert 0 < result["kl_divergence"] < 0.5 and result["top1_agreement"] > 0.6
    assert main(["generate", str(out), "The Roman Empire", "--max-tokens", "3", "--json"]) == 0


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_mixed_schemes_per_layer_round_trip(tmp_path, tiny_gguf, method):
    """Per-layer schemes (what an allocation chooses), q/k/v apart too, in one checkpoint that reloads exactly."""
    lm = load_model(tiny_gguf, with_tokenizer=False)
    mix = {"model.layers.0.self_attn.q_proj.weight": QuantScheme(2, 32),
           "model.layers.0.self_attn.v_proj.weight": QuantScheme(8, None, True),
           "model.layers.1.mlp.down_proj.weight": QuantScheme(3, 64),
           "lm_head.weight": QuantScheme(8, None, True)}
    config = QuantizeConfig(method, QuantScheme(4, 32), targets=QuantizeConfig().targets + ("head",),
                            layer_schemes=mix)
    torch.manual_seed(0)
    results = quantize_model(lm.model, config, torch.randint(0, 256, (4, 32)), progress=False)
    for name, q in results.items():
        assert q.scheme == mix.get(name, QuantScheme(4, 32)), name
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        in_memory = lm.model(ids)
    swap_in_quantized(lm.model, results)
    save_checkpoint(lm.model, None, {"method": method, "layers": {
        n: {"scheme": q.scheme.to_dict()} for n, q in results.items()}}, tmp_path / "mixed")
    loaded = load_model(str(tmp_path / "mixed"), with_tokenizer=False)
    assert loaded.model.model.layers[0].self_attn.q_proj.scheme == QuantScheme(2, 32)
    with torch.no_grad():
        assert torch.allclose(loaded.model(ids), in_memory, atol=1e-4, rtol=1e-4)
