"""Bits per MoE expert: NatScale against five allocations at the same bytes, on MoEfied SmolLM2 models.

    .venv/bin/python benchmarks/bench_moe_allocation.py [--models mixtral-e8k6 qwen2moe-e8k6-s25]
        [--budgets 2.5 3 4] [--windows 16] [--seeds 3] [--part all|moefy|allocation] [--tag NAME]

paperback loads no downloadable MoE model here, so the test models are made from the bundled SmolLM2 by
`paperback moefy` (each MLP split into experts; docs/moe.md) and kept under ~/.cache/paperback/moefied/.
Part moefy measures each MoEfied model against the dense one (perplexity and KL on WikiText-2 and PTB);
part kv serves each through the paged engine with every KV format (`paperback eval --kv F --paged`).
Part allocation quantizes every routed expert at W2/W3/W4/W8 (asymmetric, groups of 64; GPTQ on the
calibration tokens routed to it), and for each budget of average code bits per expert weight compares:
NatScale (knapsack over errors weighted by KL-calibrated factors), uniform bits, ranking by routing
frequency, by weight norm, by weight kurtosis, and random rankings (--seeds). Attention, embeddings and the
shared expert stay unquantized: the study is the experts' bits. Calibration (Hessians, errors, factors) is
on pydoc, never on the evaluation texts. Each allocation: KL to the unquantized MoE model and perplexity on
--windows windows of 512 tokens of WikiText-2 and of PTB. Writes benchmarks/results/moe_allocation[_tag].json
and a plot beside it.
"""

from __future__ import annotations

import argparse
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
from paperback.quantization.calibration import CalibrationConfig, calibration_batch
from paperback.quantization.scheme import QuantScheme

sys.path.insert(0, str(Path(__file__).parent))
from results_io import add_tag_arg, results_name, warn_if_busy, write_results  # noqa: E402

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
    out = {}
    for dataset, ids in tokens.items():
        r = evaluate(model, ids, 512, reference=reference, max_windows=windows, progress=False,
                     reference_cache=caches.setdefault(dataset, {}))
        out[dataset] = {"perplexity": r.perplexity, "kl": r.kl_divergence, "top1": r.top1_agreement,
                        "reference_perplexity": r.reference_perplexity}
    return out


def allocation_study(lm, args, tokens: dict) -> dict:
    model = lm.model
    reference = copy.deepcopy(model)  # the allocations swap expert weights of `model` in place
    calibration = calibration_batch(lm.tokenizer, CalibrationConfig(num_samples=args.calib_samples, seq_len=512,
                                                                     seed=1))
    probe = calibration_batch(lm.tokenizer, CalibrationConfig(num_samples=args.probe_samples, seq_len=512, seed=2))
    timings = {}
    start = time.perf_counter()
    routed = ea.capture_routing(model, calibration)
    candidates = ea.quantize_candidates(model, routed, SCHEMES)
    errors = ea.expert_errors(model, routed, candidates)
    timings["candidates_seconds"] = time.perf_counter() - start
    start = time.perf_counter()
    factors, kls = ea.calibrate_factors(model, probe, candidates, errors, SCHEMES[0].label)
    anchors = ea.scheme_anchors(model, probe, candidates, factors, errors, [s.label for s in SCHEMES[:-1]])
    timings["calibration_seconds"] = time.perf_counter() - start
    signals = ea.expert_signals(model, routed)
    sizes = {k: ea.expert_size(e) for k, e in ea.experts_of(model).items()}
    bits = {s.label: s.bits for s in SCHEMES}
    keys = sorted(errors)
    caches: dict = {}
    rows = []
    for budget in args.budgets:
        allocations = {"natscale": ea.natscale_allocation(factors, errors, sizes, bits, budget),
                       # ablation: each scheme's cost scaled by how the probe's all-experts KL departs from the sum
                       "natscale+anchors": ea.natscale_allocation(factors, errors, sizes, bits, budget, anchors),
                       "uniform": ea.uniform_allocation(keys, sizes, bits, budget),
                       **{name: ea.ranking_allocation(signals[name], sizes, bits, budget)
                          for name in ("frequency", "weight_norm", "kurtosis")},
                       **{f"random{seed}": ea.random_allocation(keys, sizes, bits, budget, seed)
                          for seed in range(args.seeds)}}
        for method, assignment in allocations.items():
            with torch.no_grad(), ea.assigned(model, candidates, assignment):
                result = evaluate_on(model, reference, tokens, args.windows, caches)
            row = {"budget": budget, "method": method, "average_bits": ea.average_bits(assignment, sizes, bits),
                   "predicted_kl": ea.predicted_kl(factors, errors, assignment), **{
                       f"{d}_{k}": v for d, r in result.items() for k, v in r.items()}}
            if method == "natscale":
                row["assignment"] = {f"{layer}.{e}": label for (layer, e), label in assignment.items()}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "assignment"}), flush=True)
    return {"rows": rows, **timings, "anchors": anchors,
            "experts": [{"layer": k[0], "expert": k[1], "factor": factors[k], "probe_kl": kls[k],
                         "errors": errors[k], **{name: signals[name][k] for name in signals}} for k in keys]}


