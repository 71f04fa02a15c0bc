"""AWQ: scale folding is exact in full precision; the searches lower the errors they target."""

import pytest
import torch

from helpers import max_rel_error, tiny_hf, tiny_llama_hf
from paperback.loading import load_model
from paperback.quantization import QuantScheme, quantize_rtn
from paperback.quantization.awq import (AWQConfig, activation_scale, awq_block, fold_scale, scale_groups,
                                        search_clip, search_scale)


def load_tiny(tmp_path, model):
    model.save_pretrained(tmp_path)
    return load_model(str(tmp_path), with_tokenizer=False).model


@pytest.mark.parametrize("kind", ["llama-mha", "llama-gqa", "qwen2", "gemma3"])
def test_folded_model_is_equal_in_full_precision(tmp_path, kind):
    hf = tiny_llama_hf(num_key_value_heads=4) if kind == "llama-mha" else tiny_hf(kind.replace("llama-gqa", "llama-tied"))
    model = load_tiny(tmp_path, hf)
    ids = torch.randint(0, 256, (2, 19))
    with torch.no_grad():
        before = model(ids)
        torch.manual_seed(1)
        folded = []
        for layer in model.model.layers:
            for group in scale_groups(model.config.family, layer):
                linears = [layer.get_submodule(n) for n in group.linears]
                fold_scale(layer.get_submodule(group.prev), linears, torch.rand(linears[0].in_features) * 4 + 0.1)
                folded.append(group.prev)
        after = model(ids)
    # v -> o folds only without grouped-query attention; the MLP's up -> down always
    assert ("self_attn.v_proj" in folded) == (kind == "llama-mha")
    assert "mlp.up_proj" in folded
    assert max_rel_error(after, before) < 1e-5


def test_gemma_mlp_scales_fold_into_the_pre_feedforward_norm(tmp_path):
    model = load_tiny(tmp_path, tiny_hf("gemma3"))
    prevs = [g.prev for g in scale_groups("gemma3", model.model.layers[0])]
    assert "pre_feedforward_layernorm" in prevs and "post_attention_layernorm" not in prevs


def salient_problem(seed=0):
    """Inputs whose first channels are 30x larger: the weights there matter most."""
    torch.manual_seed(seed)
    w = torch.randn(64, 256)
    x = torch.randn(2048, 256)
    x[:, :8] *= 30
    return w, x


def test_scale_search_protects_salient_channels():
    w, x = salient_problem()
    scheme = QuantScheme(3, 128)
    reference = x @ w.T
    s, errors = search_scale([w], activation_scale(x), lambda ws: x @ ws[0].T, reference, scheme, grid=20)
    rtn_err = (x @ quantize_rtn(w, scheme).dequantize().T - reference).pow(2).mean().item()
    assert errors[0] == pytest.approx(rtn_err, rel=1e-5)  # alpha = 0 is plain rounding
    assert min(errors) < 0.7 * rtn_err
    assert s[:8].mean() > 2 * s[8:].mean()


def test_clip_search_never_increases_a_group_error():
    torch.manual_seed(0)
    w = torch.randn(32, 256)
    w[torch.rand_like(w) < 0.01] *= 8  # heavy-tailed outliers worth clipping
    x = torch.randn(512, 256)
    for scheme in [QuantScheme(4, 64), QuantScheme(3, 128, True), QuantScheme(4, None)]:
        clipped = search_clip(w, x, scheme, grid=20, max_shrink=0.5)

        def group_errors(v):  # each (row, group)'s own share of the output error, as the search measures it
            diff = quantize_rtn(v, scheme).dequantize() - w
            return torch.stack([(diff[:, lo:hi] @ x[:, lo:hi].T).pow(2).mean(1)
                                for lo, hi in scheme.group_bounds(256)])

        assert (group_errors(clipped) <= group_errors(w) * (1 + 1e-5)).all()
        assert group_errors(clipped).mean() < 0.95 * group_errors(w).mean()


def test_awq_block_beats_rtn_on_held_out_inputs(tmp_path):
    model = load_tiny(tmp_path, tiny_llama_hf(num_hidden_layers=1, hidden_size=128, intermediate_size=256,
                                              num_key_value_heads=4))
    layer, scheme = model.model.layers[0], QuantScheme(3, 64)
    torch.manual_seed(0)
    calib, held_out = torch.randint(0, 256, (8, 32)), torch.randint(0, 256, (8, 32))
    positions = torch.arange(32)
    cos, sin = model.rotary_for(0)(positions, torch.float32)
    with torch.no_grad():
        hidden = model.embed(calib) * 4
        hidden[..., :4] *= 20  # outlier channels, as real residual streams have
        test = model.embed(held_out) * 4
        test[..., :4] *= 20
        reference = layer(test, cos, sin, 0, None)
        state = {k: v.clone() for k, v in layer.state_dict().items()}
        targets = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
        for name in targets:
            linear = layer.get_submodule(name)
            linear.weight.data = quantize_rtn(linear.weight.data, scheme).dequantize()
        rtn_err = (layer(test, cos, sin, 0, None) - reference).pow(2).mean()
        layer.load_state_dict(state)
        results = awq_block(layer, "llama", hidden, cos, sin, targets, scheme, AWQConfig(grid=10))
        awq_err = (layer(test, cos, sin, 0, None) - reference).pow(2).mean()
    assert set(results) == set(targets) and all(q.method == "awq" for q in results.values())
    assert awq_err < 0.8 * rtn_err


def test_salient_rules_pick_channels_and_activation_finds_the_important_ones():
    from paperback.quantization.salient import quantize_keeping, salient_channels

    w, x = salient_problem()
    scheme, s_x = QuantScheme(3, 128), activation_scale(x)
    by_activation = salient_channels("activation", w, s_x, 0.03)
    assert sorted(by_activation.tolist()) == list(range(8))  # ceil(3% of 256) = 8, the loud channels
    assert len(salient_channels("random", w, None, 0.01, torch.Generator().manual_seed(0))) == 3
    err = lambda keep: (x @ (quantize_keeping(w, scheme, keep) - w).T).pow(2).mean()
    assert err(by_activation) < 0.5 * err(salient_channels("weight", w, s_x, 0.03))
    with pytest.raises(Exception, match="unknown salient rule"):
        salient_channels("loudest", w, s_x, 0.01)
