import json
import math
import random
from dataclasses import replace

import pytest
import torch

from paperback.allocate.probe import ReferenceProbe, swapped_weights
from paperback.allocate.profile import (ProfileConfig, Profiler, additivity_summary, load_profile, split_text)
from paperback.allocate.token_importance import token_importance
from paperback.errors import DatasetError, PaperbackError

CONFIG = ProfileConfig(method="rtn", weight_schemes=("W8s-ch", "W2a-g64"), kv_formats=("fp16", "kivi2:r=32"),
                       windows=1, window_tokens=128, weight_tokens=64, calib_samples=1, additivity_samples=6)
MEASURED = replace(CONFIG, measure="all")


def sample_text(n=3000, seed=0):
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghij klmnop,.") for _ in range(n))


@pytest.fixture(params=[CONFIG, MEASURED], ids=["anchored", "all"])
def profiler(request, tiny_lm, char_tokenizer, tmp_path):
    return Profiler(tiny_lm.model, char_tokenizer, sample_text(), "sample", request.param, tmp_path / "cache",
                    progress=False, model_label="tiny")


def test_profile_measures_every_unit_layer_and_assignment(profiler):
    profile = profiler.run()
    kl = profile.weights.kl
    assert set(kl) == {u.name for u in profile.weights.units} == {u.name for u in profiler.units}
    for unit, options in kl.items():
        assert options["W2a-g64"] > options["W8s-ch"] >= -1e-5, unit  # fewer bits cost more
    kv = profile.kv.kl
    assert set(kv) == {"0", "1"}
    for options in kv.values():
        assert options["kivi2"] > 10 * abs(options["fp16"])
    long = profile.kv.long
    assert long.tokens == 512  # capped at the tiny model's positions
    assert long.kl["kivi2"] > 0 and set(long.scale) == {"fp16", "kivi2"}
    assert profile.kv_layer_cost(1, "kivi2") == kv["1"]["kivi2"] * long.scale["kivi2"]
    add = profile.additivity
    assert add.overall.samples == 6 and len(add.points) == 6
    assert {p.kind for p in add.points} == {"weights", "kv", "joint"}
    assert profile.model.label == "tiny" and profile.config == profiler.config
    for layer in profile.tokens["layers"]:
        assert sum(layer["mass_by_position"]) == pytest.approx(1.0, abs=1e-4)
        assert layer["sink_mass"] + layer["recent_mass"] + layer["middle_mass"] == pytest.approx(1.0, abs=1e-5)


def test_a_unit_alone_measured_from_its_block_equals_a_whole_forward(profiler, tiny_lm):
    """kl_from(i) with weights swapped in is the KL of the whole model run from the start."""
    windows = profiler.text.windows
    probe = ReferenceProbe(tiny_lm.model, windows, score_stride=2)
    assert probe.kl_from(0) == pytest.approx(0.0, abs=1e-6)
    layer = tiny_lm.model.model.layers[1].mlp.down_proj
    layer.weight.data = layer.weight + 0.05 * torch.randn_like(layer.weight)
    assert probe.kl_from(1) == pytest.approx(probe.kl_full(), rel=1e-4)
    assert probe.kl_from(1) > 1e-4


def test_interrupted_profile_resumes_and_never_looks_complete(profiler, tiny_lm, char_tokenizer, tmp_path,
                                                              monkeypatch):
    def interrupt(self, probe):
        raise KeyboardInterrupt

    monkeypatch.setattr(Profiler, "_kv", interrupt)
    with pytest.raises(KeyboardInterrupt):
        profiler.run()
    partial = json.loads(profiler.partial_path.read_text())
    assert not partial["complete"] and not profiler.complete_path.exists()
    assert len(partial["weights"]["kl"]) == len(partial["weights"]["units"])
    with pytest.raises(PaperbackError, match="incomplete"):
        load_profile(profiler.partial_path)
    monkeypatch.undo()
    calls = []
    original = ReferenceProbe.kl_from
    monkeypatch.setattr(ReferenceProbe, "kl_from", lambda self, *a, **k: calls.append(a) or original(self, *a, **k))
    config = profiler.config
    again = Profiler(tiny_lm.model, char_tokenizer, sample_text(), "sample", config, tmp_path / "cache",
                     progress=False)
    profile = again.run()
    # Only the KV layers and the retention options were left to measure; weights were kept.
    r = profile.retention
    retention_cells = sum(len(cells) for table in [*r.tables.values(), r.evict] for cells in table.values())
    assert retention_cells == 2 * (2 * 1 + len(r.windows)) and len(r.windows) == 2  # per layer: 2 x kivi2
    if config.measure == "all":  # one kl_from per layer and format, and per retention cell
        assert len(calls) == 2 * 2 + retention_cells and profile.estimates is None
    else:  # per layer: the KV anchor (kivi2) and the shortest eviction window; then the check's sample
        check = profile.estimates.check
        assert len(calls) == 2 * 1 + 2 * 1 + check.samples and check.samples > 0
    assert r.complete and not again.partial_path.exists() and profile.reused_from is None
    reused = Profiler(tiny_lm.model, char_tokenizer, sample_text(), "sample", config, tmp_path / "cache",
                      progress=False).run()
    assert reused.reused_from == str(again.complete_path) and reused.weights == profile.weights


