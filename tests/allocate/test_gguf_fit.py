"""`fit --format gguf`: a model fitted to a file size with llama.cpp's types. Budgets and bad requests are
refused from the config before any weight loads; the written file stays within the size, holds at every
tensor the type the solve chose, bit for bit the cell that was priced, and beats (or is) the recipe it was
measured against; prices are cached, so another size is a solve and a write."""

import json
import os

import gguf
import numpy as np
import pytest
import torch

from paperback.allocate.gguf_budget import candidate_types, gguf_budget, tensor_candidates
from paperback.allocate.gguf_cells import GGUFCells
from paperback.allocate.gguf_fit import GGUFFit, GGUFFitConfig, baseline_recipe
from paperback.allocate.gguf_prices import anchor_type, kl_with, price_cells
from paperback.allocate.probe import ReferenceProbe
from paperback.cli import main
from paperback.errors import PaperbackError
from paperback.export.gguf_quantize import gguf_types_for, tensor_bytes
from paperback.loading import load_model
from paperback.loading.gguf_file import GGUFModelFile, unpermute_rope_rows
from paperback.loading.sources import bundled_model_path
from paperback.quantization.calibration import calibration_batch
from paperback.quantization.gguf_recipes import recipe
from paperback.quantization.gguf_types import GGUF_TYPES, QUANTIZED_TYPES

def test_the_file_stays_within_the_size_and_holds_the_chosen_types(fitted):
    fit, result = fitted
    assert result["bytes"] == os.path.getsize(result["output"]) <= 4_000_000
    reader = gguf.GGUFReader(result["output"])
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["token_embd.weight"] == result["tensors"]["model.embed_tokens.weight"]
    assert types["blk.1.ffn_down.weight"] == result["tensors"]["model.layers.1.mlp.down_proj.weight"]
    assert result["written"] == "fit"
    record = json.loads(reader.fields["paperback.recipe"].contents())
    assert record["types"] == result["tensors"] and record["fit"]["written"] == "fit"
    # each tensor took a type that tiles it: rows of 64 only legacy types, the down projection any
    assert all(not GGUF_TYPES[t].is_kquant for p, t in result["tensors"].items() if "down_proj" not in p)
    assert result["tensor_bytes"] <= fit.budget.tensor_bytes


def test_the_written_weights_are_the_priced_cells(fitted, tok_gguf):
    fit, result = fitted
    lm = load_model(str(tok_gguf), "fp32")
    cells = GGUFCells(lm.model, calibration_batch(lm.tokenizer, fit.config.calibration()), "rtn")
    stored = {t.name: t for t in gguf.GGUFReader(result["output"]).tensors}
    for param, name in (("model.layers.0.self_attn.q_proj.weight", "blk.0.attn_q.weight"),
                        ("model.layers.1.mlp.down_proj.weight", "blk.1.ffn_down.weight"),
                        ("model.embed_tokens.weight", "token_embd.weight")):
        tensor = stored[name]
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if "attn_q" in name:
            values = unpermute_rope_rows(values, lm.config.num_heads)
        cell = cells.quantize(param, GGUF_TYPES[result["tensors"][param]]).dequantize()
        assert np.array_equal(values, cell.numpy()), param
        assert not torch.equal(cell, dict(lm.model.named_parameters())[param])  # quantized indeed


def test_the_solution_is_measured_and_evaluated_against_the_full_model(fitted):
    _, result = fitted
    assert result["measured_kl"]["fit"] > 0 and result["predicted_kl"] > 0
    held = result["quality"]["fit"]
    assert held["kl_divergence"] > 0 and held["tokens_scored"] > 0
    assert result["estimate_check"]["samples"] == 4


def test_a_second_size_reuses_the_prices(fitted, tok_gguf, small_gguf_fit_config, tmp_path, capsys):
    fit, first = fitted
    prices = first["prices"]
    stamp = os.path.getmtime(prices)
    again = GGUFFit(str(tok_gguf), small_gguf_fit_config, tmp_path / "big.gguf", size=6_000_000,
                    cache_dir=fit.cache_dir, progress=True)
    result = again.run()
    assert "prices from" in capsys.readouterr().out
    assert result["prices"] == prices and os.path.getmtime(prices) == stamp
    assert result["bytes"] <= 6_000_000 and result["predicted_kl"] < first["predicted_kl"]


