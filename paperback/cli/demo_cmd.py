"""`paperback demo [MODEL]`: the main job end to end, the model made lighter beside the full one.

`paperback fit` puts the model into a memory budget for a workload (a
profile of where bits matter, an exact allocation, one checkpoint with its
KV policy, a held-out evaluation and an HTML report); the demo then sets
the fitted model beside the full one: bytes against the budget, WikiText-2
perplexity and KL, decode speed, and a short generation. Each step is the
same code path as its own subcommand. The bundled default model ships its
profile, so no profiling runs for it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from paperback.allocate.candidates import DEFAULT_CANDIDATES
from paperback.cli.common import add_model_arg
from paperback.cli.output import console, note, print_table, stage


def register(sub) -> None:
    p = sub.add_parser("demo", help="the main job: fit a model into a memory budget, set it beside the full model")
    add_model_arg(p)
    p.add_argument("--memory", default="1GiB", help="memory budget (default 1GiB)")
    p.add_argument("--context", type=int, default=8192, help="tokens per user (default 8192)")
    p.add_argument("--users", type=int, default=8, help="users held at once (default 8)")
    p.add_argument("--output", type=Path, default=None,
                   help="where the fitted checkpoint goes (default ~/.cache/paperback/demo/MODEL-fit)")
    p.add_argument("--eval-windows", type=int, default=8, help="WikiText-2 windows of 512 tokens to score")
    p.add_argument("--skip-bench", action="store_true", help="skip the decode-speed comparison")
    p.add_argument("--calib-samples", type=int, default=8,
                   help="calibration windows the fit quantizes with (its AWQ search reads them)")
    p.add_argument("--candidates", type=int, default=DEFAULT_CANDIDATES,
                   help="solutions the fit quantizes and measures whole before keeping one (1: the solve alone)")
    p.add_argument("--no-needles", action="store_true", help="skip the fit's needle retrieval at --context")
    p.add_argument("--results", type=Path, default=None,
                   help="also write the comparison as JSON here (it is always written as demo.json beside the "
                        "fitted checkpoint), with what it ran on: command, commit, CPU, threads, kernels, date")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from paperback.cli import build_parser

    out = args.output or Path.home() / ".cache" / "paperback" / "demo" / f"{Path(args.model).name}-fit"
    parser = build_parser()
    fit_argv = ["fit", args.model, "--memory", args.memory, "--context", str(args.context), "--users",
                str(args.users), "-o", str(out), "--overwrite", "--eval-context", "1024", "--eval-windows", "2",
                "--calib-samples", str(args.calib_samples), "--candidates", str(args.candidates),
                *(["--no-needles"] if args.no_needles else ["--needle-depths", "0.5"])]
    console.rule(f"paperback {' '.join(fit_argv[:2])} --memory {args.memory} --context {args.context} "
                 f"--users {args.users}")
    fit_args = parser.parse_args(fit_argv)
    code = fit_args.func(fit_args)
    if code:
        return code
    console.rule("the full model beside the fitted one")
    _compare(args, out)
    console.rule(f"paperback generate {out.name}")
    gen_args = parser.parse_args(["generate", str(out), "Explain in two sentences why the sky is blue.",
                                  "--max-tokens", "48"])
    return gen_args.func(gen_args)


def _compare(args: argparse.Namespace, out: Path) -> None:
    import json

    from paperback.evaluation import load_text
    from paperback.evaluation.perplexity import evaluate
    from paperback.kv.cache import QuantizedKVCache
    from paperback.kv.policy import build_policy
    from paperback.loading import load_model
    from paperback.plan.arithmetic import kv_bytes, weight_bytes
    from paperback.plan.shape import shape_from_config

    fit = json.loads((out / "fit.json").read_text())
    allocation = fit["allocation"]
    full = load_model(args.model, "fp32")
    fitted = load_model(str(out), "fp32")
    shape = shape_from_config(full.config, full.source.label, "")
    full_weights = weight_bytes(shape, "fp16").total
    full_kv = kv_bytes(shape, args.context, "fp16", args.users)
    runtime = allocation["runtime_bytes"]
    tokens = full.tokenizer.encode(load_text("wikitext2"), add_special_tokens=False)
    bos = full.tokenizer.bos_token_id if full.tokenizer.adds_bos else None
    policy = build_policy(fitted.config, spec=allocation["kv_policy"])
    with stage("WikiText-2: the full model, then the fitted one through its KV formats"):
        reference = evaluate(full.model, tokens, 512, max_windows=args.eval_windows, dataset="wikitext2",
                             progress=False, bos_token_id=bos)
        light = evaluate(fitted.model, tokens, 512, reference=full.model, max_windows=args.eval_windows,
                         dataset="wikitext2", progress=False, bos_token_id=bos,
                         kv_cache=QuantizedKVCache.factory(fitted.model, policy), chunk=64)
    budget = fit["workload"]["memory"]
    rows = [["weights (MiB)", _mib(full_weights), _mib(allocation["weight_bytes"])],
            [f"KV cache, {args.users} x {args.context} tokens (MiB)", _mib(full_kv), _mib(allocation["kv_bytes"])],
            ["runtime allowance (MiB)", _mib(runtime), _mib(runtime)],
            [f"total against the {_mib(budget)} MiB budget", _mib(full_weights + full_kv + runtime),
             _mib(allocation["total_bytes"])],
            ["WikiText-2 perplexity", f"{reference.perplexity:.3f}", f"{light.perplexity:.3f}"],
            ["KL to the full model (nats/token)", "0", f"{light.kl_divergence:.4f}"],
            ["top-1 agreement", "1", f"{light.top1_agreement:.3f}"]]
    measured = {"model": full.source.label, "budget_bytes": budget, "users": args.users, "context": args.context,
                "bits_per_weight": allocation["bits_per_weight"],
                "full": {"weight_bytes": full_weights, "kv_bytes": full_kv, "runtime_bytes": runtime,
                         "wikitext2": reference.to_dict()},
                "fitted": {"weight_bytes": allocation["weight_bytes"], "kv_bytes": allocation["kv_bytes"],
                           "runtime_bytes": runtime, "total_bytes": allocation["total_bytes"],
                           "wikitext2": light.to_dict(), "held_out": fit["quality"]["eval"],
                           "predicted_kl": fit["quality"]["predicted_kl"]}}
    if not args.skip_bench:
        from paperback.bench.engines import BenchConfig
        from paperback.bench.report import run_in_worker

        speeds = []
        with stage("decode speed, batch 1: the full model, then the fitted one"):
            for model in (args.model, str(out)):
                result = run_in_worker("paperback", BenchConfig(model=model, batches=(1,), repeats=2))
                speeds.append(result["decode"]["1"]["decode_tokens_per_s"])
        # `paperback bench` decodes through an exact contiguous cache: this row is the weights' speed.
        rows.append(["decode tokens/s, batch 1 (exact cache)", f"{speeds[0]:.1f}", f"{speeds[1]:.1f}"])
        measured["full"]["decode_tokens_per_s"], measured["fitted"]["decode_tokens_per_s"] = speeds
    print_table(f"{full.source.label}: full (16-bit weights, fp16 cache) and fitted "
                f"({allocation['bits_per_weight']:.2f} bits per weight, per-layer KV formats)",
                ["", "full", "fitted"], rows)
    note(f"WikiText-2: {reference.tokens_scored:,} tokens in {reference.windows} windows of 512, never seen by the "
         f"fit. Report: {out / 'report.html'}")
    from paperback.system import provenance

    measured = {"provenance": provenance(), **measured}
    for path in filter(None, (out / "demo.json", args.results)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(measured, indent=2))


def _mib(n: float) -> str:
    return f"{n / 2 ** 20:,.0f}"