def test_anchored_cells_are_the_anchor_factor_times_their_block_error(tiny_lm, char_tokenizer, tmp_path):
    profiler = Profiler(tiny_lm.model, char_tokenizer, sample_text(), "sample", CONFIG, tmp_path, progress=False)
    data = profiler.run().to_dict()
    est = data["estimates"]
    assert est["weight_anchor"] == "W2a-g64" and est["kv_anchor"] == "kivi2"  # the fewest bits of two
    probe = ReferenceProbe(tiny_lm.model, profiler.text.windows[:, :CONFIG.weight_tokens], score_stride=2)
    unit = next(u for u in profiler.units if u.name == "layers.1.mlp_down")
    record = est["weights"][unit.name]
    with swapped_weights(tiny_lm.model, profiler.unit_weights(unit, "W2a-g64")):
        assert data["weights"]["kl"][unit.name]["W2a-g64"] == pytest.approx(probe.kl_from(1), rel=1e-5)
        assert record["errors"]["W2a-g64"] == pytest.approx(probe.block_error(1), rel=1e-5)
    assert record["estimated"] and record["factor"] == pytest.approx(
        data["weights"]["kl"][unit.name]["W2a-g64"] / record["errors"]["W2a-g64"])
    assert data["weights"]["kl"][unit.name]["W8s-ch"] == pytest.approx(record["factor"] * record["errors"]["W8s-ch"])
    for layer, rec in est["kv"].items():
        for label, error in rec["errors"].items():
            if label != "kivi2":
                assert data["kv"]["kl"][layer][label] == pytest.approx(rec["factor"] * error)
        for name in data["retention"]["variants"]:  # the exact-token options reuse the layer's KV factor
            assert est["retention"][name][layer]["factor"] == rec["factor"]
    # The check's measured values are the cells measured directly.
    point = next(p for p in est["check"]["points"] if p["kind"] == "weights")
    name, label = point["cell"]
    checked = next(u for u in profiler.units if u.name == name)
    with swapped_weights(tiny_lm.model, profiler.unit_weights(checked, label)):
        assert point["measured"] == pytest.approx(probe.kl_from(checked.layer), rel=1e-5)
    assert point["estimated"] == data["weights"]["kl"][name][label]
    assert {p["kind"] for p in est["check"]["points"]} == {"weights", "retention", "evict"}


def test_the_head_is_measured_on_head_tokens_positions_with_the_whole_model(tiny_lm, char_tokenizer, tmp_path):
    """The head's cost depends on which tokens appear: it is priced on many more positions than a block
    unit, and with the whole model, since a tied head is also the embedding every block reads."""
    profiler = Profiler(tiny_lm.model, char_tokenizer, sample_text(), "sample", CONFIG, tmp_path, progress=False)
    profile = profiler.run()
    head_windows = profiler.text.head_windows
    assert head_windows.shape == (11, 128)  # 1,500 profiled tokens: as many whole windows as fit
    assert profile.weights.head_tokens == head_windows.numel()
    probe = ReferenceProbe(tiny_lm.model, head_windows)
    for label in ("W8s-ch", "W2a-g64"):
        with swapped_weights(tiny_lm.model, profiler.unit_weights(next(u for u in profiler.units
                                                                        if u.name == "head"), label)):
            assert profile.weights.kl["head"][label] == pytest.approx(probe.kl_full(), rel=1e-5)
    assert "head_tokens" not in profile.to_dict()["config"]  # the default keeps earlier profiles' keys
    assert "head_tokens" in replace(CONFIG, head_tokens=1024).to_dict()
    with pytest.raises(PaperbackError, match="head tokens"):
        replace(CONFIG, head_tokens=64)


def test_a_profile_from_before_the_head_was_measured_so_is_upgraded(tiny_lm, char_tokenizer, tmp_path):
    """Its head is measured again and its additivity predictions summed again; nothing else is remeasured."""
    profiler = Profiler(tiny_lm.model, char_tokenizer, sample_text(), "sample", CONFIG, tmp_path, progress=False)
    data = profiler.run().to_dict()
    old = json.loads(json.dumps(data))
    del old["weights"]["head_tokens"]
    old["weights"]["kl"]["head"] = {label: 9.0 for label in old["weights"]["kl"]["head"]}
    profiler.complete_path.write_text(json.dumps(old))
    again = Profiler(tiny_lm.model, char_tokenizer, sample_text(), "sample", CONFIG, tmp_path, progress=False)
    again._weights = again._kv = None  # nothing but the head may run
    upgraded = again.run().to_dict()
    assert upgraded["weights"]["kl"] == data["weights"]["kl"] and upgraded["kv"] == data["kv"]
    assert upgraded["additivity"]["points"] == data["additivity"]["points"]
    assert upgraded["additivity"]["pearson"] == pytest.approx(data["additivity"]["pearson"])
    assert json.loads(profiler.complete_path.read_text())["weights"]["head_tokens"] == 11 * 128


