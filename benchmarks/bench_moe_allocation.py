"""Bits per MoE expert: NatScale against five allocations at the same bytes, on MoEfied SmolLM2 models.

    .venv/bin/python benchmarks/bench_moe_allocation.py [--models mixtral-e8k6 qwen2moe-e8k6-s25]
        [--budgets 2.5 3 4] [--windows 32] [--seeds 3] [--part all|moefy|allocation|kv|additivity|speed]
        [--calib pydoc|generated] [--recompute] [--markdown] [--tag NAME]

paperback loads no downloadable MoE model here, so the test models are made from the bundled SmolLM2 by
`paperback moefy` (each MLP split into experts; docs/moe.md) and kept under ~/.cache/paperback/moefied/.
Part moefy measures each MoEfied model against the dense one (perplexity and KL on WikiText-2 and PTB);
part kv reads each back through the paged engine with every KV format (`paperback eval --kv-cache-dtype F --paged`) and
answers a chat completion from `paperback serve --kv-cache-dtype F`; part speed times prefill and decode of the MoEfied
model and of dense SmolLM2, in fp32 and packed at W4 (head at 8 bits), through `paperback bench`.
Part allocation quantizes every routed expert at W2/W3/W4/W8 (asymmetric, groups of 64; GPTQ on the
calibration tokens routed to it), and for each budget of average code bits per expert weight compares:
NatScale (knapsack over KL-calibrated costs, priced in the budget's uniform context), uniform bits, ranking
by routing frequency, by weight norm, by weight kurtosis, and random rankings (--seeds); the ablation
"natscale (isolated)" sums one-expert-at-a-time costs instead. Part additivity measures why the ablation
fails: each layer's experts quantized together against the sum of their isolated costs.
Attention, embeddings and the shared expert stay unquantized: the study is the experts' bits. Calibration
(Hessians, errors, factors, in-context costs) is on pydoc, or with --calib generated on windows the MoEfied
model writes itself (paperback.quantization.calibration), never on the evaluation texts; the costly part
(candidates and factors, ~10 minutes a model) is cached beside the model (--recompute measures it again).
Each allocation: KL to the unquantized MoE model and perplexity on --windows windows of 512 tokens spread
over WikiText-2 and over PTB, and (to tell the calibration domain from the others) over pydoc's windows that
no calibration or probe window touches. Writes benchmarks/results/moe_allocation[_tag].json (moefy_quality, moe_kv,
moe_additivity for the other parts) and a plot beside it; --markdown prints the README's tables from it.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path

import torch

from paperback.allocate import experts as ea
from paperback.cli.output import print_table
from paperback.evaluation import evaluate, load_text
from paperback.loading import load_model
from paperback.moefy.build import MoefyConfig, moefy
from paperback.quantization.calibration import CalibrationConfig, calibration_batch, calibration_starts
from paperback.quantization.scheme import QuantScheme

sys.path.insert(0, str(Path(__file__).parent))
from results_io import (  # noqa: E402
    add_tag_arg, benchmark_parser, read_results, results_name, warn_if_busy, write_results,
)

SETTINGS = {
    "mixtral-e8k6": MoefyConfig(num_experts=8, experts_per_token=6),
    "qwen2moe-e8k6-s25": MoefyConfig(num_experts=8, experts_per_token=6, shared_fraction=0.25),
    "mixtral-e8k2": MoefyConfig(num_experts=8, experts_per_token=2),
    "mixtral-e8k4": MoefyConfig(num_experts=8, experts_per_token=4),
    "mixtral-e16k12": MoefyConfig(num_experts=16, experts_per_token=12),
    "qwen2moe-e8k4-s25": MoefyConfig(num_experts=8, experts_per_token=4, shared_fraction=0.25),
}
SCHEMES = [QuantScheme(b, 64) for b in (2, 3, 4, 8)]
DATASETS = ("wikitext2", "ptb")
# pydoc's windows disjoint from calibration and probe (all of them when calibrating on generated text)
HELD_OUT = "pydoc_heldout"
ABLATIONS = ("natscale (isolated)",)  # rows shown beside the six methods, not compared with them
CACHE = Path.home() / ".cache" / "paperback" / "moefied"


def moefied(name: str, dense) -> tuple[object, dict]:
    """The MoEfied model `name` (built and cached on first use) and its build report."""
    from paperback.export.hf_dir_export import save_hf_dir

    config = SETTINGS[name]
    path = CACHE / name
    if (path / "moefy.json").is_file() and json.loads((path / "moefy.json").read_text())["config"] == config.to_dict():
        return load_model(str(path)), json.loads((path / "moefy.json").read_text())
    start = time.perf_counter()
    moe, reports = moefy(dense.model, calibration_batch(dense.tokenizer, config.calibration), config)
    report = {"config": config.to_dict(), "build_seconds": time.perf_counter() - start,
              "layers": [r.__dict__ for r in reports]}
    save_hf_dir(moe, dense.tokenizer, path, overwrite=True, extra_files={"moefy.json": json.dumps(report, indent=2)})
    return load_model(str(path)), report


def evaluate_on(model, reference, tokens: dict, windows: int, caches: dict) -> dict:
    """Per text: perplexity, KL and top-1 agreement over `windows` windows of 512 tokens spread evenly over
    the text (the first few of WikiText-2 are one article)."""
    out = {}
    for dataset, ids in tokens.items():
        r = evaluate(model, ids, 512, reference=reference, max_windows=windows, progress=False,
                     reference_cache=caches.setdefault(dataset, {}), spread=True)
        out[dataset] = {"perplexity": r.perplexity, "kl": r.kl_divergence, "top1": r.top1_agreement,
                        "reference_perplexity": r.reference_perplexity}
    return out


def keys_to_text(values: dict) -> dict:
    """{(layer, expert): v} as JSON keys "layer.expert"."""
    return {f"{k[0]}.{k[1]}": v for k, v in values.items()}


def keys_from_text(values: dict) -> dict:
    return {tuple(map(int, k.split("."))): v for k, v in values.items()}


def study_configs(args) -> tuple[CalibrationConfig, CalibrationConfig]:
    """(calibration, probe): windows of 512 tokens of --calib, disjoint seeds."""
    return (CalibrationConfig(args.calib, num_samples=args.calib_samples, seq_len=512, seed=1),
            CalibrationConfig(args.calib, num_samples=args.probe_samples, seq_len=512, seed=2))


def study_batches(lm, args) -> tuple[torch.Tensor, torch.Tensor]:
    calibration, probe = study_configs(args)
    with torch.no_grad():
        return tuple(calibration_batch(lm.tokenizer, config, lm.model) for config in (calibration, probe))


def study_folder(name: str, args) -> Path:
    """Where a model's costly study inputs are cached, one folder a calibration corpus."""
    return CACHE / name / ("natscale" if args.calib == "pydoc" else f"natscale-{args.calib}")


