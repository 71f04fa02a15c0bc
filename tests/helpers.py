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


MOE_KINDS = ("mixtral", "qwen2_moe", "qwen3_moe", "dots1")


def tiny_moe_hf(kind: str, **overrides):
    """A small random transformers MoE model of each routing style, with routers strong enough that no two
    experts' scores nearly tie (a near tie would let rounding order pick a different expert)."""
    import transformers as tf

    torch.manual_seed(0)
    small = {**SMALL, "intermediate_size": 80, **overrides}
    if kind == "mixtral":
        model = tf.MixtralForCausalLM(tf.MixtralConfig(**{"num_local_experts": 6, "num_experts_per_tok": 2,
                                                          "tie_word_embeddings": False, **small}))
    elif kind == "qwen2_moe":  # a gated shared expert, top-k not renormalised, layer 1 dense
        model = tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
            **small, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[1]))
    elif kind == "qwen3_moe":  # q/k norm, renormalised top-k
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
            **small, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            norm_topk_prob=True))
    elif kind == "dots1":  # DeepSeek-V3 routing: sigmoid, bias, 2 of 4 groups, scaled; shared experts; layer 0 dense
        model = tf.Dots1ForCausalLM(tf.Dots1Config(
            **small, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, n_shared_experts=2,
            n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1))
    else:
        raise ValueError(kind)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)
    return model.eval()


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (convert_hf_to_gguf), for writing GGUF like it does."""
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def _finish_gguf(writer, path: Path) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_llama_gguf(hf_model, path: Path, matrix_type: str = "F32", arch: str = "llama",
                     shape_override: dict | None = None, drop: tuple[str, ...] = (),
                     tokenizer_from: Path | None = None) -> Path:
    """Write a transformers Llama model as a GGUF file in llama.cpp's layout.

    matrix_type: GGML type of the 2-D weights (F32, F16, Q8_0, ...); norms stay F32.
    shape_override maps a GGUF tensor name to an array to store instead (bad-shape tests).
    tokenizer_from: a GGUF file whose tokenizer (and chat template) the file takes, vocabulary size included.
    """
    import gguf

    cfg = hf_model.config
    writer = gguf.GGUFWriter(str(path), arch)
    if tokenizer_from is not None:
        for key, field in gguf.GGUFReader(tokenizer_from).fields.items():
            if key.startswith("tokenizer."):
                sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
                writer.add_key_value(key, field.contents(), field.types[0], sub)
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
    return _finish_gguf(writer, path)


# transformers MoE model type -> (GGUF architecture, whether llama.cpp permutes q/k rows)
MOE_GGUF_ARCHS = {"mixtral": ("llama", True), "qwen2_moe": ("qwen2moe", False), "qwen3_moe": ("qwen3moe", False),
                  "dots1": ("dots1", False)}
_HF_TO_GGUF_MOE = {"mlp.gate.weight": "ffn_gate_inp.weight", "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
                   "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
                   "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
                   "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
                   "self_attn.v_proj.bias": "attn_v.bias"}


def write_moe_gguf(hf_model, path: Path, drop: tuple[str, ...] = (), metadata: dict | None = None) -> Path:
    """Write a transformers MoE model (see tiny_moe_hf) as llama.cpp's converter does: experts stacked in one
    (experts, out, in) tensor per projection, routing in `expert_*` metadata. `drop` leaves out GGUF tensors,
    `metadata` overrides {key without the arch prefix: value}."""
    import gguf

    from paperback.loading.hf_dir import HFModelDir
    from paperback.loading.weight_names import HF_MOE_RENAMES, renamed

    cfg = hf_model.config
    arch, permute = MOE_GGUF_ARCHS[cfg.model_type]
    moe = HFModelDir.__new__(HFModelDir)  # only for the config translation
    moe.hf_config = cfg.to_dict()
    moe.path = path.parent
    routing = moe.config().moe
    writer = gguf.GGUFWriter(str(path), arch)
    fields = {"block_count": cfg.num_hidden_layers, "embedding_length": cfg.hidden_size,
              "feed_forward_length": cfg.intermediate_size, "attention.head_count": cfg.num_attention_heads,
              "attention.head_count_kv": cfg.num_key_value_heads,
              "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
              "context_length": cfg.max_position_embeddings, "rope.freq_base": float(cfg.rope_parameters["rope_theta"]),
              "vocab_size": cfg.vocab_size, "expert_count": routing.num_experts,
              "expert_used_count": routing.experts_per_token}
    if arch != "llama":  # llama.cpp's Mixtral files size their experts by feed_forward_length alone
        fields["expert_feed_forward_length"] = routing.expert_intermediate_size
    if getattr(cfg, "head_dim", None):
        fields["attention.key_length"] = fields["attention.value_length"] = cfg.head_dim
    if arch == "qwen2moe":
        fields["expert_shared_feed_forward_length"] = routing.shared_intermediate_size
    if arch == "dots1":
        fields.update(expert_shared_count=cfg.n_shared_experts, expert_weights_scale=float(routing.routed_scale),
                      expert_weights_norm=routing.normalize_top_k, expert_gating_func=2,
                      expert_group_count=routing.num_groups, expert_group_used_count=routing.groups_per_token,
                      leading_dense_block_count=len(routing.dense_layers))
    fields.update(metadata or {})
    for key, value in fields.items():
        kind = {bool: gguf.GGUFValueType.BOOL, int: gguf.GGUFValueType.UINT32,
                float: gguf.GGUFValueType.FLOAT32}[type(value)]
        writer.add_key_value(f"{arch}.{key}", value, kind)
    tensors = {}
    for name, tensor in hf_model.state_dict().items():
        arr = tensor.float().numpy()
        name = renamed(name, HF_MOE_RENAMES)
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            tensors[{"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]] = arr
            continue
        layer, rest = name.split(".")[2], ".".join(name.split(".")[3:])
        if rest == "mlp.experts.gate_up_proj":  # transformers 5 holds experts stacked: (E, 2I, C), (E, C, I)
            half = arr.shape[1] // 2
            tensors[f"blk.{layer}.ffn_gate_exps.weight"] = arr[:, :half]
            tensors[f"blk.{layer}.ffn_up_exps.weight"] = arr[:, half:]
            continue
        if rest == "mlp.experts.down_proj":
            tensors[f"blk.{layer}.ffn_down_exps.weight"] = arr
            continue
        if rest.startswith("mlp.shared_expert."):
            gname = f"ffn_{rest.split('.')[2].replace('_proj', '')}_shexp.weight"
        elif rest in _HF_TO_GGUF_MOE:
            gname = _HF_TO_GGUF_MOE[rest]
            if rest == "mlp.shared_expert_gate.weight":
                arr = arr.reshape(-1)
        else:
            gname = _HF_TO_GGUF_BLOCK[rest]
        if permute and rest.startswith("self_attn.q_proj.weight"):
            arr = llama_cpp_permute(arr, cfg.num_attention_heads)
        elif permute and rest.startswith("self_attn.k_proj.weight"):
            arr = llama_cpp_permute(arr, cfg.num_key_value_heads)
        tensors[f"blk.{layer}.{gname}"] = arr
    for gname, arr in tensors.items():
        if gname not in drop:
            writer.add_tensor(gname, np.ascontiguousarray(arr, dtype=np.float32))
    return _finish_gguf(writer, path)


class CharTokenizer:
    """Enough of a tokenizer for profiling a tiny random model: one id per character."""

    bos_token_id = None
    adds_bos = False

    def __init__(self, vocab: int):
        self.vocab = vocab

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % self.vocab for c in text]


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


# A Llama-3-style shape small enough for tests; its vocabulary is SmolLM2's padded with reserved tokens.
TINY_SHAPE_FIELDS = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 49216, "tie_word_embeddings": True}


def tiny_shape_checkpoint(root: Path, **overrides):
    """paperback.bench.shapes' files (Hugging Face directory and F16 GGUF) for a tiny Llama-3-style shape."""
    from paperback.bench.shapes import LLAMA3_ROPE, ModelShape, build_shape
    from paperback.loading import resolve_model

    shape = ModelShape("tiny-llama3", {**TINY_SHAPE_FIELDS, "rope_scaling": LLAMA3_ROPE, **overrides})
    return build_shape(shape, root, resolve_model("smollm2").path, on_step=lambda _: None)
