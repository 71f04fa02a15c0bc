"""`paperback profile` and `paperback fit` end to end on a tiny model with a real tokenizer."""

import json

import pytest

from helpers import tiny_llama_hf
from paperback.cli import main
from paperback.kv.schemes import parse_kv_scheme

SMALL = ["--method", "rtn", "--weight-schemes", "W8s-ch,W4a-g64,W2a-g64", "--kv-formats", "fp16,int8:r=32,kivi2:r=32",
         "--window-tokens", "128", "--weight-tokens", "64", "--additivity-samples", "3"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2):
    """A random two-layer Llama with SmolLM2's tokenizer, as a Hugging Face directory."""
    path = tmp_path_factory.mktemp("tiny_hf")
    hf = tiny_llama_hf(vocab_size=smollm2.config.vocab_size, hidden_size=128, intermediate_size=192,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                       tie_word_embeddings=True)
    hf.save_pretrained(path, safe_serialization=True)
    smollm2.tokenizer.hf.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One profile cache for the module: the first command profiles, the others reuse it."""
    return tmp_path_factory.mktemp("profiles")


def test_profile_cli_writes_a_complete_profile(tiny_dir, tmp_path, cache, capsys):
    out = tmp_path / "profile.json"
    assert main(["profile", str(tiny_dir), "-o", str(out), "--cache-dir", str(cache), *SMALL]) == 0
    data = json.loads(out.read_text())
    assert data["complete"] and data["weights"]["kl"]["head"]["W2a-g64"] > 0
    err = capsys.readouterr().err  # off a terminal, a line as each stage starts and ends
    for part in ("profile weights", "profile KV", "profile retention", "profile additivity"):
        assert f"[paperback] {part}: " in err and f"[paperback] {part}: done: " in err, part


def test_fit_writes_a_checkpoint_that_serves_its_own_kv_policy(tiny_dir, tmp_path, cache, capsys):
    out = tmp_path / "fitted"
    argv = ["fit", str(tiny_dir), "-o", str(out), "--memory", "400MiB", "--context", "256", "--users", "2",
            "--cache-dir", str(cache), "--eval-context", "128", "--eval-windows", "2", *SMALL, "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    recipe = json.loads((out / "recipe.json").read_text())
    assert recipe["kv_policy"] == result["allocation"]["kv_policy"]
    assert json.loads((out / "fit.json").read_text())["allocation"] == result["allocation"]
    assert result["allocation"]["total_bytes"] <= 400 * 2 ** 20
    # Every layer's scheme in the checkpoint is the one allocated to its unit.
    units = {p: u["name"] for u in json.load(open(cache / (result["profile"]["key"] + ".json")))[
        "weights"]["units"] for p in u["params"]}
    chosen = result["allocation"]["weights"]
    for param, layer in recipe["layers"].items():
        if units[param] == "head" and "head" not in chosen:  # allocated by bands of vocabulary rows
            labels = [chosen[f"head.band{b}"] for b in range(8)]
            bits = [b["scheme"]["bits"] for b in layer["bands"]] if "bands" in layer else [layer["scheme"]["bits"]] * 8
            assert bits == [int(label[1]) for label in labels]
            continue
        assert layer["scheme"]["bits"] == int(chosen[units[param]][1])
    # The second pass measured the best solutions by head scheme (and even bits) and kept the least KL.
    second = result["second_pass"]
    assert len(second) >= 2 and len({c["name"] for c in second}) == len(second)
    kept = [c for c in second if c["chosen"]]
    measured = [c["measured_kl"] for c in second if c["measured_kl"] is not None]
    assert len(kept) == 1 and (kept[0]["measured_kl"] == min(measured) if len(measured) > 1 else
                               kept[0]["predicted_kl"] == min(c["predicted_kl"] for c in second))
    name = kept[0]["name"]
    if name.startswith("even "):
        assert set(chosen.values()) == {name.removeprefix("even ")}
    elif name != "head in bands":
        assert {chosen[f"head.band{b}"] for b in range(8)} == {name.removeprefix("head ")}
    q = result["quality"]
    assert q["eval"]["kl_divergence"] > 0 and q["eval"]["tokens_scored"] == 2 * 127
    assert len(q["needles"]["fitted"]) == 3
    # plan counts the checkpoint's weights and its KV policy as the allocation did.
    assert main(["plan", str(out), "--memory", "400MiB", "--context", "256", "--users", "2", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["rows"][0]
    assert row["kv"] == "this checkpoint's KV policy" and "this checkpoint" in row["weights"]
    assert row["weight_bytes"] == result["allocation"]["weight_bytes"]  # to the byte
    assert 0.9 * result["allocation"]["kv_bytes"] <= row["kv_bytes_at_context"] <= result["allocation"]["kv_bytes"]
    # The paged engine serves the checkpoint in its per-layer formats with no flags.
    from paperback.engine.llm import LLM
    from paperback.generation.sampling import SamplingParams

    llm = LLM(str(out), kv_memory=64 * 2 ** 20)
    layers = [layer.scheme.label for layer in llm.engine.pool.layers]
    assert layers == [parse_kv_scheme(result["allocation"]["kv"][str(i)]).label for i in range(2)]
    assert len(llm.generate(["Hello there"], SamplingParams(max_tokens=4))[0].outputs[0].token_ids) == 4
    # eval on the checkpoint with no KV flags reads through the fitted policy.
    assert main(["eval", str(out), "--data", "pydoc", "--context", "128", "--max-windows", "1", "--json"]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    assert evaluated["kv"]["from_checkpoint"] and evaluated["kv"]["layers"] == [
        parse_kv_scheme(result["allocation"]["kv"][str(i)]).label for i in range(2)]


def test_fit_refuses_a_budget_below_the_smallest_model_before_work(tiny_dir, tmp_path, capsys):
    code = main(["fit", str(tiny_dir), "-o", str(tmp_path / "x"), "--memory", "100MiB", "--context", "256",
                 "--cache-dir", str(tmp_path / "cache"), *SMALL])
    err = capsys.readouterr().err
    assert code == 2 and "Nearest feasible: --memory" in err and "Traceback" not in err
    assert not (tmp_path / "cache").exists() and not (tmp_path / "x").exists()


def test_fit_refuses_tiny_text(tiny_dir, tmp_path, capsys):
    text = tmp_path / "tiny.txt"
    text.write_text("Only a few words here.")
    code = main(["fit", str(tiny_dir), "-o", str(tmp_path / "x"), "--memory", "1GiB", "--context", "256",
                 "--text", str(text), *SMALL])
    assert code == 2 and "tokens" in capsys.readouterr().err


def test_profile_refuses_an_unknown_model(tmp_path, capsys):
    code = main(["profile", str(tmp_path / "nope.gguf"), "-o", str(tmp_path / "p.json")])
    assert code == 2 and "not found" in capsys.readouterr().err


def test_fit_report_is_self_contained(tiny_dir, tmp_path, cache, capsys):
    out = tmp_path / "fitted"
    argv = ["fit", str(tiny_dir), "-o", str(out), "--memory", "400MiB", "--context", "256", "--needle-depths", "0.5",
            "--cache-dir", str(cache), "--eval-context", "128", "--eval-windows", "1", "--evict", *SMALL]
    assert main(argv) == 0
    fitted = json.loads((out / "fit.json").read_text())
    assert fitted["config"]["evict"] and fitted["config"]["retrieval_kl"] == 0.001  # --evict bounds lookups
    profile = json.loads((cache / (fitted["profile"]["key"] + ".json")).read_text())
    for layer, label in fitted["allocation"]["kv"].items():  # every layer's option within the bound
        scheme = parse_kv_scheme(label)
        if scheme.window:
            cost = min(profile["retrieval"]["evict"][layer].values())
        else:
            cost = profile["retrieval"]["formats"][layer][scheme.format_label]
        assert cost <= 0.001
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") >= 4
    for section in ("Budget split", "Per layer", "Predicted against measured quality", "Quality against budget",
                    "Breakdown point", "Pearson", "needles at", "retention", "Long-range lookups", "Second pass",
                    "Head bands:"):
        assert section in page
    # Nothing is fetched from elsewhere: no URL other than the embedded images.
    import re

    assert not re.search(r"(src|href)=\"(?!data:)", page) and "http://" not in page and "https://" not in page


def test_fit_refuses_a_bad_retrieval_bound_before_work(tiny_dir, tmp_path, capsys):
    code = main(["fit", str(tiny_dir), "-o", str(tmp_path / "x"), "--memory", "1GiB", "--context", "256",
                 "--retrieval-kl", "lots"])
    assert code == 2 and "--retrieval-kl" in capsys.readouterr().err


@pytest.mark.parametrize("margin", ["1.5", "-0.1"])
def test_fit_refuses_a_bad_even_margin_before_work(tiny_dir, tmp_path, capsys, margin):
    code = main(["fit", str(tiny_dir), "-o", str(tmp_path / "x"), "--memory", "1GiB", "--context", "256",
                 "--even-margin", margin])
    assert code == 2 and "--even-margin" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_fit_with_a_profile_of_other_text_is_refused(tiny_dir, tmp_path, cache, capsys):
    profile = tmp_path / "profile.json"
    assert main(["profile", str(tiny_dir), "-o", str(profile), "--cache-dir", str(cache), *SMALL]) == 0
    other = tmp_path / "other.txt"
    other.write_text("A different text entirely. " * 2000)
    code = main(["fit", str(tiny_dir), "-o", str(tmp_path / "x"), "--memory", "1GiB", "--context", "256",
                 "--profile", str(profile), "--text", str(other)])
    assert code == 2 and "other text" in capsys.readouterr().err


def test_the_main_job_runs_in_a_reduced_form(tmp_path, capsys):
    """`paperback demo` as the README's first command runs it, on the same code path with less work: one
    calibration window, the solve's own answer (no second pass), one scored window, no needles, no speed row.
    Off a terminal it says a line per stage."""
    out = tmp_path / "demo-fit"
    assert main(["demo", "--output", str(out), "--eval-windows", "1", "--skip-bench", "--calib-samples", "1",
                 "--candidates", "1", "--no-needles"]) == 0
    fit = json.loads((out / "fit.json").read_text())
    assert fit["seconds"]["profile"] < 5  # the shipped profile, reused
    assert fit["allocation"]["total_bytes"] <= 2 ** 30 and (out / "report.html").exists()
    assert fit["quality"]["eval"]["kl_divergence"] < 0.05
    demo = json.loads((out / "demo.json").read_text())  # the comparison, with what it ran on
    assert demo["provenance"]["cpu"] and demo["provenance"]["kernels"]["simd"]
    assert demo["fitted"]["total_bytes"] == fit["allocation"]["total_bytes"] and demo["full"]["wikitext2"]["perplexity"]
    captured = capsys.readouterr()
    assert "the full model beside the fitted one" in captured.out and "WikiText-2 perplexity" in captured.out
    assert "[fit] solving the budget" in captured.err and "[paperback] WikiText-2: the full model" in captured.err


@pytest.mark.slow  # the demo as a user runs it: two candidates quantized by AWQ on 8 windows, needles at 8,192
def test_demo_fits_the_default_model_from_its_shipped_profile(tmp_path, capsys):
    """The main job: SmolLM2 fitted into 1 GiB for 8 x 8,192 tokens (no profiling: the profile ships)."""
    out = tmp_path / "demo-fit"
    assert main(["demo", "--output", str(out), "--eval-windows", "2", "--skip-bench"]) == 0
    fit = json.loads((out / "fit.json").read_text())
    assert fit["profile"]["seconds"] and fit["seconds"]["profile"] < 5  # reused, not measured
    assert fit["allocation"]["total_bytes"] <= 2 ** 30
    assert fit["quality"]["eval"]["kl_divergence"] < 0.05 and (out / "report.html").exists()
    assert "the full model beside the fitted one" in capsys.readouterr().out


def test_a_fit_with_vllms_schemes_exports_as_compressed_tensors_it_can_load(tiny_dir, tmp_path, capsys):
    """A fit whose candidates are schemes vLLM's kernels run, exported: one config group per scheme the fit
    chose, every module where its unit put it, and nothing the vLLM check would block."""
    from paperback.export.compressed_tensors_export import export_compressed_tensors

    out = tmp_path / "fitted"
    schemes = "W8s-ch,W4s-g64,W4a-g32"
    argv = ["fit", str(tiny_dir), "-o", str(out), "--memory", "379.5MiB", "--context", "256", "--users", "2",
            "--cache-dir", str(tmp_path / "cache"), "--eval-context", "128", "--eval-windows", "1",
            "--method", "rtn", "--weight-schemes", schemes, "--kv-formats", "fp16,fp8", "--window-tokens", "128",
            "--weight-tokens", "64", "--additivity-samples", "3", "--no-needles", "--no-head-bands", "--json"]
    assert main(argv) == 0
    chosen = json.loads(capsys.readouterr().out)["allocation"]["weights"]
    summary = export_compressed_tensors(out, tmp_path / "ct", "float32", progress=False)
    assert summary["vllm"]["loads"], summary["vllm"]
    config = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    blocks = {label for unit, label in chosen.items() if unit != "head"}
    assert len(blocks) > 1, chosen  # a mix: the budget sits between all-W4 and all-W8
    assert {s for s in summary["schemes"]} == blocks
    assert len(config["config_groups"]) == len(blocks)
    recipe = json.loads((out / "recipe.json").read_text())
    for group in config["config_groups"].values():
        for module in group["targets"]:
            if module != "Linear":
                bits = recipe["layers"][f"{module}.weight"]["scheme"]["bits"]
                assert group["weights"]["num_bits"] == bits
