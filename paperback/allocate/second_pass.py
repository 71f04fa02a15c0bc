"""The allocator's second, measured pass: a few candidate solutions, each measured whole, the best kept.

The solve minimises a sum of costs each measured with one unit changed. The
one unit whose cost does not add is the output head when it is tied to the
embedding: its error changes every block's input as well as the logits, so
on Gemma 3 at the W4 g64 budget moving the head from g64 to g128 and
spending the bytes saved on blocks measured 0.010 nats worse than the sum of
the two changes (docs/allocation.md). So the allocator solves once per
scheme of the head (each the exact optimum with the head held there), keeps
the best few by predicted KL, and this module measures each candidate as a
whole on the profiled part of the text, every block's effective weights
swapped in (as the profile's additivity check does) and the KV cache in the
candidate's formats, and keeps the one with the least measured KL. The
evaluation text is never read: only the part the profile read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from paperback.allocate.candidates import Candidate
from paperback.allocate.probe import ReferenceProbe, swapped_weights
from paperback.allocate.profile import PROFILE_AWQ, ProfileConfig, ProfileText, split_text
from paperback.allocate.quantized_units import EffectiveWeight, effective_key, quantized_blocks, unit_weights
from paperback.allocate.units import HEAD_UNIT, WeightUnit, parse_weight_candidates
from paperback.kv.policy import KVPolicy
from paperback.quantization.rtn import quantize_rtn


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
    _effective: dict[tuple[str, str], dict[str, EffectiveWeight]] = field(default_factory=dict)
    _probe: ReferenceProbe | None = None

    _split: ProfileText | None = None

    def __post_init__(self):
        self.schemes = {s.label: s for s in parse_weight_candidates(self.config.weight_schemes)}

    @property
    def split(self) -> ProfileText:
        """The profiled text's windows, tokenized only when a choice is measured."""
        if self._split is None:
            bos = self.tokenizer.bos_token_id if getattr(self.tokenizer, "adds_bos", False) else None
            self._split = split_text(self.tokenizer.encode(self.text, add_special_tokens=False), self.config, bos,
                                     self.model.config.max_position_embeddings)
        return self._split

    def choose(self, candidates: list[Candidate], kv_policy=None) -> Candidate:
        """The candidate with the least measured KL (each one's `measured` filled in). `kv_policy`: a
        function from a candidate to its KVPolicy, or None for an exact cache."""
        if len(candidates) == 1:
            return candidates[0]
        self._quantize(candidates)
        if self._probe is None:
            self._probe = ReferenceProbe(self.model, self.split.head_windows, self.config.kv_chunk)
        for c in tqdm(candidates, desc="second pass", unit="candidate", disable=None if self.progress else True,
                      leave=False):
            policy: KVPolicy | None = kv_policy(c) if kv_policy is not None else None
            with swapped_weights(self.model, self._weights(c)):
                c.measured = self._probe.kl_full(policy)
        return min(candidates, key=lambda c: c.measured)

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
