"""A finished profile as paperback reads it: typed parts over the JSON `paperback profile` writes.

The profiler measures into the JSON form (cell by cell, resumable; `paperback.allocate.profile`). Everything
that reads a finished profile (the allocator, `fit`, its report, `profile`'s summary) reads a `Profile`,
built and checked once by `Profile.from_dict`; `to_dict` gives back the JSON form it was built from.

A table of measured KL is `Costs`: {unit name, or layer index as a string: {option label: KL}}, keyed as the
JSON keys it.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field, fields

from paperback.allocate.estimate import MEASURE_MODES
from paperback.allocate.units import DEFAULT_KV_FORMATS, DEFAULT_WEIGHT_SCHEMES, WeightUnit
from paperback.errors import PaperbackError
from paperback.quantization.model_pass import METHODS

PROFILE_FORMAT = "paperback-profile"
PROFILE_VERSION = 1
HEAD_TOKENS = 2048

Costs = dict[str, dict[str, float]]


class MalformedProfile(PaperbackError):
    pass


@dataclass(frozen=True)
class ProfileConfig:
    """What a profile measures and how; recorded in it, and part of its cache key."""
    method: str = "awq"
    weight_schemes: tuple[str, ...] = DEFAULT_WEIGHT_SCHEMES
    kv_formats: tuple[str, ...] = DEFAULT_KV_FORMATS
    windows: int = 1  # profiling windows the KL is measured on
    window_tokens: int = 512  # KV formats and token importance read whole windows
    weight_tokens: int = 256  # weight units are measured on each window's first weight_tokens
    score_stride: int = 2  # KL over every score_stride-th position (all still run as context)
    calib_samples: int = 2  # windows AWQ / GPTQ calibrate on, drawn from the same profiling part
    span: float = 0.5  # leading fraction of the text that may be profiled; the rest is held out
    kv_chunk: int = 64  # tokens per prefill chunk when a cache is read back
    # One longer window on which each format is measured in every layer at once: per-layer costs from the
    # short windows are scaled so their sum matches it, since a format's error grows with the tokens it holds.
    kv_context: int = 2048
    additivity_samples: int = 24
    seed: int = 0
    include_head: bool = True
    # The output head is the one unit whose cost depends on which tokens appear, so the few positions the
    # block units are scored on price it poorly (Gemma 3 W4 g64: 0.0093 there, 0.018 on eight 512-token
    # windows); it is measured on this many positions of the profiled part, every one scored.
    head_tokens: int = HEAD_TOKENS
    # "anchored": each weight unit's KL is measured at one anchor scheme and each layer's KV cache at its
    # fewest-bits format; the other cells are that factor times their own block error (allocate.estimate),
    # and check_samples of them are measured as well. "all": every cell measured.
    measure: str = "anchored"
    weight_anchor: str | None = None  # None: W3a-g128 when a candidate, else the middle candidate by bits
    check_samples: int = 16

    def __post_init__(self):
        if self.method not in METHODS:
            raise PaperbackError(f"unknown method '{self.method}' (choose from {', '.join(METHODS)})")
        if not 16 <= self.weight_tokens <= self.window_tokens:
            raise PaperbackError("weight tokens must be at least 16 and at most the window")
        if self.windows < 1 or self.calib_samples < 1 or self.score_stride < 1:
            raise PaperbackError("profiling needs at least 1 window of at least 16 tokens and 1 calibration sample")
        if not 0 < self.span <= 1:
            raise PaperbackError(f"profiling span must be in (0, 1], got {self.span}")
        if self.additivity_samples < 0 or self.kv_chunk < 1 or self.check_samples < 0:
            raise PaperbackError("additivity and check samples must be >= 0 and the KV chunk >= 1")
        if self.head_tokens < self.window_tokens:
            raise PaperbackError(f"head tokens must be at least one window ({self.window_tokens})")
        if self.measure not in MEASURE_MODES:
            raise PaperbackError(f"unknown measure mode '{self.measure}' (choose from {', '.join(MEASURE_MODES)})")

    @classmethod
    def from_dict(cls, data: dict) -> "ProfileConfig":
        """The config a profile records (`to_dict`'s inverse), keys left out at their defaults."""
        known = {f.name for f in fields(cls)}
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in known}
        values.setdefault("measure", "all")  # to_dict leaves the measure settings out of measure="all" profiles
        return cls(**values)

    def to_dict(self) -> dict:
        data = {**asdict(self), "weight_schemes": list(self.weight_schemes), "kv_formats": list(self.kv_formats)}
        if self.measure == "all":  # the settings of profiles measured before estimates existed: still reused
            for key in ("measure", "weight_anchor", "check_samples"):
                del data[key]
        if self.head_tokens == HEAD_TOKENS:  # profiles from before: still reused, their head measured again
            del data["head_tokens"]
        return data


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _costs(table, name: str) -> Costs:
    """A table of finite KL values ({key: {option: KL}})."""
    if not isinstance(table, dict) or not all(isinstance(row, dict) for row in table.values()):
        raise MalformedProfile(f"{name} is not a table of KL values")
    if not all(_finite(v) for row in table.values() for v in row.values()):
        raise MalformedProfile(f"a sensitivity in {name} is not a finite number")
    return table


