"""NatScale's expert allocation and its baselines on a tiny random MoE model: errors, calibrated factors, the
exact knapsack, the rankings, and the budgets they must keep."""

import pytest
import torch

from helpers import tiny_moe_hf
from paperback.allocate import experts as ea
from paperback.errors import PaperbackError
from paperback.loading import load_model
from paperback.quantization.scheme import QuantScheme

SCHEMES = [QuantScheme(2, 32), QuantScheme(3, 32), QuantScheme(4, 32), QuantScheme(8, 32)]
BITS = {s.label: s.bits for s in SCHEMES}


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe")
    tiny_moe_hf("qwen3_moe").save_pretrained(path)
    model = load_model(str(path), with_tokenizer=False).model
    torch.manual_seed(0)
    calibration = torch.randint(0, 256, (8, 32))
    routed = ea.capture_routing(model, calibration)
    candidates = ea.quantize_candidates(model, routed, SCHEMES, progress=False)
    errors = ea.expert_errors(model, routed, candidates)
    factors, kls = ea.calibrate_factors(model, torch.randint(0, 256, (4, 32)), candidates, errors, "W2a-g32",
                                        progress=False)
    sizes = {k: ea.expert_size(e) for k, e in ea.experts_of(model).items()}
    return model, routed, candidates, errors, factors, kls, sizes


def test_errors_fall_with_bits_and_factors_are_measured(study):
    model, routed, candidates, errors, factors, kls, sizes = study
    assert len(errors) == model.config.num_layers * model.config.moe.num_experts
    for per_scheme in errors.values():
        values = [per_scheme[s.label] for s in SCHEMES]
        assert all(a > b for a, b in zip(values, values[1:]))
    # an expert no probe token is routed to costs nothing there (factor 0); the others cost some KL
    assert all(k >= 0 for k in kls.values()) and sum(k > 0 for k in kls.values()) >= 0.9 * len(kls)
    assert len(set(round(f, 6) for f in factors.values())) > len(factors) // 2


def test_candidates_swap_in_and_out_exactly(study):
    model, routed, candidates, *_ = study
    ids = torch.randint(0, 256, (1, 12))
    key = next(iter(candidates))
    with torch.no_grad():
        before = model(ids)
        with ea.assigned(model, candidates, {key: "W2a-g32"}):
            changed = model(ids)
        after = model(ids)
    assert torch.equal(before, after) and not torch.equal(before, changed)


@pytest.mark.parametrize("budget", [2.5, 3.0, 4.0])
def test_every_allocation_spends_the_same_budget_and_natscale_predicts_least(study, budget):
    model, routed, candidates, errors, factors, kls, sizes = study
    keys = sorted(errors)
    signals = ea.expert_signals(model, routed)
    costs = ea.isolated_costs(factors, errors)
    allocations = {"natscale": ea.natscale_allocation(costs, sizes, BITS, budget),
                   "uniform": ea.uniform_allocation(keys, sizes, BITS, budget),
                   **{name: ea.ranking_allocation(signal, sizes, BITS, budget) for name, signal in signals.items()},
                   "random": ea.random_allocation(keys, sizes, BITS, budget, seed=0)}
    spent = {name: ea.average_bits(a, sizes, BITS) for name, a in allocations.items()}
    assert all(budget - 0.5 <= bits <= budget + 1e-9 for bits in spent.values()), spent
    best = ea.predicted_kl(costs, allocations["natscale"])
    others = {name: ea.predicted_kl(costs, a) for name, a in allocations.items()}
    assert all(best <= value * (1 + 1e-6) for value in others.values()), (best, others)
    if budget == 3.0:  # between W2 and W4, half the weights each; uniform gives everyone W3
        assert set(allocations["uniform"].values()) == {"W3a-g32"}
        assert sorted(set(allocations["frequency"].values())) == ["W2a-g32", "W4a-g32"]


def test_frequency_ranking_gives_the_upper_bits_to_the_busiest_experts(study):
    model, routed, _, errors, _, _, sizes = study
    frequency = ea.expert_signals(model, routed)["frequency"]
    allocation = ea.ranking_allocation(frequency, sizes, BITS, 2.5)
    upper = [frequency[k] for k, label in allocation.items() if label == "W3a-g32"]
    lower = [frequency[k] for k, label in allocation.items() if label == "W2a-g32"]
    assert min(upper) >= max(lower)


