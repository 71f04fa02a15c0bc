import json

import pytest
import torch

from helpers import SMALL, max_rel_error, tiny_hf
from paperback.loading import load_model

@pytest.mark.parametrize("model_type", ["llama3-untied", "llama-tied", "mistral", "qwen2", "qwen3", "gemma3"])
def test_safetensors_directory_matches_transformers(tmp_path, model_type):
    hf = tiny_hf(model_type)
    if model_type == "qwen2":  # biases are zero-initialised; make them count
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.5)
    hf.save_pretrained(tmp_path, max_shard_size="60KB")  # several shards plus an index
    assert (tmp_path / "model.safetensors.index.json").exists()
    lm = load_model(str(tmp_path), with_tokenizer=False)
    ids = torch.randint(0, 256, (2, 21))  # longer than the Gemma window of 8
    with torch.no_grad():
        assert max_rel_error(lm.model(ids), hf(ids).logits) < 1e-5


def test_directory_tokenizer_and_chat_template(tmp_path, smollm2):
    import transformers as tf

    cfg = tf.LlamaConfig(**{**SMALL, "vocab_size": smollm2.config.vocab_size})
    tf.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    smollm2.tokenizer.hf.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    lm = load_model(str(tmp_path))
    text = "Hello there, paperback."
    assert lm.tokenizer.encode(text) == smollm2.tokenizer.encode(text)
    assert lm.tokenizer.chat_template == smollm2.tokenizer.chat_template
    assert {0, 2} <= lm.tokenizer.eos_token_ids


def test_transformers_4_style_gemma3_config():
    """Older config.json files: rope_theta, rope_local_base_freq, rope_scaling, a sliding pattern."""
    from pathlib import Path

    from paperback.loading.hf_dir import config_from_hf

    raw = {"model_type": "gemma3", "text_config": {
        "hidden_size": 1152, "num_attention_heads": 4, "num_hidden_layers": 12, "num_key_value_heads": 1,
        "head_dim": 256, "intermediate_size": 6912, "vocab_size": 262144, "rope_theta": 1000000,
        "rope_local_base_freq": 10000, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window": 512, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256}}
    cfg = config_from_hf(raw, Path("config.json"))
    assert cfg.family == "gemma3" and cfg.layer_types[5] == cfg.layer_types[11] == "full"
    assert cfg.layer_types.count("sliding") == 10
    assert (cfg.rope.theta, cfg.rope.scaling_type, cfg.rope.factor) == (1e6, "linear", 8.0)
    assert (cfg.rope_local.theta, cfg.rope_local.scaling_type) == (1e4, "default")


def test_missing_config_field_is_named(tmp_path):
    from paperback.errors import ModelFileError
    from paperback.loading.hf_dir import config_from_hf

    with pytest.raises(ModelFileError, match="'hidden_size'"):
        config_from_hf({"model_type": "llama", "num_attention_heads": 4}, tmp_path / "config.json")
