"""`paperback plan`: verdict, lever, flags, plot; bad input is a one-line error."""

import json

import pytest

from paperback.cli import main


def run_json(capsys, *argv):
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_worked_example_table_verdict_and_flags(capsys, tmp_path):
    report = run_json(capsys, "llama-2-7b", "--memory", "80GiB", "--context", "4096", "--users", "8",
                      "--plot", str(tmp_path / "plan.png"))
    base = next(r for r in report["rows"] if r["weights"] == "fp16" and r["kv"] == "fp16")
    assert base["kv_bytes_per_token"] == 524_288 and base["kv_bytes_at_context"] == 16 * 2 ** 30
    assert base["fits"] and report["verdict"]["lever"].startswith("none needed")
    assert "--max-model-len 4096 --max-num-seqs 8" in report["flags"]["vllm"]
    assert "-c 32768 -np 8" in report["flags"]["llama_cpp"]
    assert (tmp_path / "plan.png").stat().st_size > 10_000


def test_hand_off_lines_name_what_each_engine_can_load():
    import math

    from paperback.plan.arithmetic import kv_bytes
    from paperback.plan.planner import CUDA_ALLOWANCE, hand_off_flags
    from paperback.plan.shape import load_shape

    shape = load_shape("llama-2-7b")
    row = {"weights": "W4", "kv": "int4", "weight_bytes": 4 * 2 ** 30, "kv_bytes_at_context": 2 * 2 ** 30}
    flags = hand_off_flags(row, 4096, 8, 80 * 2 ** 30, shape)
    assert flags["vllm_model"] == "EXPORT" and "--format compressed-tensors" in flags["vllm_notes"][0]
    assert "--quantization" not in flags["vllm"]  # vLLM reads the export's quantization_config
    # vLLM has no int4 cache: it holds fp8, and the utilization counts that, not paperback's int4 bytes.
    fp8 = kv_bytes(shape, 4096, "fp8", 8)
    expected = math.ceil(100 * (4 * 2 ** 30 + fp8 + CUDA_ALLOWANCE) / (80 * 2 ** 30)) / 100
    assert f"--gpu-memory-utilization {expected:.2f}" in flags["vllm"] and "--kv-cache-dtype fp8_e4m3" in flags["vllm"]
    assert flags["llama_cpp_model"] == "EXPORT.gguf" and "-ctk q4_1 -ctv q4_1 -fa on" in flags["llama_cpp"]
    flags = hand_off_flags({**row, "weights": "W3", "kv": "fp8"}, 4096, 8, 80 * 2 ** 30, shape)
    assert flags["vllm_model"] == "MODEL" and "quantize to W4 or W8" in flags["vllm_notes"][0]
    assert "-ctk q8_0" in flags["llama_cpp"] and "q8_0 is the closest" in flags["llama_cpp_notes"][1]
    flags = hand_off_flags({**row, "kv": "int8"}, 4096, 8, 8 * 2 ** 30, shape)  # does not fit a GPU of 8 GiB
    assert "--gpu-memory-utilization" not in flags["vllm"] and "omitted" in " ".join(flags["vllm_notes"])
    assert "-ctk q8_0" in flags["llama_cpp"] and not flags["llama_cpp_notes"][1:]


def test_lever_when_the_baseline_does_not_fit(capsys):
    report = run_json(capsys, "llama-3.1-8b", "--memory", "24GiB", "--context", "32768", "--users", "4")
    verdict = report["verdict"]
    assert not verdict["baseline_fits"] and verdict["bottleneck"] == "KV cache"
    row = verdict["lever_row"]
    assert row["fits"] and row["total_bytes"] <= 24 * 2 ** 30
    # max users and context are the largest that fit
    base = report["rows"][0]
    assert base["max_users"] < 4 and base["max_context"] < 32768