def test_anchor_prices_are_measured_and_the_rest_scale_with_output_error(tok_gguf):
    lm = load_model(str(tok_gguf), "fp32")
    ids = torch.randint(0, 49152, (2, 64), generator=torch.Generator().manual_seed(0))
    cells = GGUFCells(lm.model, ids, "rtn")
    probe = ReferenceProbe(lm.model, ids[:, :32])
    param = "model.layers.1.mlp.down_proj.weight"
    kinds = tensor_candidates(lm.config, candidate_types(["Q4_0", "Q8_0", "Q2_K", "Q4_K"]))
    prices = price_cells(cells, probe, {param: kinds[param]}, check_samples=0, progress=False)["cells"][param]
    anchor = anchor_type(kinds[param])
    assert anchor.name in ("Q4_0", "Q4_K") and prices[anchor.name]["measured"]
    assert prices[anchor.name]["kl"] == pytest.approx(
        kl_with(probe, param, cells.quantize(param, anchor).dequantize()), rel=1e-6)
    # more bits, less output error and a lower price
    assert prices["Q8_0"]["error"] < prices["Q4_0"]["error"] < prices["Q2_K"]["error"]
    assert prices["Q8_0"]["kl"] < prices["Q4_0"]["kl"] < prices["Q2_K"]["kl"]
    ratio = {n: p["kl"] / p["error"] for n, p in prices.items()}
    assert max(ratio.values()) == pytest.approx(min(ratio.values()), rel=1e-9)  # one factor per tensor


def test_an_embedding_price_runs_the_whole_model(tok_gguf):
    lm = load_model(str(tok_gguf), "fp32", with_tokenizer=False)
    ids = torch.randint(0, 49152, (2, 32), generator=torch.Generator().manual_seed(1))
    cells = GGUFCells(lm.model, ids, "rtn")
    probe = ReferenceProbe(lm.model, ids)
    embed = "model.embed_tokens.weight"
    weight = cells.quantize(embed, GGUF_TYPES["Q4_0"]).dequantize()
    kl = kl_with(probe, embed, weight)
    assert kl > 0
    # what a full forward with the quantized tied embedding (input rows and head) gives
    params = dict(lm.model.named_parameters())
    with torch.no_grad():
        full = torch.log_softmax(lm.model(ids).float(), -1)
        original = params[embed].data
        params[embed].data = weight
        changed = torch.log_softmax(lm.model(ids).float(), -1)
        params[embed].data = original
    assert kl == pytest.approx((full.exp() * (full - changed)).sum(-1).mean().item(), rel=1e-4)


def test_budgets_come_from_the_config_alone():
    source = GGUFModelFile(bundled_model_path("smollm2"))
    config = source.config()
    candidates = tensor_candidates(config, candidate_types(["Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q6_K"]))
    assert [k.name for k in candidates["model.layers.0.self_attn.q_proj.weight"]] == ["Q4_0", "Q5_0", "Q8_0"]
    assert "Q6_K" in [k.name for k in candidates["model.layers.0.mlp.down_proj.weight"]]
    budget = gguf_budget(source, candidates, size_of="q4_k_m")
    assert budget.size_of == "Q4_K_M"
    assert budget.tensor_bytes == tensor_bytes(config, gguf_types_for(config, recipe("Q4_K_M")))
    everything = candidate_types(QUANTIZED_TYPES)
    assert baseline_recipe(config, budget, everything) == "Q4_K_M"
    by_size = gguf_budget(source, candidates, size=110_000_000)
    assert by_size.tensor_bytes == 110_000_000 - by_size.fixed_bytes
    assert baseline_recipe(config, by_size, everything) == "Q4_K_M"  # the largest recipe within it
    # a recipe with a type the fit may not take is never its baseline (nor written instead of it)
    assert baseline_recipe(config, budget, candidate_types(["Q4_0", "Q5_0", "Q8_0", "Q4_K"])) is None
    assert baseline_recipe(config, by_size, candidate_types(["Q4_0", "Q8_0"])) == "Q4_0"
    with pytest.raises(PaperbackError, match="rows of 576 weights, which none of the candidate types"):
        tensor_candidates(config, candidate_types(["Q4_K", "Q6_K"]))


