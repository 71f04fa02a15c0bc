import json

import pytest
import torch

from paperback.allocate.allocation import Allocator, Workload, head_label
from paperback.allocate.baselines import param_shapes, policy_bytes
from paperback.allocate.head_band_profile import output_side_kl, random_band_assignments
from paperback.allocate.probe import ReferenceProbe, swapped_weights
from paperback.allocate.profile import ProfileConfig, Profiler
from paperback.quantization.head_bands import BandedWeight, band_rows, decode_band_of
from paperback.quantization.model_pass import BLOCK_LINEARS, EMBED_PARAM, QuantizeConfig, quantize_model
from paperback.quantization.rtn import quantize_rtn
from paperback.quantization.scheme import QuantScheme

from test_profile import sample_text

CONFIG = ProfileConfig(method="rtn", weight_schemes=("W8s-ch", "W4a-g64", "W2a-g64"), kv_formats=("fp16",),
                       windows=1, window_tokens=128, weight_tokens=64, calib_samples=1, additivity_samples=3)


@pytest.fixture
def tied_profile(tied_lm, char_tokenizer, tmp_path):
    profiler = Profiler(tied_lm.model, char_tokenizer, sample_text(), "sample", CONFIG, tmp_path, progress=False)
    return profiler, profiler.run()


def test_output_side_band_kl_is_the_kl_with_only_that_bands_logits_changed():
    torch.manual_seed(0)
    hidden, weight = torch.randn(300, 16), torch.randn(50, 16)
    changed = weight + 0.1 * torch.randn(50, 16)
    rows = [torch.arange(0, 5), torch.arange(5, 20), torch.arange(20, 50)]
    ref = torch.log_softmax(hidden @ weight.T, -1)
    bands, whole = output_side_kl(hidden, ref.exp(), changed - weight, rows)

    def kl(w):
        return (ref.exp() * (ref - torch.log_softmax(hidden @ w.T, -1))).sum(-1).mean().item()

    for idx, cost in zip(rows, bands):
        one = weight.clone()
        one[idx] = changed[idx]
        assert cost == pytest.approx(kl(one), rel=1e-4, abs=1e-7)
    assert whole == pytest.approx(kl(changed), rel=1e-4)


def test_a_tied_heads_bands_are_profiled_scaled_to_the_head_and_checked_whole(tied_profile, tied_lm):
    profiler, profile = tied_profile
    data = profile.to_dict()
    bands = data["weights"]["head_bands"]
    band_of = decode_band_of(bands["band_of"], 256)
    assert profile.weights.head_bands.kl == bands["kl"] and list(profile.weights.head_bands.sizes) == bands["sizes"]
    assert bands["sizes"] == [len(r) for r in band_rows(band_of)] and sum(bands["sizes"]) == 256
    head = data["weights"]["kl"]["head"]
    for label in CONFIG.weight_schemes:
        side = bands["output_side"][label]
        assert bands["scale"][label] == pytest.approx(head[label] / side["whole"])
        assert [bands["kl"][f"band{b}"][label] for b in range(8)] == pytest.approx(
            [max(c, 0) * bands["scale"][label] for c in side["bands"]])
    # The text's characters are its inputs: they rank first.
    used = set(ord(c) % 256 for c in sample_text()[:1500])
    assert set(torch.cat(band_rows(band_of)[:5]).tolist()) >= used
    check = bands["check"]
    assert check["samples"] == 8 and check["spearman"] > 0.5
    point = check["points"][0]
    picks = [point["weights"][f"band{b}"] for b in range(8)]
    weight = tied_lm.model.model.embed_tokens.weight.detach()
    schemes = {s.label: s for s in profiler.schemes}
    banded = BandedWeight(band_of, [quantize_rtn(weight[r], schemes[p]) for r, p in zip(band_rows(band_of), picks)])
    probe = ReferenceProbe(tied_lm.model, profiler.text.head_windows)
    with swapped_weights(tied_lm.model, {EMBED_PARAM: banded.dequantize()}):
        assert point["measured"] == pytest.approx(probe.kl_full(), rel=1e-5)


def test_a_profile_from_before_head_bands_gets_them_and_nothing_else_is_remeasured(tied_profile, tied_lm,
                                                                                   char_tokenizer, tmp_path):
    profiler, profile = tied_profile
    data = profile.to_dict()
    old = json.loads(json.dumps(data))
    del old["weights"]["head_bands"]
    profiler.complete_path.write_text(json.dumps(old))
    again = Profiler(tied_lm.model, char_tokenizer, sample_text(), "sample", CONFIG, tmp_path, progress=False)
    again._weights = again._kv = again._head = None  # nothing but the bands may run
    upgraded = again.run().to_dict()
    assert upgraded["weights"]["head_bands"]["kl"] == data["weights"]["head_bands"]["kl"]
    assert upgraded["weights"]["kl"] == data["weights"]["kl"] and upgraded["kv"] == data["kv"]