def test_budgets_below_two_bits_are_refused(study):
    model, routed, candidates, errors, factors, kls, sizes = study
    with pytest.raises(PaperbackError, match="below the 2 bits"):
        ea.natscale_allocation(ea.isolated_costs(factors, errors), sizes, BITS, 1.5)
    with pytest.raises(PaperbackError, match="below the 2 bits"):
        ea.ranking_allocation(factors, sizes, BITS, 1.9)


@pytest.mark.parametrize("calib", ["pydoc", "generated"])  # generated: the MoE model writes its own windows
def test_quantize_cli_allocates_expert_bits_with_natscale(tmp_path, smollm2, capsys, calib):
    import json

    from paperback.cli import main
    from paperback.quantization.qlinear import QuantLinear

    tiny_moe_hf("mixtral", vocab_size=smollm2.config.vocab_size).save_pretrained(tmp_path / "moe")
    smollm2.tokenizer.hf.save_pretrained(tmp_path / "moe")
    out = tmp_path / "q"
    assert main(["quantize", str(tmp_path / "moe"), "-o", str(out), "--method", "gptq", "--bits", "8",
                 "--group-size", "32", "--expert-bits", "3", "--expert-schemes", "W2a-g32,W3a-g32,W4a-g32,W8a-g32",
                 "--calib-samples", "4", "--calib-len", "64", "--expert-probe-samples", "2", "--calib", calib,
                 "--json"]) == 0
    recipe = json.loads((out / "recipe.json").read_text())
    assert recipe["calibration"]["corpus"] == calib
    report = recipe["expert_allocation"]
    assert report["method"] == "natscale" and report["average_bits"] <= 3.0 + 1e-9
    assert len(report["experts"]) == 3 * 6
    schemes = {e["scheme"] for e in report["experts"].values()}
    assert schemes <= {"W2a-g32", "W3a-g32", "W4a-g32", "W8a-g32"}
    lm = load_model(str(out))
    layer, expert = map(int, next(iter(report["experts"])).split("."))
    down = lm.model.model.layers[layer].mlp.experts[expert].down_proj
    assert isinstance(down, QuantLinear) and down.scheme.label == report["experts"][f"{layer}.{expert}"]["scheme"]
    assert lm.model.model.layers[0].self_attn.q_proj.scheme.bits == 8


def test_quantize_cli_refuses_bad_expert_budgets_before_loading(tmp_path, capsys, monkeypatch):
    from paperback.cli import main

    assert main(["quantize", "no-such-model", "-o", str(tmp_path / "a"), "--expert-bits", "1.5"]) == 2
    assert "below the 2 bits" in capsys.readouterr().err
    import paperback.loading

    def no_loading(*args, **kwargs):
        raise AssertionError("a dense model is refused from its config, before its weights load")

    monkeypatch.setattr(paperback.loading, "load_model", no_loading)
    assert main(["quantize", "smollm2", "-o", str(tmp_path / "b"), "--expert-bits", "3", "--method", "rtn",
                 "--calib-samples", "2"]) == 2
    assert "needs a mixture-of-experts model; smollm2 is dense" in capsys.readouterr().err


def test_context_costs_are_the_measured_kl_of_moving_a_layer(study):
    model, routed, candidates, errors, factors, kls, sizes = study
    probe = torch.randint(0, 256, (2, 32))
    context = ea.uniform_allocation(sorted(errors), sizes, BITS, 3.0)
    base, costs = ea.context_costs(model, probe, candidates, errors, factors, context, progress=False)
    with torch.no_grad():
        reference = torch.log_softmax(model(probe).float(), dim=-1)

        def measured(assignment):
            with ea.assigned(model, candidates, assignment):
                return ea._kl(reference, model(probe))

        assert base == pytest.approx(measured(context), rel=1e-4) and base > 0
        assert all(costs[k][context[k]] == 0 for k in costs)
        # moving one layer's experts together is what was measured: the prediction is exact there
        for layer, label in [(0, "W2a-g32"), (1, "W8a-g32")]:
            moved = {**context, **{k: label for k in context if k[0] == layer}}
            assert ea.predicted_kl(costs, moved, base) == pytest.approx(measured(moved), rel=1e-3, abs=1e-7)
    # the knapsack on them keeps the budget and predicts no worse than the context it started from
    chosen = ea.natscale_allocation(costs, sizes, BITS, 3.0)
    assert ea.average_bits(chosen, sizes, BITS) <= 3.0 + 1e-9
    assert ea.predicted_kl(costs, chosen, base) <= base + 1e-12