@dataclass(frozen=True)
class ProfiledModel:
    label: str
    fingerprint: str
    config: dict  # the measured model's ModelConfig.to_dict()

    @property
    def tied(self) -> bool:
        return bool(self.config.get("tie_word_embeddings"))


@dataclass(frozen=True)
class ProfiledText:
    source: str
    sha256: str
    tokens: int
    profiled_tokens: int  # the leading `span` of the text: what the profile read
    span: float


@dataclass(frozen=True)
class Agreement:
    """How well summed per-unit costs predicted whole-model measurements, over `samples` assignments."""
    samples: int
    pearson: float
    spearman: float
    log_pearson: float
    median_measured_over_predicted: float

    @classmethod
    def from_dict(cls, data: dict) -> Agreement:
        return cls(data["samples"], data["pearson"], data["spearman"], data["log_pearson"],
                   data["median_measured_over_predicted"])


@dataclass(frozen=True)
class Assignment:
    """A mixed assignment measured whole: its summed prediction and the measured KL."""
    kind: str  # "weights", "kv", "joint" or "head bands"
    predicted: float
    measured: float
    weights: dict[str, str]  # unit (or band) -> scheme label
    kv: dict[str, str]  # layer -> format label


@dataclass(frozen=True)
class AdditivityCheck:
    overall: Agreement
    by_kind: dict[str, Agreement]
    points: tuple[Assignment, ...]

    @classmethod
    def from_dict(cls, data: dict) -> AdditivityCheck:
        return cls(Agreement.from_dict(data), {k: Agreement.from_dict(v) for k, v in data["by_kind"].items()},
                   tuple(Assignment(p["kind"], p["predicted"], p["measured"], p["weights"], p["kv"])
                         for p in data["points"]))

    @property
    def ratio_range(self) -> tuple[float, float] | None:
        """The lowest and highest measured / predicted ratio seen (None without a positive pair)."""
        ratios = [p.measured / p.predicted for p in self.points if p.predicted > 0 and p.measured > 0]
        return (min(ratios), max(ratios)) if ratios else None


@dataclass(frozen=True)
class HeadBandCosts:
    """A tied head's bands of vocabulary rows (quantization.head_bands) and each band's cost per scheme."""
    band_of: str  # the band layout, encoded (quantization.head_bands.encode_band_of)
    sizes: tuple[int, ...]
    kl: Costs  # {"band<b>": {scheme: KL}}
    check: AdditivityCheck | None  # random banded heads measured whole
    usage: str | None  # how tokens were ranked by use (head_band_profile.USAGE_VERSION)