def held_out_pydoc(tokenizer, args) -> list[int]:
    """The 512-token windows of pydoc that share no token with a calibration or probe window, end to end (so
    `evaluate`'s windows are exactly them)."""
    ids = tokenizer.encode(load_text("pydoc"), add_special_tokens=False)
    used = [(start, start + config.seq_len) for config in study_configs(args) if config.corpus == "pydoc"
            for start in calibration_starts(len(ids), config)]
    free = [lo for lo in range(0, len(ids) - 511, 512) if all(lo + 512 <= a or b <= lo for a, b in used)]
    return [t for lo in free for t in ids[lo:lo + 512]]


def study_inputs(name: str, model, routed: dict, probe: torch.Tensor, args) -> tuple:
    """(candidates, errors, factors, probe KLs, timings): the study's costly part (about 10 minutes a model),
    kept under the MoEfied model's cache directory and reused while its settings are the same (--recompute
    measures them again)."""
    from safetensors.torch import load_file, save_file

    folder = study_folder(name, args)
    key = {"calib": args.calib, "calib_samples": args.calib_samples, "probe_samples": args.probe_samples,
           "schemes": [s.label for s in SCHEMES], "moefy": SETTINGS[name].to_dict()}
    meta_path, tensors_path = folder / "study.json", folder / "candidates.safetensors"
    if not args.recompute and meta_path.is_file() and tensors_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta["key"] == key:
            flat = load_file(tensors_path)
            candidates: dict = {}
            for tensor_name, weight in flat.items():
                layer, expert, label, projection = tensor_name.split("/")
                candidates.setdefault((int(layer), int(expert)), {}).setdefault(label, {})[projection] = weight
            keyed = {field: keys_from_text(meta[field]) for field in ("errors", "factors", "kls")}
            return candidates, keyed["errors"], keyed["factors"], keyed["kls"], {**meta["timings"], "cached": True}
    for stale in folder.glob("context_*.json"):  # in-context costs of other candidates
        stale.unlink()
    timings = {}
    start = time.perf_counter()
    candidates = ea.quantize_candidates(model, routed, SCHEMES)
    errors = ea.expert_errors(model, routed, candidates)
    timings["candidates_seconds"] = time.perf_counter() - start
    start = time.perf_counter()
    factors, kls = ea.calibrate_factors(model, probe, candidates, errors, SCHEMES[0].label)
    timings["calibration_seconds"] = time.perf_counter() - start
    folder.mkdir(parents=True, exist_ok=True)
    save_file({f"{k[0]}/{k[1]}/{label}/{p}": w.contiguous() for k, by_label in candidates.items()
               for label, weights in by_label.items() for p, w in weights.items()}, tensors_path)
    as_text = {field: keys_to_text(values) for field, values in (("errors", errors), ("factors", factors),
                                                                  ("kls", kls))}
    meta_path.write_text(json.dumps({"key": key, "timings": timings, **as_text}))
    return candidates, errors, factors, kls, {**timings, "cached": False}


