"""GPTQ and AWQ GEMM exports, decoded the way AutoGPTQ's and AutoAWQ's own dequantizers do (written here from
their published packing layouts: AutoGPTQ does not install beside torch 2.13, and AutoAWQ's GEMM dequantizer is
loaded from its files alone; docs/weights.md)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from paperback.cli import main
from paperback.errors import PaperbackError
from paperback.export.gptq_awq_export import export_awq, export_gptq
from paperback.loading import load_model
from paperback.quantization import QuantScheme

from test_gguf_export import quantized_checkpoint, refuses_quantization_config


def unpack_words(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """AutoGPTQ's unpacking: int32 words along `dim`, element j of a word at bit j x bits."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, bits)
    if dim == 0:
        return ((w[:, None, :] >> shifts[None, :, None]) & (2 ** bits - 1)).reshape(-1, w.shape[1])
    return ((w[:, :, None] >> shifts[None, None, :]) & (2 ** bits - 1)).reshape(w.shape[0], -1)


def gptq_v1_weight(t: dict, bits: int) -> torch.Tensor:
    q = unpack_words(t["qweight"], bits, 0)  # (in, out)
    zeros = unpack_words(t["qzeros"], bits, 1) + 1  # v1 stores zero - 1
    g = t["g_idx"].long()
    return ((q - zeros[g]) * t["scales"].float()[g]).T  # (out, in)


def awq_weight(t: dict) -> torch.Tensor:
    order = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])  # AutoAWQ's reverse of its [0, 2, 4, 6, 1, 3, 5, 7] packing

    def unpack(words):
        raw = unpack_words(words, 4, 1)  # nibble i of column c at raw[:, 8c + i]
        return raw.reshape(raw.shape[0], -1, 8)[..., order].reshape(raw.shape[0], -1)

    q, zeros, scales = unpack(t["qweight"]), unpack(t["qzeros"]), t["scales"].float()
    size = q.shape[0] // scales.shape[0]
    return ((q - zeros.repeat_interleave(size, 0)) * scales.repeat_interleave(size, 0)).T


def module_tensors(out):
    state = load_file(out / "model.safetensors")
    modules = {k.rsplit(".", 1)[0] for k in state if k.endswith(".qweight")}
    return {m: {k.rsplit(".", 1)[1]: v for k, v in state.items() if k.rsplit(".", 1)[0] == m} for m in modules}


@pytest.mark.parametrize("scheme", [QuantScheme(4, 32, True), QuantScheme(4, 64), QuantScheme(8, 64, True),
                                    QuantScheme(2, 32, True)])
def test_gptq_v1_decodes_to_paperbacks_weights(tmp_path, scheme):
    ckpt, _ = quantized_checkpoint(tmp_path, scheme, QuantScheme(8, None, True), tied=False)
    out = tmp_path / "gptq"
    try:
        summary = export_gptq(ckpt, out, progress=False)
    except PaperbackError as exc:  # an asymmetric group whose zero point is 0: v1 has no code for it
        assert not scheme.symmetric and "zero point 0 has no GPTQ v1 code" in str(exc)
        return
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config == {**config, "quant_method": "gptq", "bits": scheme.bits, "group_size": scheme.group_size,
                      "sym": scheme.symmetric, "desc_act": False, "checkpoint_format": "gptq"}
    assert summary["dense"] == ["lm_head", "model.embed_tokens"]  # the W8 head does not share GPTQ's one scheme
    paperback = load_model(str(ckpt), with_tokenizer=False).model
    tensors = module_tensors(out)
    assert len(tensors) == 14
    for module, t in tensors.items():
        assert torch.equal(gptq_v1_weight(t, scheme.bits), paperback.get_submodule(module).dequantized_weight())