def test_an_untied_head_has_no_bands(tiny_lm, char_tokenizer, tmp_path):
    profile = Profiler(tiny_lm.model, char_tokenizer, sample_text(), "sample", CONFIG, tmp_path, progress=False).run()
    assert profile.weights.head_bands is None and "head_bands" not in profile.to_dict()["weights"]
    allocator = Allocator(profile, tiny_lm.model, Workload(10 ** 12, 128, 1))
    assert allocator.band_of is None and any(u.name == "head" for u in allocator.units)


def test_the_allocator_gives_each_band_its_scheme_and_pays_for_the_layout(tied_profile, tied_lm):
    _, profile = tied_profile
    plain = Allocator(profile, tied_lm.model, Workload(10 ** 12, 128, 1), head_bands=False)
    assert [u.name for u in plain.units if u.layer is None] == ["head"]
    probe = Allocator(profile, tied_lm.model, Workload(10 ** 12, 128, 1))
    assert [u.name for u in probe.units if u.layer is None] == [f"head.band{b}" for b in range(8)]
    assert probe.layout_bytes == 256
    # A budget between uniform W2 and W4: the bands are worth mixing.
    groups = probe.weight_groups()
    low = sum(min(o.bytes for o in g.options) for g in groups)
    high = sum(max(o.bytes for o in g.options) for g in groups)
    fixed = probe.runtime + probe.fixed_bytes + probe.kv_groups()[0].options[0].bytes * 2
    allocation = Allocator(profile, tied_lm.model, Workload(int(fixed + low + 0.3 * (high - low)), 128, 1)).allocate()
    labels = [allocation.weights[f"head.band{b}"] for b in range(8)]
    assert len(set(labels)) > 1 and head_label(allocation.weights).endswith(", ".join(labels))
    schemes, head_bands = probe.quantize_schemes(allocation.layer_schemes(probe.units))
    assert EMBED_PARAM not in schemes and [s.label for s in head_bands.schemes] == labels
    # The bytes the allocation counts are the bytes the quantized head stores, layout included.
    model = tied_lm.model
    quantized = quantize_model(model, QuantizeConfig("rtn", QuantScheme(), targets=BLOCK_LINEARS + ("head",),
                                                     layer_schemes=schemes, head_bands=head_bands), progress=False)
    stored = sum(q.storage_bits() if isinstance(q, BandedWeight) else q.scheme.storage_bits(*q.shape)
                 for q in quantized.values()) / 8
    policy = allocation.layer_schemes(probe.units)
    counted = policy_bytes(param_shapes(probe.units), policy)
    assert counted == pytest.approx(stored, rel=0.01)
    assert allocation.weight_bytes - probe.fixed_bytes == counted


def test_candidates_are_the_free_bands_then_plain_heads_then_even_bits(tied_profile, tied_lm):
    _, profile = tied_profile
    probe = Allocator(profile, tied_lm.model, Workload(10 ** 12, 128, 1))
    groups = probe.weight_groups()
    mid = sum(sorted(o.bytes for o in g.options)[1] for g in groups)
    from paperback.allocate.candidates import second_pass_candidates

    candidates = second_pass_candidates(groups, mid, 2, probe.layout_bytes)
    assert candidates[0].name == "head in bands"
    assert candidates[1].name.startswith("head W") and candidates[-1].even
    assert sum(o.bytes for o in candidates[0].chosen.values()) <= mid - probe.layout_bytes


def test_random_band_assignments_are_seeded_and_use_the_candidates():
    schemes = [QuantScheme(8, None, True), QuantScheme(4, 64), QuantScheme(2, 64)]
    a = random_band_assignments(schemes, 8, 5, seed=1)
    assert a == random_band_assignments(schemes, 8, 5, seed=1) and len(a) == 5
    assert {label for picks in a for label in picks} <= {s.label for s in schemes}


def test_a_profile_with_corrupt_head_bands_is_refused(tied_profile, tied_lm, tmp_path):
    from paperback.allocate.profile import load_profile
    from paperback.allocate.profile_data import Profile
    from paperback.errors import PaperbackError

    data = tied_profile[1].to_dict()
    for corrupt, message in ((lambda b: b["kl"].pop("band3"), "cover every band"),
                             (lambda b: b["kl"]["band0"].pop("W8s-ch"), "cover the schemes"),
                             (lambda b: b["kl"]["band1"].update({"W8s-ch": float("nan")}), "cover the schemes")):
        bad = json.loads(json.dumps(data))
        corrupt(bad["weights"]["head_bands"])
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(bad))
        with pytest.raises(PaperbackError, match=message):
            load_profile(path, tied_lm.model)
    bad = json.loads(json.dumps(data))
    bad["weights"]["head_bands"]["band_of"] = bad["weights"]["head_bands"]["band_of"][:-8]
    with pytest.raises(PaperbackError, match="entries, the vocabulary"):
        Allocator(Profile.from_dict(bad), tied_lm.model, Workload(10 ** 12, 128, 1))


