"""`fit --format gguf`: a model fitted to a file size with llama.cpp's tensor types, written as one GGUF file.

Each weight may take any GGUF type that tiles its rows. Every (tensor, type) cell is quantized from the
full model's inputs on the calibration windows (allocate.gguf_cells) and priced as the KL it adds alone
(allocate.gguf_prices, cached per model, text and settings, so fitting another size is a solve and a
write); the exact solve (allocate.solver) then picks one type per tensor within the budget and, where
llama-bench is at hand, no slower in llama.cpp on this CPU than the recipe of the size (each type's speed
in each role measured by llama-bench itself, allocate.gguf_speed, cached per CPU; the solution then timed
whole against the recipe, and solved again, or given up for the recipe's types, where it is slower). The solution
and the llama.cpp recipe of the nearest size below the budget, quantized by the same method, are measured
whole on windows the prices never read; the lower KL is written (the report says which). The file is
evaluated where it is read back, on the part of the text after the profiled span.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from paperback.allocate.gguf_budget import GGUFBudget, candidate_types, gguf_budget, tensor_candidates
from paperback.allocate.gguf_cells import CELL_METHODS, GGUFCells, layer_of
from paperback.allocate.gguf_prices import ANCHOR_BITS, anchor_type, costs, exact_types, price_cells
from paperback.allocate.gguf_speed import PHASES, SpeedSettings, SpeedTable, measure_speed, time_assignments
from paperback.allocate.probe import ReferenceProbe, swapped_weights
from paperback.allocate.solver import Group, InfeasibleBudget, Option, solve
from paperback.errors import DatasetError, PaperbackError
from paperback.export.gguf_quantize import ROLES, gguf_types_for, tensor_bytes, weight_shapes
from paperback.quantization.calibration import CalibrationConfig, calibration_batch
from paperback.quantization.gguf_recipes import RECIPES, recipe
from paperback.quantization.gguf_types import GGUF_TYPES, QUANTIZED_TYPES, GGUFType
from paperback.quantization.awq import AWQConfig
from paperback.quantization.gptq import GPTQConfig
from paperback.quantization.model_pass import HEAD_PARAM

PRICES_VERSION = 1
SPEED_ATTEMPTS = 3  # solves timed whole against the recipe before its own types are taken
SPEED_TOLERANCE = 0.03  # slower than the recipe by at most this, as llama-bench measures the two in turns


@dataclass(frozen=True)
class GGUFFitConfig:
    method: str = "rtn"
    types: tuple[str, ...] = QUANTIZED_TYPES  # candidate GGUF types, each tensor taking those that tile it
    text: str = "pydoc"  # calibrated and priced on its leading `span`; the rest is held out for evaluation
    calib_samples: int = 64  # windows whose inputs every cell is quantized from (llama-imatrix's text too)
    window_tokens: int = 512
    probe_windows: int = 4  # windows each anchor's KL is measured on ...
    probe_tokens: int = 256  # ... their first tokens
    check_windows: int = 4  # windows the solution and the recipe are measured whole on
    span: float = 0.5
    seed: int = 0
    anchor_bits: float = ANCHOR_BITS
    check_samples: int = 12  # estimated cells measured as well
    eval_windows: int = 4
    eval_context: int = 512
    gptq: GPTQConfig = field(default_factory=GPTQConfig)
    awq: AWQConfig = field(default_factory=AWQConfig)

    def __post_init__(self):
        if self.method not in CELL_METHODS:
            raise PaperbackError(f"a GGUF fit quantizes by {', '.join(CELL_METHODS)}, not '{self.method}'")
        candidate_types(self.types)
        for name in ("calib_samples", "window_tokens", "probe_windows", "probe_tokens", "check_windows",
                     "eval_windows", "eval_context"):
            if getattr(self, name) < 1:
                raise PaperbackError(f"{name.replace('_', ' ')} must be at least 1")
        if self.probe_tokens > self.window_tokens:
            raise PaperbackError("probe tokens must be at most the window")

    def calibration(self) -> CalibrationConfig:
        return CalibrationConfig(self.text, self.calib_samples, self.window_tokens, self.seed, span=self.span)

    def probe(self) -> CalibrationConfig:
        return CalibrationConfig(self.text, self.probe_windows, self.probe_tokens, self.seed + 1, span=self.span)

    def check(self) -> CalibrationConfig:
        return CalibrationConfig(self.text, self.check_windows, self.window_tokens, self.seed + 2, span=self.span)

    def price_settings(self) -> dict:
        """What the prices depend on (the cache key): not the check, the evaluation or the budget."""
        return {"version": PRICES_VERSION, "method": self.method, "types": list(self.types),
                "calibration": self.calibration().to_dict(), "probe": self.probe().to_dict(),
                "anchor_bits": self.anchor_bits, "check_samples": self.check_samples,
                "gptq": asdict(self.gptq) if self.method == "gptq" else None,
                **({"awq": self.awq.to_dict()} if self.method == "awq" else {})}

    def to_dict(self) -> dict:
        return asdict(self)


class SlowerThanRecipe(PaperbackError):
    """No mix of the allowed types is as fast in llama.cpp as the recipe of the size."""


@dataclass
class HeldSolve:
    """A solve's answer, with the whole-file timings that checked it against the recipe's speed."""
    types: dict[str, GGUFType]
    predicted_kl: float
    checks: list[dict] = field(default_factory=list)
    fell_back: bool = False  # no solution measured as fast: the recipe's own types


def source_gguf(spec: str | None) -> Path:
    """The GGUF file a model comes from: the file a fit copies its metadata from."""
    from paperback.loading.sources import resolve_model

    source = resolve_model(spec)
    if source.kind != "gguf":
        raise PaperbackError(f"{source.label} is not a GGUF file; a GGUF fit copies the tokenizer and chat template "
                             "of the GGUF file a model came from (a Hugging Face source is not built yet)")
    return Path(source.path)


def baseline_recipe(config, budget: GGUFBudget, kinds: tuple[GGUFType, ...]) -> str | None:
    """The named llama.cpp recipe the fit is measured against: --size-of's, else the largest within the
    budget; only a recipe whose every type is a candidate (a fit told to avoid a type never writes it)."""
    allowed = {k.name for k in kinds}
    every = {name: gguf_types_for(config, r) for name, r in RECIPES.items()}
    usable = {name: types for name, types in every.items() if {t.name for t in types.values()} <= allowed}
    if budget.size_of:
        return budget.size_of if budget.size_of in usable else None
    sizes = {name: tensor_bytes(config, types) for name, types in usable.items()}
    within = [name for name, size in sizes.items() if size <= budget.tensor_bytes]
    return max(within, key=sizes.get, default=None)


def default_cache_dir() -> Path:
    return Path(os.environ.get("PAPERBACK_CACHE", Path.home() / ".cache" / "paperback")) / "gguf-prices"


class GGUFFit:
    """A GGUF fit of one model. Everything a user can get wrong is checked in the constructor, before the
    weights load; `run` fits the budget given there, and `run_budget` any other with the same prices (a
    benchmark's several sizes from one load)."""

    def __init__(self, spec: str | None, config: GGUFFitConfig, out: Path, size: int | None = None,
                 size_of: str | None = None, overwrite: bool = False, cache_dir: Path | None = None,
                 progress: bool = True, llama_bench: Path | None = None, speed: SpeedSettings | None = None):
        from paperback.evaluation.datasets import load_text
        from paperback.loading.gguf_file import GGUFModelFile

        self.spec, self.config, self.progress, self.overwrite = spec, config, progress, overwrite
        # No slower than the recipe: needs llama-bench (None: the speed is not constrained, and the result says so)
        self.llama_bench, self.speed = llama_bench, speed or SpeedSettings()
        self.out = self._checked_output(out)
        self.source = source_gguf(spec)
        self.source_file = GGUFModelFile(self.source)  # metadata only: no tensor is read
        self.model_config = self.source_file.config()
        self.kinds = candidate_types(config.types)
        self.candidates = tensor_candidates(self.model_config, self.kinds)
        # Every legal quantized type is priced (and cached), whichever the solve may choose from
        self.priced = tensor_candidates(self.model_config, candidate_types((*QUANTIZED_TYPES, *config.types)))
        self.budget = self.budget_of(size, size_of)
        self.text = load_text(config.text)
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self.seconds: dict[str, float] = {}
        self._shared: dict = {}  # the loaded model, cells and prices: one per fit and its `restricted` copies

    def _checked_output(self, out: Path) -> Path:
        out = Path(out)
        if out.suffix != ".gguf":
            raise PaperbackError(f"a GGUF fit writes one file: give -o a name ending in .gguf, not {out}")
        if out.exists() and not self.overwrite:
            raise PaperbackError(f"{out} exists; pass --overwrite to replace it")
        return out

    def restricted(self, types: tuple[str, ...]) -> GGUFFit:
        """The same fit (model, statistics and prices shared) choosing only from `types`."""
        other = copy.copy(self)
        other.config = replace(self.config, types=tuple(types))
        other.kinds = candidate_types(types)
        other.candidates = tensor_candidates(self.model_config, other.kinds)
        return other

    def exact_types(self) -> dict[str, int]:
        """The types that reproduce most of the source's tensors exactly (gguf_prices.exact_types)."""
        return exact_types(self._prepare()[2])

    def budget_of(self, size: int | None = None, size_of: str | None = None) -> GGUFBudget:
        return gguf_budget(self.source_file, self.candidates, size, size_of)

    def _stage(self, message: str) -> None:
        if self.progress:
            print(f"[fit gguf] {message}", flush=True)

    def run(self) -> dict:
        return self.run_budget(self.budget, self.out)

    def _prepare(self):
        """(model, cells, prices, held-out ids): loaded, measured and priced once per fit object."""
        from paperback.allocate.profile import model_fingerprint, text_fingerprint
        from paperback.loading import load_model

        if "state" in self._shared:
            return self._shared["state"]
        cfg = self.config
        lm = load_model(self.spec, "fp32")
        tokens = lm.tokenizer.encode(self.text, add_special_tokens=False)
        held_out = tokens[int(len(tokens) * cfg.span):]
        if len(held_out) < cfg.eval_context:
            raise DatasetError(f"the held-out part of '{cfg.text}' (after the first {cfg.span:.0%}) has "
                               f"{len(held_out)} tokens, fewer than one evaluation window of {cfg.eval_context}")
        t0 = time.perf_counter()
        self._stage(f"input statistics on {cfg.calib_samples} windows of {cfg.window_tokens} tokens of {cfg.text}")
        # AWQ's scales are searched at each tensor's anchor: the type its other prices are scaled from
        anchors = {param: anchor_type(kinds, cfg.anchor_bits) for param, kinds in self.priced.items()}
        cells = GGUFCells(lm.model, calibration_batch(lm.tokenizer, cfg.calibration()), cfg.method, cfg.gptq,
                          awq=cfg.awq, scale_types=anchors, progress=self.progress)
        self.seconds["statistics"] = time.perf_counter() - t0
        settings = {**cfg.price_settings(), "types": sorted({k.name for ks in self.priced.values() for k in ks})}
        key = hashlib.sha256(json.dumps({"model": model_fingerprint(lm.model), "text": text_fingerprint(self.text),
                                         **settings}, sort_keys=True).encode()).hexdigest()[:24]
        cached = self.cache_dir / f"{key}.json"
        t0 = time.perf_counter()
        if cached.is_file():
            self._stage(f"prices from {cached}")
            prices = json.loads(cached.read_text())
        else:
            count = sum(len(k) for k in self.priced.values())
            self._stage(f"pricing {count} cells ({len(self.priced)} tensors x their legal types) by {cfg.method}")
            probe = ReferenceProbe(lm.model, calibration_batch(lm.tokenizer, cfg.probe()))
            prices = price_cells(cells, probe, self.priced, cfg.anchor_bits, cfg.check_samples, cfg.seed,
                                 self.progress)
            del probe
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(prices))
            os.replace(tmp, cached)
        prices["path"] = str(cached)
        self.seconds["price"] = time.perf_counter() - t0
        self._shared["state"] = (lm, cells, prices, held_out)
        return self._shared["state"]

    def run_budget(self, budget: GGUFBudget, out: Path) -> dict:
        """Fit `budget`, write `out`, evaluate it: the result `fit --json` prints."""
        from paperback.export.gguf_quantize import write_weights

        out = self._checked_output(out)
        cfg = self.config
        lm, cells, prices, held_out = self._prepare()
        model = lm.model
        baseline = baseline_recipe(self.model_config, budget, self.kinds)
        baseline_types = gguf_types_for(self.model_config, recipe(baseline)) if baseline is not None else None
        # The speed to match is that of the recipe of this size, even one using types the fit may not take
        paced = baseline_recipe(self.model_config, budget, tuple(GGUF_TYPES.values()))
        held = self._held_solve(lm, prices, budget, self._speed_table(lm), paced,
                                baseline_types if baseline == paced else None)
        types, predicted = held.types, held.predicted_kl
        t0 = time.perf_counter()
        contenders = {"fit": types}
        if baseline is not None:
            contenders[baseline] = baseline_types
        self._stage(f"measuring the solution{f' and {baseline}' if baseline else ''} whole on "
                    f"{cfg.check_windows} other windows")
        check = ReferenceProbe(model, calibration_batch(lm.tokenizer, cfg.check()))
        measured = {}
        for name, assignment in contenders.items():
            with swapped_weights(model, cells.weights(assignment)):
                measured[name] = check.kl_full()
        del check
        written = min(measured, key=lambda name: (measured[name], name != "fit"))
        self.seconds["check"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        chosen = contenders[written]
        self._stage(f"writing {out} ({'the solution' if written == 'fit' else f'{written}: it measured lower'})")
        record = {"method": cfg.method, "types": {p: t.name for p, t in chosen.items()},
                  "fit": {"budget": budget.to_dict(), "written": written, "predicted_kl": predicted,
                          "measured_kl": measured, "calibration": cfg.calibration().to_dict()}}
        summary = write_weights(lm, {p: cells.quantized(p, t) for p, t in chosen.items()}, out, record,
                                self.progress)
        if budget.file_bytes is not None and summary["bytes"] > budget.file_bytes:
            out.unlink()  # a file over the size asked for is not the fit: leave nothing behind
            raise PaperbackError(f"the written file has {summary['bytes']:,} bytes, over the {budget.file_bytes:,} "
                                 "asked for: the estimate of its metadata was short (a bug: please report it)")
        self.seconds["write"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        quality = self._evaluate(lm, held_out, cells, contenders, written, out)
        self.seconds["evaluate"] = time.perf_counter() - t0
        layers, edges = self._layer_table(chosen)
        return {"output": str(out), "model": lm.source.label, "source": str(self.source),
                "budget": budget.to_dict(), "bytes": summary["bytes"], "tensor_bytes": summary["tensor_bytes"],
                "bits_per_weight": 8 * summary["tensor_bytes"] / sum(o * i for o, i in
                                                                     weight_shapes(self.model_config).values()),
                "written": written, "baseline": baseline, "predicted_kl": predicted, "measured_kl": measured,
                "types": dict(Counter(t.name for t in chosen.values())),
                "tensors": {p: t.name for p, t in chosen.items()}, "layers": layers, "edges": edges,
                "estimate_check": {k: v for k, v in prices["check"].items() if k != "points"},
                "exact_types": exact_types(prices),
                "quality": quality, "prices": prices["path"], "seconds": dict(self.seconds),
                "speed": self._speed_report(self._speed_table(lm), contenders, written, paced, held),
                "config": cfg.to_dict()}

    def _speed_table(self, lm) -> SpeedTable | None:
        """llama.cpp's speed of every priced type on this CPU (measured once, cached); None without llama-bench."""
        if self.llama_bench is None:
            return None
        if "speed" not in self._shared:
            t0 = time.perf_counter()
            kinds = tuple(GGUF_TYPES[n] for n in sorted({k.name for ks in self.priced.values() for k in ks}))
            self._shared["speed"] = measure_speed(lm, kinds, self.llama_bench, self.speed, progress=self.progress)
            self.seconds["speed"] = time.perf_counter() - t0
        return self._shared["speed"]

    def _held_solve(self, lm, prices: dict, budget: GGUFBudget, table: SpeedTable | None, paced: str | None,
                    fallback: dict[str, GGUFType] | None) -> HeldSolve:
        """The solve held to the speed of recipe `paced`, then checked: the solution and the recipe timed whole
        by llama-bench (zero-weight files, in turns). What the per-type costs miss is learnt from each check: the
        recipe's own misprediction is common to every file, and the solution's further shortfall is charged to
        each weight that departs from the recipe's type, so the next solve keeps closer to the recipe where the
        departures cost more than the costs said. After SPEED_ATTEMPTS the recipe's own types (`fallback`, where
        the fit may take them) are the answer, else the fit is refused."""
        if table is None or paced is None:
            return HeldSolve(*self._solve(prices, budget))
        shapes = weight_shapes(self.model_config)
        paced_types = gguf_types_for(self.model_config, recipe(paced))
        bound = table.seconds(paced_types, shapes)  # seconds per token the solution may take, each phase
        departure = dict.fromkeys(PHASES, 0.0)  # seconds per token per weight off the recipe's type, learnt
        checks = []
        for attempt in range(1, SPEED_ATTEMPTS + 1):
            try:
                types, predicted = self._solve(prices, budget, table, bound, paced, paced_types, departure)
            except SlowerThanRecipe:
                if attempt == 1:
                    raise
                break  # nothing departs from the recipe cheaply enough (a fit that cannot take its types)
            if types == paced_types:
                return HeldSolve(types, predicted, checks, fell_back=attempt > 1)
            self._stage(f"timing the solution against {paced} whole with llama-bench ({self.speed.rounds} rounds)")
            timed = time_assignments(lm, {"fit": types, paced: paced_types}, self.llama_bench, self.speed)
            mine, theirs = timed["fit"]["seconds"], timed[paced]["seconds"]
            expected = table.seconds(types, shapes)
            departed = sum(shapes[p][0] * shapes[p][1] for p, kind in types.items() if kind != paced_types[p])
            ratio = {phase: theirs[phase] / mine[phase] for phase in PHASES}  # the solution's speed, recipe = 1
            checks.append({"attempt": attempt, "types": dict(Counter(t.name for t in types.values())),
                           "departed_weights": departed, "departure_cost": dict(departure),
                           "predicted_seconds": expected, "measured_seconds": mine, "recipe_seconds": theirs,
                           "recipe_predicted_seconds": dict(bound), "ratio": ratio,
                           "tokens_per_s": {name: t["tokens_per_s"] for name, t in timed.items()}})
            self._stage("measured " + ", ".join(f"{phase} {ratio[phase]:.3f}x" for phase in PHASES) + f" {paced}")
            if all(ratio[phase] >= 1 - SPEED_TOLERANCE for phase in PHASES):
                return HeldSolve(types, predicted, checks)
            for phase in PHASES:  # what the model (costs, common offset, departures) still missed on this file
                missed = (mine[phase] - expected[phase]) - (theirs[phase] - bound[phase]) - departure[phase] * departed
                departure[phase] = max(0.0, departure[phase] + missed / departed)
        if fallback is None:
            raise SlowerThanRecipe(f"no solution within {budget.label} measured as fast in llama.cpp as {paced} "
                                   f"({len(checks)} timed), and the types allowed cannot write {paced} itself: "
                                   "allow its types, or pass --any-speed")
        self._stage(f"no solution measured as fast as {paced} ({len(checks)} timed): writing its own types")
        table_kl = costs(prices)
        return HeldSolve(fallback, sum(table_kl[p][k.name] for p, k in fallback.items()), checks, fell_back=True)

    def _speed_report(self, table: SpeedTable | None, contenders: dict, written: str, baseline: str | None,
                      held: HeldSolve) -> dict:
        if table is None:
            return {"constrained": False, "why": "no llama-bench (give --llama-bench PATH or put it on PATH): "
                                                 "the fit may run slower in llama.cpp than the recipe"}
        shapes = weight_shapes(self.model_config)
        if baseline is not None and baseline not in contenders:
            contenders = {**contenders, baseline: gguf_types_for(self.model_config, recipe(baseline))}
        predicted = {name: {phase: 1 / s for phase, s in table.seconds(types, shapes).items()}
                     for name, types in contenders.items()}
        return {"constrained": baseline is not None, "against": baseline,
                "why": None if baseline is not None else "no llama.cpp recipe fits the budget to hold it to",
                "predicted_tokens_per_s": predicted, "written": written, "checks": held.checks,
                "fell_back": held.fell_back, "measured_ratio": None if held.fell_back or not held.checks
                else held.checks[-1]["ratio"],
                "llama_bench": table.measured.get("llama_bench_path"), "cpu": table.measured.get("cpu"),
                "threads": table.measured.get("settings", {}).get("threads")}

    def _solve(self, prices: dict, budget: GGUFBudget, speed: SpeedTable | None = None,
               bound: dict[str, float] | None = None, baseline_name: str | None = None,
               paced_types: dict[str, GGUFType] | None = None, departure: dict[str, float] | None = None
               ) -> tuple[dict[str, GGUFType], float]:
        """The least predicted KL within the budget; with a speed table and a bound (seconds per token of each
        phase, prompt processing and generation), also within the bound by the table's prediction, each weight
        off its type in `paced_types` costing `departure` more."""
        shapes = weight_shapes(self.model_config)
        table = costs(prices)
        limited = speed is not None and bound is not None
        departure = departure or dict.fromkeys(PHASES, 0.0)

        def uses(param: str, kind: GGUFType) -> tuple[float, ...]:
            if not limited:
                return ()
            numel = shapes[param][0] * shapes[param][1]
            off = paced_types is not None and kind != paced_types.get(param)
            return tuple((speed.cost(kind, phase, param) + (departure[phase] if off else 0.0)) * numel
                         for phase in PHASES)

        groups = [Group(param, tuple(Option(k.name, k.tensor_bytes(*shapes[param]), table[param][k.name],
                                            uses(param, k)) for k in kinds))
                  for param, kinds in self.candidates.items()]
        limits = tuple(bound[phase] - speed.reference_seconds[phase] for phase in PHASES) if limited else ()
        try:
            chosen = solve(groups, budget.tensor_bytes, limits)
        except InfeasibleBudget:
            if not limited:
                raise
            raise SlowerThanRecipe(f"no mix of {', '.join(k.name for k in self.kinds)} within {budget.label} runs as "
                                 f"fast in llama.cpp as {baseline_name} (by llama-bench's timing of each type on "
                                 "this CPU): allow more types, or pass --any-speed") from None
        self._stage(f"solved: {dict(Counter(o.label for o in chosen.values()))} within {budget.label}"
                    + (", no slower than its recipe by llama-bench's speeds" if limited else ""))
        return {p: GGUF_TYPES[o.label] for p, o in chosen.items()}, sum(o.cost for o in chosen.values())

    def _evaluate(self, lm, held_out: list[int], cells: GGUFCells, contenders: dict, written: str,
                  out: Path) -> dict:
        """The written file read back, and the other contender, against the full model on held-out text."""
        from paperback.evaluation.perplexity import evaluate
        from paperback.loading import load_model

        cfg = self.config
        bos = lm.tokenizer.bos_token_id if lm.tokenizer.adds_bos else None
        self._stage(f"evaluating on {cfg.eval_windows} held-out windows of {cfg.eval_context}")
        fitted = load_model(str(out), "fp32", with_tokenizer=False)  # exactly what was written
        reference_cache: dict = {}

        def score(model) -> dict:
            return evaluate(model, held_out, cfg.eval_context, reference=lm.model, max_windows=cfg.eval_windows,
                            dataset="held-out", progress=self.progress, bos_token_id=bos,
                            reference_cache=reference_cache).to_dict()

        quality = {"held_out_tokens": len(held_out), written: score(fitted.model)}
        del fitted
        for name, assignment in contenders.items():
            if name != written:
                other = copy.deepcopy(lm.model)
                params = dict(other.named_parameters())
                with torch.no_grad():
                    for param, weight in cells.weights(assignment).items():
                        params[param].copy_(weight)
                quality[name] = score(other)
        return quality

    def _layer_table(self, types: dict[str, GGUFType]) -> tuple[list[dict], dict[str, str]]:
        """({llama.cpp's tensor role: type} per block, {token_embd / output: type}); a tied embedding is
        llama.cpp's token_embd, read as the output head too."""
        rows: dict[int, dict] = {}
        edges = {}
        for param, kind in types.items():
            layer = layer_of(param)
            if layer is None:
                edges["output" if param == HEAD_PARAM else "token_embd"] = kind.name
            else:
                linear = param.removesuffix(".weight").split(".", 3)[3]
                rows.setdefault(layer, {"layer": layer})[ROLES[linear]] = kind.name
        return [rows[i] for i in sorted(rows)], edges
