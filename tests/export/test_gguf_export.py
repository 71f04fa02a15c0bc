"""GGUF export: paperback's codes as llama.cpp's legacy blocks, read back by the gguf package and by paperback."""

import json

import gguf
import numpy as np
import pytest
import torch

from helpers import tiny_llama_hf, write_llama_gguf
from paperback.cli import main
from paperback.errors import PaperbackError
from paperback.export.gguf_export import encode_blocks, export_gguf, permute_rope_rows
from paperback.loading import load_model
from paperback.loading.gguf_file import unpermute_rope_rows
from paperback.quantization import QuantScheme
from paperback.quantization.checkpoint import save_checkpoint, swap_in_quantized
from paperback.quantization.model_pass import EMBED_PARAM, HEAD_PARAM, QuantizeConfig, parse_targets, quantize_model
from paperback.quantization.rtn import quantize_rtn


@pytest.mark.parametrize("scheme, qtype", [(QuantScheme(4, 32, True), "Q4_0"), (QuantScheme(4, 64, True), "Q4_0"),
                                           (QuantScheme(8, None, True), "Q8_0"), (QuantScheme(8, 64, True), "Q8_0"),
                                           (QuantScheme(4, 32), "Q4_1"), (QuantScheme(4, 128), "Q4_1")])
def test_blocks_dequantize_as_paperback_does(scheme, qtype):
    w = torch.randn(24, 256) * torch.linspace(0.01, 3, 256)
    q = quantize_rtn(w, scheme)
    from paperback.export.gguf_export import BLOCK_TYPES

    data = encode_blocks(q, BLOCK_TYPES[(scheme.bits, scheme.symmetric)])
    assert data.shape == (24, 256 // 32 * gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][1])
    theirs = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype])
    mine = q.dequantize().numpy()
    if scheme.symmetric:  # the same codes and fp16 scales: bit-exact
        assert np.array_equal(theirs, mine)
    else:  # Q4_1's offset m = -zero x scale is rounded to fp16
        assert np.abs(theirs - mine).max() <= 1e-3 * np.abs(mine).max()


def test_rope_row_permutation_round_trips():
    rows = np.arange(48 * 3).reshape(48, 3)
    assert np.array_equal(unpermute_rope_rows(permute_rope_rows(rows, 4), 4), rows)


def refuses_quantization_config(out, capsys):
    """A function (change, message): edit a copy of `out`'s quantization_config with `change`, and check that
    loading the directory is refused with `message` on one line, no traceback."""
    config = json.loads((out / "config.json").read_text())

    def refused(change, message):
        edited = json.loads(json.dumps(config))
        change(edited["quantization_config"])
        (out / "config.json").write_text(json.dumps(edited))
        assert main(["eval", str(out), "--max-windows", "1"]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err

    return refused


def quantized_checkpoint(tmp_path, scheme, edge, tied=True):
    hf = tiny_llama_hf(num_hidden_layers=2, hidden_size=128, intermediate_size=256, tie_word_embeddings=tied)
    source = write_llama_gguf(hf, tmp_path / "tiny.gguf")
    lm = load_model(str(source), with_tokenizer=False)
    config = QuantizeConfig("rtn", scheme, targets=parse_targets("blocks,embed,head"),
                            layer_schemes={EMBED_PARAM: edge, HEAD_PARAM: edge})
    results = quantize_model(lm.model, config, progress=False)
    swap_in_quantized(lm.model, results)
    recipe = {"source_model": str(source), "layers": {n: {"scheme": q.scheme.to_dict()} for n, q in results.items()}}
    return save_checkpoint(lm.model, None, recipe, tmp_path / "ckpt"), source


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("scheme", [QuantScheme(4, 64), QuantScheme(4, 32, True)])
def test_export_reloads_with_the_same_logits(tmp_path, scheme, tied):
    ckpt, source = quantized_checkpoint(tmp_path, scheme, QuantScheme(8, None, True), tied)
    out = tmp_path / "tiny-q.gguf"
    summary = export_gguf(ckpt, out, progress=False)
    kind = "Q4_0" if scheme.symmetric else "Q4_1"
    assert summary["tensors"] == {kind: 14, "Q8_0": 1 if tied else 2, "F32": 5}
    reader = gguf.GGUFReader(out)
    source_reader = gguf.GGUFReader(source)
    for key in ("llama.block_count", "llama.embedding_length", "llama.rope.freq_base"):
        assert reader.fields[key].contents() == source_reader.fields[key].contents()
    assert ("output.weight" in {t.name for t in reader.tensors}) != tied
    # paperback loads the export through its GGUF loader: the same model, up to Q4_1's fp16 offsets.
    mine = load_model(str(ckpt), with_tokenizer=False).model
    theirs = load_model(str(out), with_tokenizer=False).model
    ids = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        a, b = mine(ids), theirs(ids)
    if scheme.symmetric:
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
    else:
        assert (a - b).abs().max() <= 1e-2 * a.abs().max()
    assert oct(out.stat().st_mode & 0o777) == "0o644"


def test_schemes_gguf_cannot_hold_are_refused_before_writing(tmp_path, capsys):
    ckpt, _ = quantized_checkpoint(tmp_path, QuantScheme(3, 64), QuantScheme(8, None, True))
    out = tmp_path / "x.gguf"
    with pytest.raises(PaperbackError, match="W3a-g64.*GGUF export takes W4 symmetric"):
        export_gguf(ckpt, out, progress=False)
    assert not out.exists() and not list(tmp_path.glob("x.gguf*"))
    (tmp_path / "b").mkdir()
    ckpt2, _ = quantized_checkpoint(tmp_path / "b", QuantScheme(4, 48), QuantScheme(8, None, True))
    assert main(["export", str(ckpt2), "--format", "gguf", "-o", str(out)]) == 2
    assert "multiples of 32" in capsys.readouterr().err
    assert main(["export", str(tmp_path), "-o", str(out)]) == 2
    assert "not a paperback checkpoint" in capsys.readouterr().err


def test_cli_exports_the_default_checkpoint_of_the_bundled_model(tmp_path, capsys):
    ckpt = tmp_path / "smol"
    assert main(["quantize", "smollm2", "--method", "rtn", "--group-size", "64", "-o", str(ckpt), "--json"]) == 0
    capsys.readouterr()
    out = tmp_path / "smol.gguf"
    assert main(["export", str(ckpt), "--format", "gguf", "-o", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["tensors"] == {"Q4_1": 210, "Q8_0": 1, "F32": 61}
    reader = gguf.GGUFReader(out)
    assert reader.fields["tokenizer.ggml.pre"].contents() == "smollm"
    assert "tokenizer.chat_template" in reader.fields
    assert main(["export", str(ckpt), "-o", str(out)]) == 2  # exists
    assert "--overwrite" in capsys.readouterr().err
    # paperback reads the export and computes the checkpoint's distribution on real text (Q4_1's fp16 offsets
    # are the one rounding).
    from paperback.evaluation import load_text

    fitted = load_model(str(ckpt))
    ids = torch.tensor([fitted.tokenizer.encode(load_text("wikitext2")[:2000], add_special_tokens=False)[:128]])
    with torch.no_grad():
        mine = torch.log_softmax(fitted.model(ids), -1)
        theirs = torch.log_softmax(load_model(str(out), with_tokenizer=False).model(ids), -1)
    assert (mine.exp() * (mine - theirs)).sum(-1).mean() < 1e-3
