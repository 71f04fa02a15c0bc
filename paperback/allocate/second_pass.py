"""The allocator's second, measured pass: a few candidate solutions, each measured whole, the best kept.

The solve minimises a sum of costs each measured with one unit changed, and
two things it cannot see decide the last few percent at 4 bits. The output
head, when tied to the embedding, changes every block's input as well as
the logits, so its cost does not add to the blocks' (on Gemma 3 at the W4
g64 budget, 0.010 nats off the sum; docs/allocation.md). And the final
quantization calibrates on more text than the profile did: AWQ from 16
windows instead of 2 moves the same assignment's KL by 3-4%, as much as a
mix's predicted gain over even bits. So the allocator solves once per
scheme of the head and once with every weight unit held at one scheme
(allocate.candidates), and a second pass measures each candidate whole on
the part of the text the profile read, every unit and the KV cache in the
candidate's formats at once, and keeps the least KL, except that even bits
stay unless a mix beats them there by a margin (candidates.EVEN_MARGIN: a
mix was chosen on that text, even bits were not). The evaluation text is
never read.

Two ways to measure:
- `ShippedSecondPass` (what `fit` and bench_allocation use): each candidate
  quantized by the final pass itself (its method, calibration and settings)
  from a fresh copy of the model, so the model measured is the model
  written, and the best one is kept rather than quantized again;
- `SecondPass`: the profile's own effective weights (each block quantized
  from exact inputs with the profile's calibration) swapped in; cheaper,
  and what bench_second_pass and bench_final_quantization compare against.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from paperback.allocate.candidates import EVEN_MARGIN, Candidate, kept_candidate
from paperback.allocate.probe import ReferenceProbe, swapped_weights
from paperback.allocate.profile import PROFILE_AWQ, ProfileConfig, ProfileText, split_text
from paperback.allocate.quantized_units import EffectiveWeight, effective_key, quantized_blocks, unit_weights
from paperback.allocate.units import HEAD_UNIT, WeightUnit, parse_weight_candidates
from paperback.kv.policy import KVPolicy
from paperback.models import DecoderLM
from paperback.progress import progress as stage_progress
from paperback.quantization.rtn import QuantizedWeight, quantize_rtn


def profiled_split(model: DecoderLM, tokenizer, text: str, config: ProfileConfig) -> ProfileText:
    """The windows the profile read from `text` (the same split, so the head windows are the same)."""
    bos = tokenizer.bos_token_id if getattr(tokenizer, "adds_bos", False) else None
    return split_text(tokenizer.encode(text, add_special_tokens=False), config, bos,
                      model.config.max_position_embeddings)


@dataclass
class SecondPass:
    """Measures candidates on the profiled part of `text`: the head windows the profile priced the head on
    (every position scored), with each candidate's weights and KV formats applied at once."""

    model: object
    tokenizer: object
    text: str
    config: ProfileConfig
    units: list[WeightUnit]
    progress: bool = True
    even_margin: float = EVEN_MARGIN
    _effective: dict[tuple[str, str], dict[str, EffectiveWeight]] = field(default_factory=dict)
    _probe: ReferenceProbe | None = None

    _split: ProfileText | None = None

    def __post_init__(self):
        self.schemes = {s.label: s for s in parse_weight_candidates(self.config.weight_schemes)}

    @property
    def split(self) -> ProfileText:
        """The profiled text's windows, tokenized only when a choice is measured."""
        if self._split is None:
            self._split = profiled_split(self.model, self.tokenizer, self.text, self.config)
        return self._split

    def choose(self, candidates: list[Candidate], kv_policy=None) -> Candidate:
        """The kept candidate (`kept_candidate`; each one's `measured` filled in). `kv_policy`: a function
        from a candidate to its KVPolicy, or None for an exact cache."""
        if len(candidates) == 1:
            return candidates[0]
        self._quantize(candidates)
        if self._probe is None:
            self._probe = ReferenceProbe(self.model, self.split.head_windows, self.config.kv_chunk)
        for c in stage_progress(candidates, desc="second pass", unit="candidate", enabled=self.progress):
            policy: KVPolicy | None = kv_policy(c) if kv_policy is not None else None
            with swapped_weights(self.model, self._weights(c)):
                c.measured = self._probe.kl_full(policy)
        return kept_candidate(candidates, self.even_margin)

    def _quantize(self, candidates: list[Candidate]) -> None:
        """Effective weights for every (block, scheme) and head scheme some candidate uses, as the profile
        quantized them (its method, its calibration windows and AWQ settings)."""
        needed: dict[str, set[str]] = {}
        for c in candidates:
            for unit in self.units:
                needed.setdefault(effective_key(unit), set()).add(c.chosen[unit.name].label)
        todo = {key: {label for label in labels if (key, label) not in self._effective}
                for key, labels in needed.items()}
        def schemes_of(idx: int):
            return [self.schemes[label] for label in sorted(todo.get(f"layers.{idx}", ()))]

        if any(todo.get(f"layers.{i}") for i in range(self.model.config.num_layers)):
            blocks = quantized_blocks(self.model, self.split.calibration, schemes_of, self.config.method,
                                      PROFILE_AWQ)
            for idx, effective in blocks:
                for label, weights in effective.items():
                    self._effective[(f"layers.{idx}", label)] = weights
        head = next((u for u in self.units if u.name == HEAD_UNIT), None)
        if head is not None:
            weight = dict(self.model.named_parameters())[head.params[0]]
            for label in todo.get(HEAD_UNIT, ()):
                self._effective[(HEAD_UNIT, label)] = {head.params[0]: EffectiveWeight(
                    quantize_rtn(weight, self.schemes[label]))}

    def _weights(self, candidate: Candidate) -> dict[str, torch.Tensor]:
        swap = {}
        for unit in self.units:
            swap.update(unit_weights(self._effective, unit, candidate.chosen[unit.name].label))
        return swap


