"""Bits per MoE expert within an average budget: NatScale, and the five allocations it is measured against.

An MoE model runs k experts a token but stores them all, so which expert gets how many bits decides what fits.
NatScale predicts the model's loss of an assignment as a sum over experts of each expert's quantization error
weighted by a calibrated factor (its cost), and picks the assignment of least predicted loss exactly (a multiple-choice
knapsack, `allocate.solver`):

    predicted KL = sum_e  cost_e(s_e),   sum_e size_e * bits(s_e) <= budget * sum_e size_e

err_e(s) is the expert's output error on the calibration tokens routed to it, weighted by their routing
weights (sum_t r_te^2 ||E_s(x_t) - E(x_t)||^2 / tokens); w_e is measured, not ranked: the KL of the model's
output distribution when expert e alone is quantized at a probe scheme, divided by its err_e there. A rarely
routed expert can still matter (a late layer, a large output), a frequent one can be robust; the factor says
how much, in nats per unit of error.

Measured one expert at a time, those costs do not add up (many quantized experts saturate the KL; its slope
per unit of error differs between W2 and W4), so the knapsack prices each move where it will land
(`context_costs`): from the budget's uniform assignment, each layer's experts are moved together to each
candidate and the probe's KL change is measured, then split among them by w_e x their change of err_e.

The baselines rank experts by one signal (routing frequency, weight norm, weight kurtosis, a random order)
and give the top of the ranking the candidate just above the budget and the rest the one just below, in the
proportion that spends the budget; uniform gives every expert the same bits (at a budget between two
candidates, the same share of each layer's experts, by index, takes the upper one).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from paperback.allocate.solver import Group, Option, solve
from paperback.errors import PaperbackError
from paperback.models.layers import gated_mlp_act
from paperback.progress import progress as stage_progress
from paperback.quantization.gptq import GPTQConfig
from paperback.quantization.model_pass import METHODS
from paperback.quantization.scheme import QuantScheme

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
MIN_BUDGET_BITS = 2.0
Key = tuple[int, int]  # (layer, expert)


@dataclass
class RoutedInputs:
    """One MoE layer's calibration traffic: inputs of its MoE block (N, C), and each token's chosen experts and
    routing weights (N, k)."""

    x: torch.Tensor
    chosen: torch.Tensor
    weights: torch.Tensor

    def of(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows (n, C), routing weights (n,)) of the tokens routed to `expert`."""
        token, slot = torch.nonzero(self.chosen == expert, as_tuple=True)
        return self.x[token], self.weights[token, slot]


def moe_blocks(model) -> dict[int, torch.nn.Module]:
    """{layer: SparseMoE} of the model's MoE layers."""
    if model.config.moe is None:
        raise PaperbackError("expert allocation needs a mixture-of-experts model")
    return {i: layer.mlp for i, layer in enumerate(model.model.layers) if model.config.is_moe_layer(i)}


def experts_of(model) -> dict[Key, torch.nn.Module]:
    return {(i, e): expert for i, block in moe_blocks(model).items() for e, expert in enumerate(block.experts)}


def expert_size(expert) -> int:
    return sum(getattr(expert, p).weight.numel() for p in PROJECTIONS)


def capture_routing(model, calibration: torch.Tensor, batch: int = 4) -> dict[int, RoutedInputs]:
    """Run `calibration` (B, T) through the model and keep every MoE block's inputs and routing."""
    blocks = moe_blocks(model)
    seen: dict[int, list[torch.Tensor]] = {i: [] for i in blocks}
    hooks = [block.register_forward_pre_hook(lambda _m, args, i=i: seen[i].append(
        args[0].reshape(-1, args[0].shape[-1]).float())) for i, block in blocks.items()]
    try:
        with torch.no_grad():
            for ids in calibration.split(batch):
                model(ids)
    finally:
        for hook in hooks:
            hook.remove()
    routed = {}
    with torch.no_grad():
        for i, block in blocks.items():
            x = torch.cat(seen[i])
            weights, chosen = block.gate(x.to(block.gate.weight.dtype))
            routed[i] = RoutedInputs(x, chosen, weights.float())
    return routed


def quantize_candidates(model, routed: dict[int, RoutedInputs], schemes: list[QuantScheme], method: str = "gptq",
                        gptq: GPTQConfig = GPTQConfig(), progress: bool = True) -> dict[Key, dict[str, dict]]:
    """{expert: {scheme label: {projection: dequantized fp32 weight}}}: every expert at every candidate, by the
    expert form of `method` (quantization.expert_forms) on the tokens routed to it."""
    form = METHODS[method].expert if method in METHODS else None
    if form is None:
        raise PaperbackError(f"expert candidates are quantized by "
                             f"{' or '.join(m.name for m in METHODS.values() if m.expert)}, not '{method}'")
    act = gated_mlp_act(model.config.hidden_act)
    candidates: dict[Key, dict[str, dict]] = {}
    for (layer, e), expert in stage_progress(experts_of(model).items(), desc="expert candidates", unit="expert",
                                             enabled=progress):
        x, _ = routed[layer].of(e)
        weights = {p: getattr(expert, p).weight.detach().float() for p in PROJECTIONS}
        candidates[(layer, e)] = {s.label: {p: q.dequantize(torch.float32)
                                            for p, q in form(weights, x, act, s, gptq).items()} for s in schemes}
    return candidates


