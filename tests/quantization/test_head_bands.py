import json

import pytest
import torch

from helpers import tiny_llama_hf, write_llama_gguf
from paperback.errors import ModelFileError, PaperbackError
from paperback.loading import load_model
from paperback.memory import module_bytes
from paperback.quantization.checkpoint import RECIPE_FILE, WEIGHTS_FILE
from paperback.quantization.head_bands import (BAND_ENDS, BandedQuantEmbedding, HeadBands, band_of_ranking,
                                               band_rows, band_sizes, decode_band_of, encode_band_of,
                                               quantize_banded, split_head_bands)
from paperback.quantization.model_pass import BLOCK_LINEARS, EMBED_PARAM, QuantizeConfig, quantize_model
from paperback.quantization.pipeline import save_quantized
from paperback.quantization.qlinear import QuantEmbedding
from paperback.quantization.rtn import quantize_rtn
from paperback.quantization.scheme import QuantScheme

SCHEMES = (QuantScheme(8, None, True), QuantScheme(8, None, True), QuantScheme(4, 32), QuantScheme(4, 64),
           QuantScheme(4, 64), QuantScheme(3, 64), QuantScheme(3, 64), QuantScheme(2, 64))


def ranking(vocab, seed=0):
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("vocab", [256, 1000, 49152, 9])
def test_bands_double_in_size_and_cover_the_vocabulary_once(vocab):
    sizes = band_sizes(vocab)
    assert len(sizes) == len(BAND_ENDS) and sum(sizes) == vocab and min(sizes) >= 0
    band_of = band_of_ranking(ranking(vocab))
    assert [len(r) for r in band_rows(band_of)] == sizes
    if vocab >= 1000:
        assert sizes[-1] == vocab // 2 and sizes[0] == pytest.approx(vocab / 128, abs=1)


def test_the_most_used_tokens_are_in_the_first_band_and_the_layout_round_trips():
    order = ranking(256)
    band_of = band_of_ranking(order)
    assert set(band_rows(band_of)[0].tolist()) == set(order[:2].tolist())
    assert torch.equal(decode_band_of(encode_band_of(band_of), 256), band_of)
    with pytest.raises(PaperbackError, match="holds 256 entries"):
        decode_band_of(encode_band_of(band_of), 300)
    with pytest.raises(PaperbackError, match="base64"):
        decode_band_of("not base64!", 256)


def test_a_banded_embedding_looks_up_and_multiplies_as_its_dequantized_matrix():
    torch.manual_seed(0)
    weight = torch.randn(256, 64)
    bands = HeadBands(band_of_ranking(ranking(256)), SCHEMES)
    q = quantize_banded(weight, bands, quantize_rtn)
    dense = q.dequantize()
    for rows, part, scheme in zip(band_rows(bands.band_of), q.bands, SCHEMES):
        assert torch.equal(dense[rows], quantize_rtn(weight[rows], scheme).dequantize())
        assert part.scheme == scheme
    module = BandedQuantEmbedding.from_banded(q)
    ids = torch.tensor([[0, 5, 255, 17], [3, 3, 128, 200]])
    assert torch.equal(module(ids), dense[ids])
    x = torch.randn(3, 64)
    assert torch.allclose(module.as_linear(x), x @ dense.T, atol=1e-4)
    assert module.storage_bytes() == sum(b.storage_bytes() for b in module.bands) + 256
    from paperback.allocate.units import quantized_bytes  # what the allocator counts, to the byte
    assert module.storage_bytes() == sum(quantized_bytes(s, len(r), 64)
                                         for r, s in zip(band_rows(bands.band_of), SCHEMES)) + 256


def test_one_scheme_in_every_band_is_the_plain_head_and_a_policy_splits_into_layers_and_bands():
    band_of = band_of_ranking(ranking(256))
    assert HeadBands(band_of, (QuantScheme(4, 64),) * 8).uniform == QuantScheme(4, 64)
    assert HeadBands(band_of, SCHEMES).uniform is None
    plain, bands = split_head_bands({"a.weight": SCHEMES[0], **{f"{EMBED_PARAM}@band{b}": s
                                                                 for b, s in enumerate(SCHEMES)}}, band_of)
    assert plain == {"a.weight": SCHEMES[0]} and bands.schemes == SCHEMES
    assert split_head_bands({"a.weight": SCHEMES[0]}, None) == ({"a.weight": SCHEMES[0]}, None)
    with pytest.raises(PaperbackError, match="without their layout"):
        split_head_bands({f"{EMBED_PARAM}@band0": SCHEMES[0]}, band_of)


@pytest.fixture(scope="module")
def tied_gguf(tmp_path_factory):
    hf = tiny_llama_hf(tie_word_embeddings=True)
    return write_llama_gguf(hf, tmp_path_factory.mktemp("tied") / "tied.gguf")


def banded_checkpoint(tied_gguf, out, schemes=SCHEMES):
    lm = load_model(str(tied_gguf), "fp32", with_tokenizer=False)
    bands = HeadBands(band_of_ranking(ranking(lm.config.vocab_size)), schemes)
    config = QuantizeConfig("rtn", QuantScheme(4, 32), targets=BLOCK_LINEARS + ("head",), head_bands=bands)
    quantized = quantize_model(lm.model, config, progress=False)
    ids = torch.tensor([[1, 7, 200, 33, 90]])
    fake = lm.model.logits(lm.model.hidden_states(ids))
    save_quantized(lm, config, None, quantized, 0.0, out)
    return lm, fake, ids


