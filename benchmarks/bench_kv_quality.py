"""KV cache formats: quality read back from the cache, by position, needle retrieval, and the breakdown point.

    .venv/bin/python benchmarks/bench_kv_quality.py --part quality|positions|needle|sweep|fp8-error|plot
        [--model smollm2] [--formats fp16 kivi2 ...] [--windows 4] [--context 4096]

Every part feeds text through paperback's quantized KV cache `--chunk` tokens
at a time (default 32; any chunk scores as token-by-token decoding does,
since what a position reads depends on its position alone), so each token is
scored with every earlier token read back from the cache as stored. The
reference is the same fp32 model with exact attention.

  quality    WikiText-2 perplexity and KL at --context tokens, first --windows windows
  positions  mean KL and NLL by position over one 8,192-token window, in 512-token buckets
  needle     a 6-digit code planted at depths 0.1/0.5/0.9 of 2k, 4k and 8k tokens of WikiText-2
  sweep      bits against KL and perplexity within each format family; knee and recommendation
  fp8-error  FP8 rounding error of keys and values by scale (1, calibrated per layer or head), the
             share of subnormal and saturated elements, and the floor set by the mantissa alone
  plot       PNGs of the sweep and of the position curves from the JSON

Results go to benchmarks/results/kv_<model>.json after every cell; a rerun
skips cells already there (--fresh to redo).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch

from paperback.cli.output import print_table
from paperback.evaluation import evaluate, load_text
from paperback.evaluation.breakdown import breakdown
from paperback.evaluation.needle import run_needles
from paperback.kv import QuantizedKVCache, build_policy, calibrate_kv_amax
from paperback.kv.calibrate import fp8_scale
from paperback.kv.codecs import FP8_DTYPES, FP8Codec
from paperback.loading import load_model
from paperback.quantization.calibration import CalibrationConfig, calibration_batch

RESULTS = Path(__file__).parent / "results"
FORMATS = ["fp16", "bf16", "fp8-e4m3", "fp8-e4m3:scale=calibrated", "fp8-e5m2", "fp8-e5m2:scale=calibrated",
           "int8", "int4", "kivi4", "kivi2", "pnmix", "pnmix:lo=1,top=8", "kivi2:g=16"]
# A format may name layers kept at fp16 after a bar: "kivi2|skip=global" (Gemma 3's full-attention layers).
# Within each family, settings from many bits to few (the x axis of the breakdown plot).
SWEEP = {
    "int": ["int4:bits=8", "int4", "int4:bits=3", "int2", "int2:bits=1"],
    "kivi": ["kivi4:bits=8", "kivi4", "kivi2:bits=3", "kivi2", "kivi2:bits=1"],
    "fp8": ["fp8-e4m3:scale=calibrated", "fp8-e5m2:scale=calibrated"],
    "pnmix": ["pnmix:top=16", "pnmix:top=8", "pnmix", "pnmix:top=2"],
    "pnmix-lo1": ["pnmix:lo=1,top=12", "pnmix:lo=1,top=8", "pnmix:lo=1,top=4"],
}
NEEDLE_LENGTHS = [2048, 4096, 8000]
NEEDLE_DEPTHS = [0.1, 0.5, 0.9]
POSITION_CONTEXT, BUCKET = 8192, 512
FP8_ERROR_TOKENS = 2048


class Bench:
    def __init__(self, args):
        self.args = args
        self.lm = load_model(args.model, "fp32")
        self.model = self.lm.model
        self.tokens = self.lm.tokenizer.encode(load_text("wikitext2"), add_special_tokens=False)
        self.bos = self.lm.tokenizer.bos_token_id if self.lm.tokenizer.adds_bos else None
        self.out = RESULTS / f"kv_{args.model}.json"
        self.earlier = json.loads(self.out.read_text()) if self.out.exists() and not args.fresh else {}
        self.report = dict(self.earlier)  # parts this run does not measure stay, with their run's provenance
        self.report.update(model=args.model, chunk=args.chunk, threads=torch.get_num_threads())
        self.reference_cache: dict = {}
        self._amax = None

    def save(self):
        from results_io import write_results

        write_results(self.out, self.report, kept_from=self.earlier or None, announce=False)

    def factory(self, spec: str):
        fmt, _, skip = spec.partition("|skip=")
        policy = build_policy(self.model.config, fmt, skip or None)
        amax = self.kv_amax() if policy.needs_fp8_calibration(self.model.config.num_layers) else None
        return policy, QuantizedKVCache.factory(self.model, policy, amax)

    def eval_cell(self, spec: str, context: int, windows: int, per_position: bool = False) -> dict:
        policy, factory = self.factory(spec)
        start = time.perf_counter()
        r = evaluate(self.model, self.tokens, context, None, None, windows, dataset="wikitext2",
                     bos_token_id=self.bos, reference_cache=self.reference_cache, kv_cache=factory,
                     chunk=self.args.chunk, per_position=per_position)
        cell = {"format": spec, "label": policy.label, "context": context, "windows": windows,
                "bits_per_element": policy.bits_per_element(self.model.config),
                "bits_at_context": policy.bits_at(self.model.config, context),
                "perplexity": r.perplexity, "reference_perplexity": r.reference_perplexity,
                "kl": r.kl_divergence, "top1": r.top1_agreement, "seconds": time.perf_counter() - start}
        key, value = policy.default.codecs()
        if hasattr(key, "code_bits"):
            cell["key_code_bits"] = key.code_bits(self.model.config.head_dim)
        if per_position:
            cell["bucket"] = BUCKET
            cell["position_kl"] = _buckets(r.position_kl)
            cell["position_nll"] = _buckets(r.position_nll)
        return cell

    def cells(self, part: str) -> dict:
        return self.report.setdefault(part, {})

    def run_quality(self):
        cells = self.cells("quality")
        for spec in self.args.formats:
            if spec not in cells:
                cells[spec] = self.eval_cell(spec, self.args.context, self.args.windows)
                self.save()
                _log(cells[spec])

    def run_positions(self):
        cells = self.cells("positions")
        for spec in self.args.formats:
            if spec not in cells:
                cells[spec] = self.eval_cell(spec, POSITION_CONTEXT, 1, per_position=True)
                self.save()
                _log(cells[spec])

    def run_needle(self):
        cells = self.cells("needle")
        for spec in self.args.formats:
            if spec in cells:
                continue
            _, factory = self.factory(spec)
            results = run_needles(self.model, self.lm.tokenizer, self.tokens, NEEDLE_LENGTHS, NEEDLE_DEPTHS,
                                  factory, self.args.chunk)
            cells[spec] = {"cases": [r.to_dict() for r in results],
                           "accuracy": {str(n): sum(r.correct for r in results if r.length == n) / len(NEEDLE_DEPTHS)
                                        for n in NEEDLE_LENGTHS}}
            self.save()
            print(f"needle {spec}: {cells[spec]['accuracy']}", flush=True)

    def kv_amax(self) -> dict:
        if self._amax is None:  # pydoc, never the evaluation text
            calib = calibration_batch(self.lm.tokenizer, CalibrationConfig("pydoc", 16, 512))
            self._amax = calibrate_kv_amax(self.model, calib, progress=False)
        return self._amax

    @torch.inference_mode()
    def run_fp8_error(self):
        """Rounding error of FP8 keys and values under each scale, beside the floor the mantissa alone sets.

        Relative RMS error over every layer's keys (and values) of the first
        FP8_ERROR_TOKENS tokens of WikiText-2, the share of elements that land
        in the subnormal range or saturate, and the error of rounding to the
        format's significant bits at any exponent (no range limit at all): no
        choice of scale can go below that floor.
        """
        amax = self.kv_amax()
        ids = torch.tensor([self.tokens[:FP8_ERROR_TOKENS]])
        scales = {"scale=1": lambda i, which, variant: 1.0,
                  "calibrated per layer": lambda i, which, variant: fp8_scale(amax[i][which], variant, False),
                  "calibrated per head": lambda i, which, variant: fp8_scale(amax[i][which], variant, True)}
        rows = {}
        for variant in ("e4m3", "e5m2"):
            dtype = FP8_DTYPES[variant]
            significant = {"e4m3": 4, "e5m2": 3}[variant]  # the implicit bit and 3 or 2 stored mantissa bits
            tally = {(name, which): [0.0, 0.0, 0, 0, 0] for name in [*scales, "mantissa floor"] for which in (0, 1)}

            def record(layer_idx, k, v, start_pos):
                for which, x in ((0, k.float()), (1, v.float())):
                    power = float((x ** 2).sum())
                    for name, scale_of in scales.items():
                        codec = FP8Codec(variant, scale_of(layer_idx, which, variant))
                        scaled = (x / codec.scale).abs()
                        t = tally[name, which]
                        t[0] += float(((codec.decode(codec.encode(x), torch.float32) - x) ** 2).sum())
                        t[1] += power
                        t[2] += int((scaled < torch.finfo(dtype).smallest_normal).sum())
                        t[3] += int((scaled > torch.finfo(dtype).max).sum())
                        t[4] += x.numel()
                    mantissa, exponent = torch.frexp(x)
                    floor = torch.ldexp(torch.round(mantissa * 2 ** significant) / 2 ** significant, exponent)
                    t = tally["mantissa floor", which]
                    t[0] += float(((floor - x) ** 2).sum())
                    t[1] += power
                    t[4] += x.numel()
                return k, v

            recorder = type("Recorder", (), {"update": staticmethod(record)})()
            self.model.hidden_states(ids, 0, recorder)
            for (name, which), (err, power, subnormal, saturated, count) in tally.items():
                row = rows.setdefault(f"fp8-{variant} {name}", {"variant": variant, "scale": name})
                part = "keys" if which == 0 else "values"
                row[f"{part}_relative_rms_error"] = math.sqrt(err / power)
                row[f"{part}_subnormal"] = subnormal / count
                row[f"{part}_saturated"] = saturated / count
        self.report["fp8_error"] = {"tokens": FP8_ERROR_TOKENS, "rows": rows}
        self.save()
        table = []
        for label, r in rows.items():
            cells = [label]
            for part in ("keys", "values"):
                cells += [f"{r[f'{part}_relative_rms_error']:.4f}", f"{100 * r[f'{part}_subnormal']:.2f}%",
                          f"{100 * r[f'{part}_saturated']:.2f}%"]
            table.append(cells)
        print_table(f"{self.args.model}: FP8 rounding error of keys and values, {FP8_ERROR_TOKENS} tokens",
                    ["format, scale", "keys: rel. RMS error", "subnormal", "saturated",
                     "values: rel. RMS error", "subnormal", "saturated"], table)

    def run_sweep(self):
        cells = self.cells("sweep")
        for family, specs in SWEEP.items():
            for spec in specs:
                if spec not in cells:
                    cells[spec] = {"family": family, **self.eval_cell(spec, self.args.sweep_context,
                                                                       self.args.sweep_windows)}
                    self.save()
                    _log(cells[spec])
        set_breakdown(self.report)
        self.save()


def set_breakdown(report: dict) -> None:
    """Knee and recommendation of every sweep family (from SWEEP, so regrouping needs no rerun)."""
    cells = report.get("sweep", {})
    report["breakdown"] = {family: breakdown([cells[s] for s in specs if s in cells])
                           for family, specs in SWEEP.items() if any(s in cells for s in specs)}


def _buckets(values: list[float]) -> list[float]:
    out = []
    for lo in range(0, len(values), BUCKET):
        chunk = [v for v in values[lo:lo + BUCKET] if not math.isnan(v)]
        out.append(sum(chunk) / len(chunk) if chunk else float("nan"))
    return out


def _log(cell: dict) -> None:
    print(f"{cell['format']}: {cell['bits_at_context']:.3f} bits at {cell['context']}, ppl {cell['perplexity']:.3f} "
          f"(ref {cell['reference_perplexity']:.3f}), KL {cell['kl']:.4f}, {cell['seconds']:.0f}s", flush=True)


def plot(report: dict, model: str) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    sweep = report.get("sweep", {})
    if sweep:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        for family, specs in SWEEP.items():
            pts = sorted((sweep[s] for s in specs if s in sweep), key=lambda c: c["bits_per_element"])
            if not pts:
                continue
            bits = [c["bits_per_element"] for c in pts]
            line, = axes[0].plot(bits, [c["kl"] for c in pts], "o-", label=family)
            axes[1].plot(bits, [c["perplexity"] for c in pts], "o-", color=line.get_color(), label=family)
            knee = report.get("breakdown", {}).get(family, {})
            for c in pts:
                if c["format"] == knee.get("knee"):
                    axes[0].plot(c["bits_per_element"], c["kl"], "kx", markersize=12, mew=2)
                if c["format"] == knee.get("recommended"):
                    axes[0].plot(c["bits_per_element"], c["kl"], "o", mfc="none", mec="k", markersize=14)
        ref = next(iter(sweep.values()))["reference_perplexity"]
        axes[1].axhline(ref, color="gray", ls="--", lw=1, label="exact cache")
        axes[0].set_yscale("log")
        axes[1].set_yscale("log")
        for ax, label in zip(axes, ("KL to the exact cache (nats/token)", "WikiText-2 perplexity")):
            ax.set_xlabel("stored bits per element (scales included)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        axes[0].set_title("x = knee, circle = recommended", fontsize=9)
        fig.suptitle(f"{model}: KV format breakdown, context {next(iter(sweep.values()))['context']}")
        fig.tight_layout()
        path = RESULTS / f"kv_breakdown_{model}.png"
        fig.savefig(path, dpi=110)
        written.append(path)
    positions = report.get("positions", {})
    if positions:
        fig, ax = plt.subplots(figsize=(8, 4.2))
        colors = plt.get_cmap("tab20").colors
        for i, (spec, c) in enumerate(positions.items()):
            xs = [(j + 0.5) * c["bucket"] for j in range(len(c["position_kl"]))]
            ax.plot(xs, [max(v, 1e-7) for v in c["position_kl"]], color=colors[i % len(colors)],
                    ls="-" if i < len(colors) else "--", label=spec)
        ax.set_yscale("log")
        ax.set_xlabel("position in the window (tokens)")
        ax.set_ylabel("mean KL to the exact cache, per 512 tokens")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        ax.set_title(f"{model}: KV format quality by position")
        fig.tight_layout()
        path = RESULTS / f"kv_positions_{model}.png"
        fig.savefig(path, dpi=110)
        written.append(path)
    return written


def run() -> int:
    from results_io import benchmark_parser, warn_if_busy, write_results

    parser = benchmark_parser(__doc__.splitlines()[0])
    parser.add_argument("--part", nargs="+", default=["quality"],
                        choices=["quality", "positions", "needle", "sweep", "fp8-error", "plot"])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--formats", nargs="+", default=FORMATS)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--sweep-context", type=int, default=2048)
    parser.add_argument("--sweep-windows", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=32)
    parser.add_argument("--fresh", action="store_true")
    args = parser.parse_args()

    warn_if_busy()  # a busy machine distorts timings, and even ratios
    if args.part == ["plot"]:
        path = RESULTS / f"kv_{args.model}.json"
        report = json.loads(path.read_text())
        set_breakdown(report)
        write_results(path, report, kept_from=report)  # re-derived, not re-measured
        for path in plot(report, args.model):
            print(f"wrote {path}")
        return 0
    bench = Bench(args)
    for part in args.part:
        if part != "plot":
            getattr(bench, f"run_{part.replace('-', '_')}")()
    for path in plot(bench.report, args.model):
        print(f"wrote {path}")
    print_summary(bench.report)
    print(f"wrote {bench.out}")
    return 0


def print_summary(report: dict) -> None:
    quality, needle = report.get("quality", {}), report.get("needle", {})
    rows = []
    for spec in dict.fromkeys(list(quality) + list(needle)):
        q, n = quality.get(spec), needle.get(spec)
        rows.append([spec, f"{q['bits_at_context']:.2f}" if q else "-",
                     f"{q['perplexity']:.3f}" if q else "-", f"{q['kl']:.4f}" if q else "-"]
                    + [f"{n['accuracy'][str(k)]:.2f}" if n else "-" for k in NEEDLE_LENGTHS])
    if rows:
        ctx = next(iter(quality.values()))["context"] if quality else "-"
        print_table(f"{report['model']}: KV formats, WikiText-2 at {ctx} tokens (chunk {report['chunk']})",
                    ["format", "bits/elem", "perplexity", "KL"] + [f"needle {n}" for n in NEEDLE_LENGTHS], rows)


if __name__ == "__main__":
    sys.exit(run())
