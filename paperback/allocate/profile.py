"""A sensitivity profile: measured once per model and text, saved, read by the allocator, `fit` and the report.

It holds, on the profiling part of the text (the leading `span` of it; the
rest is held out for evaluation):

- weights: the KL increase to the full model when one unit alone is
  quantized, for every unit and candidate scheme;
- kv: the KL increase when one layer alone stores its cache in a format,
  read back as served (chunked prefill through the format);
- tokens: per layer, where the attention mass goes (sinks, recent, middle);
- retention: the KL when one layer keeps its first RETENTION_SINK tokens
  exact in each quantized format (with its own recent window, and with a
  32-token one), and (models without sliding-window layers)
  when one layer evicts everything but those sinks and a window of a
  fraction of the long window (StreamingLLM), measured on the long window;
- retrieval: the KL of a planted fact's answer, asked for at the end of a
  long-window prompt, when one layer alone stores its cache in each format
  or evicts at each window (`paperback.allocate.retrieval`): what running
  text misses about the far past;
- additivity: for random mixed assignments, the summed prediction against
  the KL measured with everything applied at once, and their correlation.

Profiling is resumable: measurements go to `<key>.partial.json` in the
cache directory as they are made, and the complete profile is written
(temporary file, then rename) only at the end, so an interrupted run never
leaves a file that looks complete. A complete profile for the same model,
text and settings is reused from the cache.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from paperback.allocate.head_band_profile import USAGE_VERSION, measure_head_bands, random_band_assignments
from paperback.allocate.probe import ReferenceProbe, swapped_weights
from paperback.allocate.profile_data import PROFILE_FORMAT, PROFILE_VERSION, Profile, ProfileConfig
from paperback.allocate.estimate import anchor_factor, check_summary
from paperback.allocate.quantized_units import EffectiveWeight, quantized_blocks, unit_weights
from paperback.allocate.retrieval import RetrievalProbe, retrieval_prompts
from paperback.allocate.stats import pearson, ranks
from paperback.allocate.token_importance import token_importance
from paperback.allocate.units import (HEAD_UNIT, RETENTION_SINK, WeightUnit, parse_kv_candidates,
                                      parse_weight_candidates, weight_units, with_retention)
from paperback.errors import DatasetError, PaperbackError
from paperback.kv.policy import KVPolicy
from paperback.kv.schemes import KVScheme
from paperback.progress import progress as stage_progress
from paperback.quantization.awq import AWQConfig
from paperback.quantization.head_bands import BandedWeight, band_rows, decode_band_of
from paperback.quantization.rtn import quantize_rtn

# Eviction windows measured, as fractions of the long window; the allocator scales them to the context.
EVICT_FRACTIONS = (0.25, 0.5)
# Exact-token options measured for every quantized format: name -> (sink tokens, recent window or 0 for the
# format's own). A short recent window pays for the sinks and more: 96 fewer exact tokens per layer.
EXACT_VARIANTS = {"sinks": (RETENTION_SINK, 0), "sinks_short_recent": (RETENTION_SINK, 32)}
# AWQ's searches at profiling size: a sensitivity needs the scheme's error, not the last 1% of it.
PROFILE_AWQ = AWQConfig(grid=10, clip_grid=10, clip_tokens=256, search_tokens=512)
HEAD_BAND_CHECKS = 8  # random banded heads measured whole against their summed band costs


def model_fingerprint(model) -> str:
    """sha256 of every tensor's name, shape, dtype and bytes: the same weights give the same profile."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(tensor.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def text_fingerprint(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def profile_key(model_fp: str, text_fp: str, config: ProfileConfig) -> str:
    settings = hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True).encode()).hexdigest()
    return f"{model_fp[:16]}-{text_fp[:16]}-{settings[:12]}"


def default_cache_dir() -> Path:
    return Path(os.environ.get("PAPERBACK_CACHE", Path.home() / ".cache" / "paperback")) / "profiles"


@dataclass
class ProfileText:
    """The token ids a profile reads: scored windows and calibration windows, both from the profiled part."""

    windows: torch.Tensor  # (N, T)
    calibration: torch.Tensor  # (M, T)
    long_window: torch.Tensor | None  # (1, L): up to kv_context tokens after the windows, when the text has them
    head_windows: torch.Tensor  # (K, T): the part's first head_tokens (whole windows, as many as it has)
    profiled_tokens: int
    total_tokens: int


