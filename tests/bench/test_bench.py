import json

import pytest
import torch

from paperback.bench.engines import BenchConfig
from paperback.bench.report import bench_rows, run_bench
from paperback.bench.roofline import DecodeRoofline, decode_roofline, measure_read_bandwidth
from paperback.errors import PaperbackError
from paperback.memory import dense_kv_bytes_per_token, kv_bytes_read_per_step, weight_bytes_read_per_step


def test_roofline_arithmetic():
    roof = DecodeRoofline(batch=8, context=1000, weight_bytes=1_000_000, kv_bytes_per_sequence=50_000,
                          bandwidth_bytes_per_s=1e9)
    assert roof.bytes_per_step == 1_400_000
    assert roof.max_tokens_per_s == pytest.approx(8 * 1e9 / 1_400_000)


def test_bytes_per_token_of_the_bundled_models(smollm2, gemma3):
    import torch

    # SmolLM2: 2 (K and V) x 30 layers x 3 KV heads x 64 dims x 4 bytes
    assert dense_kv_bytes_per_token(smollm2.config, torch.float32) == 2 * 30 * 3 * 64 * 4
    # Gemma 3: sliding layers stop growing at the 512-token window
    per_layer = 2 * 1 * 256 * 4
    assert kv_bytes_read_per_step(gemma3.config, torch.float32, 4096) == per_layer * (15 * 512 + 3 * 4096)
    # tied head: the whole embedding matrix is read each step
    params = sum(p.numel() for p in smollm2.model.parameters())
    assert weight_bytes_read_per_step(smollm2.model) == params * 4
    assert decode_roofline(smollm2.model, 1, 100, 1e10).max_tokens_per_s < 1e10 / (params * 4)


def test_bandwidth_is_plausible():
    assert 1e8 < measure_read_bandwidth(64 * 2**20, repeats=2) < 1e13


def test_bench_config_validation():
    with pytest.raises(PaperbackError):
        BenchConfig(decode_tokens=1)
    with pytest.raises(PaperbackError):
        BenchConfig(batches=(0,))
    with pytest.raises(PaperbackError, match="must be one of fp32, int8"):
        BenchConfig(decode_activations="int4")
    with pytest.raises(PaperbackError, match="threads"):
        BenchConfig(threads=0)
    with pytest.raises(PaperbackError, match="kv cache dtype"):
        BenchConfig(kv_cache_dtype="fp8")


def test_bench_runs_in_a_worker_and_reports_every_metric():
    cfg = BenchConfig(prompt_tokens=32, decode_tokens=4, batches=(1, 2), repeats=1, threads=1,
                      decode_activations="int8", kv_cache_dtype="fp16")
    report = run_bench(cfg, peers=())
    json.dumps(report)
    assert report["config"]["decode_activations"] == "int8"  # recorded with the figures
    assert report["kernels"]["simd"] and set(report["kernels"]["built"]) == {"packed weights", "paged attention",
                                                                             "fused decode"}
    assert report["cpu"]["model"]
    pb = report["engines"]["paperback"]
    # an fp16 cache under the fp32 model: half the cache bytes a step reads, in the roofline too
    assert pb["model"]["kv_cache_dtype"] == "float16"
    assert pb["model"]["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 2
    assert pb["threads"] == 1
    assert pb["prefill_tokens_per_s"] > 0 and pb["peak_rss_bytes"] > 100 * 2**20
    assert set(pb["decode"]) == {"1", "2"}
    assert all(v["decode_tokens_per_s"] > 0 and v["time_to_first_token_s"] > 0 for v in pb["decode"].values())
    assert report["roofline"]["2"]["max_tokens_per_s"] > report["roofline"]["1"]["max_tokens_per_s"]
    assert len(bench_rows(report)) == 6


@pytest.mark.slow
def test_bench_against_transformers():
    cfg = BenchConfig(prompt_tokens=64, decode_tokens=4, batches=(1,), repeats=1)
    report = run_bench(cfg)
    rows = bench_rows(report)
    assert set(report["engines"]) == {"paperback", "transformers"}
    assert all(row[3].endswith("x") for row in rows)


def test_peak_rss_of_a_worker_is_its_own_not_its_parents():
    """ru_maxrss survives fork + exec on Linux; a worker started by a big process must not report it."""
    import subprocess
    import sys

    ballast = bytearray(600 << 20)
    for i in range(0, len(ballast), 4096):
        ballast[i] = 1
    code = "from paperback.bench.engines import peak_rss_bytes; print(peak_rss_bytes())"
    child = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert child < 500 << 20
    del ballast


def test_step_profile_parts_add_up_and_everything_is_put_back(tmp_path):
    """The decode step's parts sum to its wall time, on a model with packed layers too; afterwards no timer is
    left on the model or the functions it calls."""
    from helpers import tiny_llama_hf, write_llama_gguf

    from paperback.bench.step_profile import FUSED_ELEMENTWISE, PARTS, profile_decode
    from paperback.generation.fused_decode import FusedDecoder
    from paperback.kernels.fused import fused_decode
    from paperback.loading import load_model
    from paperback.models import blocks
    from paperback.quantization import QuantScheme
    from paperback.quantization.checkpoint import swap_in_quantized
    from paperback.quantization.model_pass import QuantizeConfig, quantize_model

    lm = load_model(str(write_llama_gguf(tiny_llama_hf(num_hidden_layers=2), tmp_path / "t.gguf")),
                    with_tokenizer=False)
    swap_in_quantized(lm.model, quantize_model(lm.model, QuantizeConfig("rtn", QuantScheme(4, 32)), progress=False))
    originals = (blocks.run_linears, blocks.attend, blocks.apply_rope, blocks.Attention._store, FusedDecoder.step)
    ids = torch.randint(0, 200, (1, 12))
    with torch.inference_mode():
        before = lm.model(ids)
    with fused_decode(False):  # module by module: each part timed
        report = profile_decode(lm.model, ids, 6)
    assert report["steps"] == 5 and list(report["parts_ms"]) == list(PARTS)
    assert sum(report["parts_ms"].values()) == pytest.approx(report["ms_per_step"], rel=1e-6)
    assert report["parts_ms"]["linears"] > 0 and report["parts_ms"]["attention"] > 0
    assert report["parts_ms"]["fused call, other"] == report["parts_ms"][FUSED_ELEMENTWISE] == 0
    fused = profile_decode(lm.model, ids, 6)  # the layers as one C call, which times its own parts
    assert sum(fused["parts_ms"].values()) == pytest.approx(fused["ms_per_step"], rel=1e-6)
    parts = fused["parts_ms"]
    assert min(parts["linears"], parts["attention"], parts[FUSED_ELEMENTWISE], parts["output head"]) > 0
    assert parts["fused call, other"] >= 0 and parts["rope"] == 0  # RoPE is inside the C call
    assert (blocks.run_linears, blocks.attend, blocks.apply_rope, blocks.Attention._store,
            FusedDecoder.step) == originals
    assert "forward" not in vars(lm.model) and "logits" not in vars(lm.model)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in lm.model.modules())
    with torch.inference_mode():
        assert torch.equal(lm.model(ids), before)