@dataclass(frozen=True)
class WeightCosts:
    units: tuple[WeightUnit, ...]
    schemes: tuple[str, ...]
    kl: Costs  # {unit: {scheme: KL}}
    head_tokens: int | None  # positions the head was measured on
    head_bands: HeadBandCosts | None


@dataclass(frozen=True)
class LongWindow:
    """Every format in every layer at once on one long window: the scale from summed short-window costs."""
    tokens: int
    kl: dict[str, float]
    scale: dict[str, float]


@dataclass(frozen=True)
class KVCosts:
    formats: tuple[str, ...]  # format labels, in the order of `specs`
    specs: tuple[str, ...]  # as --kv-cache-dtype names them
    kl: Costs  # {layer: {format label: KL}}
    long: LongWindow | None

    def scale(self, label: str) -> float:
        """What a short-window cost of this format is multiplied by to stand for the long window."""
        return self.long.scale.get(label, 1.0) if self.long is not None else 1.0


@dataclass(frozen=True)
class RetentionCosts:
    sink: int  # exact leading tokens of the sink variants
    variants: dict[str, tuple[int, int]]  # name -> (sinks, recent window or 0 for the format's own)
    tables: dict[str, Costs]  # variant name -> {layer: {format label: KL}}
    windows: tuple[int, ...]  # eviction windows measured, in tokens of the long window
    evict: Costs  # {layer: {window: KL}}
    long_tokens: int | None
    complete: bool


@dataclass(frozen=True)
class RetrievalCosts:
    tokens: int
    depths: tuple[float, ...]
    answer_tokens: int
    formats: Costs  # {layer: {format label: answer KL}}
    evict: Costs  # {layer: {window: answer KL}}
    complete: bool


@dataclass(frozen=True)
class EstimateCheck:
    """Estimated cells measured as well: how far the estimates were."""
    samples: int
    positive: int  # samples with both values above zero (the ratios below are over these)
    median_abs_log_ratio: float | None
    p90_abs_log_ratio: float | None
    spearman: float
    by_kind: dict[str, tuple[int, float | None]]  # kind -> (samples, median |log ratio|)


@dataclass(frozen=True)
class Estimates:
    weight_anchor: str
    kv_anchor: str
    check: EstimateCheck | None


