"""`fit`: plan, profile, allocate, quantize, evaluate on held-out text; one checkpoint with its KV policy.

Every step is the one its own command runs: the profile is `paperback
profile`'s (cached), the allocation is the exact solve over it, the
quantization is the model pass with per-unit schemes, and the evaluation is
`evaluate` and `run_needles` through the cache in the chosen formats, on the
part of the text the profile never read.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from paperback.allocate.allocation import (Allocation, Allocator, Workload, breakdown_point, check_budget,
                                           fitting_candidates)
from paperback.allocate.candidates import DEFAULT_CANDIDATES, EVEN_MARGIN, Candidate, within_additivity
from paperback.allocate.profile import ProfileConfig, Profiler, load_profile, text_fingerprint
from paperback.allocate.second_pass import ShippedSecondPass
from paperback.allocate.units import BLOCK_UNITS, retention_label
from paperback.errors import DatasetError, PaperbackError
from paperback.kv.schemes import parse_kv_scheme
from paperback.quantization.awq import AWQConfig
from paperback.quantization.calibration import CalibrationConfig, calibration_batch
from paperback.quantization.model_pass import BLOCK_LINEARS, METHODS, QuantizeConfig, quantize_model
from paperback.quantization.pipeline import save_quantized


@dataclass(frozen=True)
class FitConfig:
    workload: Workload
    text_source: str
    profile: ProfileConfig = ProfileConfig()
    calib_samples: int = 16  # AWQ / GPTQ calibration windows for the final quantization
    eval_context: int = 1024
    eval_windows: int = 4
    needle_depths: tuple[float, ...] = (0.25, 0.5, 0.75)
    needle_context: int | None = None  # None: the workload's context, capped by the model's positions
    breakdown_kl: float = 0.5  # predicted KL (nats/token) past which quality counts as broken down
    evict: bool = False  # may layers evict (StreamingLLM: sinks plus a window, chosen per layer)
    # Most answer KL of a long-range lookup any one layer's KV option may cost (the profile's retrieval part);
    # None: not constrained.
    retrieval_kl: float | None = None
    # Solutions by head scheme the second pass quantizes and measures whole on the profiled text, besides the
    # even-bits one (allocate.second_pass); 1: the solve alone, not measured.
    candidates: int = DEFAULT_CANDIDATES
    # How much lower (a fraction) a mix's measured KL must be than even bits' for the mix to be written.
    even_margin: float = EVEN_MARGIN
    # A tied head allocated by bands of vocabulary rows (quantization.head_bands), when the profile has them.
    head_bands: bool = True

    def to_dict(self) -> dict:
        return {**asdict(self), "profile": self.profile.to_dict()}


def held_out_tokens(token_ids: list[int], config: FitConfig) -> list[int]:
    """The part of the text after the profiled span: evaluation reads only this."""
    rest = token_ids[int(len(token_ids) * config.profile.span):]
    if len(rest) < config.eval_context:
        raise DatasetError(f"the held-out part of the text (after the first {config.profile.span:.0%}) has "
                           f"{len(rest)} tokens, fewer than one evaluation window of {config.eval_context}; "
                           "give a longer --text or a smaller --eval-context")
    return rest


def needle_score(results: list[dict]) -> str:
    """'k/n': how many of the needle cases were answered correctly."""
    return f"{sum(r['correct'] for r in results)}/{len(results)}"


class Fit:
    """One fit run. Checks everything it can (budget, text, profile) before any long step."""

    def __init__(self, lm, text: str, config: FitConfig, out_dir: Path, profile_path: Path | None = None,
                 cache_dir: Path | None = None, overwrite: bool = False, progress: bool = True):
        self.lm, self.config, self.out_dir, self.progress = lm, config, Path(out_dir), progress
        if self.out_dir.exists() and any(self.out_dir.iterdir()) and not overwrite:
            raise PaperbackError(f"{self.out_dir} exists and is not empty; pass --overwrite to replace it")
        self.overwrite = overwrite
        self.profile_path = profile_path
        self.profile = self.profiler = None
        if profile_path is not None:
            self.profile = load_profile(profile_path, lm.model)
            if self.profile.text.sha256 != text_fingerprint(text):
                raise PaperbackError(f"profile {profile_path} was measured on other text "
                                     f"({self.profile.text.source}); fit evaluates on the part of the same "
                                     "text the profile never read, so give that --text or profile this one")
            # The profile's own candidates, method and split decide the rest of the fit.
            measured = self.profile.config
            config = replace(config, profile=replace(
                config.profile, method=measured.method, weight_schemes=measured.weight_schemes,
                kv_formats=measured.kv_formats, span=measured.span, window_tokens=measured.window_tokens,
                weight_tokens=measured.weight_tokens, include_head=measured.include_head))
            self.config = config
        check_budget(lm.model, config.workload, config.profile.weight_schemes, config.profile.kv_formats,
                     config.profile.include_head)
        self.held_out = held_out_tokens(lm.tokenizer.encode(text, add_special_tokens=False), config)
        if self.profile is None:
            self.profiler = Profiler(lm.model, lm.tokenizer, text, config.text_source, config.profile, cache_dir,
                                     progress, lm.source.label)
        self.text = text
        self.seconds: dict[str, float] = {}

    def run(self, reference_lm) -> dict:
        """reference_lm: the full model, loaded separately (the fitted one is quantized in place)."""
        t0 = time.perf_counter()
        if self.profile is None:
            self._stage("profile: KL per weight unit and KV layer (reused where cached or shipped with paperback)")
            self.profile = self.profiler.run()
        self.seconds["profile"] = time.perf_counter() - t0
        cfg = self.config
        t0 = time.perf_counter()
        self._stage("solving the budget, then quantizing and measuring the best candidates whole")
        allocator, candidates = fitting_candidates(self.profile, self.lm.model, cfg.workload, cfg.candidates,
                                                   cfg.head_bands, evict=cfg.evict, retrieval_kl=cfg.retrieval_kl)
        allocation, second_pass, summary = self._allocate_and_quantize(allocator, candidates)
        self.seconds["second_pass_and_quantize"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self._stage(f"evaluating the written checkpoint on {cfg.eval_windows} held-out windows")
        quality = self._evaluate(reference_lm, allocation)
        self.seconds["evaluate"] = time.perf_counter() - t0
        curve = allocator.budget_curve()
        measured = self.profile.to_dict()
        return {"checkpoint": str(self.out_dir), "workload": asdict(self.config.workload),
                "curve": curve, "breakdown": breakdown_point(curve, self.config.breakdown_kl),
                "breakdown_kl": self.config.breakdown_kl,
                "allocation": allocation.to_dict(), "second_pass": second_pass, "layers": self._layer_table(allocation),
                "quantization": summary, "quality": quality, "additivity": measured.get("additivity"),
                "profile": {"key": self.profiler.key if self.profiler else None,
                            "path": str(self.profile_path) if self.profile_path else None,
                            "seconds": self.profile.seconds},
                "tokens": self.profile.tokens, "seconds": self.seconds, "config": self.config.to_dict()}

    def _stage(self, message: str) -> None:
        if self.progress:
            print(f"[fit] {message}", file=sys.stderr, flush=True)

    def _allocate_and_quantize(self, allocator: Allocator, candidates: list[Candidate]
                               ) -> tuple[Allocation, list[dict], dict]:
        """The solve's best candidates by head scheme and the even-bits one, each quantized by the final pass
        and measured whole on the profiled text (the ones the additivity check rules out are not); the model
        with the least KL is the one written."""
        from paperback.kv.policy import build_policy

        cfg = self.config
        plausible = within_additivity(candidates, self.profile.additivity)
        calibration = CalibrationConfig(cfg.text_source, cfg.calib_samples, cfg.profile.window_tokens,
                                        cfg.profile.seed, span=cfg.profile.span)
        if not METHODS[cfg.profile.method].calibrated:
            calibration = None
        batch = calibration_batch(self.lm.tokenizer, calibration, self.lm.model) if calibration is not None else None

        def quantize(model, candidate):
            return quantize_model(model, self._quantize_config(allocator.allocation_of(candidate), allocator), batch,
                                  progress=self.progress)

        second = ShippedSecondPass(self.lm.model, self.lm.tokenizer, self.text,
                                   self.profile.config, self.progress,
                                   cfg.even_margin)
        best = second.choose(plausible, quantize, lambda c: build_policy(
            self.lm.config, spec=allocator.allocation_of(c).kv_policy_spec()))
        allocation = allocator.allocation_of(best.candidate)
        self.lm.model = best.model
        extra = {"kv_policy": allocation.kv_policy_spec(), "allocation": allocation.to_dict(),
                 "fit": {"workload": asdict(cfg.workload), "text": asdict(self.profile.text),
                         "profile_model": self.profile.model.fingerprint}}
        summary = save_quantized(self.lm, self._quantize_config(allocation, allocator), calibration, best.weights,
                                 best.seconds, self.out_dir, self.overwrite, extra)
        return allocation, [{**c.summary(), "chosen": c is best.candidate} for c in candidates], summary

    def _quantize_config(self, allocation: Allocation, allocator: Allocator) -> QuantizeConfig:
        cfg = self.config
        targets = BLOCK_LINEARS + (("head",) if any(u.layer is None for u in allocator.units) else ())
        schemes, head_bands = allocator.quantize_schemes(allocation.layer_schemes(allocator.units))
        return QuantizeConfig(cfg.profile.method, next(iter(schemes.values())),
                              awq=AWQConfig(search_samples=cfg.calib_samples), targets=targets, layer_schemes=schemes,
                              head_bands=head_bands)

    def _evaluate(self, reference_lm, allocation: Allocation) -> dict:
        from paperback.evaluation.needle import run_needles
        from paperback.evaluation.perplexity import evaluate
        from paperback.generation.kv_cache import ContiguousKVCache
        from paperback.kv.cache import QuantizedKVCache
        from paperback.kv.policy import build_policy
        from paperback.loading import load_model

        cfg = self.config
        fitted = load_model(str(self.out_dir), "fp32")  # exactly what was written
        policy = build_policy(fitted.config, spec=allocation.kv_policy_spec())
        bos = fitted.tokenizer.bos_token_id if fitted.tokenizer.adds_bos else None
        result = evaluate(fitted.model, self.held_out, cfg.eval_context, reference=reference_lm.model,
                          max_windows=cfg.eval_windows, dataset="held-out", progress=self.progress,
                          bos_token_id=bos, kv_cache=QuantizedKVCache.factory(fitted.model, policy), chunk=64)
        quality = {"held_out_tokens": len(self.held_out), "eval": result.to_dict(),
                   "predicted_kl": allocation.predicted_kl}
        length = min(cfg.needle_context or cfg.workload.context, fitted.config.max_position_embeddings - 16)
        if cfg.needle_depths and len(self.held_out) >= length:
            self._stage(f"needles at {length} tokens, depths {', '.join(map(str, cfg.needle_depths))}")
            full = reference_lm.model
            exact = run_needles(full, reference_lm.tokenizer, self.held_out, [length], list(cfg.needle_depths),
                                lambda n: ContiguousKVCache(full.config, 1, n, full.dtype), chunk=256)
            mine = run_needles(fitted.model, fitted.tokenizer, self.held_out, [length], list(cfg.needle_depths),
                               QuantizedKVCache.factory(fitted.model, policy), chunk=256)
            quality["needles"] = {"length": length, "full": [r.to_dict() for r in exact],
                                  "fitted": [r.to_dict() for r in mine]}
        return quality

    def _layer_table(self, allocation: Allocation) -> list[dict]:
        config = self.lm.config
        rows = []
        for layer in range(config.num_layers):
            stored = parse_kv_scheme(allocation.kv[layer])
            recent = None if stored.is_native else stored.residual
            row = {"layer": layer, "kv": stored.format_label,
                   "retention": retention_label(stored.sink, stored.window, recent), "kv_spec": allocation.kv[layer]}
            for unit in BLOCK_UNITS:
                row[unit] = allocation.weights[f"layers.{layer}.{unit}"]
            rows.append(row)
        return rows