@pytest.mark.parametrize("argv, message", [
    (["--size", "40KB"], "the smallest mix"),
    (["--size-of", "Q4_K_XL"], "unknown llama.cpp recipe 'Q4_K_XL'"),
    (["--size-of", "Q4_K_M", "--types", "Q4_0,Q4_K_X"], "unknown GGUF weight type 'Q4_K_X': llama.cpp has no"),
    (["--size-of", "Q4_K_M", "--types", "Q4_0,IQ4_XS"], "llama.cpp's weight type IQ4_XS is not one paperback writes"),
    (["--size-of", "Q4_K_M", "--types", "Q4_K,Q6_K"], "rows of 64 weights, which none of the candidate types"),
    ([], "--size BYTES or as --size-of"),
    (["--size", "100MB", "--size-of", "Q4_K_M"], "(one of them)"),
    (["--size-of", "Q4_K_M", "--memory", "1GiB"], "--memory is an option of `fit --format checkpoint`"),
])
def test_bad_gguf_fits_are_refused_in_one_line_before_the_model_loads(plain_gguf, argv, message, tmp_path, capsys):
    out = tmp_path / "x.gguf"
    assert main(["fit", str(plain_gguf), "--format", "gguf", "-o", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_gguf_options_are_refused_for_a_checkpoint_fit(tmp_path, capsys):
    assert main(["fit", "smollm2", "--memory", "1GiB", "--context", "512", "--size-of", "Q4_K_M",
                 "-o", str(tmp_path / "d")]) == 2  # refused before the model is even opened
    assert "--size-of is an option of `fit --format gguf`" in capsys.readouterr().err
    assert main(["fit", "smollm2", "-o", str(tmp_path / "d")]) == 2
    assert "--memory and --context" in capsys.readouterr().err


def test_a_gguf_fit_needs_a_gguf_file_name_and_source(plain_gguf, tmp_path, capsys):
    assert main(["fit", str(plain_gguf), "--format", "gguf", "--size-of", "Q4_K_M", "-o", str(tmp_path / "x.bin")]) == 2
    assert "ending in .gguf" in capsys.readouterr().err
    existing = tmp_path / "there.gguf"
    existing.write_bytes(b"keep")
    assert main(["fit", str(plain_gguf), "--format", "gguf", "--size-of", "Q4_K_M", "-o", str(existing)]) == 2
    assert "--overwrite" in capsys.readouterr().err and existing.read_bytes() == b"keep"
    with pytest.raises(PaperbackError, match="not a GGUF file"):
        hf = tmp_path / "hf"
        hf.mkdir()
        (hf / "config.json").write_text("{}")
        GGUFFit(str(hf), GGUFFitConfig(), tmp_path / "y.gguf", size_of="Q4_K_M")


def test_a_restricted_fit_shares_the_prices_and_takes_only_its_types(fitted, tmp_path):
    fit, first = fitted
    assert fit.exact_types() == {}  # an F32 source: no type reproduces it
    narrow = fit.restricted(("Q4_0", "Q8_0", "Q4_K"))
    assert narrow._shared is fit._shared  # the loaded model, cells and prices, once
    result = narrow.run_budget(narrow.budget_of(size=4_000_000), tmp_path / "narrow.gguf")
    assert set(result["types"]) <= {"Q4_0", "Q8_0", "Q4_K"}
    assert result["prices"] == first["prices"] and result["bytes"] <= 4_000_000
    # the unrestricted solve had more to choose from, so its predicted KL is no higher
    assert first["predicted_kl"] <= result["predicted_kl"]