def test_nothing_fits_names_the_nearest(capsys):
    report = run_json(capsys, "llama-3.1-70b", "--memory", "16GiB", "--context", "8192")
    assert report["verdict"]["lever"] is None and "nearest" in report["verdict"]["nearest"]


@pytest.mark.parametrize("argv, message", [
    (["nonesuch", "--memory", "8GiB"], "neither a preset"),
    (["llama-2-7b", "--memory", "0GiB"], "must be positive"),
    (["llama-2-7b", "--memory", "8GiB", "--context", "0"], "must be positive"),
    (["llama-2-7b", "--memory", "8GiB", "--kv", "int4:g=48"], "does not divide the head dimension 128"),
    (["llama-2-7b", "--memory", "8GiB", "--weights", "W5"], "unknown weight scheme"),
])
def test_bad_input(capsys, argv, message):
    assert main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err


def test_config_missing_a_field(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}))
    assert main(["plan", str(cfg), "--memory", "1GiB"]) == 2
    assert "lacks the required field 'num_hidden_layers'" in capsys.readouterr().err


def test_a_quantized_checkpoint_plans_with_its_own_stored_weights(tmp_path, capsys):
    from helpers import tiny_llama_hf, write_llama_gguf
    from paperback.loading import load_model
    from paperback.plan.arithmetic import checkpoint_weight_bytes, weight_bytes
    from paperback.plan.shape import load_shape
    from paperback.quantization import QuantScheme
    from paperback.quantization.checkpoint import save_checkpoint, swap_in_quantized
    from paperback.quantization.model_pass import QuantizeConfig, quantize_model

    gguf = write_llama_gguf(tiny_llama_hf(num_hidden_layers=2, hidden_size=128, intermediate_size=200),
                            tmp_path / "tiny.gguf")
    lm = load_model(str(gguf), with_tokenizer=False)
    scheme = QuantScheme(4, 64)
    results = quantize_model(lm.model, QuantizeConfig("rtn", scheme), progress=False)
    swap_in_quantized(lm.model, results)
    out = save_checkpoint(lm.model, None, {"layers": {n: {"scheme": q.scheme.to_dict()} for n, q in results.items()}},
                          tmp_path / "ckpt")
    # The bytes read from the file's header are the bytes the arithmetic predicts from the shape alone
    # (the tensors left unpacked stored as loaded, fp32), and they are the file's tensor bytes.
    label, stored = checkpoint_weight_bytes(out)
    assert label == "W4a-g64"
    predicted = weight_bytes(load_shape(str(out)), scheme)
    assert (stored.quantized_codes, stored.quantized_overhead) == (predicted.quantized_codes,
                                                                    predicted.quantized_overhead)
    assert stored.full_precision == 2 * predicted.full_precision
    assert checkpoint_weight_bytes(out, other_bits=16)[1] == predicted
    header = int.from_bytes((out / "model.safetensors").read_bytes()[:8], "little")
    assert stored.total == (out / "model.safetensors").stat().st_size - 8 - header
    assert load_shape(str(out)) == load_shape(str(gguf)).__class__(**{**load_shape(str(gguf)).__dict__,
                                                                      "name": "ckpt", "source": str(out)})
    report = run_json(capsys, str(out), "--memory", "1GiB", "--weights", "W8")
    assert [r["weights"] for r in report["rows"][::5]] == ["W4a-g64 (this checkpoint)", "W8"]
    assert report["rows"][0]["weight_bytes"] == stored.total
    assert report["rows"][0]["weight_overhead_bytes"] == stored.quantized_overhead


def test_a_corrupt_checkpoint_is_a_clear_error(tmp_path, capsys):
    out = tmp_path / "broken"
    out.mkdir()
    (out / "recipe.json").write_text(json.dumps({"format_version": 1}))
    assert main(["plan", str(out), "--memory", "1GiB"]) == 2
    assert "recipe.json" in capsys.readouterr().err