def test_a_banded_head_is_saved_and_loads_to_the_same_logits(tied_gguf, tmp_path):
    lm, fake, ids = banded_checkpoint(tied_gguf, tmp_path / "ck")
    assert isinstance(lm.model.model.embed_tokens, BandedQuantEmbedding)
    recipe = json.loads((tmp_path / "ck" / RECIPE_FILE).read_text())
    entry = recipe["layers"][EMBED_PARAM]
    assert [b["rows"] for b in entry["bands"]] == band_sizes(256)
    assert [QuantScheme(**b["scheme"]) for b in entry["bands"]] == list(SCHEMES)
    loaded = load_model(str(tmp_path / "ck"), "fp32", with_tokenizer=False).model
    assert isinstance(loaded.model.embed_tokens, BandedQuantEmbedding)
    assert torch.allclose(loaded.logits(loaded.hidden_states(ids)), fake, atol=1e-4)
    assert module_bytes(loaded.model.embed_tokens) == loaded.model.embed_tokens.storage_bytes()


def test_a_head_of_one_scheme_in_every_band_is_stored_plainly(tied_gguf, tmp_path):
    lm, _, _ = banded_checkpoint(tied_gguf, tmp_path / "ck", (QuantScheme(4, 64),) * 8)
    assert type(lm.model.model.embed_tokens) is QuantEmbedding
    assert "bands" not in json.loads((tmp_path / "ck" / RECIPE_FILE).read_text())["layers"][EMBED_PARAM]


def test_a_banded_checkpoint_with_a_layout_that_does_not_match_its_bands_is_refused(tied_gguf, tmp_path):
    from safetensors.torch import load_file, save_file

    banded_checkpoint(tied_gguf, tmp_path / "ck")
    recipe_path = tmp_path / "ck" / RECIPE_FILE
    recipe = json.loads(recipe_path.read_text())
    del recipe["weights_sha256"]  # edited on purpose: the layout check, not the digest, must catch it
    recipe_path.write_text(json.dumps(recipe))
    state = load_file(str(tmp_path / "ck" / WEIGHTS_FILE))
    state["model.embed_tokens.band_of"] = torch.zeros(256, dtype=torch.uint8)
    save_file(state, str(tmp_path / "ck" / WEIGHTS_FILE))
    with pytest.raises(ModelFileError, match="band_of puts"):
        load_model(str(tmp_path / "ck"), "fp32", with_tokenizer=False)
    recipe["layers"][EMBED_PARAM]["bands"][0]["rows"] = 3
    recipe_path.write_text(json.dumps(recipe))
    with pytest.raises(ModelFileError, match="hold 257 rows"):
        load_model(str(tmp_path / "ck"), "fp32", with_tokenizer=False)


def test_head_bands_without_a_quantized_head_or_on_a_model_with_its_own_head_are_refused(tmp_path):
    bands = HeadBands(band_of_ranking(ranking(256)), SCHEMES)
    with pytest.raises(PaperbackError, match="neither the head nor the embedding"):
        QuantizeConfig("rtn", targets=BLOCK_LINEARS, head_bands=bands)
    untied = load_model(str(write_llama_gguf(tiny_llama_hf(), tmp_path / "untied.gguf")), "fp32",
                        with_tokenizer=False)
    with pytest.raises(PaperbackError, match="tied embedding"):
        quantize_model(untied.model, QuantizeConfig("rtn", targets=BLOCK_LINEARS + ("head",), head_bands=bands),
                       progress=False)


def test_hf_export_writes_a_banded_head_as_the_dense_embedding(tied_gguf, tmp_path):
    from safetensors.torch import load_file

    from paperback.export.compressed_tensors_export import export_compressed_tensors

    lm, _, _ = banded_checkpoint(tied_gguf, tmp_path / "ck")
    export_compressed_tensors(tmp_path / "ck", tmp_path / "hf", progress=False)
    state = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert not any(".bands." in name or "band_of" in name for name in state)
    dense = lm.model.model.embed_tokens.dequantized_weight()
    assert torch.allclose(state["model.embed_tokens.weight"].float(), dense, atol=1e-2)


def test_info_counts_a_banded_head_band_by_band(tied_gguf, tmp_path):
    from paperback.cli.info_cmd import _quantization

    lm, _, _ = banded_checkpoint(tied_gguf, tmp_path / "ck")
    q = _quantization(load_model(str(tmp_path / "ck"), "fp32", with_tokenizer=False))
    assert q["layers"] == 2 * len(BLOCK_LINEARS) + 1  # the banded head is one layer
    assert "W2a-g64" in q["schemes"] and "W8s-ch" in q["schemes"]
    packed = sum(m.in_features * m.out_features for m in lm.model.modules() if hasattr(m, "qweight"))
    assert q["bits_per_weight"] * packed == pytest.approx(
        sum(s.storage_bits(len(r), 64) for r, s in zip(band_rows(lm.model.model.embed_tokens.band_of), SCHEMES))
        + sum(m.scheme.storage_bits(m.out_features, m.in_features) for n, m in lm.model.named_modules()
              if hasattr(m, "qweight") and ".bands." not in n))
