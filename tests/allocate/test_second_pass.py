"""The second pass: candidates by head scheme, each the exact optimum given the head, measured whole."""

import itertools

import pytest
import torch

from paperback.allocate.allocation import Allocator, Workload
from paperback.allocate.candidates import (Candidate, even_weight_candidate, head_candidates, kept_candidate,
                                           second_pass_candidates)
from paperback.allocate.probe import ReferenceProbe, swapped_weights
from paperback.allocate.profile import ProfileConfig, Profiler, split_text
from paperback.allocate.second_pass import SecondPass, ShippedSecondPass
from paperback.allocate.solver import Group, InfeasibleBudget, Option
from paperback.kv.policy import build_policy
from paperback.quantization.model_pass import BLOCK_LINEARS, QuantizeConfig, quantize_model
from paperback.quantization.rtn import quantize_rtn

from test_profile import sample_text

CONFIG = ProfileConfig(method="rtn", weight_schemes=("W8s-ch", "W4a-g64", "W2a-g64"), kv_formats=("fp16", "kivi2:r=32"),
                       windows=1, window_tokens=128, weight_tokens=64, calib_samples=1, additivity_samples=0,
                       head_tokens=256)


def test_even_bits_are_kept_unless_a_mix_beats_them_by_the_margin():
    def measured(name, kl, even=False):
        return Candidate(name, {}, predicted=0.0, measured=kl, even=even)

    even = measured("even W4a-g64", 1.00, even=True)
    close, clear = measured("head W4a-g128", 0.95), measured("head W4a-g64", 0.85)
    assert kept_candidate([close, even], margin=0.10) is even  # 5% lower: within the margin
    assert kept_candidate([close, even, clear], margin=0.10) is clear  # 15% lower: kept
    assert kept_candidate([close, even], margin=0.0) is close  # no margin: the least KL
    worse = measured("head W3a-g64", 1.20)
    assert kept_candidate([worse, even], margin=0.10) is even
    assert kept_candidate([close, worse], margin=0.10) is close  # no even-bits candidate: the least KL
    with pytest.raises(ValueError, match="margin"):
        kept_candidate([close, even], margin=1.0)


def brute_force(groups, capacity):
    best = None
    for combo in itertools.product(*(g.options for g in groups)):
        if sum(o.bytes for o in combo) <= capacity:
            cost = sum(o.cost for o in combo)
            best = cost if best is None or cost < best else best
    return best


def test_each_candidate_is_the_exact_optimum_with_its_head_scheme():
    head = Group("head", (Option("hi", 8, 0.1), Option("mid", 5, 0.3), Option("lo", 3, 0.9), Option("max", 20, 0)))
    blocks = [Group(f"b{i}", (Option("hi", 4, 0.05 * i), Option("lo", 2, 0.2 + 0.1 * i))) for i in range(3)]
    capacity = 16.5  # no combination sums to it exactly: the solver keeps a tolerance below the capacity
    candidates = head_candidates([head, *blocks], capacity, count=3)
    assert [c.predicted for c in candidates] == sorted(c.predicted for c in candidates)
    assert len({c.chosen["head"].label for c in candidates}) == 3  # one per head scheme; "max" never fits
    assert candidates[0].predicted == pytest.approx(brute_force([head, *blocks], capacity))
    for c in candidates:
        assert sum(o.bytes for o in c.chosen.values()) <= capacity
        fixed = Group("head", (c.chosen["head"],))
        assert c.predicted == pytest.approx(brute_force([fixed, *blocks], capacity))
    with pytest.raises(InfeasibleBudget):
        head_candidates([head, *blocks], 8)
    assert len(head_candidates([head, *blocks], capacity, count=1)) == 1
    assert head_candidates(blocks, capacity)[0].name == "solve"  # no head unit: the one solve


def test_the_even_candidate_holds_every_weight_unit_at_one_scheme_and_solves_the_cache_for_the_rest():
    head = Group("head", (Option("hi", 8, 0.1), Option("lo", 3, 0.9)))
    blocks = [Group(f"b{i}", (Option("hi", 4, 0.05 * i), Option("lo", 2, 0.2 + 0.1 * i))) for i in range(3)]
    kv = Group("kv.0", (Option("fp16", 6, 0.0), Option("kivi2", 1, 0.5)))
    # 20 bytes: every unit at "hi" (20) leaves no room for the cache's smallest option; "lo" (9) leaves 11.
    even = even_weight_candidate([head, *blocks, kv], 20)
    assert even.name == "even lo" and {even.chosen[g.name].label for g in (head, *blocks)} == {"lo"}
    assert even.chosen["kv.0"].label == "fp16"  # the bytes left go to the cache
    assert even_weight_candidate([head, *blocks, kv], 25).name == "even hi"  # the better one that fits
    assert even_weight_candidate([head, *blocks], 5) is None
    # The second pass measures it beside the mixed solves, unless one of them already is it.
    mixed = second_pass_candidates([head, *blocks], 13, count=3)
    assert mixed[-1].name == "even lo" and len(mixed) == len(head_candidates([head, *blocks], 13, count=3)) + 1
    assert [c.name for c in second_pass_candidates([head, *blocks], 21, count=3)].count("even hi") == 0
    assert len(second_pass_candidates([head, *blocks], 13, count=1)) == 1  # no second pass: the solve alone


@pytest.fixture
def profile(tiny_lm, char_tokenizer, tmp_path):
    return Profiler(tiny_lm.model, char_tokenizer, sample_text(), "sample", CONFIG, tmp_path, progress=False).run()