@dataclass
class ShippedCandidate:
    """A candidate quantized as it ships: the model (fake-quantized weights), its quantized weights, seconds."""

    candidate: Candidate
    model: DecoderLM
    weights: dict[str, QuantizedWeight]
    seconds: float


# quantize(model, candidate): quantizes the model in place as the final pass does; returns its quantized weights.
Quantize = Callable[[DecoderLM, Candidate], dict[str, QuantizedWeight]]


@dataclass
class ShippedSecondPass:
    """Measures candidates as they ship: each quantized by `quantize` from a fresh copy of `model` (the full
    model, left unchanged), measured on the profiled head windows of `text`, the best model kept."""

    model: DecoderLM
    tokenizer: object
    text: str
    config: ProfileConfig
    progress: bool = True
    even_margin: float = EVEN_MARGIN
    _probe: ReferenceProbe | None = None  # the full model's reference, made once for every budget asked

    def choose(self, candidates: list[Candidate], quantize: Quantize,
               kv_policy: Callable[[Candidate], KVPolicy | None] | None = None) -> ShippedCandidate:
        """The kept candidate (`kept_candidate`), quantized (each one's `measured` filled in; with one
        candidate, it is quantized and not measured). At most three models are held at a time: the even-bits
        one, the best mix so far and the one being measured."""
        if len(candidates) == 1:
            return self._quantized(candidates[0], quantize)
        if self._probe is None:
            self._probe = ReferenceProbe(self.model, profiled_split(self.model, self.tokenizer, self.text,
                                                                    self.config).head_windows, self.config.kv_chunk)
        kept: dict[bool, ShippedCandidate] = {}  # even or not: the least KL of each
        for c in stage_progress(candidates, desc="second pass", unit="candidate", enabled=self.progress):
            shipped = self._quantized(c, quantize)
            policy = kv_policy(c) if kv_policy is not None else None
            # The quantized copy's every parameter (AWQ also changed norms) swapped into the probe's model.
            with swapped_weights(self.model, {n: p.data for n, p in shipped.model.named_parameters()}):
                c.measured = self._probe.kl_full(policy)
            if c.even not in kept or c.measured < kept[c.even].candidate.measured:
                kept[c.even] = shipped
        chosen = kept_candidate([k.candidate for k in kept.values()], self.even_margin)
        return kept[chosen.even]

    def _quantized(self, candidate: Candidate, quantize: Quantize) -> ShippedCandidate:
        model = copy.deepcopy(self.model)
        start = time.perf_counter()
        weights = quantize(model, candidate)
        return ShippedCandidate(candidate, model, weights, time.perf_counter() - start)
