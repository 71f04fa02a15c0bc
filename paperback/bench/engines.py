"""Speed measurements of one engine, run inside a fresh worker process.

Each engine is timed the same way: prefill = one forward over the prompt that
returns the last position's logits; decode = timestamps of every generated
token (greedy, EOS ignored), so time to first token and tokens/s come from the
same run. Peak RSS is the worker's own high-water mark, so engines never
share memory figures.
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from paperback.bench.workloads import text_prompts


@dataclass(frozen=True)
class BenchConfig:
    model: str = "smollm2"
    dtype: str = "fp32"
    prompt_tokens: int = 512
    decode_tokens: int = 32
    batches: tuple[int, ...] = (1, 8)
    repeats: int = 3
    dataset: str = "wikitext2"
    decode_activations: str = "fp32"  # paperback's packed decode path: fp32 or int8 activations
    prefill_matmul: str = "fp32"  # paperback's packed prefill path: fp32 or bf16 tiles
    threads: int | None = None  # None: torch's default
    profile: bool = False  # also time a decode step's parts at each batch (paperback.bench.step_profile)
    fused_decode: bool = True  # decode steps through every layer in one C call where the model qualifies
    kv_cache_dtype: str = "auto"  # paperback's dense cache: auto (the model's dtype), fp32, fp16 or bf16

    def __post_init__(self):
        from paperback.errors import PaperbackError

        if self.prompt_tokens < 1 or self.decode_tokens < 2 or self.repeats < 1:
            raise PaperbackError("prompt tokens >= 1, decode tokens >= 2 and repeats >= 1 are required")
        from paperback.kernels.settings import checked

        checked("decode_activations", self.decode_activations)
        checked("prefill_matmul", self.prefill_matmul, "prefill matmul")
        if self.kv_cache_dtype not in ("auto", "fp32", "fp16", "bf16"):
            raise PaperbackError(f"kv cache dtype must be auto, fp32, fp16 or bf16, got {self.kv_cache_dtype!r}")
        if self.threads is not None and self.threads < 1:
            raise PaperbackError("threads must be at least 1")
        if not self.batches or min(self.batches) < 1:
            raise PaperbackError("batch sizes must be positive")
        object.__setattr__(self, "batches", tuple(self.batches))

    def to_dict(self) -> dict:
        return asdict(self)

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The torch dtype of paperback's KV cache under this config."""
        from paperback.loading import parse_dtype

        return model_dtype if self.kv_cache_dtype == "auto" else parse_dtype(self.kv_cache_dtype)