def _expert_output(x: torch.Tensor, weights: dict, act) -> torch.Tensor:
    return (act(x @ weights["gate_proj"].T) * (x @ weights["up_proj"].T)) @ weights["down_proj"].T


def expert_errors(model, routed: dict[int, RoutedInputs], candidates: dict[Key, dict[str, dict]]
                  ) -> dict[Key, dict[str, float]]:
    """{expert: {scheme: sum over routed tokens of r^2 ||E_s(x) - E(x)||^2, per calibration token}}."""
    act = gated_mlp_act(model.config.hidden_act)
    errors = {}
    with torch.no_grad():
        for (layer, e), expert in experts_of(model).items():
            x, r = routed[layer].of(e)
            tokens = len(routed[layer].x)
            exact = _expert_output(x, {p: getattr(expert, p).weight.float() for p in PROJECTIONS}, act)
            errors[(layer, e)] = {
                label: float(((r[:, None] * (_expert_output(x, w, act) - exact)) ** 2).sum() / tokens)
                for label, w in candidates[(layer, e)].items()}
    return errors


def expert_signals(model, routed: dict[int, RoutedInputs]) -> dict[str, dict[Key, float]]:
    """The baselines' ranking signals: routing frequency, weight norm (Frobenius, all three projections) and
    weight kurtosis (of all the expert's weights: heavy tails are harder to round)."""
    signals: dict[str, dict[Key, float]] = {"frequency": {}, "weight_norm": {}, "kurtosis": {}}
    for (layer, e), expert in experts_of(model).items():
        chosen = routed[layer].chosen
        signals["frequency"][(layer, e)] = float((chosen == e).any(dim=1).float().mean())
        flat = torch.cat([getattr(expert, p).weight.detach().float().flatten() for p in PROJECTIONS]).double()
        signals["weight_norm"][(layer, e)] = float(flat.norm())
        centred = flat - flat.mean()
        signals["kurtosis"][(layer, e)] = float((centred ** 4).mean() / (centred ** 2).mean() ** 2)
    return signals


@contextmanager
def assigned(model, candidates: dict[Key, dict[str, dict]], assignment: dict[Key, str]):
    """The model with each assigned expert's weights replaced by its candidate's, restored on exit."""
    experts = experts_of(model)
    saved = {}
    try:
        for key, label in assignment.items():
            expert = experts[key]
            saved[key] = {p: getattr(expert, p).weight.data for p in PROJECTIONS}
            for p in PROJECTIONS:
                getattr(expert, p).weight.data = candidates[key][label][p].to(saved[key][p].dtype)
        yield model
    finally:
        for key, weights in saved.items():
            for p, w in weights.items():
                getattr(experts[key], p).weight.data = w


def _kl(reference_logprobs: torch.Tensor, logits: torch.Tensor) -> float:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return float((reference_logprobs.exp() * (reference_logprobs - logprobs)).sum(-1).mean())


def calibrate_factors(model, probe: torch.Tensor, candidates: dict[Key, dict[str, dict]],
                      errors: dict[Key, dict[str, float]], probe_label: str, progress: bool = True
                      ) -> tuple[dict[Key, float], dict[Key, float]]:
    """NatScale's factors: ({expert: KL / err at the probe scheme}, {expert: that KL}). Each expert alone is
    quantized at `probe_label` and the model runs on `probe` (B, T) from that expert's layer on (the layers
    before it are unchanged, so their outputs are computed once); KL to the unquantized model's next-token
    distribution, mean over tokens."""
    with torch.no_grad():
        hidden_states, kl_from = layer_runner(model, probe)
        hidden = hidden_states()
        factors, kls = {}, {}
        for key in stage_progress(experts_of(model), desc="calibrating experts", unit="expert", enabled=progress):
            with assigned(model, candidates, {key: probe_label}):
                kls[key] = max(kl_from(key[0], hidden), 0.0)
            error = errors[key][probe_label]
            factors[key] = kls[key] / error if error > 0 else 0.0
    return factors, kls


