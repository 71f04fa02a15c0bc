
import pytest
import torch

from paperback.models.config import ModelConfig, RopeConfig
from paperback.models.layers import RMSNorm, attend, rope_inv_freq
from paperback.errors import UnsupportedModelError


def naive_attention(q, k, v, start_pos, scaling, window):
    """Reference: explicit scores with repeated KV heads and a per-element mask."""
    b, h, t, d = q.shape
    k = k.repeat_interleave(h // k.shape[1], dim=1)
    v = v.repeat_interleave(h // v.shape[1], dim=1)
    scores = (q @ k.transpose(-1, -2)) * scaling
    for i in range(t):
        qpos = start_pos + i
        for j in range(k.shape[2]):
            if j > qpos or (window is not None and j <= qpos - window):
                scores[:, :, i, j] = float("-inf")
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("start_pos,new,window", [
    (0, 7, None), (0, 7, 3), (5, 4, None), (5, 4, 3), (9, 1, None), (9, 1, 4), (2, 1, 8), (0, 1, None),
])
def test_attend_matches_masked_reference(start_pos, new, window):
    torch.manual_seed(0)
    q = torch.randn(2, 4, new, 8)
    k = torch.randn(2, 2, start_pos + new, 8)
    v = torch.randn(2, 2, start_pos + new, 8)
    out = attend(q, k, v, start_pos, 8 ** -0.5, window)
    torch.testing.assert_close(out, naive_attention(q, k, v, start_pos, 8 ** -0.5, window), rtol=1e-5, atol=1e-5)


def test_rmsnorm_plain_and_unit_offset():
    x = torch.randn(3, 16)
    plain, gemma = RMSNorm(16, 1e-6), RMSNorm(16, 1e-6, unit_offset=True)
    with torch.no_grad():
        plain.weight.copy_(torch.linspace(0.5, 1.5, 16))
        gemma.weight.copy_(torch.linspace(0.5, 1.5, 16) - 1)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * torch.linspace(0.5, 1.5, 16)
    torch.testing.assert_close(plain(x), expected)
    torch.testing.assert_close(gemma(x), expected)


@pytest.mark.parametrize("params", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
])
def test_rope_frequencies_match_transformers(params):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=256, num_attention_heads=2, rope_parameters=dict(params),
                      max_position_embeddings=131072)
    kind = params["rope_type"]
    if kind == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        expected, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
    ours = rope_inv_freq(RopeConfig(theta=params["rope_theta"], scaling_type=kind,
                                    factor=params.get("factor", 1.0),
                                    low_freq_factor=params.get("low_freq_factor", 1.0),
                                    high_freq_factor=params.get("high_freq_factor", 4.0),
                                    original_max_position_embeddings=params.get(
                                        "original_max_position_embeddings", 8192)), 128)
    torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=0)


def test_config_rejects_inconsistent_shapes():
    base = dict(family="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=2,
                num_heads=4, num_kv_heads=4, head_dim=2, rms_norm_eps=1e-6, max_position_embeddings=32)
    ModelConfig(**base)
    with pytest.raises(UnsupportedModelError, match="multiple"):
        ModelConfig(**{**base, "num_kv_heads": 3})
    with pytest.raises(UnsupportedModelError, match="family"):
        ModelConfig(**{**base, "family": "bert"})
    with pytest.raises(UnsupportedModelError, match="sliding_window"):
        ModelConfig(**{**base, "layer_types": ("sliding", "full")})
    with pytest.raises(UnsupportedModelError, match="RoPE scaling"):
        RopeConfig(scaling_type="yarn")
