"""Test helpers: tiny random checkpoints written in the formats real tools write."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# Hugging Face name -> GGUF name, the inverse of paperback's table for a Llama block.
_HF_TO_GGUF_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def tiny_llama_hf(**overrides):
    """A random transformers LlamaForCausalLM small enough to build in milliseconds."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kwargs = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=False, rms_norm_eps=1e-5)
    kwargs.update(overrides)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**kwargs)).eval()
    with torch.no_grad():  # non-trivial norms so a mix-up of norm tensors shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def tiny_hf(model_type: str):
    """A small random transformers model of each supported family, built in milliseconds."""
    import transformers as tf

    torch.manual_seed(0)
    if model_type == "llama3-untied":
        return tiny_llama_hf(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 16})
    if model_type == "llama-tied":
        return tiny_llama_hf(tie_word_embeddings=True)
    if model_type == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(**SMALL, sliding_window=None)).eval()
    if model_type == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**SMALL)).eval()
    if model_type == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**SMALL, head_dim=32)).eval()
    if model_type == "gemma3":
        cfg = tf.Gemma3TextConfig(**SMALL, head_dim=32, sliding_window=8, query_pre_attn_scalar=24,
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"])
        model = tf.Gemma3ForCausalLM(cfg).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(-0.5, 0.5)
        return model
    raise ValueError(model_type)


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (convert_hf_to_gguf), for writing GGUF like it does."""
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_llama_gguf(hf_model, path: Path, matrix_type: str = "F32", arch: str = "llama",
                     shape_override: dict | None = None, drop: tuple[str, ...] = ()) -> Path:
    """Write a transformers Llama model as a GGUF file in llama.cpp's layout.

    matrix_type: GGML type of the 2-D weights (F32, F16, Q8_0, ...); norms stay F32.
    shape_override maps a GGUF tensor name to an array to store instead (bad-shape tests).
    """
    import gguf

    cfg = hf_model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    qtype = gguf.GGMLQuantizationType[matrix_type]
    tensors = {}
    for name, tensor in hf_model.state_dict().items():
        arr = tensor.float().numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:  # llama.cpp writes no output.weight for tied models
                continue
            gname = "output.weight"
        else:
            layer, rest = name.split(".")[2], ".".join(name.split(".")[3:])
            gname = f"blk.{layer}.{_HF_TO_GGUF_BLOCK[rest]}"
            if rest.startswith("self_attn.q_proj"):
                arr = llama_cpp_permute(arr, cfg.num_attention_heads)
            elif rest.startswith("self_attn.k_proj"):
                arr = llama_cpp_permute(arr, cfg.num_key_value_heads)
        tensors[gname] = arr
    for gname, arr in (shape_override or {}).items():
        tensors[gname] = arr
    for gname, arr in tensors.items():
        if gname in drop:
            continue
        if arr.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            if qtype in (gguf.GGMLQuantizationType.F16,):
                writer.add_tensor(gname, arr.astype(np.float16))
            else:
                writer.add_tensor(gname, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gname, np.ascontiguousarray(arr, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def max_rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max |e|: the error relative to the logits' scale."""
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


class LiveServer:
    """paperback's OpenAI server over `lm` on a free local port, in a thread: `with LiveServer(lm) as s: s.url`."""

    def __init__(self, lm, name: str = "smollm2", num_blocks: int = 256, max_num_seqs: int = 8,
                 step_tokens: int = 256, max_waiting: int = 64, **app_args):
        from paperback.engine.llm import LLMEngine
        from paperback.engine.scheduler import SchedulerConfig
        from paperback.server.async_engine import AsyncEngine

        self.engine = AsyncEngine(LLMEngine(lm, num_blocks=num_blocks,
                                            scheduler=SchedulerConfig(max_num_seqs, step_tokens)),
                                  max_waiting=max_waiting, model_name=name)
        self.name, self.app_args = name, app_args

    def __enter__(self):
        import socket
        import threading
        import time

        import uvicorn

        from paperback.server.app import create_app

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.engine, self.name, **self.app_args),
                                                    host="127.0.0.1", port=port, log_level="error"))
        threading.Thread(target=self.server.run, daemon=True).start()
        for _ in range(400):
            if self.server.started:
                break
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port}"
        return self

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=kwargs.pop("api_key", "none"), max_retries=0,
                             **kwargs)

    def wait_idle(self, timeout: float = 20.0) -> dict:
        """The engine's stats once nothing runs, waits or holds a block (or at the timeout)."""
        import time

        for _ in range(int(timeout / 0.05)):
            stats = self.engine.stats()
            if stats["running"] == 0 and stats["waiting"] == 0 and stats["blocks_used"] == 0:
                break
            time.sleep(0.05)
        return stats

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.engine.shutdown()