def layer_runner(model, probe: torch.Tensor):
    """(hidden_states() -> every layer's input and the last output on `probe` (B, T) as the model stands,
    kl_from(start, hidden) -> KL to the model as it stood at this call, run from layer `start` on those hidden
    states): the layers before a changed one need not run again."""
    layers = model.model.layers
    positions = torch.arange(probe.shape[1])
    rotary = [model.rotary_for(idx)(positions, model.dtype) for idx in range(len(layers))]

    def hidden_states() -> list[torch.Tensor]:
        hidden = [model.embed(probe)]
        for idx, layer in enumerate(layers):
            hidden.append(layer(hidden[-1], *rotary[idx], 0, None))
        return hidden

    def kl_from(start: int, hidden: list[torch.Tensor]) -> float:
        x = hidden[start]
        for idx in range(start, len(layers)):
            x = layers[idx](x, *rotary[idx], 0, None)
        return _kl(reference, model.logits(model.model.norm(x)))

    reference = torch.log_softmax(model.logits(model.model.norm(hidden_states()[-1])).float(), dim=-1)
    return hidden_states, kl_from


def context_costs(model, probe: torch.Tensor, candidates: dict[Key, dict[str, dict]],
                  errors: dict[Key, dict[str, float]], factors: dict[Key, float], context: dict[Key, str],
                  progress: bool = True) -> tuple[float, dict[Key, dict[str, float]]]:
    """(KL of the `context` assignment, {expert: {scheme: predicted change of KL when it moves there}}).

    Costs measured one expert at a time, with every other expert exact, do not add up: errors of many
    quantized experts saturate the output's KL, and the KL per unit of error is not the same at W2 as at W4
    (measured on MoEfied SmolLM2: 8 experts of a layer at W2 cost 0.4 x the sum of their single KLs, at W4
    2.4 x). So the costs are measured where the allocation will land: with every expert at `context` (the
    uniform assignment of the budget), each layer's experts are moved together to each scheme and the probe's
    KL change is measured; the change is split among the layer's experts by factor x change of routed error."""
    labels = sorted({label for per_scheme in errors.values() for label in per_scheme})
    by_layer: dict[int, list[Key]] = {}
    for key in sorted(errors):
        by_layer.setdefault(key[0], []).append(key)
    costs: dict[Key, dict[str, float]] = {key: {} for key in errors}
    with torch.no_grad():
        hidden_states, kl_from = layer_runner(model, probe)  # the reference: the unquantized model
    with torch.no_grad(), assigned(model, candidates, context):
        hidden = hidden_states()
        base = kl_from(len(model.model.layers), hidden)
        steps = [(layer, label) for layer in by_layer for label in labels]
        for layer, label in stage_progress(steps, desc="calibrating in context", unit="move", enabled=progress):
            keys = by_layer[layer]
            moved = {key: label for key in keys if context[key] != label}
            change = 0.0
            if moved:
                with assigned(model, candidates, moved):
                    change = kl_from(layer, hidden) - base
            weighted = {key: factors[key] * (errors[key][label] - errors[key][context[key]]) for key in keys}
            total = sum(weighted.values())
            for key in keys:
                costs[key][label] = change * weighted[key] / total if total else 0.0
    return base, costs


def isolated_costs(factors: dict[Key, float], errors: dict[Key, dict[str, float]]) -> dict[Key, dict[str, float]]:
    """{expert: {scheme: factor x routed error}}: the one-expert-at-a-time prediction, summed as if additive."""
    return {key: {label: factors[key] * error for label, error in errors[key].items()} for key in errors}


def check_budget(budget: float, bits: dict[str, int]) -> None:
    if not math.isfinite(budget) or budget < MIN_BUDGET_BITS:
        raise PaperbackError(f"a budget of {budget:g} average bits per expert weight is below the {MIN_BUDGET_BITS:g} "
                             f"bits the smallest candidate needs")
    if budget < min(bits.values()):
        raise PaperbackError(f"a budget of {budget:g} bits is below the smallest candidate "
                             f"({min(bits.values())} bits)")


def natscale_allocation(costs: dict[Key, dict[str, float]], sizes: dict[Key, int], bits: dict[str, int],
                        budget: float) -> dict[Key, str]:
    """The assignment of least predicted KL (the sum of its experts' costs: `context_costs`, or
    `isolated_costs`) within `budget` average bits, exactly."""
    check_budget(budget, bits)
    groups = [Group(f"{k[0]}.{k[1]}", tuple(Option(label, sizes[k] * bits[label], costs[k][label]) for label in bits))
              for k in costs]
    # The solver keeps 1e-6 of its largest option below the capacity (HiGHS's tolerance); that sliver back, so
    # an assignment that spends the budget exactly (every expert at a budget that is a candidate) stays allowed.
    slack = 2e-6 * max(sizes[k] * max(bits.values()) for k in costs)
    chosen = solve(groups, budget * sum(sizes[k] for k in costs) + slack)
    return {k: chosen[f"{k[0]}.{k[1]}"].label for k in costs}


