"""Bad input: one clear line on stderr, exit code 2, no traceback, nothing unpickled."""

import subprocess
import sys

import numpy as np
import pytest

from helpers import tiny_llama_hf, write_llama_gguf
from paperback.cli import main


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory):
    return write_llama_gguf(tiny_llama_hf(), tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def run_cli(capsys, *argv) -> str:
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("paperback: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_truncated_gguf(tmp_path, good_gguf, capsys):
    bad = tmp_path / "truncated.gguf"
    data = good_gguf.read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    assert "truncated" in run_cli(capsys, "info", str(bad))


@pytest.mark.parametrize("content", [b"", b"GGUF", b"not a model at all" * 100, b"GGUF\x03\x00\x00\x00" + b"\xff" * 64])
def test_corrupt_gguf(tmp_path, content, capsys):
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(content)
    assert "GGUF" in run_cli(capsys, "info", str(bad))


def test_missing_file(capsys):
    assert "not found" in run_cli(capsys, "info", "/nonexistent/model.gguf")


def test_unknown_gguf_architecture(tmp_path, capsys):
    path = write_llama_gguf(tiny_llama_hf(), tmp_path / "bert.gguf", arch="bert")
    assert "architecture 'bert' is not supported" in run_cli(capsys, "info", str(path))


def test_unknown_hf_model_type(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert "model_type 'gpt2' is not supported" in run_cli(capsys, "info", str(tmp_path))


def test_wrong_tensor_shape(tmp_path, capsys):
    path = write_llama_gguf(tiny_llama_hf(), tmp_path / "shape.gguf",
                            shape_override={"blk.0.attn_v.weight": np.zeros((16, 64), np.float32)})
    msg = run_cli(capsys, "info", str(path))
    assert "model.layers.0.self_attn.v_proj.weight" in msg and "shape" in msg


def test_missing_tensor(tmp_path, capsys):
    path = write_llama_gguf(tiny_llama_hf(), tmp_path / "missing.gguf", drop=("blk.1.ffn_up.weight",))
    assert "missing tensors: model.layers.1.mlp.up_proj.weight" in run_cli(capsys, "info", str(path))


def test_nan_weights(tmp_path, capsys):
    nan = np.full((32, 64), np.nan, np.float32)
    path = write_llama_gguf(tiny_llama_hf(), tmp_path / "nan.gguf", shape_override={"blk.0.attn_v.weight": nan})
    assert "NaN" in run_cli(capsys, "info", str(path))


def test_truncated_safetensors(tmp_path, capsys):
    tiny_llama_hf().save_pretrained(tmp_path)
    shard = tmp_path / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])
    assert "safetensors" in run_cli(capsys, "info", str(tmp_path))


def test_pickle_weights_are_refused(tmp_path, capsys):
    tiny_llama_hf().config.to_json_file(tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not loaded")
    assert "pickle" in run_cli(capsys, "info", str(tmp_path))


def test_unknown_dataset_fails_before_loading(capsys):
    assert "unknown data set 'nope'" in run_cli(capsys, "eval", "/nonexistent.gguf", "--data", "nope")


def test_prompt_longer_than_context(capsys):
    msg = run_cli(capsys, "generate", "smollm2", "word " * 9000, "--raw")
    assert "context is 8192 tokens" in msg


def test_max_tokens_past_context(capsys):
    assert "lower max_tokens" in run_cli(capsys, "generate", "smollm2", "hi", "--max-tokens", "9000")


def test_bad_sampling_values(capsys):
    assert "top_p" in run_cli(capsys, "generate", "smollm2", "hi", "--top-p", "0")


def test_subprocess_has_no_traceback(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"garbage")
    proc = subprocess.run([sys.executable, "-m", "paperback", "info", str(bad)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("paperback: error:") and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_quantize_bad_bits(tmp_path, capsys):
    assert "unsupported bits 5" in run_cli(capsys, "quantize", "smollm2", "--bits", "5", "-o", str(tmp_path / "q"))
    assert not (tmp_path / "q").exists()


def test_quantize_calibration_text_too_short(tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("only a few words here")
    msg = run_cli(capsys, "quantize", "smollm2", "--method", "gptq", "--calib", str(short), "-o", str(tmp_path / "q"))
    assert "too few for samples" in msg and not (tmp_path / "q").exists()


@pytest.mark.parametrize("argv, message", [
    (["--targets", "blocks,lm_head"], "unknown quantization target 'lm_head'"),
    (["--group-size", "-4"], "group size must be positive"),
    (["--method", "awq", "--bits", "1"], "unsupported bits 1"),
])
def test_quantize_bad_settings_fail_before_any_work(tmp_path, capsys, argv, message):
    assert message in run_cli(capsys, "quantize", "smollm2", *argv, "-o", str(tmp_path / "q"))
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("argv, message", [
    (["--kv", "nf4"], "unknown KV format 'nf4'"),
    (["--kv", "int4:bits=9"], "unsupported KV bits 9"),
    (["--kv", "int4:g=48"], "channel group 48 does not divide the head dimension 64"),
    (["--kv", "kivi2", "--kv-skip-layers", "31"], "names layer 31, but the model has 30 layers"),
    (["--kv", "kivi2", "--kv-skip-layers", "global"], "no sliding-window layers"),
    (["--kv-policy", "missing.json"], "does not exist"),
])
def test_eval_bad_kv_settings(capsys, argv, message):
    assert message in run_cli(capsys, "eval", "smollm2", *argv, "--max-windows", "1")


@pytest.mark.parametrize("argv, message", [
    (["--kv", "nf4"], "unknown KV format 'nf4'"),
    (["--kv-memory", "lots"], "bad memory size 'lots'"),
    (["--kv-memory=0GiB"], "must be positive"),
    (["--memory", "10MiB"], "does not even hold the weights"),
    (["--memory", "1GiB", "--kv-memory", "1GiB"], "not both"),
    (["--kv-memory", "1KiB"], "holds no block"),
    (["--swap-space=-1"], "--swap-space must be at least 0 GiB"),
    (["--swap-space", "nan"], "--swap-space must be at least 0 GiB"),
    (["--swap-space", "inf"], "--swap-space must be at least 0 GiB"),
])
def test_serve_bad_settings(capsys, argv, message):
    assert message in run_cli(capsys, "serve", "smollm2", "--port", "0", *argv)
