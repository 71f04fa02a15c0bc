"""Cross-domain calibration: calibrate on one corpus, evaluate on another, and the reverse.

    .venv/bin/python benchmarks/bench_cross_domain.py [--model smollm2] [--methods gptq awq] [--scheme W4a-g128]
        [--calib pydoc ptb generated]

Two corpora of different kinds, the Python documentation (pydoc) and Penn
Treebank news text (ptb), are each cut in half: calibration windows come only
from the first half, evaluation windows only from the second, so the
in-domain cells never see their evaluation text. Every method is calibrated
on each corpus and evaluated on both (and on WikiText-2, foreign to both);
RTN, which needs no calibration, is the control. A third calibration text,
`generated`, is written by the model itself from the start-of-document token
(self-calibration: no data, and none of the evaluation texts). Writes
benchmarks/results/cross_domain_<model>.json, keeping the rows of calibration
texts not run this time.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path

from bench_quality import parse_scheme

from paperback.cli.output import print_table
from paperback.evaluation import evaluate, load_text
from paperback.loading import load_model
from paperback.quantization.calibration import GENERATED, CalibrationConfig, calibration_batch
from paperback.quantization.model_pass import QuantizeConfig, quantize_model

RESULTS = Path(__file__).parent / "results"
CORPORA = ("pydoc", "ptb")


def run() -> int:
    from results_io import benchmark_parser, warn_if_busy, write_results

    parser = benchmark_parser(__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--methods", nargs="+", default=["gptq", "awq"])
    parser.add_argument("--scheme", default="W4a-g128")
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--calib-samples", type=int, default=128)
    parser.add_argument("--calib", nargs="+", default=[*CORPORA, GENERATED], choices=[*CORPORA, GENERATED],
                        help="calibration texts to run (rows of the others are kept from the last run)")
    args = parser.parse_args()

    warn_if_busy()  # a busy machine distorts timings, and even ratios
    scheme = parse_scheme(args.scheme)
    lm = load_model(args.model, "fp32")
    encode = lambda name: lm.tokenizer.encode(load_text(name), add_special_tokens=False)
    # Evaluation text: the second half of each calibration corpus, and all of WikiText-2.
    eval_sets = {}
    for name in CORPORA:
        tokens = encode(name)
        eval_sets[f"{name} (2nd half)"] = tokens[len(tokens) // 2:]
    eval_sets["wikitext2"] = encode("wikitext2")
    bos = lm.tokenizer.bos_token_id if lm.tokenizer.adds_bos else None
    cache: dict = {}
    batches: dict[str, tuple] = {}  # corpus: (token ids, seconds to make them)
    rows = []
    plan = [("rtn", None)] + [(m, c) for m in args.methods for c in args.calib]
    for method, corpus in plan:
        model = copy.deepcopy(lm.model)
        calibration, calibration_seconds = None, None
        if corpus is not None:  # one batch per corpus, shared by the methods (generated text takes minutes)
            if corpus not in batches:
                start = time.perf_counter()
                batch = calibration_batch(lm.tokenizer, CalibrationConfig(corpus, args.calib_samples, 512, span=0.5),
                                          lm.model)
                batches[corpus] = batch, time.perf_counter() - start
            calibration, calibration_seconds = batches[corpus]
        start = time.perf_counter()
        quantize_model(model, QuantizeConfig(method, scheme), calibration)
        label = corpus and (f"{corpus} (1st half)" if corpus in CORPORA else f"{corpus} (by the model)")
        row = {"method": method, "calibrated_on": label,
               "quantize_seconds": time.perf_counter() - start,
               "calibration_seconds": calibration_seconds}
        for name, tokens in eval_sets.items():
            r = evaluate(model, tokens, 512, None, lm.model, args.windows, dataset=name, bos_token_id=bos,
                         reference_cache=cache)
            row[name] = {"perplexity": r.perplexity, "kl": r.kl_divergence,
                         "reference_perplexity": r.reference_perplexity}
        rows.append(row)
        print(method, corpus, {n: round(row[n]["kl"], 4) for n in eval_sets}, flush=True)
    out = RESULTS / f"cross_domain_{args.model}.json"
    earlier = None
    if out.is_file():  # rows of calibration texts not run this time, measured on the same windows and scheme
        previous = json.loads(out.read_text())
        if previous["scheme"] == scheme.to_dict() and previous["windows"] == args.windows:
            ran = {(r["method"], r["calibrated_on"]) for r in rows}
            kept = [r for r in previous["rows"] if (r["method"], r["calibrated_on"]) not in ran]
            rows, earlier = rows + kept, previous if kept else None
            order = {m: i for i, m in enumerate(["rtn", *args.methods])}
            rows.sort(key=lambda r: order.get(r["method"], len(order)))
    print_table(f"{args.model} {scheme.label}: perplexity (KL to the full model) by calibration corpus",
                ["method", "calibrated on"] + list(eval_sets),
                [[r["method"], r["calibrated_on"] or "-"]
                 + [f"{r[n]['perplexity']:.3f} ({r[n]['kl']:.4f})" for n in eval_sets] for r in rows])
    write_results(out, {"model": args.model, "scheme": scheme.to_dict(), "windows": args.windows, "rows": rows},
                  kept_from=earlier)
    return 0


if __name__ == "__main__":
    sys.exit(run())