def test_a_weight_anchor_that_is_not_a_candidate_is_refused(tiny_lm, char_tokenizer, tmp_path):
    with pytest.raises(PaperbackError, match="weight anchor W4a-g128 is not a candidate"):
        Profiler(tiny_lm.model, char_tokenizer, sample_text(), "sample", replace(CONFIG, weight_anchor="W4a-g128"),
                 tmp_path, progress=False)
    with pytest.raises(PaperbackError, match="unknown measure mode 'some'"):
        replace(CONFIG, measure="some")


def test_block_error_is_zero_for_the_model_itself_and_grows_with_the_change(tiny_lm):
    probe = ReferenceProbe(tiny_lm.model, torch.randint(0, 256, (1, 64)))
    assert probe.block_error(0) == pytest.approx(0.0, abs=1e-10)
    layer = tiny_lm.model.model.layers[1].mlp.down_proj
    errors = []
    for scale in (0.01, 0.02):
        noise = scale * torch.randn_like(layer.weight, generator=torch.Generator().manual_seed(0))
        with swapped_weights(tiny_lm.model, {"model.layers.1.mlp.down_proj.weight": layer.weight + noise}):
            errors.append(probe.block_error(1))
    assert errors[1] == pytest.approx(4 * errors[0], rel=1e-3)  # linear in the weight change, squared


def test_text_too_short_is_refused_before_work(tiny_lm, char_tokenizer, tmp_path):
    with pytest.raises(DatasetError, match="needs at least 256 tokens"):
        Profiler(tiny_lm.model, char_tokenizer, sample_text(200), "short", CONFIG, tmp_path, progress=False)
    with pytest.raises(DatasetError):
        split_text([], CONFIG)


def test_load_profile_refuses_bad_files(profiler, tmp_path, tiny_gguf):
    from helpers import tiny_llama_hf, write_llama_gguf
    from paperback.loading import load_model

    data = profiler.run().to_dict()
    good = tmp_path / "good.json"
    good.write_text(json.dumps(data))
    assert load_profile(good).weights.kl == data["weights"]["kl"]
    cases = {"missing.json": None, "garbage.json": "{not json", "other.json": json.dumps({"format": "x"}),
             "truncated.json": json.dumps(data)[:500]}
    broken = json.loads(json.dumps(data))
    del broken["weights"]["kl"]["head"]
    cases["hole.json"] = json.dumps(broken)
    nan = json.loads(json.dumps(data))
    nan["kv"]["kl"]["0"]["fp16"] = math.nan
    cases["nan.json"] = json.dumps(nan)
    retention = json.loads(json.dumps(data))
    retention["retention"]["sinks"]["1"]["kivi2"] = "0.1"
    cases["retention.json"] = json.dumps(retention)
    retrieval = json.loads(json.dumps(data))
    retrieval["retrieval"]["formats"]["0"]["fp16"] = None
    cases["retrieval.json"] = json.dumps(retrieval)
    for name, content in cases.items():
        path = tmp_path / name
        if content is not None:
            path.write_text(content)
        with pytest.raises(PaperbackError):
            load_profile(path)
    other = load_model(str(write_llama_gguf(tiny_llama_hf(num_hidden_layers=3, hidden_size=128,
                                                          max_position_embeddings=512, intermediate_size=192),
                                            tmp_path / "other.gguf")), with_tokenizer=False)
    with pytest.raises(PaperbackError, match="another model"):
        load_profile(good, other.model)


def test_additivity_summary_of_exact_predictions():
    points = [{"kind": "weights", "predicted": x, "measured": 2 * x} for x in (0.1, 0.2, 0.4, 0.8)]
    summary = additivity_summary(points)
    assert summary["pearson"] == pytest.approx(1.0) and summary["spearman"] == pytest.approx(1.0)
    assert summary["median_measured_over_predicted"] == pytest.approx(2.0)


def test_token_importance_finds_a_sink(tiny_lm):
    """A key that every query matches strongly draws the mass: forcing the first token's key large."""
    model = tiny_lm.model
    windows = torch.randint(0, 256, (1, 96))
    layers = token_importance(model, windows, sinks=4, recent=16)
    assert len(layers) == 2
    for layer in layers:
        assert 0 <= layer["heavy_hitter_share"] <= 1
        assert layer["middle_mass"] > 0  # a random model spreads its attention
