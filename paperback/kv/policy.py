"""Per-layer KV cache policy: a default scheme, per-layer overrides, layers kept at native precision.

From the CLI (`--kv-cache-dtype kivi2 --kv-skip-layers 0,global`) or a JSON file:

    {"default": "kivi2",
     "layers": {"0-1": "int8", "global": "fp8:scale=calibrated"},
     "skip_layers": [29]}

Layer selectors: an index, a range `a-b` (inclusive), `global` or `sliding`
(Gemma 3's full-attention or sliding-window layers). Skipped layers keep the
16-bit baseline (`skip_dtype`, fp16 unless set), as vLLM's skip-layers do.
Later entries win: layers, then skip_layers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from paperback.errors import PaperbackError
from paperback.kv.schemes import KVScheme, paged_block_size, parse_kv_scheme
from paperback.models.config import ModelConfig

POLICY_KEYS = {"default", "layers", "skip_layers", "skip_dtype"}


@dataclass(frozen=True)
class KVPolicy:
    default: KVScheme
    overrides: dict[int, KVScheme] = field(default_factory=dict)

    def scheme_for(self, layer: int) -> KVScheme:
        return self.overrides.get(layer, self.default)

    @property
    def label(self) -> str:
        if not self.overrides:
            return self.default.label
        return f"{self.default.label} (+{len(self.overrides)} layer overrides)"

    def needs_fp8_calibration(self, num_layers: int) -> bool:
        return any(s.needs_calibration for s in map(self.scheme_for, range(num_layers)))

    def bits_per_element(self, config: ModelConfig) -> float:
        """Steady-state stored bits per cached element (recent window not counted), averaged over layers."""
        return sum(self.scheme_for(i).bits_per_element(config.head_dim)
                   for i in range(config.num_layers)) / config.num_layers

    def bits_at(self, config: ModelConfig, tokens: int, recent_bits: int = 16) -> float:
        """Stored bits per cached element after `tokens` tokens, averaged over layers.

        Counts each layer's recent window at `recent_bits` (what a served
        fp16/bf16 model holds it in); per-layer FP8 scales are left out.
        """
        schemes = [self.scheme_for(i) for i in range(config.num_layers)]
        unit = paged_block_size(schemes)  # every layer encodes a pool block at a time, as served
        return sum(s.stored_bits(tokens, config.head_dim, recent_bits, unit)
                   for s in schemes) / (tokens * config.num_layers)

    def to_dict(self, num_layers: int) -> dict:
        return {"default": self.default.to_dict(),
                "layers": [self.scheme_for(i).label for i in range(num_layers)]}


def select_layers(selector: str | int, config: ModelConfig) -> list[int]:
    """Layer indices named by one selector, checked against the model."""
    n = config.num_layers
    text = str(selector).strip()
    if text in ("global", "sliding"):
        windows = [config.window_of(i) for i in range(n)]
        if all(w is None for w in windows):
            raise PaperbackError(f"layer selector '{text}': this model has no sliding-window layers")
        return [i for i, w in enumerate(windows) if (w is None) == (text == "global")]
    try:
        if "-" in text[1:]:
            lo, hi = (int(part) for part in text.split("-", 1))
            layers = list(range(lo, hi + 1))
            if not layers:
                raise ValueError
        else:
            layers = [int(text)]
    except ValueError:
        raise PaperbackError(f"bad layer selector '{text}' (an index, a range like 0-3, global or sliding)") from None
    bad = [i for i in layers if not 0 <= i < n]
    if bad:
        raise PaperbackError(f"KV policy names layer {bad[0]}, but the model has {n} layers (0-{n - 1})")
    return layers


def build_policy(config: ModelConfig, kv: str | None = None, skip_layers: str | None = None,
                 policy_file: str | Path | None = None, spec: dict | None = None) -> KVPolicy:
    """Policy from a format name, a comma-separated skip list and/or a JSON file (or its parsed `spec`,
    as a checkpoint's recipe carries it); validated against the model."""
    where = "KV policy"
    if policy_file is not None:
        path = Path(policy_file)
        where = f"KV policy file {path}"
        try:
            spec = json.loads(path.read_text())
        except FileNotFoundError:
            raise PaperbackError(f"KV policy file {path} does not exist") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PaperbackError(f"KV policy file {path} is not valid JSON: {e}") from None
    spec = {} if spec is None else spec
    if not isinstance(spec, dict) or set(spec) - POLICY_KEYS:
        extra = sorted(set(spec) - POLICY_KEYS) if isinstance(spec, dict) else []
        raise PaperbackError(f"{where}: expected an object with keys {sorted(POLICY_KEYS)}"
                             + (f"; unknown: {extra}" if extra else ""))
    if kv is not None and "default" in spec and parse_kv_scheme(spec["default"]) != parse_kv_scheme(kv):
        raise PaperbackError(f"--kv-cache-dtype {kv} and the policy's default '{spec['default']}' disagree")
    default = parse_kv_scheme(spec.get("default", kv or "fp16"))
    overrides: dict[int, KVScheme] = {}
    layers = spec.get("layers", {})
    if not isinstance(layers, dict):
        raise PaperbackError("KV policy 'layers' must map layer selectors to formats")
    for selector, name in layers.items():
        scheme = parse_kv_scheme(name)
        for i in select_layers(selector, config):
            overrides[i] = scheme
    skip = list(spec.get("skip_layers", []))
    if skip_layers:
        skip += [part for part in skip_layers.split(",") if part.strip()]
    native = parse_kv_scheme(spec.get("skip_dtype", "fp16"))
    if not native.is_native:
        raise PaperbackError(f"skip_dtype must be fp16, bf16 or fp32, not '{spec['skip_dtype']}'")
    for selector in skip:
        for i in select_layers(selector, config):
            overrides[i] = native
    for scheme in {default, *overrides.values()}:
        scheme.check_head_dim(config.head_dim)
    policy = KVPolicy(default, overrides)
    for i in range(config.num_layers):
        if policy.scheme_for(i).window and config.window_of(i) is not None:
            raise PaperbackError(f"layer {i} already attends a sliding window of {config.window_of(i)} tokens; "
                                 "a retention window applies to full-attention layers (select them with 'global')")
    return policy
