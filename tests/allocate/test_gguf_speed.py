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
                                           probe_types, zero_weight)
from paperback.cli import main
from paperback.errors import PaperbackError
from paperback.export.gguf_quantize import gguf_types_for, weight_shapes
from paperback.loading import load_model
from paperback.quantization.gguf_pack import from_bytes, to_bytes
from paperback.quantization.gguf_recipes import recipe
from paperback.quantization.gguf_types import GGUF_TYPES, QUANTIZED_TYPES

from test_gguf_fit import fitted, plain_gguf, tok_gguf  # noqa: F401 (fixtures)

# The stand-in's seconds per token per weight of each type (prompt, generation) and of the rest of the model
COSTS = {"Q8_0": (2e-12, 8e-12), "Q6_K": (2e-12, 6e-12), "Q5_K": (2e-12, 5e-12), "Q4_K": (1e-12, 4e-12),
         "Q3_K": (2e-12, 4e-12), "Q2_K": (2e-12, 3e-12), "Q5_1": (9e-12, 6e-12), "Q5_0": (3e-12, 6e-12),
         "Q4_1": (8e-12, 5e-12), "Q4_0": (1e-12, 4e-12)}
BASE = (1e-3, 4e-3)



def fake_llama_bench(tmp_path: Path) -> Path:
    """An executable that answers as `llama-bench -o json` does, its time the linear model of COSTS applied to
    the probe file's record of its types (the numbers per type written into the file's metadata)."""
    script = tmp_path / "llama-bench"
    script.write_text(f"""#!{sys.executable}
import json, sys
args = sys.argv[1:]
model = args[args.index("-m") + 1]
open(__file__ + ".calls", "a").write(model + chr(10))
head = open(model, "rb").read()
start = head.index(b'{{"speed_probe"')
record, _ = json.JSONDecoder().raw_decode(head[start:].decode("latin-1"))
costs = {json.dumps(COSTS)}
base = {list(BASE)}
seconds = [base[i] + sum(n * costs[t][i] for t, n in record["speed_probe"].items()) for i in (0, 1)]
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


def test_speeds_are_measured_per_weight_relative_to_the_reference_and_cached(tok_gguf, tmp_path, capsys):
    lm = load_model(str(tok_gguf), "fp32")
    bench = fake_llama_bench(tmp_path)
    kinds = tuple(GGUF_TYPES[n] for n in QUANTIZED_TYPES)
    table = measure_speed(lm, kinds, bench, SpeedSettings(rounds=2), cache_dir=tmp_path / "cache", progress=False)
    for name in QUANTIZED_TYPES:
        for i, phase in enumerate(("prompt", "generate")):
            assert table.costs[name][phase] == pytest.approx(COSTS[name][i] - COSTS[REFERENCE_TYPE][i],
                                                             rel=1e-6, abs=1e-18)
    assert len(table.measured["tokens_per_s"]["Q4_0"]) == 2
    # The linear model predicts any mix: a recipe's file, timed by the stand-in, is what the table says.
    shapes = weight_shapes(lm.config)
    types = gguf_types_for(lm.config, recipe("Q4_K_M"))
    numel = {}
    for p, k in types.items():
        numel[k.name] = numel.get(k.name, 0) + shapes[p][0] * shapes[p][1]
    expected = [BASE[i] + sum(n * COSTS[t][i] for t, n in numel.items()) for i in (0, 1)]
    assert list(table.seconds(types, shapes).values()) == pytest.approx(expected, rel=1e-6)
    calls = Path(f"{bench}.calls").read_text().splitlines()
    assert len(calls) == 2 * (len(QUANTIZED_TYPES))  # every type's file (the reference among them) each round
    # cached: a second call runs nothing
    again = measure_speed(lm, kinds, bench, SpeedSettings(rounds=2), cache_dir=tmp_path / "cache", progress=False)
    assert again.costs == table.costs and Path(f"{bench}.calls").read_text().splitlines() == calls


def test_a_fit_held_to_its_recipes_speed_is_predicted_no_slower(fitted, tmp_path):
    fit, _ = fitted
    free = fit.run_budget(fit.budget_of(size_of="Q4_0"), tmp_path / "free.gguf")
    held = copy.copy(fit)
    held._shared = dict(fit._shared)  # the model and prices, but a speed table of its own
    held.llama_bench = fake_llama_bench(tmp_path)
    held._speed_table = lambda lm, cached={}: cached.setdefault("t", measure_speed(
        lm, tuple(GGUF_TYPES[n] for n in QUANTIZED_TYPES), held.llama_bench, SpeedSettings(rounds=1),
        cache_dir=tmp_path / "cache", progress=False))
    result = held.run_budget(held.budget_of(size_of="Q4_0"), tmp_path / "held.gguf")
    speed = result["speed"]
    assert speed["constrained"] and speed["against"] == result["baseline"] == "Q4_0"
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
