"""llama.cpp's speed per GGUF type: probe files of the model's shapes (zeros of each type), timed by llama-bench
in turns, turned into a cost per weight a fit's solve holds to the recipe's own. A stand-in llama-bench whose
times follow a known linear model checks the arithmetic, the parsing and the cache; the real one is run by the
`llamacpp`-marked test."""

import copy
import json
import stat
import sys
from pathlib import Path

import pytest

from paperback.allocate.gguf_speed import (REFERENCE_TYPE, SpeedSettings, find_llama_bench, measure_speed,
                                           probe_types, probes, speed_role, time_assignments, zero_weight)
from paperback.cli import main
from paperback.errors import PaperbackError
from paperback.export.gguf_quantize import gguf_types_for, weight_shapes
from paperback.loading import load_model
from paperback.quantization.gguf_pack import from_bytes, to_bytes
from paperback.quantization.gguf_recipes import recipe
from paperback.quantization.gguf_types import GGUF_TYPES, QUANTIZED_TYPES


# The stand-in's seconds per token per weight of each type (prompt, generation) and of the rest of the model
COSTS = {"Q8_0": (2e-12, 8e-12), "Q6_K": (2e-12, 6e-12), "Q5_K": (2e-12, 5e-12), "Q4_K": (1e-12, 4e-12),
         "Q3_K": (2e-12, 4e-12), "Q2_K": (2e-12, 3e-12), "Q5_1": (9e-12, 6e-12), "Q5_0": (3e-12, 6e-12),
         "Q4_1": (8e-12, 5e-12), "Q4_0": (1e-12, 4e-12)}
BASE = (1e-3, 4e-3)
# ... scaled in each role: a prompt computes the tied embedding's head for its last token only
ROLE_SCALE = {"blocks": (1.0, 1.0), "token_embd": (0.0, 1.0), "output": (0.0, 1.0)}