def split_text(token_ids: list[int], config: ProfileConfig, bos_token_id: int | None = None,
               max_positions: int | None = None) -> ProfileText:
    """Windows from the leading `span` of the text: the first `windows` in a row, then seeded calibration ones."""
    part = token_ids[: int(len(token_ids) * config.span)]
    need = config.windows * config.window_tokens
    if len(part) < need:
        raise DatasetError(
            f"the text has {len(token_ids)} tokens; profiling reads {config.windows} window(s) of "
            f"{config.window_tokens} from its first {config.span:.0%}, so it needs at least "
            f"{math.ceil(need / config.span)} tokens")
    ids = torch.tensor(part, dtype=torch.long)
    windows = ids[:need].reshape(config.windows, config.window_tokens).clone()
    gen = torch.Generator().manual_seed(config.seed)
    starts = torch.randint(0, len(part) - config.window_tokens + 1, (config.calib_samples,), generator=gen)
    calibration = torch.stack([ids[s:s + config.window_tokens] for s in starts.tolist()])
    head_windows = ids[:min(config.head_tokens, len(part)) // config.window_tokens * config.window_tokens]
    head_windows = head_windows.reshape(-1, config.window_tokens).clone()
    long_window = None
    length = min(config.kv_context, len(part) - need, max_positions or config.kv_context)
    if length >= 2 * config.window_tokens:  # shorter than that says nothing the windows do not
        long_window = ids[need:need + length][None].clone()
    if bos_token_id is not None:
        for batch in (windows, calibration, long_window, head_windows):
            if batch is not None:
                batch[:, 0] = bos_token_id
    return ProfileText(windows, calibration, long_window, head_windows, len(part), len(token_ids))


def _atomic_write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


class Profiler:
    """Measures a profile of `model` on `text`, saving partial results to the cache as it goes."""

    def __init__(self, model, tokenizer, text: str, text_source: str, config: ProfileConfig,
                 cache_dir: Path | None = None, progress: bool = True, model_label: str = "",
                 reuse_shipped: bool = True):
        """reuse_shipped: a profile shipped with paperback for this key counts as finished (False: measure it
        afresh, as benchmarks/bench_profile.py times it)."""
        self.model, self.config, self.progress = model, config, progress
        self.reuse_shipped = reuse_shipped
        self.tokenizer = tokenizer
        self.schemes = parse_weight_candidates(config.weight_schemes)
        self.formats = parse_kv_candidates(config.kv_formats, model.config)
        self.weight_anchor, self.kv_anchor = self._anchors() if config.measure == "anchored" else (None, None)
        self.units = weight_units(model.config, config.include_head)
        bos = tokenizer.bos_token_id if getattr(tokenizer, "adds_bos", False) else None
        self.text = split_text(tokenizer.encode(text, add_special_tokens=False), config, bos,
                               model.config.max_position_embeddings)
        self.model_fp = model_fingerprint(model)
        self.text_fp = text_fingerprint(text)
        self.key = profile_key(self.model_fp, self.text_fp, config)
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self.data = {
            "format": PROFILE_FORMAT, "version": PROFILE_VERSION, "complete": False,
            "model": {"label": model_label, "fingerprint": self.model_fp, "config": model.config.to_dict()},
            "text": {"source": text_source, "sha256": self.text_fp, "tokens": self.text.total_tokens,
                     "profiled_tokens": self.text.profiled_tokens, "span": config.span},
            "config": config.to_dict(),
            "weights": {"units": [{"name": u.name, "layer": u.layer, "params": list(u.params),
                                   "shapes": [list(s) for s in u.shapes]} for u in self.units],
                        "schemes": [s.label for s in self.schemes], "kl": {}},
            "kv": {"formats": [f.label for f in self.formats], "specs": list(config.kv_formats), "kl": {},
                   "long": None},
            "tokens": None, "additivity": None, "retention": None, "retrieval": None, "seconds": {},
        }
        if self.weight_anchor is not None:
            self.data["estimates"] = {"mode": "anchored", "weight_anchor": self.weight_anchor,
                                      "kv_anchor": self.kv_anchor.label, "weights": {}, "kv": {}, "retention": {},
                                      "evict": {}, "check": None}
        self.effective: dict[tuple[str, str], dict[str, EffectiveWeight]] = {}

    def _anchors(self) -> tuple[str, KVScheme]:
        """The weight scheme each unit is measured at and the KV format each layer is (its fewest bits)."""
        labels = [s.label for s in self.schemes]
        if self.config.weight_anchor is not None:
            anchor = parse_weight_candidates([self.config.weight_anchor])[0].label
            if anchor not in labels:
                raise PaperbackError(f"weight anchor {anchor} is not a candidate scheme ({', '.join(labels)})")
        elif "W3a-g128" in labels:
            anchor = "W3a-g128"
        else:
            by_bits = sorted(self.schemes, key=lambda s: s.bits_per_weight(4096, 4096))
            anchor = by_bits[(len(by_bits) - 1) // 2].label
        head_dim = self.model.config.head_dim
        quantized = [f for f in self.formats if not f.is_native] or self.formats
        return anchor, min(quantized, key=lambda f: f.bits_per_element(head_dim))

    @property
    def partial_path(self) -> Path:
        return self.cache_dir / f"{self.key}.partial.json"

    @property
    def complete_path(self) -> Path:
        return self.cache_dir / f"{self.key}.json"

    def _save_partial(self) -> None:
        _atomic_write(self.partial_path, self.data)

    def _resume(self) -> None:
        try:
            saved = json.loads(self.partial_path.read_text())
        except (OSError, json.JSONDecodeError):
            return
        if saved.get("model", {}).get("fingerprint") == self.model_fp and saved.get("config") == self.data["config"]:
            for part in ("weights", "kv"):
                self.data[part]["kl"] = saved.get(part, {}).get("kl", {})
            self.data["weights"]["head_tokens"] = saved.get("weights", {}).get("head_tokens")
            if saved.get("weights", {}).get("head_bands") is not None:
                self.data["weights"]["head_bands"] = saved["weights"]["head_bands"]
            self.data["kv"]["long"] = saved.get("kv", {}).get("long")
            self.data["additivity"] = saved.get("additivity")
            self.data["retention"] = saved.get("retention")
            self.data["retrieval"] = saved.get("retrieval")
            self.data["tokens"] = saved.get("tokens")
            self.data["seconds"] = saved.get("seconds", {})
            if "estimates" in self.data and saved.get("estimates"):
                self.data["estimates"] = saved["estimates"]

    def _finished(self) -> dict | None:
        """A complete profile for this key: from the cache, or shipped with paperback (the bundled models')."""
        shipped = resources.files("paperback.data").joinpath("profiles", f"{self.key}.json")
        for path in (self.complete_path, shipped) if self.reuse_shipped else (self.complete_path,):
            try:
                cached = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            if cached.get("complete") and cached.get("config") == self.data["config"]:
                cached["reused_from_cache"] = str(path)
                return cached
        return None

    def run(self) -> Profile:
        """The finished profile: reused, completed (a part measured since it was written) or measured."""
        return Profile.from_dict(self._measure(), f"profile {self.complete_path}")

    def _measure(self) -> dict:
        finished = self._finished()
        if finished is not None and (self._retention_todo(finished.get("retention")) > 0
                                     or self._retrieval_todo(finished.get("retrieval"))
                                     or self._head_todo(finished["weights"])
                                     or self._head_bands_todo(finished["weights"])):
            # A profile from before (some of) retention or retrieval was measured, or before the head was
            # measured on head_tokens positions: add that part, keep the rest.
            reused = finished.pop("reused_from_cache")
            self.data = finished
            head_probe = None
            if self._head_todo(finished["weights"]):
                head_probe = self._head()
                self._repredict_additivity()
                finished["weights"].pop("head_bands", None)  # priced against the head's old cells
            self._head_bands(head_probe)
            del head_probe
            self._retention()
            self._retrieval()
            _atomic_write(self.complete_path, self.data)
            self.partial_path.unlink(missing_ok=True)
            self.data["reused_from_cache"] = reused
            return self.data
        if finished is not None:
            return finished
        self._resume()
        start = time.perf_counter()
        cfg = self.config
        probe = ReferenceProbe(self.model, self.text.windows, cfg.kv_chunk, cfg.score_stride)
        weight_probe = probe if cfg.weight_tokens == cfg.window_tokens else ReferenceProbe(
            self.model, self.text.windows[:, :cfg.weight_tokens], cfg.kv_chunk, cfg.score_stride)
        self._timed("reference", start)
        self._weights(weight_probe)
        self._kv(probe)
        self._kv_long()
        if self.data["tokens"] is None:
            t0 = time.perf_counter()
            self.data["tokens"] = {"sinks": 4, "recent": 128,
                                   "layers": token_importance(self.model, self.text.windows)}
            self._timed("tokens", t0)
            self._save_partial()
        self._retention(probe)
        self._retrieval()
        self._check_estimates(weight_probe, probe)
        self._additivity(weight_probe, probe)
        self._head_bands()
        self.data["complete"] = True
        _atomic_write(self.complete_path, self.data)
        self.partial_path.unlink(missing_ok=True)
        return self.data

    def _timed(self, part: str, start: float) -> None:
        self.data["seconds"][part] = self.data["seconds"].get(part, 0.0) + time.perf_counter() - start

    # --- weights ------------------------------------------------------------------------------------------
    def _block_units(self, layer: int) -> list[WeightUnit]:
        return [u for u in self.units if u.layer == layer]

    def _weights(self, probe: ReferenceProbe) -> None:
        kl = self.data["weights"]["kl"]
        todo = sum(1 for u in self.units for s in self.schemes if s.label not in kl.get(u.name, {}))
        if todo == 0 and self.data["additivity"] is not None:
            return  # nothing left that needs the quantized weights
        bar = stage_progress(total=todo, desc="profile weights", unit="unit", enabled=self.progress)
        t0 = time.perf_counter()
        blocks = quantized_blocks(self.model, self.text.calibration, lambda idx: self.schemes, self.config.method,
                                  PROFILE_AWQ)
        with torch.inference_mode():
            for idx, effective in blocks:
                for label, weights in effective.items():
                    self.effective[(f"layers.{idx}", label)] = weights
                for unit in self._block_units(idx):
                    todo = [s.label for s in self.schemes if s.label not in kl.get(unit.name, {})]
                    if todo:
                        kl[unit.name] = self._unit_cells(unit, probe, kl.get(unit.name, {}))
                        bar.update(len(todo))
                self._timed("weights", t0)
                self._save_partial()
                t0 = time.perf_counter()
        head_probe = self._head(bar)
        bar.close()
        self._head_bands(head_probe)

    def _head_todo(self, weights: dict) -> bool:
        """Whether the head's cells are missing or were measured on other positions than head_tokens now."""
        return (any(u.name == HEAD_UNIT for u in self.units)
                and weights.get("head_tokens") != self.text.head_windows.numel())

    @torch.inference_mode()
    def _head(self, bar=None) -> ReferenceProbe | None:
        """The output head under each scheme (RTN, as checkpoints store it), with the whole model on the
        head windows: when tied, the embedding it shares changes every block's input too. Returns the head
        windows' reference when it was built (the bands reuse it), else None."""
        head = [u for u in self.units if u.name == HEAD_UNIT]
        if not head:
            return None
        t0 = time.perf_counter()
        weights = self.data["weights"]
        if self._head_todo(weights):  # cells from other positions (or none): measure them all afresh
            weights["kl"].pop(HEAD_UNIT, None)
            weights["head_tokens"] = self.text.head_windows.numel()
        kl = weights["kl"].setdefault(HEAD_UNIT, {})
        param = head[0].params[0]
        weight = dict(self.model.named_parameters())[param]
        probe = None
        for scheme in self.schemes:
            q = quantize_rtn(weight, scheme)
            self.effective[(HEAD_UNIT, scheme.label)] = {param: EffectiveWeight(q)}
            if scheme.label in kl:
                continue
            if probe is None:
                probe = ReferenceProbe(self.model, self.text.head_windows, self.config.kv_chunk)
            with swapped_weights(self.model, {param: q.dequantize()}):
                kl[scheme.label] = probe.kl_full()
            if bar is not None:
                bar.update()
            self._save_partial()
        self._timed("head", t0)
        return probe

    def _head_bands_todo(self, weights: dict) -> bool:
        """Whether a tied head's band cells (or their check) are missing."""
        bands = weights.get("head_bands")
        return (self.model.lm_head is None and any(u.name == HEAD_UNIT for u in self.units)
                and (bands is None or bands.get("check") is None or bands.get("usage") != USAGE_VERSION))

    def _start_id(self) -> int:
        """The token the model's own text starts from: BOS where the model reads one, else its end of text."""
        if getattr(self.tokenizer, "adds_bos", False) and self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        eos = sorted(getattr(self.tokenizer, "eos_token_ids", None) or ())
        return eos[0] if eos else int(self.text.head_windows[0, 0])

    def _head_bands(self, probe: ReferenceProbe | None = None) -> None:
        """Cells of the tied head's bands of vocabulary rows (allocate.head_band_profile), then the check:
        random banded heads measured whole against the sum of their bands' cells. `probe`: the head
        windows' reference, when the head's measurement already built it."""
        weights = self.data["weights"]
        if not self._head_bands_todo(weights):
            return
        t0 = time.perf_counter()
        param = next(u for u in self.units if u.name == HEAD_UNIT).params[0]
        probe = probe or ReferenceProbe(self.model, self.text.head_windows, self.config.kv_chunk)
        if (weights.get("head_bands") or {}).get("usage") != USAGE_VERSION:  # none, or ranked another way
            weights["head_bands"] = measure_head_bands(self.model, param, probe, self.schemes,
                                                       weights["kl"][HEAD_UNIT], self._start_id(),
                                                       self.config.seed, self.progress)
            self._timed("head bands", t0)
            self._save_partial()
            t0 = time.perf_counter()
        bands = weights["head_bands"]
        weight = dict(self.model.named_parameters())[param].detach()
        band_of = decode_band_of(bands["band_of"], weight.shape[0])
        rows = band_rows(band_of)
        by_label = {s.label: s for s in self.schemes}
        samples = []
        assignments = random_band_assignments(self.schemes, len(rows), HEAD_BAND_CHECKS, self.config.seed)
        for picks in stage_progress(assignments, desc="profile head band check", unit="sample", enabled=self.progress):
            banded = BandedWeight(band_of, [quantize_rtn(weight[r], by_label[label]) for r, label in zip(rows, picks)])
            with swapped_weights(self.model, {param: banded.dequantize()}):
                measured = probe.kl_full()
            predicted = sum(bands["kl"][f"band{b}"][label] for b, label in enumerate(picks))
            samples.append({"kind": "head bands", "predicted": predicted, "measured": measured,
                            "weights": {f"band{b}": label for b, label in enumerate(picks)}, "kv": {}})
        bands["check"] = additivity_summary(samples)
        self._timed("head bands", t0)
        self._save_partial()

    def _unit_cells(self, unit: WeightUnit, probe: ReferenceProbe, done: dict[str, float]) -> dict[str, float]:
        """{scheme label: KL} of a block unit: each measured, or anchored (one measured, the rest estimated)."""
        labels = [s.label for s in self.schemes]

        def measure(label: str) -> float:
            with swapped_weights(self.model, self.unit_weights(unit, label)):
                return probe.kl_from(unit.layer)

        def error(label: str) -> float:
            with swapped_weights(self.model, self.unit_weights(unit, label)):
                return probe.block_error(unit.layer)

        if self.weight_anchor is None:
            return {label: done[label] if label in done else measure(label) for label in labels}
        cells, record = self._anchored(labels, self.weight_anchor, measure, error)
        self.data["estimates"]["weights"][unit.name] = record
        return cells

    @staticmethod
    def _anchored(labels: list[str], anchor: str, measure, error, factor: float | None = None
                  ) -> tuple[dict[str, float], dict]:
        """Cells for `labels`: the anchor's KL measured (unless `factor` is given), every block error measured,
        the others estimated as factor x error; measured instead where the anchor is at the noise floor."""
        errors = {label: error(label) for label in labels}
        cells = {}
        if factor is None and anchor in labels:
            cells[anchor] = measure(anchor)
            factor = anchor_factor(cells[anchor], errors[anchor])
        for label in labels:
            if label not in cells:
                cells[label] = factor * errors[label] if factor is not None else measure(label)
        return {label: cells[label] for label in labels}, {"factor": factor, "errors": errors,
                                                           "estimated": factor is not None}

    def unit_weights(self, unit: WeightUnit, label: str) -> dict[str, torch.Tensor]:
        """{param name: effective weight} of a unit under the scheme labelled `label`."""
        return unit_weights(self.effective, unit, label)

    # --- KV cache -----------------------------------------------------------------------------------------
    def _kv(self, probe: ReferenceProbe) -> None:
        kl = self.data["kv"]["kl"]
        layers = range(self.model.config.num_layers)
        todo = sum(1 for i in layers for f in self.formats if f.label not in kl.get(str(i), {}))
        bar = stage_progress(total=todo, desc="profile KV", unit="layer", enabled=self.progress)
        schemes = {f.label: f for f in self.formats}
        for i in layers:
            t0 = time.perf_counter()
            todo = [f.label for f in self.formats if f.label not in kl.get(str(i), {})]
            if not todo:
                continue
            if self.kv_anchor is None:
                for label in todo:
                    kl.setdefault(str(i), {})[label] = probe.kl_with_kv(i, schemes[label])
            else:
                kl[str(i)], self.data["estimates"]["kv"][str(i)] = self._anchored(
                    list(schemes), self.kv_anchor.label, lambda label: probe.kl_with_kv(i, schemes[label]),
                    lambda label: probe.error_with_kv(i, schemes[label]))
            bar.update(len(todo))
            self._timed("kv", t0)
            self._save_partial()
        bar.close()

    def _kv_long(self) -> None:
        """Every format in every layer on the long window; the scale from summed short-window costs to it."""
        if self.data["kv"].get("long") is not None or self.text.long_window is None:
            return
        t0 = time.perf_counter()
        probe = ReferenceProbe(self.model, self.text.long_window, self.config.kv_chunk, 4 * self.config.score_stride)
        kl, scale = {}, {}
        short = self.data["kv"]["kl"]
        for scheme in stage_progress(self.formats, desc="profile KV, long window", unit="format",
                                     enabled=self.progress):
            kl[scheme.label] = probe.kl_full(KVPolicy(scheme))
            summed = sum(short[str(i)][scheme.label] for i in range(self.model.config.num_layers))
            # A format whose error is at the noise floor on both (fp16) keeps its short-window costs.
            scale[scheme.label] = kl[scheme.label] / summed if summed > 1e-6 and kl[scheme.label] > 0 else 1.0
        self.data["kv"]["long"] = {"tokens": int(self.text.long_window.shape[1]), "kl": kl, "scale": scale}
        self._timed("kv", t0)
        self._save_partial()

    # --- retention ------------------------------------------------------------------------------------------
    def _retention_todo(self, retention: dict | None) -> int:
        """Cells of a profile's retention part still to measure (0: complete)."""
        r = retention or {}
        config = self.model.config
        layers = range(config.num_layers)
        quantized = [f.label for f in self.formats if not f.is_native]
        todo = sum(1 for name in EXACT_VARIANTS for i in layers for label in quantized
                   if label not in r.get(name, {}).get(str(i), {}))
        return todo + sum(1 for i in layers for w in self._evict_windows()
                          if str(w) not in r.get("evict", {}).get(str(i), {}))

    def _evict_windows(self) -> list[int]:
        config, long_window = self.model.config, self.text.long_window
        if long_window is None or any(config.window_of(i) is not None for i in range(config.num_layers)):
            return []  # sliding-window layers never evict in the engine, so neither does the pool
        return [int(f * long_window.shape[1]) for f in EVICT_FRACTIONS]

    def _retention(self, probe: ReferenceProbe | None = None) -> None:
        """Per layer and quantized format, each EXACT_VARIANTS option (short windows, like `kv`); and, where
        every layer may evict, fp16 with sinks and a window of each EVICT_FRACTIONS of the long window."""
        todo = self._retention_todo(self.data.get("retention"))
        if todo == 0:
            return
        t0 = time.perf_counter()
        cfg, config = self.config, self.model.config
        done = self.data.get("retention") or {}
        windows = self._evict_windows()
        long_window = self.text.long_window
        r = self.data["retention"] = {
            "sink": RETENTION_SINK, "variants": {name: list(v) for name, v in EXACT_VARIANTS.items()},
            **{name: done.get(name, {}) for name in EXACT_VARIANTS}, "windows": windows,
            "evict": done.get("evict", {}), "long_tokens": int(long_window.shape[1]) if long_window is not None
            else None, "complete": False}
        bar = stage_progress(total=todo, desc="profile retention", unit="cell", enabled=self.progress)
        variants = self._retention_variants()
        layers = range(config.num_layers)
        estimates = self.data.get("estimates")
        for i in layers:
            for name in EXACT_VARIANTS:
                todo = [label for label in variants[name] if label not in r[name].get(str(i), {})]
                if not todo:
                    continue
                if probe is None:
                    probe = ReferenceProbe(self.model, self.text.windows, cfg.kv_chunk, cfg.score_stride)
                if estimates is None:
                    for label in todo:
                        r[name].setdefault(str(i), {})[label] = probe.kl_with_kv(i, variants[name][label])
                else:  # the layer's KV factor, from its anchor format, scales these block errors too
                    r[name][str(i)], record = self._anchored(
                        list(variants[name]), "", lambda label: probe.kl_with_kv(i, variants[name][label]),
                        lambda label: probe.error_with_kv(i, variants[name][label]),
                        factor=estimates["kv"][str(i)]["factor"])
                    estimates["retention"].setdefault(name, {})[str(i)] = record
                bar.update(len(todo))
            self._save_partial()
        if windows:
            long = None
            evictions = self._evictions()
            for i in layers:
                todo = [w for w in evictions if w not in r["evict"].get(str(i), {})]
                if not todo:
                    continue
                if long is None:
                    long = ReferenceProbe(self.model, long_window, cfg.kv_chunk, 4 * cfg.score_stride)
                if estimates is None:
                    for w in todo:
                        r["evict"].setdefault(str(i), {})[w] = long.kl_with_kv(i, evictions[w])
                else:  # the shortest window (the largest change) is the anchor
                    r["evict"][str(i)], estimates["evict"][str(i)] = self._anchored(
                        list(evictions), str(min(windows)), lambda w: long.kl_with_kv(i, evictions[w]),
                        lambda w: long.error_with_kv(i, evictions[w]))
                bar.update(len(todo))
                self._save_partial()
        bar.close()
        r["complete"] = True
        self._timed("retention", t0)
        self._save_partial()

    def _retention_variants(self) -> dict[str, dict[str, KVScheme]]:
        """{variant name: {quantized format label: that format with the variant's exact tokens}}."""
        config = self.model.config
        quantized = [(spec, f) for spec, f in zip(self.config.kv_formats, self.formats) if not f.is_native]
        return {name: {f.label: parse_kv_candidates([with_retention(spec, sink, recent=recent)], config)[0]
                       for spec, f in quantized}
                for name, (sink, recent) in EXACT_VARIANTS.items()}

    def _evictions(self) -> dict[str, KVScheme]:
        """{window as a string: fp16 with the exact sinks and that window}."""
        return {str(w): parse_kv_candidates([with_retention("fp16", RETENTION_SINK, w)], self.model.config)[0]
                for w in self._evict_windows()}

    # --- retrieval --------------------------------------------------------------------------------------------
    def _retrieval_todo(self, retrieval: dict | None) -> bool:
        return self.text.long_window is not None and not (retrieval or {}).get("complete")

    def _retrieval(self) -> None:
        """Per layer, the answer's KL with the layer's cache in each format, and evicting at each window (fp16
        with the exact sinks), on prompts built from the long window (`paperback.allocate.retrieval`)."""
        if not self._retrieval_todo(self.data.get("retrieval")):
            return
        t0 = time.perf_counter()
        config = self.model.config
        long_window = self.text.long_window
        bos = long_window[0, 0].item() if getattr(self.tokenizer, "adds_bos", False) else None
        haystack = long_window[0, 1:].tolist() if bos is not None else long_window[0].tolist()
        prompts = retrieval_prompts(self.tokenizer, haystack, long_window.shape[1], bos)
        r = self.data.get("retrieval") or {}
        r = self.data["retrieval"] = {"tokens": int(long_window.shape[1]), "depths": list(prompts.depths),
                                      "answer_tokens": prompts.answer_tokens, "formats": r.get("formats", {}),
                                      "evict": r.get("evict", {}), "complete": False}
        evictions = self._evictions()
        probe = None
        for i in stage_progress(range(config.num_layers), desc="profile retrieval", unit="layer",
                                enabled=self.progress):
            formats = r["formats"].setdefault(str(i), {})
            evict = r["evict"].setdefault(str(i), {})
            todo = [f for f in self.formats if f.label not in formats] + [w for w in evictions if w not in evict]
            if not todo:
                continue
            probe = probe or RetrievalProbe(self.model, prompts, self.config.kv_chunk)
            for f in self.formats:
                if f.label not in formats:
                    formats[f.label] = probe.kl_with_kv(i, f)
            for w, scheme in evictions.items():
                if w not in evict:
                    evict[w] = probe.kl_with_kv(i, scheme)
            self._save_partial()
        r["complete"] = True
        self._timed("retrieval", t0)
        self._save_partial()

    # --- the estimates' check -------------------------------------------------------------------------------
    def _check_estimates(self, weight_probe: ReferenceProbe, probe: ReferenceProbe) -> None:
        """Measure a seeded sample of the estimated cells, an equal share from each kind, against their estimate."""
        estimates = self.data.get("estimates")
        if estimates is None or estimates.get("check") is not None or self.config.check_samples == 0:
            return
        t0 = time.perf_counter()
        units = {u.name: u for u in self.units}
        formats = {f.label: f for f in self.formats}  # native formats sit at the noise floor: not checked
        variants, evictions = self._retention_variants(), self._evictions()
        evict_anchor = str(min(map(int, evictions))) if evictions else None
        r = self.data["retention"]
        long = None

        def measure_evict(layer, w):
            nonlocal long
            if long is None:
                long = ReferenceProbe(self.model, self.text.long_window, self.config.kv_chunk,
                                      4 * self.config.score_stride)
            return long.kl_with_kv(layer, evictions[w])

        def weight_cell(unit, label):
            with swapped_weights(self.model, self.unit_weights(units[unit], label)):
                return weight_probe.kl_from(units[unit].layer)

        kinds = {
            "weights": [((u, label), self.data["weights"]["kl"][u][label], weight_cell)
                        for u, rec in estimates["weights"].items() if rec["estimated"]
                        for label in rec["errors"] if label != estimates["weight_anchor"]],
            "kv": [((int(i), label), self.data["kv"]["kl"][i][label],
                    lambda i, label: probe.kl_with_kv(i, formats[label]))
                   for i, rec in estimates["kv"].items() if rec["estimated"]
                   for label in rec["errors"] if label != estimates["kv_anchor"] and not formats[label].is_native],
            "retention": [((name, int(i), label), r[name][i][label],
                           lambda name, i, label: probe.kl_with_kv(i, variants[name][label]))
                          for name, layers in estimates["retention"].items() for i, rec in layers.items()
                          if rec["estimated"] for label in rec["errors"]],
            "evict": [((int(i), w), r["evict"][i][w], measure_evict)
                      for i, rec in estimates["evict"].items() if rec["estimated"]
                      for w in rec["errors"] if w != evict_anchor],
        }
        kinds = {kind: cells for kind, cells in kinds.items() if cells}
        rng = random.Random(self.config.seed + 1)
        share = math.ceil(self.config.check_samples / max(1, len(kinds)))
        points = []
        for kind, cells in stage_progress(kinds.items(), desc="profile estimate check", unit="kind",
                                          enabled=self.progress):
            for args, value, measure in rng.sample(cells, min(share, len(cells))):
                points.append({"kind": kind, "cell": list(args), "estimated": value, "measured": measure(*args)})
        estimates["check"] = check_summary(points)
        self._timed("check", t0)
        self._save_partial()

    # --- additivity -----------------------------------------------------------------------------------------
    def _additivity(self, weight_probe: ReferenceProbe, probe: ReferenceProbe) -> None:
        """Weights-only assignments are measured on the tokens the weight units were, the others on whole
        windows (the weight part of a joint prediction comes from the shorter windows)."""
        n = self.config.additivity_samples
        if n == 0 or self.data["additivity"] is not None:
            return
        t0 = time.perf_counter()
        rng = random.Random(self.config.seed)
        weight_kl, kv_kl = self.data["weights"]["kl"], self.data["kv"]["kl"]
        # Options ordered from most to least precise, so a "level" picks a neighbourhood of them.
        schemes = sorted(self.schemes, key=lambda s: -s.bits_per_weight(4096, 4096))
        formats = sorted(self.formats, key=lambda f: -f.bits_per_element(self.model.config.head_dim))
        samples = []
        kinds = ("weights", "kv", "joint")
        for k in stage_progress(range(n), desc="profile additivity", unit="sample", enabled=self.progress):
            kind = kinds[k % 3]
            predicted = 0.0
            swap: dict[str, torch.Tensor] = {}
            policy = None
            choice_w, choice_kv = {}, {}
            if kind in ("weights", "joint"):
                level = rng.random()
                for unit in self.units:
                    label = schemes[_pick(rng, level, len(schemes))].label
                    choice_w[unit.name] = label
                    predicted += weight_kl[unit.name][label]
                    swap.update(self.unit_weights(unit, label))
            if kind in ("kv", "joint"):
                level = rng.random()
                overrides = {}
                for i in range(self.model.config.num_layers):
                    scheme = formats[_pick(rng, level, len(formats))]
                    overrides[i] = scheme
                    choice_kv[str(i)] = scheme.label
                    predicted += kv_kl[str(i)][scheme.label]
                policy = KVPolicy(formats[0], overrides)
            with swapped_weights(self.model, swap):
                measured = (weight_probe if kind == "weights" else probe).kl_full(policy)
            samples.append({"kind": kind, "predicted": predicted, "measured": measured,
                            "weights": choice_w, "kv": choice_kv})
        self.data["additivity"] = additivity_summary(samples)
        self._timed("additivity", t0)
        self._save_partial()


    def _repredict_additivity(self) -> None:
        """Each additivity sample's prediction summed again from the cells as they are now (after the head
        was measured again); the measured KL does not depend on them."""
        additivity = self.data.get("additivity")
        if not additivity:
            return
        weight_kl, kv_kl = self.data["weights"]["kl"], self.data["kv"]["kl"]
        for point in additivity["points"]:
            point["predicted"] = (sum(weight_kl[unit][label] for unit, label in point["weights"].items())
                                  + sum(kv_kl[layer][label] for layer, label in point["kv"].items()))
        self.data["additivity"] = additivity_summary(additivity["points"])


def _pick(rng: random.Random, level: float, count: int) -> int:
    """An option index near `level` (0 = most precise, 1 = least), spread by about one option."""
    return min(count - 1, max(0, round(level * (count - 1) + rng.gauss(0, 1))))


def additivity_summary(samples: list[dict]) -> dict:
    """Correlation of predicted (summed) against measured KL, overall and per kind of assignment."""
    def stats(group: list[dict]) -> dict:
        pred = [s["predicted"] for s in group]
        meas = [s["measured"] for s in group]
        logs = [(math.log(p), math.log(m)) for p, m in zip(pred, meas) if p > 0 and m > 0]
        ratios = sorted(m / p for p, m in zip(pred, meas) if p > 0)
        return {"samples": len(group), "pearson": pearson(pred, meas),
                "spearman": pearson(ranks(pred), ranks(meas)),
                "log_pearson": pearson([a for a, _ in logs], [b for _, b in logs]),
                "median_measured_over_predicted": ratios[len(ratios) // 2] if ratios else float("nan")}

    by_kind = {kind: stats([s for s in samples if s["kind"] == kind])
               for kind in dict.fromkeys(s["kind"] for s in samples)}
    return {**stats(samples), "by_kind": by_kind, "points": samples}


def load_profile(path: Path, model=None) -> Profile:
    """A complete profile from `path`, checked for shape and (given the model) for being this model's."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise PaperbackError(f"profile {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PaperbackError(f"profile {path} is unreadable or not JSON ({exc})") from None
    profile = Profile.from_dict(data, f"profile {path}")
    if model is not None and profile.model.fingerprint != model_fingerprint(model):
        raise PaperbackError(f"profile {path} was measured on another model "
                             f"({profile.model.label or 'unknown'}); profile this one first")
    return profile