KV_FORMATS = ("fp16", "fp8", "int8", "int4", "int2", "kivi4", "kivi2", "pnmix")


def kv_formats(path: Path, windows: int) -> dict:
    """Each KV format read back from the serving engine's paged blocks (`paperback eval --kv F --paged`): KL to
    the same model with an exact cache, on WikiText-2."""
    import contextlib
    import io

    from paperback.cli import main as paperback_cli

    out = {}
    for spec in KV_FORMATS:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            code = paperback_cli(["eval", str(path), "--kv", spec, "--paged", "--max-windows", str(windows),
                                  "--context", "512", "--json"])
        if code:
            raise SystemExit(f"eval --kv {spec} failed")
        [result] = json.loads(printed.getvalue())["results"]
        out[spec] = {"kl": result["kl_divergence"], "perplexity": result["perplexity"]}
        print(json.dumps({"kv": spec, **out[spec]}), flush=True)
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
            out.append({**mean, "budget": budget, "method": f"random (mean of {len(randoms)})"})
    return out


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
                ax.plot(*zip(*points), marker="o", label=method, linewidth=2.5 if method == "natscale" else 1.2)
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["mixtral-e8k6", "qwen2moe-e8k6-s25"], choices=SETTINGS)
    parser.add_argument("--budgets", type=float, nargs="+", default=[2.5, 3.0, 4.0])
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--calib-samples", type=int, default=16)
    parser.add_argument("--probe-samples", type=int, default=4)
    parser.add_argument("--part", choices=["all", "moefy", "allocation", "kv"], default="all")
    parser.add_argument("--threads", type=int, default=2)
    add_tag_arg(parser)
    args = parser.parse_args()
    for budget in args.budgets:
        ea.check_budget(budget, {s.label: s.bits for s in SCHEMES})
    warn_if_busy()
    torch.set_num_threads(args.threads)
    dense = load_model("smollm2")
    tokens = {d: dense.tokenizer.encode(load_text(d)) for d in DATASETS}
    out_name = results_name({"moefy": "moefy_quality", "kv": "moe_kv"}.get(args.part, "moe_allocation"), args.tag)
    previous = Path(__file__).parent / "results" / out_name
    results = json.loads(previous.read_text()) if previous.is_file() else {"models": {}}
    results.update(windows=args.windows, context=512, schemes=[s.label for s in SCHEMES])
    for name in args.models:
        lm, report = moefied(name, dense)
        entry = results["models"].setdefault(name, {})
        entry["build"] = {"config": report["config"], "build_seconds": report.get("build_seconds"),
                          "mean_router_recall": sum(r["router_recall"] for r in report["layers"]) / len(report["layers"]),
                          "mean_error": sum(r["error"] for r in report["layers"]) / len(report["layers"])}
        if args.part in ("all", "moefy"):
            with torch.no_grad():
                entry["quality"] = evaluate_on(lm.model, dense.model, tokens, args.windows, {})
            print(json.dumps({"model": name, **entry["quality"]}), flush=True)
        if args.part in ("all", "allocation"):
            entry["allocation"] = allocation_study(lm, args, tokens)
        if args.part == "kv":
            entry["kv"] = kv_formats(CACHE / name, args.windows)
        write_results(out_name, results)
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
        if "allocation" in entry:
            print_table(f"{name}: expert bits (KL to the unquantized MoE; perplexity)",
                        ["bits", "method", "avg bits", "predicted KL", *[f"{d} KL" for d in DATASETS],
                         *[f"{d} ppl" for d in DATASETS]],
                        [[f"{r['budget']:g}", r["method"], f"{r['average_bits']:.3f}", f"{r['predicted_kl']:.4f}",
                          *[f"{r[f'{d}_kl']:.4f}" for d in DATASETS], *[f"{r[f'{d}_perplexity']:.2f}" for d in DATASETS]]
                         for r in summarize(entry["allocation"])])
    if any("allocation" in e for e in results["models"].values()):
        figure = Path(__file__).parent / "results" / out_name.replace(".json", ".png")
        plot(results, figure)
        print(f"wrote {figure}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