def budget_costs(name: str, model, probe: torch.Tensor, candidates: dict, errors: dict, factors: dict,
                 context: dict, budget: float, args) -> tuple[float, dict, float]:
    """(KL of the budget's uniform assignment, NatScale's in-context costs, seconds measuring them), cached
    beside the study's inputs."""
    path = study_folder(name, args) / f"context_{budget:g}.json"
    if not args.recompute and path.is_file():
        saved = json.loads(path.read_text())
        return saved["base"], keys_from_text(saved["costs"]), saved["seconds"]
    start = time.perf_counter()
    base, costs = ea.context_costs(model, probe, candidates, errors, factors, context)
    seconds = time.perf_counter() - start
    path.write_text(json.dumps({"base": base, "seconds": seconds,
                                "costs": keys_to_text(costs)}))
    return base, costs, seconds


def allocation_study(name: str, lm, args, tokens: dict) -> dict:
    model = lm.model
    reference = copy.deepcopy(model)  # the allocations swap expert weights of `model` in place
    calibration, probe = study_batches(lm, args)
    tokens = {**tokens, HELD_OUT: held_out_pydoc(lm.tokenizer, args)}
    routed = ea.capture_routing(model, calibration)
    candidates, errors, factors, kls, timings = study_inputs(name, model, routed, probe, args)
    signals = ea.expert_signals(model, routed)
    sizes = {k: ea.expert_size(e) for k, e in ea.experts_of(model).items()}
    bits = {s.label: s.bits for s in SCHEMES}
    keys = sorted(errors)
    isolated = ea.isolated_costs(factors, errors)
    caches: dict = {}
    rows = []
    for budget in args.budgets:
        uniform = ea.uniform_allocation(keys, sizes, bits, budget)
        base, costs, timings[f"context_seconds_{budget:g}"] = budget_costs(name, model, probe, candidates, errors,
                                                                           factors, uniform, budget, args)
        allocations = {"natscale": ea.natscale_allocation(costs, sizes, bits, budget),
                       # ablation: the one-expert-at-a-time costs, summed as if they added up
                       "natscale (isolated)": ea.natscale_allocation(isolated, sizes, bits, budget),
                       "uniform": uniform,
                       **{signal: ea.ranking_allocation(signals[signal], sizes, bits, budget)
                          for signal in ("frequency", "weight_norm", "kurtosis")},
                       **{f"random{seed}": ea.random_allocation(keys, sizes, bits, budget, seed)
                          for seed in range(args.seeds)}}
        for method, assignment in allocations.items():
            with torch.no_grad(), ea.assigned(model, candidates, assignment):
                result = evaluate_on(model, reference, tokens, args.windows, caches)
            row = {"budget": budget, "method": method, "average_bits": ea.average_bits(assignment, sizes, bits),
                   "predicted_kl": ea.predicted_kl(costs, assignment, base),
                   "isolated_predicted_kl": ea.predicted_kl(isolated, assignment), **{
                       f"{d}_{k}": v for d, r in result.items() for k, v in r.items()}}
            if method == "natscale":
                row["assignment"] = keys_to_text(assignment)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "assignment"}), flush=True)
    return {"rows": rows, **timings,
            "experts": [{"layer": k[0], "expert": k[1], "factor": factors[k], "probe_kl": kls[k],
                         "errors": errors[k], **{name: signals[name][k] for name in signals}} for k in keys]}


