"""The MoE family against transformers: Mixtral, Qwen2-MoE, Qwen3-MoE and dots.llm1 (DeepSeek-V3 routing), from
safetensors directories and GGUF files, and the errors a malformed MoE checkpoint gets."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import MOE_KINDS, max_rel_error, tiny_moe_hf, write_moe_gguf
from paperback.errors import ModelFileError
from paperback.generation import SamplingParams, generate_tokens
from paperback.loading import load_model


@pytest.fixture(scope="module", params=MOE_KINDS)
def hf_moe(request, tmp_path_factory):
    """(kind, transformers model, its safetensors directory, its GGUF file)."""
    hf = tiny_moe_hf(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path / "hf", max_shard_size="200KB")
    return request.param, hf, path / "hf", write_moe_gguf(hf, path / "model.gguf")


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_logits_and_greedy_tokens_match_transformers(hf_moe, source):
    kind, hf, directory, gguf_path = hf_moe
    lm = load_model(str(directory if source == "safetensors" else gguf_path), with_tokenizer=False)
    assert lm.config.family == "moe"
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (2, 21))
    with torch.no_grad():
        assert max_rel_error(lm.model(ids), hf(ids).logits) < 1e-4
    prompt = ids[:1, :9]
    ours = torch.stack(list(generate_tokens(lm.model, prompt, SamplingParams(max_tokens=24, ignore_eos=True))), 1)
    with torch.no_grad():
        theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, min_new_tokens=24,
                             do_sample=False)[:, prompt.shape[1]:]
    assert ours.tolist() == theirs.tolist()


def test_routing_reaches_every_expert_and_matters(hf_moe, tmp_path):
    """The parity above is not vacuous: tokens spread over the experts, and two swapped experts change logits."""
    kind, hf, directory, _ = hf_moe
    lm = load_model(str(directory), with_tokenizer=False)
    layer = next(i for i in range(lm.config.num_layers) if lm.config.is_moe_layer(i))
    x = torch.randn(200, lm.config.hidden_size)
    _, chosen = lm.model.model.layers[layer].mlp.gate(x)
    assert set(chosen.flatten().tolist()) == set(range(lm.config.moe.num_experts))
    experts = lm.model.model.layers[layer].mlp.experts
    experts[0], experts[1] = experts[1], experts[0]
    ids = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        assert max_rel_error(lm.model(ids), hf(ids).logits) > 1e-3


def test_moe_config_survives_a_recipe_round_trip():
    from pathlib import Path

    from paperback.loading.hf_dir import config_from_hf
    from paperback.quantization.checkpoint import config_from_recipe

    config = config_from_hf(tiny_moe_hf("dots1").config.to_dict(), Path("config.json"))
    raw = json.loads(json.dumps({"model_config": config.to_dict()}))
    assert config_from_recipe(raw, Path(".")) == config


def _one_shard(directory):
    (shard,) = directory.glob("*.safetensors")
    return shard


@pytest.mark.parametrize("change, message", [
    ("experts_in_config", "router of layer 0 scores 6 experts but the config says 7"),
    ("missing_expert", "expert 3 of layer 1 is missing"),
    ("top_k", "experts_per_token"),
])
def test_malformed_mixtral_directory_gets_one_clear_line(tmp_path, change, message):
    hf = tiny_moe_hf("mixtral")
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    if change == "experts_in_config":
        config["num_local_experts"] = 7
    elif change == "top_k":
        config["num_experts_per_tok"] = 9
    else:
        tensors = load_file(_one_shard(tmp_path))
        del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
        save_file(tensors, _one_shard(tmp_path), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFileError, match=message):
        load_model(str(tmp_path), with_tokenizer=False)


def test_malformed_moe_gguf_gets_one_clear_line(tmp_path):
    hf = tiny_moe_hf("qwen3_moe")
    write_moe_gguf(hf, tmp_path / "drop.gguf", drop=("blk.2.ffn_down_exps.weight",))
    with pytest.raises(ModelFileError, match="expert 0 of layer 2 is missing .down_proj and 7 more"):
        load_model(str(tmp_path / "drop.gguf"), with_tokenizer=False)
    write_moe_gguf(hf, tmp_path / "count.gguf", metadata={"expert_count": 4})
    with pytest.raises(ModelFileError, match="router of layer 0 scores 8 experts but the config says 4"):
        load_model(str(tmp_path / "count.gguf"), with_tokenizer=False)


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
def test_planner_counts_every_expert_byte(hf_moe, source):
    """fp32 weight bytes from the config alone = 4 x the parameters transformers holds (routers, shared experts,
    dense layers, DeepSeek's router bias included)."""
    from paperback.plan.arithmetic import weight_bytes
    from paperback.plan.shape import load_shape

    kind, hf, directory, gguf_path = hf_moe
    shape = load_shape(str(directory if source == "safetensors" else gguf_path))
    stored = sum(t.numel() for name, t in hf.state_dict().items()
                 if not (hf.config.tie_word_embeddings and name == "lm_head.weight"))
    assert weight_bytes(shape, "fp32").total == 4 * stored


def test_decode_reads_only_the_experts_it_runs(hf_moe):
    """A batch-1 decode step reads k of E routed experts (and every shared expert); larger batches read the
    expected union under uniform routing; active parameters count k experts a token."""
    from paperback.memory import active_parameter_count, module_bytes, parameter_count, weight_bytes_read_per_step

    kind, hf, directory, _ = hf_moe
    model = load_model(str(directory), with_tokenizer=False).model
    moe = model.config.moe
    blocks = [layer.mlp for i, layer in enumerate(model.model.layers) if model.config.is_moe_layer(i)]
    expert_bytes = sum(module_bytes(e) for block in blocks for e in block.experts)
    expert_params = sum(e.gate_proj.weight.numel() * 3 for block in blocks for e in block.experts)
    everything = module_bytes(model) - (module_bytes(model.model.embed_tokens) if model.lm_head is not None else 0)
    idle = 1 - moe.experts_per_token / moe.num_experts
    assert weight_bytes_read_per_step(model) == everything - round(idle * expert_bytes)
    assert weight_bytes_read_per_step(model, 8) == everything - round(idle ** 8 * expert_bytes)
    assert active_parameter_count(model) == parameter_count(model) - round(idle * expert_params)