def autoawq_dequantize_gemm():
    """AutoAWQ's own `dequantize_gemm` (awq/utils/packing_utils.py, pure torch), loaded from the installed
    package's file: importing `awq` itself pulls in its CUDA-era model stack."""
    import importlib.metadata
    import importlib.util

    try:
        dist = importlib.metadata.distribution("autoawq")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("autoawq is not installed (scripts/setup.sh installs it)")
    path = next(dist.locate_file(f) for f in dist.files if str(f).endswith("awq/utils/packing_utils.py"))
    spec = importlib.util.spec_from_file_location("autoawq_packing_utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.dequantize_gemm


@pytest.mark.parametrize("scheme", [QuantScheme(4, 32), QuantScheme(4, 64, True)])
def test_awq_gemm_decodes_to_paperbacks_weights(tmp_path, scheme):
    ckpt, _ = quantized_checkpoint(tmp_path, scheme, QuantScheme(8, None, True), tied=True)
    out = tmp_path / "awq"
    export_awq(ckpt, out, progress=False)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "awq" and config["version"] == "gemm" and config["zero_point"]
    paperback = load_model(str(ckpt), with_tokenizer=False).model
    tensors = module_tensors(out)
    assert len(tensors) == 14
    dequantize_gemm = autoawq_dequantize_gemm()
    for module, t in tensors.items():
        mine = paperback.get_submodule(module).dequantized_weight()
        assert torch.equal(awq_weight(t), mine)
        theirs = dequantize_gemm(t["qweight"], t["qzeros"], t["scales"], 4, scheme.group_size)  # (in, out), fp16
        assert torch.equal(theirs.T.float(), mine.half().float())  # AutoAWQ computes in fp16


def test_what_gptq_and_awq_cannot_hold_is_refused_before_writing(tmp_path, capsys):
    ckpt, _ = quantized_checkpoint(tmp_path, QuantScheme(3, 32), QuantScheme(8, None, True))
    with pytest.raises(PaperbackError, match="AWQ GEMM holds 4-bit codes only"):
        export_awq(ckpt, tmp_path / "a", progress=False)
    with pytest.raises(PaperbackError, match="GPTQ export writes 2, 4 or 8 bits"):
        export_gptq(ckpt, tmp_path / "g", progress=False)
    assert not (tmp_path / "a").exists() and not (tmp_path / "g").exists()
    (tmp_path / "b").mkdir()
    ckpt, _ = quantized_checkpoint(tmp_path / "b", QuantScheme(4, 96, True), QuantScheme(8, None, True))
    assert main(["export", str(ckpt), "--format", "gptq", "-o", str(tmp_path / "g")]) == 2
    assert "GPTQ's kernels need groups that divide the row (here: g32, g64, g128)" in capsys.readouterr().err
    (tmp_path / "c").mkdir()
    ckpt, _ = quantized_checkpoint(tmp_path / "c", QuantScheme(4, None, True), QuantScheme(8, None, True))
    assert main(["export", str(ckpt), "--format", "awq", "-o", str(tmp_path / "a")]) == 2
    assert "stores groups, not per-channel scales" in capsys.readouterr().err


@pytest.mark.parametrize("fmt, scheme", [("gptq", QuantScheme(4, 32, True)), ("gptq", QuantScheme(8, 64, True)),
                                         ("gptq", QuantScheme(2, 32, True)), ("awq", QuantScheme(4, 32)),
                                         ("awq", QuantScheme(4, 64))])
def test_export_then_import_gives_the_same_packed_layers(tmp_path, fmt, scheme):
    from paperback.quantization.qlinear import QuantEmbedding, QuantLinear

    ckpt, _ = quantized_checkpoint(tmp_path, scheme, QuantScheme(8, None, True), tied=True)
    (export_gptq if fmt == "gptq" else export_awq)(ckpt, tmp_path / fmt, progress=False)
    original = load_model(str(ckpt), with_tokenizer=False).model
    imported = load_model(str(tmp_path / fmt), with_tokenizer=False).model
    layers = {n: m for n, m in original.named_modules()
              if isinstance(m, QuantLinear) and not isinstance(m, QuantEmbedding)}
    assert len(layers) == 14
    for name, layer in layers.items():
        other = imported.get_submodule(name)
        assert isinstance(other, QuantLinear) and torch.equal(other.qweight, layer.qweight)
        assert torch.equal(other.scales, layer.scales)
        assert torch.equal(other.dequantized_weight(), layer.dequantized_weight())


def test_gptq_and_awq_files_paperback_cannot_run_are_refused_by_name(tmp_path, capsys):
    ckpt, _ = quantized_checkpoint(tmp_path, QuantScheme(4, 32, True), QuantScheme(8, None, True), tied=True)
    out = tmp_path / "gptq"
    export_gptq(ckpt, out, progress=False)
    written = (out / "config.json").read_text()
    refused = refuses_quantization_config(out, capsys)

    refused(lambda q: q.update(checkpoint_format="marlin"), "GPTQ checkpoint format 'marlin'")
    refused(lambda q: q.update(bits=3), "GPTQ with 3-bit weights")
    refused(lambda q: q.update(quant_method="awq", version="gemv"), "AWQ version 'gemv'")
    # A permuted g_idx (activation order without static groups).
    from safetensors.torch import load_file, save_file

    (out / "config.json").write_text(written)
    state = load_file(out / "model.safetensors")
    name = next(k for k in state if k.endswith("g_idx"))
    state[name] = state[name].flip(0).contiguous()
    save_file(state, out / "model.safetensors")
    assert main(["eval", str(out), "--max-windows", "1"]) == 2
    assert "activation-ordered groups" in capsys.readouterr().err