def additivity(name: str, lm, args) -> dict:
    """Do one-expert-at-a-time costs add up? On the probe: each layer's experts quantized together at each
    scheme (the rest exact) against the sum of their isolated costs, and every expert at each scheme against
    the sum over all of them."""
    model = lm.model
    calibration, probe = study_batches(lm, args)
    candidates, errors, factors, _, _ = study_inputs(name, model, ea.capture_routing(model, calibration), probe, args)
    isolated = ea.isolated_costs(factors, errors)
    labels = [s.label for s in SCHEMES[:-1]]
    layers, everything = [], {}
    with torch.no_grad():
        hidden_states, kl_from = ea.layer_runner(model, probe)
        hidden = hidden_states()
        for layer in sorted({k[0] for k in errors}):
            keys = [k for k in errors if k[0] == layer]
            for label in labels:
                with ea.assigned(model, candidates, {k: label for k in keys}):
                    joint = kl_from(layer, hidden)
                layers.append({"layer": layer, "scheme": label, "joint_kl": joint,
                               "sum_of_isolated": sum(isolated[k][label] for k in keys)})
        for label in labels:
            with ea.assigned(model, candidates, {k: label for k in errors}):
                everything[label] = {"measured_kl": kl_from(0, hidden),
                                     "sum_of_isolated": sum(isolated[k][label] for k in errors)}
                everything[label]["sum_of_layers"] = sum(r["joint_kl"] for r in layers if r["scheme"] == label)
            print(json.dumps({"model": name, "scheme": label, **everything[label]}), flush=True)
    return {"layers": layers, "all_experts": everything}