def fake_llama_bench(tmp_path: Path, mix_penalty: tuple[float, float] | None = None) -> Path:
    """An executable that answers as `llama-bench -o json` does, its time the linear model of COSTS and
    ROLE_SCALE applied to the probe file's record of its types (written into the file's metadata); with
    `mix_penalty`, seconds more (prompt, generation) for a file whose blocks mix two types besides the
    reference (a probe never does), which
    no linear model of the probes predicts."""
    script = tmp_path / "llama-bench"
    script.write_text(f"""#!{sys.executable}
import json, sys
args = sys.argv[1:]
model = args[args.index("-m") + 1]
open(__file__ + ".calls", "a").write(model + chr(10))
head = open(model, "rb").read()
start = head.index(b'{{"speed_probe"')
record, _ = json.JSONDecoder().raw_decode(head[start:].decode("latin-1"))
costs, scale, penalty = {json.dumps(COSTS)}, {json.dumps(ROLE_SCALE)}, {list(mix_penalty or (0, 0))}
held = record["speed_probe"]
seconds = [{list(BASE)}[i] + sum(n * costs[t][i] * scale[role][i] for role, types in held.items()
                                 for t, n in types.items()) for i in (0, 1)]
if len(set(held.get("blocks", {{}})) - {{"Q8_0"}}) > 1:
    seconds = [s + p for s, p in zip(seconds, penalty)]
# a run slowed by interference, then one at the model's speed: the fastest is the measurement
runs = [[0.7 / s, 1 / s] for s in seconds]
print(json.dumps([{{"n_prompt": int(args[args.index("-p") + 1]), "n_gen": 0, "avg_ts": 0.85 / seconds[0],
                   "samples_ts": runs[0]}},
                  {{"n_prompt": 0, "n_gen": int(args[args.index("-n") + 1]), "avg_ts": 0.85 / seconds[1],
                   "samples_ts": runs[1]}}]))
print("llama-bench log on stderr", file=sys.stderr)
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def stand_in_seconds(types: dict, shapes: dict) -> list[float]:
    """What the stand-in (without a mix penalty) times a file of `types` at."""
    return [BASE[i] + sum(shapes[p][0] * shapes[p][1] * COSTS[k.name][i] * ROLE_SCALE[speed_role(p)][i]
                          for p, k in types.items()) for i in (0, 1)]


@pytest.mark.parametrize("name", QUANTIZED_TYPES + ("F16", "BF16"))
def test_a_zero_weight_is_valid_bytes_of_its_type(name):
    kind = GGUF_TYPES[name]
    weight = zero_weight(kind, (4, 512))
    raw = to_bytes(weight)
    assert raw.nbytes == kind.tensor_bytes(4, 512)
    assert not from_bytes(raw, kind, (4, 512)).dequantize().any()


def test_probe_types_put_the_reference_where_a_type_cannot_tile(tok_gguf):
    config = load_model(str(tok_gguf), "fp32", with_tokenizer=False).config
    shapes = weight_shapes(config)
    q4k = probe_types(GGUF_TYPES["Q4_K"], shapes)
    assert {p for p, k in q4k.items() if k.name == "Q4_K"} == {p for p in shapes if p.endswith("down_proj.weight")}
    assert {k.name for p, k in q4k.items() if not p.endswith("down_proj.weight")} == {REFERENCE_TYPE}
    # One file per type and role: a k-quant tiles no row of the embedding, so it has no token_embd file
    planned = probes(tuple(GGUF_TYPES[n] for n in ("Q8_0", "Q4_0", "Q4_K")), shapes)
    assert set(planned) == {(REFERENCE_TYPE, "all"), ("Q4_0", "blocks"), ("Q4_0", "token_embd"), ("Q4_K", "blocks")}
    assert {p for p, k in planned["Q4_0", "token_embd"].items() if k.name == "Q4_0"} == {"model.embed_tokens.weight"}


def test_speeds_are_measured_per_weight_relative_to_the_reference_and_cached(tok_gguf, tmp_path, capsys):
    lm = load_model(str(tok_gguf), "fp32")
    bench = fake_llama_bench(tmp_path)
    kinds = tuple(GGUF_TYPES[n] for n in QUANTIZED_TYPES)
    table = measure_speed(lm, kinds, bench, SpeedSettings(rounds=2), cache_dir=tmp_path / "cache", progress=False)
    shapes = weight_shapes(lm.config)
    planned = probes(kinds, shapes)
    for name, role in planned:
        if name != REFERENCE_TYPE:
            for i, phase in enumerate(("prompt", "generate")):
                relative = (COSTS[name][i] - COSTS[REFERENCE_TYPE][i]) * ROLE_SCALE[role][i]
                assert table.costs[name][role][phase] == pytest.approx(relative, rel=1e-6, abs=1e-18)
    # the tied embedding's type costs prompts nothing and generation its bytes' worth: measured apart
    assert table.costs["Q4_0"]["token_embd"]["prompt"] == pytest.approx(0, abs=1e-18)
    assert table.costs["Q4_0"]["blocks"]["prompt"] < 0 < table.costs["Q5_1"]["blocks"]["prompt"]
    assert len(table.measured["tokens_per_s"]["Q4_0 blocks"]) == 2
    # The linear model predicts any mix: a recipe's file, timed by the stand-in, is what the table says.
    types = gguf_types_for(lm.config, recipe("Q4_K_M"))
    assert list(table.seconds(types, shapes).values()) == pytest.approx(stand_in_seconds(types, shapes), rel=1e-6)
    calls = Path(f"{bench}.calls").read_text().splitlines()
    assert len(calls) == 2 * len(planned)  # every file (the reference among them) each round
    # cached: a second call runs nothing
    again = measure_speed(lm, kinds, bench, SpeedSettings(rounds=2), cache_dir=tmp_path / "cache", progress=False)
    assert again.costs == table.costs and Path(f"{bench}.calls").read_text().splitlines() == calls


def held_to_speed(fit, bench: Path, cache: Path):
    """`fit` (its model and prices shared) timing types with `bench`, one round."""
    held = copy.copy(fit)
    held._shared = dict(fit._shared)  # the model and prices, but a speed table of its own
    held.llama_bench, held.speed = bench, SpeedSettings(rounds=1)
    held._speed_table = lambda lm, cached={}: cached.setdefault("t", measure_speed(
        lm, tuple(GGUF_TYPES[n] for n in QUANTIZED_TYPES), bench, held.speed, cache_dir=cache, progress=False))
    return held


def test_a_fit_held_to_its_recipes_speed_is_predicted_and_measured_no_slower(fitted, tmp_path):
    fit, _ = fitted
    free = fit.run_budget(fit.budget_of(size_of="Q4_0"), tmp_path / "free.gguf")
    held = held_to_speed(fit, fake_llama_bench(tmp_path), tmp_path / "cache")
    result = held.run_budget(held.budget_of(size_of="Q4_0"), tmp_path / "held.gguf")
    speed = result["speed"]
    assert speed["constrained"] and speed["against"] == result["baseline"] == "Q4_0"
    # timed whole against the recipe once: the stand-in is the linear model, so the first solution holds
    assert len(speed["checks"]) == 1 and not speed["fell_back"]
    assert all(r >= 1 - 1e-9 for r in speed["measured_ratio"].values())
    lm = fit._prepare()[0]
    table = held._speed_table(lm)
    shapes = weight_shapes(lm.config)
    mine = table.seconds({p: GGUF_TYPES[t] for p, t in result["tensors"].items()}, shapes)
    theirs = table.seconds(gguf_types_for(lm.config, recipe(result["baseline"])), shapes)
    unheld = table.seconds({p: GGUF_TYPES[t] for p, t in free["tensors"].items()}, shapes)
    assert unheld["prompt"] > theirs["prompt"]  # without the limit, the fit is slower than its recipe here ...
    for phase in ("prompt", "generate"):  # ... and with it, no slower
        assert mine[phase] <= theirs[phase] * (1 + 1e-9)
    assert result["predicted_kl"] >= free["predicted_kl"]  # the speed is paid for in KL, never the reverse
    assert free["speed"] == {"constrained": False, "why": free["speed"]["why"]} and "llama-bench" in free["speed"]["why"]
    # A fit that may not take the recipe's own types is still held to that recipe's speed (it is not measured
    # against the recipe's KL: it could never write it).
    with pytest.raises(PaperbackError, match="no mix of Q5_0, Q8_0, Q4_K within the size of Q4_0 .* runs as fast"):
        slow = held.restricted(("Q5_0", "Q8_0", "Q4_K"))  # every one slower than Q4_0 at prompts, by COSTS
        slow.run_budget(slow.budget_of(size_of="Q4_0"), tmp_path / "slow.gguf")
    assert not (tmp_path / "slow.gguf").exists()
    narrow = held.restricted(("Q4_0", "Q4_K", "Q5_0", "Q6_K"))  # not the recipe's Q8_0 (for the embedding)
    other = narrow.run_budget(narrow.budget_of(size_of="Q4_0"), tmp_path / "narrow.gguf")
    assert other["baseline"] is None and other["speed"]["constrained"] and other["speed"]["against"] == "Q4_0"
    mine = table.seconds({p: GGUF_TYPES[t] for p, t in other["tensors"].items()}, shapes)
    assert all(mine[phase] <= theirs[phase] * (1 + 1e-9) for phase in ("prompt", "generate"))


def test_a_solution_measured_slower_than_predicted_is_solved_again_or_gives_way_to_the_recipe(fitted, tmp_path):
    fit, _ = fitted
    # blocks that mix two types besides Q8_0 cost a fifth of the reference's time more: no probe shows it
    bench = fake_llama_bench(tmp_path, mix_penalty=(0.2 * BASE[0], 0.2 * BASE[1]))
    held = held_to_speed(fit, bench, tmp_path / "cache")
    result = held.run_budget(held.budget_of(size_of="Q4_0"), tmp_path / "held.gguf")
    checks = result["speed"]["checks"]
    assert checks and min(checks[0]["ratio"].values()) < 0.97  # the first solution mixed types and lost
    assert checks[0]["measured_seconds"]["prompt"] > checks[0]["predicted_seconds"]["prompt"]
    blocks = {t for p, t in result["tensors"].items() if p.startswith("model.layers.")}
    if result["speed"]["fell_back"]:  # ... then the recipe's own types
        recipe_types = gguf_types_for(fit.model_config, recipe("Q4_0"))
        assert result["tensors"] == {p: k.name for p, k in recipe_types.items()}
    else:  # ... or a solution that measured as fast, its blocks one type besides Q8_0
        assert min(checks[-1]["ratio"].values()) >= 0.97 and len(blocks - {"Q8_0"}) == 1
    assert len(checks) <= 3
    # A fit that cannot fall back to the recipe's types and finds nothing as fast is refused
    narrow = held.restricted(tuple(t for t in QUANTIZED_TYPES if t != "Q8_0"))
    with pytest.raises(PaperbackError, match="no solution within the size of Q4_0 .* measured as fast in llama.cpp as "
                                             r"Q4_0 \(1 timed\), and the types allowed cannot write Q4_0 itself"):
        narrow.run_budget(narrow.budget_of(size_of="Q4_0"), tmp_path / "narrow.gguf")
    assert not (tmp_path / "narrow.gguf").exists()


def test_a_llama_bench_that_is_not_one_is_refused(plain_gguf, tmp_path, capsys):
    with pytest.raises(PaperbackError, match="is not an executable file"):
        find_llama_bench(tmp_path / "nothing")
    out = tmp_path / "x.gguf"
    assert main(["fit", str(plain_gguf), "--format", "gguf", "--size-of", "Q4_K_M", "--llama-bench",
                 str(tmp_path / "nothing"), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "is not an executable file" in err and len(err.strip().splitlines()) == 1
    assert main(["fit", "smollm2", "--memory", "1GiB", "--context", "512", "--any-speed", "-o", str(tmp_path / "d")]) == 2
    assert "--any-speed is an option of `fit --format gguf`" in capsys.readouterr().err


LLAMA_BENCH = Path(__file__).resolve().parents[2] / ".llamacpp-tools" / "bin" / "llama-bench"


@pytest.mark.llamacpp
@pytest.mark.slow  # llama.cpp's tools are built by benchmarks/peers/setup_llamacpp_tools.sh, outside the suite
@pytest.mark.skipif(not LLAMA_BENCH.exists(), reason="llama.cpp's tools are not built")
def test_the_real_llama_bench_runs_every_probe_file_and_a_whole_mix(tok_gguf, tmp_path):
    lm = load_model(str(tok_gguf), "fp32")
    settings = SpeedSettings(prompt=64, generate=16, rounds=1, repetitions=1)
    kinds = tuple(GGUF_TYPES[n] for n in ("Q4_0", "Q4_K", "Q5_0"))
    table = measure_speed(lm, kinds, LLAMA_BENCH, settings, cache_dir=tmp_path, progress=False)
    assert {n: set(r) for n, r in table.costs.items()} == {"Q4_0": {"blocks", "token_embd"}, "Q4_K": {"blocks"},
                                                           "Q5_0": {"blocks", "token_embd"}}
    assert all(s > 0 for s in table.reference_seconds.values())
    shapes = weight_shapes(lm.config)
    mix = {p: GGUF_TYPES["Q4_K" if p.endswith("down_proj.weight") else "Q5_0"] for p in shapes}
    timed = time_assignments(lm, {"mix": mix, "Q4_0": gguf_types_for(lm.config, recipe("Q4_0"))}, LLAMA_BENCH,
                             settings)
    assert set(timed) == {"mix", "Q4_0"} and all(s > 0 for t in timed.values() for s in t["seconds"].values())