def predicted_kl(costs: dict[Key, dict[str, float]], assignment: dict[Key, str], base: float = 0.0) -> float:
    return base + sum(costs[k][label] for k, label in assignment.items())


def _levels(bits: dict[str, int], budget: float) -> tuple[str, str, float]:
    """(lower label, upper label, share of weights at the upper) that average `budget` bits."""
    check_budget(budget, bits)
    ordered = sorted(bits, key=bits.get)
    if budget >= bits[ordered[-1]]:
        return ordered[-1], ordered[-1], 1.0
    below = [label for label in ordered if bits[label] < budget] or [ordered[0]]
    above = [label for label in ordered if bits[label] > budget]
    low, high = below[-1], above[0]
    if budget == bits[ordered[0]]:
        return low, low, 0.0
    return low, high, (budget - bits[low]) / (bits[high] - bits[low])


def ranking_allocation(scores: dict[Key, float], sizes: dict[Key, int], bits: dict[str, int],
                       budget: float) -> dict[Key, str]:
    """Experts by decreasing score take the upper of the two candidates around the budget while the budget
    allows, the rest the lower."""
    low, high, _ = _levels(bits, budget)
    capacity = budget * sum(sizes.values()) - sum(sizes[k] * bits[low] for k in scores)
    assignment = {k: low for k in scores}
    for key in sorted(scores, key=lambda k: (-scores[k], k)):
        extra = sizes[key] * (bits[high] - bits[low])
        if extra <= capacity + 1e-9:
            assignment[key], capacity = high, capacity - extra
    return assignment


def uniform_allocation(keys: list[Key], sizes: dict[Key, int], bits: dict[str, int], budget: float
                       ) -> dict[Key, str]:
    """The same bits for every expert; between two candidates, the same share of every layer's experts (the
    lowest-numbered ones) at the upper."""
    exact = [label for label, b in bits.items() if b == budget]
    if exact:
        return {key: exact[0] for key in keys}
    low, high, share = _levels(bits, budget)
    by_layer: dict[int, list[Key]] = {}
    for key in sorted(keys):
        by_layer.setdefault(key[0], []).append(key)
    scores = {key: float(key[1] < round(share * len(experts))) for experts in by_layer.values() for key in experts}
    return ranking_allocation(scores, sizes, bits, budget)


def random_allocation(keys: list[Key], sizes: dict[Key, int], bits: dict[str, int], budget: float,
                      seed: int) -> dict[Key, str]:
    order = torch.randperm(len(keys), generator=torch.Generator().manual_seed(seed)).tolist()
    return ranking_allocation({keys[i]: float(rank) for rank, i in enumerate(order)}, sizes, bits, budget)


def average_bits(assignment: dict[Key, str], sizes: dict[Key, int], bits: dict[str, int]) -> float:
    return sum(sizes[k] * bits[label] for k, label in assignment.items()) / sum(sizes[k] for k in assignment)


def natscale_schemes(model, calibration: torch.Tensor, probe: torch.Tensor, schemes: list[QuantScheme],
                     budget: float, method: str = "gptq", progress: bool = True) -> tuple[dict[str, QuantScheme], dict]:
    """NatScale end to end for `paperback quantize --expert-bits`: ({expert parameter name: scheme}, a report
    for the recipe). calibration (B, T) gives the routed errors and GPTQ Hessians, probe (B, T) the factors."""
    bits = {s.label: s.bits for s in schemes}
    check_budget(budget, bits)
    routed = capture_routing(model, calibration)
    candidates = quantize_candidates(model, routed, schemes, method, progress=progress)
    errors = expert_errors(model, routed, candidates)
    factors, kls = calibrate_factors(model, probe, candidates, errors, min(bits, key=bits.get), progress=progress)
    sizes = {k: expert_size(e) for k, e in experts_of(model).items()}
    context = uniform_allocation(sorted(errors), sizes, bits, budget)
    base, costs = context_costs(model, probe, candidates, errors, factors, context, progress)
    assignment = natscale_allocation(costs, sizes, bits, budget)
    by_label = {s.label: s for s in schemes}
    layer_schemes = {f"model.layers.{layer}.mlp.experts.{e}.{p}.weight": by_label[label]
                     for (layer, e), label in assignment.items() for p in PROJECTIONS}
    report = {"method": "natscale", "budget_bits": budget, "average_bits": average_bits(assignment, sizes, bits),
              "predicted_kl": predicted_kl(costs, assignment, base), "uniform_kl": base,
              "candidates": sorted(bits, key=bits.get),
              "experts": {f"{layer}.{e}": {"scheme": label, "factor": factors[(layer, e)],
                                            "probe_kl": kls[(layer, e)]}
                          for (layer, e), label in sorted(assignment.items())}}
    return layer_schemes, report