def speed(name: str, args) -> dict:
    """Prefill and decode speed of the MoEfied model against dense SmolLM2, each in fp32 and with its block
    linears packed at W4 (RTN, g128: speed does not depend on how codes were chosen) and its output head at
    quantize's default 8 bits, as a W4 checkpoint is served (an fp32 head would be most of a step's bytes),
    every configuration through `paperback bench` in fresh worker processes (`bench_weight_speed.bench`: the
    fastest of --trials)."""
    import tempfile

    from bench_weight_speed import QUANTIZED, bench

    from paperback.cli import main as paperback_cli

    runs = {}
    with tempfile.TemporaryDirectory(prefix="paperback-moe-speed-") as tmp:
        tmp = Path(tmp)
        for label, spec in (("dense", "smollm2"), (name, str(CACHE / name))):
            runs[f"{label} fp32"] = bench(spec, "fp32", args.batch, tmp / f"{label}.json", args.trials)
            packed = tmp / f"{label}-w4"
            if paperback_cli(["quantize", spec, "--method", "rtn", *QUANTIZED["W4 blocks+head"], "-o", str(packed),
                              "--json"]):
                raise SystemExit(f"quantizing {spec} failed")
            runs[f"{label} W4"] = bench(str(packed), "fp32", args.batch, tmp / f"{label}-w4.json", args.trials)
    rows = []
    for config, report in runs.items():
        engine = report["engines"]["paperback"]
        dense = runs[f"dense {config.split()[-1]}"]["engines"]["paperback"]
        row = {"config": config, "active_parameters": engine["model"]["active_parameters"],
               "weight_bytes_read_per_step": engine["model"]["weight_bytes_read_per_step"],
               "prefill_tokens_per_s": engine["prefill_tokens_per_s"],
               "prefill_vs_dense": engine["prefill_tokens_per_s"] / dense["prefill_tokens_per_s"]}
        for b in args.batch:
            row[f"decode_b{b}_tokens_per_s"] = engine["decode"][b]["decode_tokens_per_s"]
            row[f"decode_b{b}_vs_dense"] = row[f"decode_b{b}_tokens_per_s"] / dense["decode"][b]["decode_tokens_per_s"]
            row[f"roofline_b{b}_tokens_per_s"] = report["roofline"][b]["max_tokens_per_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"rows": rows, "runs": runs}


KV_FORMATS = ("fp32", "fp16", "bf16", "fp8", "int8", "int4", "int2", "kivi4", "kivi2", "pnmix")


def kv_formats(path: Path, windows: int) -> dict:
    """Each KV format read back from the serving engine's paged blocks (`paperback eval --kv-cache-dtype F
    --paged`): KL to the same model with an exact cache, on WikiText-2."""
    import contextlib
    import io

    from paperback.cli import main as paperback_cli

    out = {}
    for spec in KV_FORMATS:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            code = paperback_cli(["eval", str(path), "--kv-cache-dtype", spec, "--paged", "--max-windows", str(windows),
                                  "--context", "512", "--json"])
        if code:
            raise SystemExit(f"eval --kv-cache-dtype {spec} failed")
        [result] = json.loads(printed.getvalue())["results"]
        out[spec] = {"kl": result["kl_divergence"], "perplexity": result["perplexity"]}
        print(json.dumps({"kv": spec, **out[spec]}), flush=True)
    return out


def serve_formats(path: Path) -> dict:
    """`paperback serve DIR --kv-cache-dtype F` for each KV format, answering one chat completion through the OpenAI API
    (greedy, 24 tokens): {format: {"text", "completion_tokens", "seconds"}}."""
    import socket
    import subprocess

    import httpx

    out = {}
    for spec in KV_FORMATS:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = subprocess.Popen([sys.executable, "-m", "paperback", "serve", str(path), "--kv-cache-dtype", spec,
                                   "--port", str(port), "--kv-memory", "256MiB"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            url = f"http://127.0.0.1:{port}"
            for _ in range(600):
                if server.poll() is not None:
                    raise SystemExit(f"serve --kv-cache-dtype {spec} exited: {server.stderr.read()[-2000:]}")
                try:
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            start = time.perf_counter()
            reply = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
                "model": path.name, "max_tokens": 24, "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]})
            reply.raise_for_status()
            body = reply.json()
            out[spec] = {"text": body["choices"][0]["message"]["content"],
                         "completion_tokens": body["usage"]["completion_tokens"],
                         "seconds": time.perf_counter() - start}
            print(json.dumps({"serve": spec, **out[spec]}), flush=True)
        finally:
            server.terminate()
            server.wait(timeout=30)
    return out


def summarize(study: dict) -> list[dict]:
    """Per budget and method: mean over random seeds collapsed into one 'random' row (its worst seed kept)."""
    out = []
    for budget in sorted({r["budget"] for r in study["rows"]}):
        rows = [r for r in study["rows"] if r["budget"] == budget]
        randoms = [r for r in rows if r["method"].startswith("random")]
        for r in rows:
            if not r["method"].startswith("random"):
                out.append(r)
        if randoms:
            mean = {k: sum(r[k] for r in randoms) / len(randoms) for k in randoms[0]
                    if isinstance(randoms[0][k], float)}
            worst = {f"{d}_kl_worst": max(r[f"{d}_kl"] for r in randoms) for d in DATASETS}
            out.append({**mean, **worst, "budget": budget, "method": f"random (mean of {len(randoms)})"})
    return out


def markdown(results: dict) -> str:
    """The README's and docs/moe.md's tables from the JSON: per model, KL (perplexity) by budget and text, the
    lowest KL of the six compared methods in bold (ablation rows in italics, outside the contest)."""
    lines = []
    for name, entry in results["models"].items():
        if "allocation" not in entry:
            continue
        summary = summarize(entry["allocation"])
        budgets = sorted({r["budget"] for r in summary})
        methods = list(dict.fromkeys(r["method"] for r in summary))
        best = {(b, d): min(r[f"{d}_kl"] for r in summary if r["budget"] == b and r["method"] not in ABLATIONS)
                for b in budgets for d in DATASETS}
        lines += [f"**{name}** (KL to the unquantized MoE, nats/token; perplexity in brackets; random: mean of "
                  "its seeds / worst seed)", "",
                  "| method | " + " | ".join(f"{b:g} bits: {d}" for b in budgets for d in DATASETS) + " |",
                  "|---" * (1 + len(budgets) * len(DATASETS)) + "|"]
        for method in methods:
            cells = []
            for b in budgets:
                r = next(r for r in summary if r["method"] == method and r["budget"] == b)
                for d in DATASETS:
                    kl = f"{r[f'{d}_kl']:.3f}" + (f" / {r[f'{d}_kl_worst']:.3f}" if f"{d}_kl_worst" in r else "")
                    cell = f"{kl} ({r[f'{d}_perplexity']:.1f})"
                    if method in ABLATIONS:
                        cell = f"*{cell}*"
                    elif r[f"{d}_kl"] == best[(b, d)]:
                        cell = f"**{cell}**"
                    cells.append(cell)
            label = ("random" if method.startswith("random") else method).replace("_", " ")
            lines.append(f"| {f'*{label}*' if method in ABLATIONS else label} | " + " | ".join(cells) + " |")
        wins = sum(next(r for r in summary if r["method"] == "natscale" and r["budget"] == b)[f"{d}_kl"] == best[(b, d)]
                   for b in budgets for d in DATASETS)
        lines += ["", f"NatScale lowest in {wins} of {len(best)} settings."]
        if f"{HELD_OUT}_kl" in summary[0]:
            kl = {(r["method"], r["budget"]): r[f"{HELD_OUT}_kl"] for r in summary}
            held_wins = sum(kl[("natscale", b)] == min(v for (m, bb), v in kl.items() if bb == b and m not in ABLATIONS)
                            for b in budgets)
            domain = ("not the calibration text, which the model wrote itself"
                      if results.get("calibration") == "generated" else
                      "the calibration text's domain; windows disjoint from calibration and probe")
            lines.append(f"On held-out pydoc ({domain}) NatScale is lowest of the six at {held_wins} of "
                         f"{len(budgets)} budgets; against "
                         "uniform: " + "; ".join(
                             f"{b:g} bits {kl[('natscale', b)]:.3f} vs {kl[('uniform', b)]:.3f}" for b in budgets)
                         + ".")
        lines.append("")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in results["models"] if "allocation" in results["models"][m]]
    fig, axes = plt.subplots(len(models), 3, figsize=(16, 4.6 * len(models)), squeeze=False)
    for row, name in enumerate(models):
        study = results["models"][name]["allocation"]
        summary = summarize(study)
        for col, dataset in enumerate(DATASETS):
            ax = axes[row][col]
            for method in dict.fromkeys(r["method"] for r in summary):
                points = sorted((r["budget"], r[f"{dataset}_kl"]) for r in summary if r["method"] == method)
                ax.plot(*zip(*points), marker="o", label=method, linewidth=2.5 if method == "natscale" else 1.2,
                        linestyle="--" if method in ABLATIONS else "-")
            ax.set_yscale("log")
            ax.set_xlabel("average bits per expert weight")
            ax.set_ylabel(f"KL to the unquantized MoE, {dataset} (nats/token)")
            ax.set_title(f"{name}: {dataset}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        ax = axes[row][2]
        experts = study["experts"]
        layers = sorted({e["layer"] for e in experts})
        per_layer = len(experts) // len(layers)
        mid = sorted({r["budget"] for r in study["rows"]})[len({r["budget"] for r in study["rows"]}) // 2]
        nat = next(r for r in study["rows"] if r["method"] == "natscale" and r["budget"] == mid)["assignment"]
        grid = [[int(nat[f"{layer}.{e}"][1]) for e in range(per_layer)] for layer in layers]
        image = ax.imshow(list(zip(*grid)), aspect="auto", cmap="viridis")
        ax.set_xlabel("layer")
        ax.set_ylabel("expert")
        ax.set_title(f"{name}: NatScale's bits at {mid:g} average")
        fig.colorbar(image, ax=ax, label="bits")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    # why: calibrated factor against routing frequency
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for col, name in enumerate(models):
        experts = results["models"][name]["allocation"]["experts"]
        ax = axes[0][col]
        scatter = ax.scatter([e["frequency"] for e in experts], [e["factor"] for e in experts],
                             c=[e["layer"] for e in experts], cmap="plasma", s=14)
        ax.set_yscale("log")
        ax.set_xlabel("routing frequency (share of calibration tokens)")
        ax.set_ylabel("calibrated factor (KL per unit of routed error)")
        ax.set_title(name)
        fig.colorbar(scatter, ax=ax, label="layer")
    fig.tight_layout()
    fig.savefig(path.with_name(path.stem + "_factors.png"), dpi=110)
    plt.close(fig)


def main() -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--models", nargs="+", default=["mixtral-e8k6", "qwen2moe-e8k6-s25"], choices=SETTINGS)
    parser.add_argument("--budgets", type=float, nargs="+", default=[2.5, 3.0, 4.0])
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--calib-samples", type=int, default=16)
    parser.add_argument("--probe-samples", type=int, default=4)
    parser.add_argument("--calib", choices=["pydoc", "generated"], default="pydoc",
                        help="calibration and probe text of part allocation: pydoc, or windows the MoEfied model "
                             "writes itself (self-calibration)")
    parser.add_argument("--part", choices=["all", "moefy", "allocation", "kv", "additivity", "speed"],
                        default="all", help="'all' is moefy and allocation; kv, additivity and speed run alone")
    parser.add_argument("--batch", nargs="+", default=["1", "8"], help="decode batch sizes of part speed")
    parser.add_argument("--trials", type=int, default=3, help="fresh-process bench runs a configuration (speed)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--markdown", action="store_true",
                        help="print the tables as markdown and redraw the plot from the JSON; run nothing")
    parser.add_argument("--recompute", action="store_true",
                        help="measure the expert candidates and factors again instead of reusing the cached ones")
    add_tag_arg(parser)
    args = parser.parse_args()
    if args.markdown:  # the tables, and the plot redrawn, from the JSON
        path = Path(__file__).parent / "results" / results_name("moe_allocation", args.tag)
        if not path.is_file():
            raise SystemExit(f"no results to render: {path} (run --part allocation first)")
        results = json.loads(path.read_text())
        print(markdown(results))
        plot(results, path.with_suffix(".png"))
        return 0
    for budget in args.budgets:
        ea.check_budget(budget, {s.label: s.bits for s in SCHEMES})
    warn_if_busy()
    torch.set_num_threads(args.threads)
    dense = load_model("smollm2")
    tokens = {d: dense.tokenizer.encode(load_text(d)) for d in DATASETS}
    out_name = results_name({"moefy": "moefy_quality", "kv": "moe_kv", "additivity": "moe_additivity",
                             "speed": "moe_speed"}.get(
        args.part, "moe_allocation"), args.tag)
    earlier = read_results(out_name)
    results = {"models": {}, **earlier}  # other models' and parts' entries stay, with their run's provenance
    results.update({  # what the part's numbers were measured on
        "kv": {"windows": args.windows, "window_choice": "the first windows of WikiText-2", "context": 512},
        "speed": {"batch": args.batch, "trials": args.trials},
        "additivity": {"schemes": [s.label for s in SCHEMES]},
    }.get(args.part, {"windows": args.windows, "window_choice": "spread evenly over each text", "context": 512,
                      "schemes": [s.label for s in SCHEMES]}))
    if args.part in ("all", "allocation"):
        results["calibration"] = args.calib
    for name in args.models:
        lm, report = moefied(name, dense)
        entry = results["models"].setdefault(name, {})
        entry["build"] = {"config": report["config"], "build_seconds": report.get("build_seconds"),
                          "mean_router_recall": (sum(r["router_recall"] for r in report["layers"])
                                                 / len(report["layers"])),
                          "mean_error": sum(r["error"] for r in report["layers"]) / len(report["layers"])}
        if args.part in ("all", "moefy"):
            with torch.no_grad():
                entry["quality"] = evaluate_on(lm.model, dense.model, tokens, args.windows, {})
            print(json.dumps({"model": name, **entry["quality"]}), flush=True)
        if args.part in ("all", "allocation"):
            entry["allocation"] = allocation_study(name, lm, args, tokens)
        if args.part == "additivity":
            entry["additivity"] = additivity(name, lm, args)
        if args.part == "speed":
            entry["speed"] = speed(name, args)
        if args.part == "kv":
            entry["kv"] = kv_formats(CACHE / name, args.windows)
            entry["serve"] = serve_formats(CACHE / name)
        write_results(out_name, results, kept_from=earlier or None)
    warn_if_busy(args.threads)
    for name, entry in results["models"].items():
        if "quality" in entry:
            q = entry["quality"]
            print_table(f"{name} against dense SmolLM2 ({args.windows} x 512 tokens)", ["data", "perplexity",
                        "dense perplexity", "KL", "top-1 agree"],
                        [[d, f"{q[d]['perplexity']:.2f}", f"{q[d]['reference_perplexity']:.2f}", f"{q[d]['kl']:.4f}",
                          f"{q[d]['top1']:.3f}"] for d in DATASETS])
        if "kv" in entry:
            print_table(f"{name}: KV formats from paged blocks (WikiText-2, KL to an exact cache)",
                        ["KV format", "KL", "perplexity"],
                        [[spec, f"{r['kl']:.5f}", f"{r['perplexity']:.2f}"] for spec, r in entry["kv"].items()])
        if "serve" in entry:
            print_table(f"{name}: `paperback serve --kv-cache-dtype F`, one chat completion (greedy)",
                        ["KV format", "tokens", "seconds", "answer"],
                        [[spec, r["completion_tokens"], f"{r['seconds']:.2f}", r["text"][:60]]
                                               for spec, r in entry["serve"].items()])
        if "speed" in entry:
            print_table(f"{name} against dense SmolLM2: tokens/s (ratio to dense in the same format)",
                        ["config", "active params (M)", "MiB read/step", "prefill tok/s",
                         *[f"decode b{b} tok/s" for b in args.batch], *[f"roofline b{b}" for b in args.batch]],
                        [[r["config"], f"{r['active_parameters'] / 1e6:.1f}",
                          f"{r['weight_bytes_read_per_step'] / 2**20:.0f}",
                          f"{r['prefill_tokens_per_s']:.0f} ({r['prefill_vs_dense']:.2f}x)",
                          *[f"{r[f'decode_b{b}_tokens_per_s']:.1f} ({r[f'decode_b{b}_vs_dense']:.2f}x)"
                            for b in args.batch],
                          *[f"{r[f'roofline_b{b}_tokens_per_s']:.0f}" for b in args.batch]]
                         for r in entry["speed"]["rows"]])
        if "additivity" in entry:
            print_table(f"{name}: do isolated expert costs add up? (probe KL)", ["scheme", "all experts measured",
                        "sum of layers measured", "sum of isolated"],
                        [[label, f"{r['measured_kl']:.4f}", f"{r['sum_of_layers']:.4f}", f"{r['sum_of_isolated']:.4f}"]
                         for label, r in entry["additivity"]["all_experts"].items()])
        if "allocation" in entry:
            print_table(f"{name}: expert bits (KL to the unquantized MoE; perplexity)",
                        ["bits", "method", "avg bits", "predicted KL", *[f"{d} KL" for d in DATASETS],
                         *[f"{d} ppl" for d in DATASETS]],
                        [[f"{r['budget']:g}", r["method"], f"{r['average_bits']:.3f}", f"{r['predicted_kl']:.4f}",
                          *[f"{r[f'{d}_kl']:.4f}" for d in DATASETS],
                          *[f"{r[f'{d}_perplexity']:.2f}" for d in DATASETS]]
                         for r in summarize(entry["allocation"])])
    if any("allocation" in e for e in results["models"].values()):
        figure = Path(__file__).parent / "results" / out_name.replace(".json", ".png")
        plot(results, figure)
        print(f"wrote {figure}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