def peak_rss_bytes() -> int:
    """This process's resident high-water mark.

    On Linux, VmHWM: getrusage's ru_maxrss carries the parent's high-water mark
    across fork + exec, so a worker started by a large process would report
    the parent's size.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * 1024 if sys.platform != "darwin" else kib


class PaperbackEngine:
    name = "paperback"

    def __init__(self, cfg: BenchConfig):
        from paperback.loading import load_model

        self.lm = load_model(cfg.model, cfg.dtype)
        self.tokenizer = self.lm.tokenizer
        self.cache_dtype = cfg.cache_dtype(self.lm.dtype)

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor) -> None:
        from paperback.generation.kv_cache import ContiguousKVCache

        model = self.lm.model
        cache = ContiguousKVCache(model.config, ids.shape[0], ids.shape[1], self.cache_dtype)
        model(ids, 0, cache, last_only=True)

    def decode_timestamps(self, ids: torch.Tensor, new_tokens: int) -> list[float]:
        from paperback.generation import SamplingParams, generate_tokens

        stamps = []
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
        for _ in generate_tokens(self.lm.model, ids, params, self.cache_dtype):
            stamps.append(time.perf_counter())
        return stamps


class TransformersEngine:
    name = "transformers"

    def __init__(self, cfg: BenchConfig):
        from transformers import AutoModelForCausalLM

        from paperback.loading import parse_dtype, resolve_model
        from paperback.loading.tokenizer import tokenizer_from_dir, tokenizer_from_gguf

        source = resolve_model(cfg.model)
        dtype = parse_dtype(cfg.dtype)
        if source.kind == "gguf":
            self.tokenizer = tokenizer_from_gguf(source.path)
            self.model = AutoModelForCausalLM.from_pretrained(
                source.path.parent, gguf_file=source.path.name, dtype=dtype)
        else:
            self.tokenizer = tokenizer_from_dir(source.path)
            self.model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype)
        self.model.eval()

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor) -> None:
        self.model(ids, use_cache=True, logits_to_keep=1)

    @torch.inference_mode()
    def decode_timestamps(self, ids: torch.Tensor, new_tokens: int) -> list[float]:
        from transformers import LogitsProcessor, LogitsProcessorList

        stamps: list[float] = []

        class StepClock(LogitsProcessor):
            def __call__(self, input_ids, scores):
                stamps.append(time.perf_counter())
                return scores

        self.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, logits_processor=LogitsProcessorList([StepClock()]),
            pad_token_id=self.tokenizer.hf.pad_token_id or 0,
        )
        return stamps


ENGINES = {"paperback": PaperbackEngine, "transformers": TransformersEngine}


def run_engine(engine_name: str, cfg: BenchConfig) -> dict:
    """All measurements of one engine; called in a worker process."""
    from paperback.kernels.packed import set_decode_activations, set_prefill_matmul

    torch.manual_seed(0)
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    set_decode_activations(cfg.decode_activations)
    set_prefill_matmul(cfg.prefill_matmul)
    from paperback.kernels.settings import settings

    settings.fused_decode = cfg.fused_decode
    start = time.perf_counter()
    engine = ENGINES[engine_name](cfg)
    load_s = time.perf_counter() - start
    prompts = text_prompts(engine.tokenizer, max(cfg.batches), cfg.prompt_tokens, cfg.dataset)
    single = prompts[:1]
    engine.prefill(single[:, :16])  # warm-up: first-call allocations
    prefill_times = []
    for _ in range(cfg.repeats):
        t0 = time.perf_counter()
        engine.prefill(single)
        prefill_times.append(time.perf_counter() - t0)
    prefill_s = statistics.median(prefill_times)
    result = {
        "engine": engine_name,
        "load_s": load_s,
        "prefill_s": prefill_s,
        "prefill_tokens_per_s": cfg.prompt_tokens / prefill_s,
        "decode": {},
        "threads": torch.get_num_threads(),
    }
    for batch in cfg.batches:
        runs = []
        for _ in range(cfg.repeats if batch == 1 else 1):
            t0 = time.perf_counter()
            stamps = engine.decode_timestamps(prompts[:batch], cfg.decode_tokens)
            runs.append((stamps[0] - t0, batch * (len(stamps) - 1) / (stamps[-1] - stamps[0])))
        result["decode"][str(batch)] = {
            "time_to_first_token_s": statistics.median(r[0] for r in runs),
            "decode_tokens_per_s": statistics.median(r[1] for r in runs),
        }
    if engine_name == "paperback":
        result["model"] = _model_facts(engine.lm, cfg)
        if cfg.profile:
            from paperback.bench.step_profile import profile_decode

            # one profile per decode batch: {batch: where its step's time goes}
            result["profile"] = {str(batch): profile_decode(engine.lm.model, prompts[:batch], cfg.decode_tokens,
                                                            engine.cache_dtype)
                                 for batch in cfg.batches}
    result["peak_rss_bytes"] = peak_rss_bytes()
    return result


def _model_facts(lm, cfg: BenchConfig) -> dict:
    from paperback.generation.fused_decode import plan_for
    from paperback.generation.kv_cache import ContiguousKVCache
    from paperback.memory import (active_parameter_count, dense_kv_bytes_per_token, kv_bytes_read_per_step,
                                  module_bytes, parameter_count, weight_bytes_read_per_step)

    cache_dtype = cfg.cache_dtype(lm.dtype)
    return {
        "name": lm.config.name,
        "family": lm.config.family,
        "parameters": parameter_count(lm.model),
        "weight_bytes": module_bytes(lm.model),
        "active_parameters": active_parameter_count(lm.model),  # per token: an MoE runs k of its E experts
        "weight_bytes_read_per_step": weight_bytes_read_per_step(lm.model),
        # an MoE's steps read more experts as the batch grows (expected count under uniform routing)
        "weight_bytes_read_per_step_by_batch": {str(b): weight_bytes_read_per_step(lm.model, b) for b in cfg.batches},
        "kv_cache_dtype": str(cache_dtype).removeprefix("torch."),
        "kv_bytes_per_token": dense_kv_bytes_per_token(lm.config, cache_dtype),
        # cache bytes one decode step reads at the mean decode context (sliding windows capped)
        "decode_context": decode_context(cfg),
        "kv_bytes_read_per_step": kv_bytes_read_per_step(lm.config, cache_dtype, decode_context(cfg)),
        # decode steps ran every layer in one C call (generation.fused_decode), or module by module
        "fused_decode": plan_for(lm.model, ContiguousKVCache(lm.config, 1, 2, cache_dtype)) is not None,
    }


def decode_context(cfg: BenchConfig) -> int:
    """Mean context length over the timed decode steps."""
    return cfg.prompt_tokens + cfg.decode_tokens // 2