@dataclass(frozen=True)
class Profile:
    model: ProfiledModel
    text: ProfiledText
    config: ProfileConfig
    weights: WeightCosts
    kv: KVCosts
    tokens: dict | None  # where each layer's attention goes (allocate.token_importance), reported as measured
    retention: RetentionCosts | None
    retrieval: RetrievalCosts | None
    additivity: AdditivityCheck | None
    estimates: Estimates | None  # None: every cell measured
    seconds: dict[str, float]
    reused_from: str | None = None  # the cached or shipped file a finished profile was reused from
    _json: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, data: dict, where: str = "profile") -> Profile:
        """A complete profile from its JSON form, checked for shape; a bad one is refused naming `where`."""
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
            raise PaperbackError(f"{where} is not a paperback profile")
        if data.get("version") != PROFILE_VERSION:
            raise PaperbackError(f"{where} has version {data.get('version')!r}; this paperback reads "
                                 f"{PROFILE_VERSION}")
        if not data.get("complete"):
            raise PaperbackError(f"{where} is incomplete (an interrupted run); run `paperback profile` again "
                                 "to resume it")
        try:
            return cls._parse(data)
        except (MalformedProfile, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PaperbackError(f"{where} is malformed ({exc})") from None

    @classmethod
    def _parse(cls, data: dict) -> Profile:
        model, text, w, kv = data["model"], data["text"], data["weights"], data["kv"]
        units = tuple(WeightUnit(u["name"], u["layer"], tuple(u["params"]), tuple(tuple(s) for s in u["shapes"]))
                      for u in w["units"])
        schemes = tuple(w["schemes"])
        kl = _costs(w["kl"], "weights.kl")
        if set(kl) != {u.name for u in units}:
            raise MalformedProfile("weights.kl does not cover every unit")
        bands = w.get("head_bands")
        if bands is not None:
            if set(bands["kl"]) != {f"band{b}" for b in range(len(bands["sizes"]))} or \
                    not isinstance(bands["band_of"], str):
                raise MalformedProfile("weights.head_bands does not cover every band")
            if not all(set(row) == set(schemes) and all(_finite(v) for v in row.values())
                       for row in bands["kl"].values()):
                raise MalformedProfile("a head band's sensitivities do not cover the schemes as finite numbers")
            bands = HeadBandCosts(bands["band_of"], tuple(bands["sizes"]), bands["kl"],
                                  AdditivityCheck.from_dict(bands["check"]) if bands.get("check") else None,
                                  bands.get("usage"))
        long = kv.get("long")
        r = data.get("retention")
        retention = None if r is None else RetentionCosts(
            r["sink"], {name: tuple(v) for name, v in r["variants"].items()},
            {name: _costs(r.get(name, {}), f"retention.{name}") for name in r["variants"]},
            tuple(r.get("windows") or ()), _costs(r.get("evict", {}), "retention.evict"), r.get("long_tokens"),
            bool(r.get("complete")))
        found = data.get("retrieval")
        retrieval = None if found is None else RetrievalCosts(
            found["tokens"], tuple(found["depths"]), found["answer_tokens"],
            _costs(found.get("formats", {}), "retrieval.formats"), _costs(found.get("evict", {}), "retrieval.evict"),
            bool(found.get("complete")))
        est = data.get("estimates")
        estimates = None
        if est:
            check = est.get("check")
            estimates = Estimates(est["weight_anchor"], est["kv_anchor"], None if not check else EstimateCheck(
                check["samples"], check["positive"], check["median_abs_log_ratio"], check["p90_abs_log_ratio"],
                check["spearman"], {k: (v["samples"], v["median_abs_log_ratio"]) for k, v in check["by_kind"].items()}))
        return cls(
            ProfiledModel(model.get("label") or "", model["fingerprint"], model["config"]),
            ProfiledText(text["source"], text["sha256"], text["tokens"], text["profiled_tokens"], text["span"]),
            ProfileConfig.from_dict(data["config"]),
            WeightCosts(units, schemes, kl, w.get("head_tokens"), bands),
            KVCosts(tuple(kv["formats"]), tuple(kv["specs"]), _costs(kv["kl"], "kv.kl"),
                    None if long is None else LongWindow(long["tokens"], long["kl"], long["scale"])),
            data.get("tokens"), retention, retrieval,
            AdditivityCheck.from_dict(data["additivity"]) if data.get("additivity") else None,
            estimates, dict(data.get("seconds") or {}), data.get("reused_from_cache"), copy.deepcopy(data))

    @classmethod
    def of_zeros(cls, units: list[WeightUnit], schemes: list[str], specs: list[str], labels: list[str],
                 num_layers: int) -> Profile:
        """Every cost 0, for these units, schemes and KV formats (`specs`, their `labels`): what sizing a
        budget needs, since bytes do not depend on measured costs."""
        return cls(ProfiledModel("", "", {}), ProfiledText("", "", 0, 0, 1.0), ProfileConfig(),
                   WeightCosts(tuple(units), tuple(schemes), {u.name: dict.fromkeys(schemes, 0.0) for u in units},
                               None, None),
                   KVCosts(tuple(labels), tuple(specs), {str(i): dict.fromkeys(labels, 0.0) for i in range(num_layers)},
                           None),
                   None, None, None, None, None, {})

    def to_dict(self) -> dict:
        """The JSON form (as measured and saved; a profile is never edited once finished)."""
        data = copy.deepcopy(self._json)
        data.pop("reused_from_cache", None)
        return data

    def kv_layer_cost(self, layer: int, label: str, variant: str | None = None) -> float:
        """A layer's measured KL in a format (with a retention variant's exact tokens), scaled to the long
        window when the profile has one."""
        table = self.retention.tables[variant] if variant else self.kv.kl
        return table[str(layer)][label] * self.kv.scale(label)