def test_head_bands_take_at_least_three_bits_unless_asked(tied_profile, tied_lm):
    """The ranking is the profiled text's; 2-bit rows for tokens it rarely saw cost another text dearly."""
    _, profile = tied_profile
    for floor, lowest in ((None, 4), (2, 2)):  # candidates W8, W4 and W2: W4 is the least at 3 bits or more
        kwargs = {} if floor is None else {"band_min_bits": floor}
        allocator = Allocator(profile, tied_lm.model, Workload(10 ** 12, 128, 1), **kwargs)
        for group in allocator.weight_groups():
            bits = {allocator.schemes[o.label].bits for o in group.options}
            assert min(bits) == (lowest if group.name.startswith("head.band") else 2)


def test_the_models_own_text_is_seeded_and_weighs_like_the_profiled_text(tied_lm):
    from paperback.allocate.head_band_profile import free_running_usage

    a = free_running_usage(tied_lm.model, 3, sequences=2, tokens=16, seed=1)
    assert torch.equal(a, free_running_usage(tied_lm.model, 3, sequences=2, tokens=16, seed=1))
    assert a.sum().item() == pytest.approx(2.0) and (a >= 0).all()
    assert not torch.equal(a, free_running_usage(tied_lm.model, 3, sequences=2, tokens=16, seed=2))


def test_bands_ranked_another_way_are_measured_again(tied_profile, tied_lm, char_tokenizer, tmp_path):
    from paperback.allocate.head_band_profile import USAGE_VERSION

    profiler, profile = tied_profile
    data = profile.to_dict()
    assert profile.weights.head_bands.usage == USAGE_VERSION
    old = json.loads(json.dumps(data))
    old["weights"]["head_bands"]["usage"] = "text/0"
    old["weights"]["head_bands"]["kl"]["band0"] = {label: 9.0 for label in CONFIG.weight_schemes}
    profiler.complete_path.write_text(json.dumps(old))
    again = Profiler(tied_lm.model, char_tokenizer, sample_text(), "sample", CONFIG, tmp_path, progress=False)
    upgraded = again.run()
    assert upgraded.weights.head_bands.kl == profile.weights.head_bands.kl


def test_a_budget_only_a_plain_two_bit_head_meets_is_fitted_with_the_head_as_one_unit(tied_profile, tied_lm):
    """check_budget counts the head at W2, bands stop at 3 bits: fit must not refuse what it let through."""
    from paperback.allocate.allocation import banded_or_plain, check_budget, fitting_candidates
    from paperback.allocate.candidates import second_pass_candidates
    from paperback.allocate.solver import InfeasibleBudget, min_bytes

    _, profile = tied_profile
    probe = Allocator(profile, tied_lm.model, Workload(10 ** 12, 128, 1))
    plain = Allocator(profile, tied_lm.model, Workload(10 ** 12, 128, 1), head_bands=False)
    fixed = probe.runtime + probe.fixed_bytes
    banded_min = fixed + min_bytes(probe.weight_groups() + probe.kv_groups())
    plain_min = fixed + min_bytes(plain.weight_groups() + plain.kv_groups())
    assert plain_min < banded_min
    workload = Workload(int(plain_min + (banded_min - plain_min) // 2), 128, 1)
    check_budget(tied_lm.model, workload, CONFIG.weight_schemes, CONFIG.kv_formats)  # let through before work
    with pytest.raises(InfeasibleBudget):
        Allocator(profile, tied_lm.model, workload).candidates(2)
    allocator, candidates = fitting_candidates(profile, tied_lm.model, workload, 2)
    assert allocator.band_of is None and candidates[0].chosen["head"].label == "W2a-g64"
    assert allocator.allocation_of(candidates[0]).total_bytes <= workload.memory
    with pytest.raises(InfeasibleBudget):  # below every plain head too: still refused
        fitting_candidates(profile, tied_lm.model, Workload(int(plain_min) - 1, 128, 1), 2)
    # The benchmarks' weights-only solve keeps the same rule (banded_or_plain)
    weights_plain, weights_banded = min_bytes(plain.weight_groups()), min_bytes(probe.weight_groups())
    budget = (weights_plain + weights_banded) // 2
    used, found = banded_or_plain(probe, lambda a: second_pass_candidates(a.weight_groups(), budget, 2,
                                                                          a.layout_bytes))
    assert used.band_of is None and found[0].chosen["head"].label == "W2a-g64"