def test_the_second_pass_measures_each_candidate_whole_and_keeps_the_least(profile, tiny_lm, char_tokenizer):
    allocator = Allocator(profile, tiny_lm.model, Workload(10 ** 12, 256, 1))
    groups = allocator.weight_groups()
    middle = (sum(min(o.bytes for o in g.options) for g in groups) + sum(max(o.bytes for o in g.options)
                                                                          for g in groups)) / 2
    candidates = head_candidates(groups, middle, count=3)
    assert len(candidates) >= 2
    second = SecondPass(tiny_lm.model, char_tokenizer, sample_text(), CONFIG, allocator.units, progress=False)
    before = {n: p.detach().clone() for n, p in tiny_lm.model.named_parameters()}
    best = second.choose(candidates)
    assert best.measured == min(c.measured for c in candidates)
    assert all(torch.equal(p, before[n]) for n, p in tiny_lm.model.named_parameters())  # weights restored
    # Each measurement is the whole model with every unit's RTN weights at once, on the head windows.
    windows = split_text(char_tokenizer.encode(sample_text()), CONFIG).head_windows
    probe = ReferenceProbe(tiny_lm.model, windows, CONFIG.kv_chunk)
    params = dict(tiny_lm.model.named_parameters())
    for c in candidates:
        swap = {p: quantize_rtn(params[p], allocator.schemes[c.chosen[u.name].label]).dequantize()
                for u in allocator.units for p in u.params}
        with swapped_weights(tiny_lm.model, swap):
            assert c.measured == pytest.approx(probe.kl_full(), rel=1e-5)
    # With a KV policy, the cache is read back in its formats as well.
    policy = build_policy(tiny_lm.config, spec={"default": "kivi2:r=32"})
    second.choose(candidates, lambda c: policy)
    with swapped_weights(tiny_lm.model, second._weights(candidates[0])):
        assert candidates[0].measured == pytest.approx(probe.kl_full(policy), rel=1e-5)


def test_the_shipped_pass_measures_each_candidate_as_quantized_and_keeps_that_model(profile, tiny_lm,
                                                                                      char_tokenizer):
    allocator = Allocator(profile, tiny_lm.model, Workload(10 ** 12, 256, 1))
    groups = allocator.weight_groups()
    middle = (sum(min(o.bytes for o in g.options) for g in groups) + sum(max(o.bytes for o in g.options)
                                                                          for g in groups)) / 2
    candidates = second_pass_candidates(groups, middle, count=2)
    assert candidates[-1].name.startswith("even ") and len(candidates) == 3
    quantized_copies = []

    def quantize(model, candidate):  # the final pass, as fit runs it (RTN here: the tiny profile's method)
        assert model is not tiny_lm.model
        quantized_copies.append(model)
        config = QuantizeConfig("rtn", allocator.schemes["W8s-ch"], targets=BLOCK_LINEARS + ("head",),
                                layer_schemes={p: allocator.schemes[candidate.chosen[u.name].label]
                                               for u in allocator.units for p in u.params})
        return quantize_model(model, config, progress=False)

    before = {n: p.detach().clone() for n, p in tiny_lm.model.named_parameters()}
    second = ShippedSecondPass(tiny_lm.model, char_tokenizer, sample_text(), CONFIG, progress=False)
    best = second.choose(candidates, quantize)
    assert all(torch.equal(p, before[n]) for n, p in tiny_lm.model.named_parameters())  # the full model unchanged
    assert len(quantized_copies) == 3 and best.model is quantized_copies[candidates.index(best.candidate)]
    assert best.candidate is kept_candidate(candidates)
    # What was measured is the kept model itself, whole, on the profile's head windows, against the full model.
    windows = split_text(char_tokenizer.encode(sample_text()), CONFIG).head_windows
    probe = ReferenceProbe(tiny_lm.model, windows, CONFIG.kv_chunk)
    with swapped_weights(tiny_lm.model, {n: p.data for n, p in best.model.named_parameters()}):
        assert best.candidate.measured == pytest.approx(probe.kl_full(), rel=1e-5)
    # The head in the kept model is the kept candidate's scheme: the model is not quantized again.
    head = next(u.params[0] for u in allocator.units if u.name == "head")
    scheme = allocator.schemes[best.candidate.chosen["head"].label]
    assert best.weights[head].scheme == scheme
    assert torch.equal(dict(best.model.named_parameters())[head], quantize_rtn(before[head], scheme).dequantize())
    # One candidate: quantized, not measured.
    fresh = second_pass_candidates(groups, middle, count=1)
    assert second.choose(fresh, quantize).candidate.measured is None


def test_candidates_the_additivity_check_rules_out_are_not_measured():
    from paperback.allocate.candidates import Candidate, within_additivity
    from paperback.allocate.profile_data import AdditivityCheck, Agreement, Assignment

    candidates = [Candidate("a", {}, 0.1), Candidate("b", {}, 0.15), Candidate("c", {}, 0.5)]
    additivity = AdditivityCheck(Agreement(2, 1.0, 1.0, 1.0, 1.2), {},
                                 (Assignment("weights", 1.0, 0.8, {}, {}), Assignment("weights", 1.0, 1.6, {}, {})))
    # c at its most favourable ratio (0.8 x 0.5 = 0.4) still exceeds a at its least (1.6 x 0.1 = 0.16).
    assert [c.name for c in within_additivity(candidates, additivity)] == ["a", "b"]
    assert within_additivity(candidates, None) == candidates  # no check in the profile: all are measured