def test_per_layer_kv_policy_and_skipped_layers(tmp_path, capsys):
    from paperback.kv.policy import build_policy
    from paperback.plan.arithmetic import kv_bytes, kv_bytes_per_token
    from paperback.plan.shape import load_shape

    shape = load_shape("gemma-3-27b")
    policy_file = tmp_path / "policy.json"
    policy_file.write_text(json.dumps({"default": "int4", "layers": {"global": "fp8"}}))
    report = run_json(capsys, "gemma-3-27b", "--memory", "80GiB", "--context", "32768", "--users", "2",
                      "--weights", "W4", "--kv", "fp16", "int4", "--kv-skip-layers", "global",
                      "--kv-policy", str(policy_file), "--plot", str(tmp_path / "p.png"))
    rows = {r["kv"]: r for r in report["rows"]}
    assert set(rows) == {"fp16 (fp16 at global)", "int4 (fp16 at global)", "policy policy.json (fp16 at global)"}
    # Per token, layer by layer: a global layer's share at 16 bits, every other layer's at int4's 5 bits.
    per_layer = 2 * shape.num_kv_heads * shape.head_dim
    n_global = sum(w is None for w in shape.layer_windows)
    expected = per_layer * (n_global * 16 + (shape.num_layers - n_global) * 5) / 8
    assert rows["int4 (fp16 at global)"]["kv_bytes_per_token"] == pytest.approx(expected)
    assert rows["fp16 (fp16 at global)"]["kv_bytes_per_token"] == kv_bytes_per_token(shape, "fp16")
    # The skipped layers win over the file's choice for them, as in eval and serve.
    assert rows["policy policy.json (fp16 at global)"]["kv_bytes_at_context"] == \
        rows["int4 (fp16 at global)"]["kv_bytes_at_context"]
    mixed = build_policy(shape, None, None, policy_file)
    assert kv_bytes_per_token(shape, mixed) == pytest.approx(
        per_layer * (n_global * 8 + (shape.num_layers - n_global) * 5) / 8)
    assert kv_bytes(shape, 32768, "fp8", 2) > kv_bytes(shape, 32768, mixed, 2) > kv_bytes(shape, 32768, "int4", 2)


def test_policy_naming_missing_layers_is_refused(capsys):
    assert main(["plan", "llama-2-7b", "--memory", "8GiB", "--kv-skip-layers", "40"]) == 2
    assert "has 32 layers" in capsys.readouterr().err
    assert main(["plan", "llama-2-7b", "--memory", "8GiB", "--kv-skip-layers", "global"]) == 2
    assert "no sliding-window layers" in capsys.readouterr().err


def test_kv_memory_shows_what_the_pool_holds_as_served(capsys):
    """The same layout the engine sizes its pool with (tests/engine/test_pool_layout.py checks them equal)."""
    from paperback.engine.pool_layout import pool_layout
    from paperback.kv import build_policy
    from paperback.plan.shape import load_shape

    report = run_json(capsys, "smollm2", "--memory", "4GiB", "--kv-memory", "256MiB", "--kv", "fp16", "int8",
                      "kivi2", "--kv-skip-layers", "0-1")
    capacity = report["kv_capacity"]
    assert capacity["kv_memory"] == 256 * 2 ** 20
    shape = load_shape("smollm2")
    tokens = {r["kv"]: r["tokens"] for r in capacity["rows"]}
    for kv in ("fp16", "int8", "kivi2"):
        layout = pool_layout(shape, build_policy(shape, kv, "0-1"), 256 * 2 ** 20)
        assert tokens[f"{kv} (fp16 at 0-1)"] == layout.tokens
    assert tokens["fp16 (fp16 at 0-1)"] < tokens["int8 (fp16 at 0-1)"] < tokens["kivi2 (fp16 at 0-1)"]
    assert main(["plan", "smollm2", "--memory", "4GiB", "--kv-memory", "256MiB"]) == 0
    assert "as `paperback serve` lays it out" in capsys.readouterr().out
