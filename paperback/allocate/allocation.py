"""From a profile and a memory budget to a fixed policy: each weight unit's scheme, each layer's KV format.

The budget is what a serving process holds: weights + users x KV cache at
the context + the runtime allowance the planner counts. The objective is the
profile's predicted KL, the sum of each choice's measured cost, which the
profile's additivity check validates. Solved exactly (`solver.solve`).

Token retention is part of each layer's KV choice: every quantized format
also with its first RETENTION_SINK tokens exact (when the profile measured
that). StreamingLLM eviction (sinks plus a window, the middle dropped) is
considered only when asked (`evict=True`): it gives up retrieval of anything
outside the window, which KL on running text does not see. It is a
per-layer choice like the others, at each measured window: the paged
engine keeps a block table per group of layers that free blocks alike
(`paperback.engine.cache_groups`), so a layer that evicts holds only its
sinks and window while the others keep every token, and the bytes of each
layer's option do not depend on the others'.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TypeVar

from paperback.allocate.candidates import Candidate, second_pass_candidates
from paperback.allocate.profile_data import Profile, RetentionCosts
from paperback.allocate.solver import Group, InfeasibleBudget, Option, min_bytes, solve
from paperback.allocate.units import (HEAD_BAND_UNIT, HEAD_UNIT, WeightUnit, fixed_weight_bytes, head_band_units,
                                      kv_layer_bytes, parse_kv_candidates, parse_weight_candidates, pool_block_size,
                                      with_retention)
from paperback.errors import PaperbackError
from paperback.models.config import ModelConfig
from paperback.plan.planner import runtime_allowance
from paperback.plan.shape import shape_from_config
from paperback.quantization.head_bands import (MIN_BAND_BITS, HeadBands, band_rows, decode_band_of, split_head_bands,
                                               stored_layout_bytes)
from paperback.quantization.scheme import QuantScheme

T = TypeVar("T")


@dataclass(frozen=True)
class Workload:
    memory: int  # bytes
    context: int
    users: int

    def __post_init__(self):
        if self.memory <= 0 or self.context <= 0 or self.users <= 0:
            raise PaperbackError("memory, context and users must be positive")


def kv_policy_spec(kv: dict[int, str]) -> dict:
    """{layer: KV spec} as `build_policy` reads it: the commonest spec as the default, the rest per layer."""
    counts: dict[str, int] = {}
    for spec in kv.values():
        counts[spec] = counts.get(spec, 0) + 1
    default = max(counts, key=counts.get)
    return {"default": default, "layers": {str(i): s for i, s in sorted(kv.items()) if s != default}}


@dataclass
class Allocation:
    weights: dict[str, str]  # unit name -> scheme label
    kv: dict[int, str]  # layer -> KV spec
    predicted_kl: float
    weight_bytes: int
    kv_bytes: float  # all users at the context
    runtime_bytes: int
    budget: int
    bits_per_weight: float  # over the allocated units
    breakdown: dict = field(default_factory=dict)

    @property
    def total_bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes + self.runtime_bytes

    def layer_schemes(self, units: list[WeightUnit]) -> dict[str, QuantScheme]:
        """{parameter name: scheme} for QuantizeConfig.layer_schemes."""
        schemes = {s.label: s for s in parse_weight_candidates(set(self.weights.values()))}
        return {param: schemes[self.weights[u.name]] for u in units for param in u.params}

    def kv_policy_spec(self) -> dict:
        """The KV policy as `build_policy` reads it from a file."""
        return kv_policy_spec(self.kv)

    def to_dict(self) -> dict:
        return {**asdict(self), "kv": {str(k): v for k, v in self.kv.items()}, "total_bytes": self.total_bytes,
                "kv_policy": self.kv_policy_spec()}


class Allocator:
    """Options and their bytes for one model and workload, from a profile's measured costs."""

    def __init__(self, profile: Profile, model, workload: Workload, head_bands: bool = True,
                 band_min_bits: int = MIN_BAND_BITS):
        """head_bands: a tied head whose profile measured its bands of vocabulary rows is allocated band by
        band (quantization.head_bands), each band at band_min_bits or more; False keeps it one unit."""
        self.profile, self.workload, self._model = profile, workload, model
        self.band_min_bits = band_min_bits
        self.config: ModelConfig = model.config
        self.units = list(profile.weights.units)
        self.kl = dict(profile.weights.kl)
        self.band_of = None  # the head's band layout, when it is allocated in bands
        bands = profile.weights.head_bands
        head = next((u for u in self.units if u.name == HEAD_UNIT), None)
        if head_bands and bands is not None and head is not None and self.config.tie_word_embeddings:
            self.band_of = decode_band_of(bands.band_of, self.config.vocab_size)
            band_units = head_band_units(head, [len(r) for r in band_rows(self.band_of)])
            self.units = [u for u in self.units if u is not head] + band_units
            self.kl.update({u.name: bands.kl[u.name.removeprefix(HEAD_UNIT + ".")] for u in band_units})
        self.schemes = {s.label: s for s in parse_weight_candidates(profile.weights.schemes)}
        specs = profile.kv.specs
        self.formats = dict(zip(specs, parse_kv_candidates(specs, self.config)))
        self.labels = dict(zip(specs, profile.kv.formats))
        self.block_size = pool_block_size(list(self.formats.values()))
        self.fixed_bytes = fixed_weight_bytes(model, self.units)
        self.runtime = runtime_allowance(shape_from_config(self.config, "", ""), users=workload.users).total

    def with_plain_head(self) -> Allocator:
        """The same allocator with the head as one unit (any scheme, no bands)."""
        return Allocator(self.profile, self._model, self.workload, head_bands=False)

    @property
    def layout_bytes(self) -> int:
        """What a head in bands stores beside its bands: a byte per token naming its band."""
        return 0 if self.band_of is None else self.band_of.numel()

    def quantize_schemes(self, schemes: dict[str, QuantScheme]) -> tuple[dict[str, QuantScheme], HeadBands | None]:
        """A policy ({param or band key: scheme}, e.g. Allocation.layer_schemes) as QuantizeConfig takes it:
        the per-layer schemes and the head's bands (None when the head is one unit)."""
        return split_head_bands(schemes, self.band_of)

    def weight_groups(self, allowed: set[str] | None = None) -> list[Group]:
        """Each weight unit's options; a head band's only from band_min_bits up (quantization.head_bands)."""
        kl = self.kl

        def offered(unit: WeightUnit, label: str, scheme: QuantScheme) -> bool:
            if allowed is not None and label not in allowed:
                return False
            return not unit.name.startswith(HEAD_BAND_UNIT) or scheme.bits >= self.band_min_bits

        return [Group(u.name, tuple(Option(label, u.bytes_for(s), kl[u.name][label])
                                    for label, s in self.schemes.items() if offered(u, label, s)))
                for u in self.units]

    def kv_cost(self, layer: int, spec: str, variant: str | None = None) -> float:
        """A layer's measured KL in a format (with a retention variant's exact tokens), scaled to the
        profile's long window when it has one."""
        return self.profile.kv_layer_cost(layer, self.labels[spec], variant)

    @property
    def retention(self) -> RetentionCosts | None:
        """The profile's retention measurements, when it has them all."""
        r = self.profile.retention
        return r if r is not None and r.complete else None

    def eviction_windows(self) -> list[tuple[int, int]]:
        """(window at the workload's context, measured window) for each measured eviction window: the same
        fraction of the context as of the long window it was measured on, in whole blocks."""
        r = self.retention
        if r is None or not r.windows:
            return []
        residual = max(f.residual for f in self.formats.values())
        out = []
        for measured in r.windows:
            window = int(measured / r.long_tokens * self.workload.context) // self.block_size * self.block_size
            if residual < window < self.workload.context:
                out.append((window, measured))
        return out

    def exact_variants(self) -> dict[str, tuple[int, int]]:
        """The profile's measured exact-token options: name -> (sinks, recent window or 0 for the format's)."""
        return dict(self.retention.variants) if self.retention is not None else {}

    def retrieval_cost(self, layer: int, spec: str, measured_window: int | None) -> float:
        """The profile's answer KL of a long-range lookup with this layer alone in an option: its format's,
        or when it evicts, that window's (a planted fact far back is then gone whatever the format; exact
        sinks and recent tokens do not reach it)."""
        r = self.profile.retrieval
        if r is None or not r.complete:
            raise PaperbackError("this profile has no retrieval measurements; run `paperback profile` again "
                                 "to add them")
        if measured_window:
            return r.evict[str(layer)][str(measured_window)]
        return r.formats[str(layer)][self.labels[spec]]

    def kv_groups(self, allowed: set[str] | None = None, evict: bool = False,
                  retrieval_kl: float | None = None) -> list[Group]:
        """Per layer, every format, and every quantized one also with each measured exact-token variant
        (sinks, a short recent window); with `evict`, also each of those evicting to its sinks and each
        measured window (`eviction_windows`), the layer's measured eviction cost added. `allowed` names
        exact options ('kivi2' is kivi2 alone). With `retrieval_kl`, a layer takes only options that alone
        cost a long-range lookup at most that much (`retrieval_cost`)."""
        w = self.workload
        variants = self.exact_variants()
        sink = self.retention.sink if self.retention is not None else 0
        # (stored spec, its scheme, format spec, measured variant or None, measured window or None), the same
        # in every layer.
        choices = []
        for window in [None] + (self.eviction_windows() if evict else []):
            for spec, scheme in self.formats.items():
                kinds = [(None, 0, 0)] + [(name, s, r) for name, (s, r) in variants.items() if not scheme.is_native]
                if window:  # eviction keeps sinks: the measured variants, or fp16's own sinks
                    kinds = [k for k in kinds if k[0]] or ([(None, sink, 0)] if scheme.is_native else [])
                for variant, sinks, recent in kinds:
                    kept = with_retention(spec, sinks, window[0] if window else 0, recent)
                    if allowed is None or kept in allowed:  # allowed names exact options
                        choices.append((kept, parse_kv_candidates([kept], self.config)[0], spec, variant,
                                        window[1] if window else None))
        evict_costs = self.retention.evict if self.retention is not None else {}
        return [Group(f"kv.{i}", tuple(
            Option(kept, w.users * kv_layer_bytes(stored, self.config, i, w.context, self.block_size),
                   self.kv_cost(i, spec, variant) + (evict_costs[str(i)][str(measured)] if measured else 0.0))
            for kept, stored, spec, variant, measured in choices
            if retrieval_kl is None or self.retrieval_cost(i, spec, measured) <= retrieval_kl))
            for i in range(self.config.num_layers)]

    def capacity(self) -> float:
        return self.workload.memory - self.runtime - self.fixed_bytes

    def allocate(self, weight_options: set[str] | None = None, kv_options: set[str] | None = None,
                 evict: bool = False, retrieval_kl: float | None = None) -> Allocation:
        """The least predicted KL within the budget, over the allowed options (all by default); with
        `evict`, any layer may also evict at each measured window; with `retrieval_kl`, only options that
        keep a long-range lookup within it (`kv_groups`)."""
        groups = self.weight_groups(weight_options) + self.kv_groups(kv_options, evict, retrieval_kl)
        return self._allocation(self.solve_exactly(groups, self.capacity() - self.layout_bytes))

    def candidates(self, count: int, weight_options: set[str] | None = None, kv_options: set[str] | None = None,
                   evict: bool = False, retrieval_kl: float | None = None) -> list[Candidate]:
        """`allocate`'s solve once per scheme of the output head, the best `count` by predicted KL, and the
        best solve with every weight unit at one scheme, for the second pass to measure
        (allocate.second_pass); the first is `allocate`'s own choice."""
        groups = self.weight_groups(weight_options) + self.kv_groups(kv_options, evict, retrieval_kl)
        if min_bytes(groups) > self.capacity():  # refused naming the nearest feasible point, as allocate does
            raise InfeasibleBudget(self.infeasible_message(groups))
        return second_pass_candidates(groups, self.capacity(), count, self.layout_bytes)

    def allocation_of(self, candidate: Candidate) -> Allocation:
        return self._allocation(candidate.chosen)

    def solve_exactly(self, groups: list[Group], capacity: float) -> dict[str, Option]:
        """The exact solve within `capacity` bytes, or a message naming the nearest feasible point."""
        empty = [g.name for g in groups if not g.options]
        if empty:
            raise PaperbackError(f"no candidate left for {', '.join(empty[:4])} after restricting the options")
        try:
            return solve(groups, capacity)
        except InfeasibleBudget:
            raise InfeasibleBudget(self.infeasible_message(groups)) from None

    def budget_curve(self, points: int = 24) -> list[dict]:
        """Predicted KL of the best allocation at budgets from the least that fits to the most any option
        takes (the curve a report draws, the breakdown point comes from): [{memory, predicted_kl, ...}]."""
        groups = self.weight_groups() + self.kv_groups()
        fixed = self.runtime + self.fixed_bytes + self.layout_bytes
        low = fixed + min_bytes(groups)
        high = fixed + sum(max(o.bytes for o in g.options) for g in groups)
        curve = []
        for k in range(points):
            memory = low + (high - low) * (k / (points - 1)) ** 2  # denser where quality changes fastest
            chosen = solve(groups, memory - fixed)
            curve.append({"memory": memory, "predicted_kl": sum(o.cost for o in chosen.values()),
                          "bytes": fixed + sum(o.bytes for o in chosen.values())})
        return curve

    def infeasible_message(self, groups: list[Group]) -> str:
        need = min_bytes(groups) + self.runtime + self.fixed_bytes
        w = self.workload
        kv_min = min_bytes([g for g in groups if g.name.startswith("kv.")])
        weights_min = need - kv_min - self.runtime
        per_user = kv_min / w.users
        room = w.memory - weights_min - self.runtime
        users = int(room // per_user) if per_user > 0 and room > 0 else 0
        return (f"{_mib(w.memory)} cannot hold {w.users} user(s) at {w.context} tokens even with the smallest "
                f"options: that needs {_mib(need)} (weights {_mib(weights_min)}, KV {_mib(kv_min)}, runtime "
                f"{_mib(self.runtime)}). Nearest feasible: --memory {_mib(need)}, or --users {users} at this "
                f"context" + ("" if users else " (none fit: raise --memory)"))

    def _allocation(self, chosen: dict[str, Option]) -> Allocation:
        weights = {u.name: chosen[u.name].label for u in self.units}
        kv = {i: chosen[f"kv.{i}"].label for i in range(self.config.num_layers)}
        unit_bytes = sum(chosen[u.name].bytes for u in self.units)
        unit_bytes += stored_layout_bytes(self.layout_bytes, [chosen[u.name].label for u in self.units
                                                              if u.name.startswith(HEAD_BAND_UNIT)])
        kv_bytes = sum(chosen[f"kv.{i}"].bytes for i in range(self.config.num_layers))
        numel = sum(u.numel for u in self.units)
        weight_kl = sum(chosen[u.name].cost for u in self.units)
        kv_kl = sum(chosen[f"kv.{i}"].cost for i in range(self.config.num_layers))
        return Allocation(weights, kv, weight_kl + kv_kl, int(unit_bytes + self.fixed_bytes), kv_bytes,
                          self.runtime, self.workload.memory, 8 * unit_bytes / numel,
                          {"weights_kl": weight_kl, "kv_kl": kv_kl, "fixed_weight_bytes": self.fixed_bytes,
                           "block_size": self.block_size})


def head_label(weights: dict[str, str]) -> str | None:
    """The output head's scheme in an allocation's {unit: label}: one label, or its bands' (most used first)."""
    if HEAD_UNIT in weights:
        return weights[HEAD_UNIT]
    bands = sorted((int(name.removeprefix(HEAD_BAND_UNIT)), label) for name, label in weights.items()
                   if name.startswith(HEAD_BAND_UNIT))
    if not bands:
        return None
    return "in bands of vocabulary rows, most used first: " + ", ".join(label for _, label in bands)


def banded_or_plain(allocator: Allocator, solve: Callable[[Allocator], T]) -> tuple[Allocator, T]:
    """(allocator, solve(allocator)); where its head bands cannot meet the budget, the same with the head as one
    unit. Head bands stop at MIN_BAND_BITS, so a budget that only a plain head at fewer bits reaches
    (check_budget counts that head) is met with the head whole rather than refused: the one rule `fit` and the
    benchmarks share."""
    try:
        return allocator, solve(allocator)
    except InfeasibleBudget:
        if allocator.band_of is None:
            raise
    plain = allocator.with_plain_head()
    return plain, solve(plain)


def fitting_candidates(profile: Profile, model, workload: Workload, count: int, head_bands: bool = True,
                       **options) -> tuple[Allocator, list[Candidate]]:
    """The allocator and its second-pass candidates (`Allocator.candidates`, `options` passed on), the head
    whole where its bands cannot meet the budget (banded_or_plain)."""
    return banded_or_plain(Allocator(profile, model, workload, head_bands),
                           lambda allocator: allocator.candidates(count, **options))


def breakdown_point(curve: list[dict], max_kl: float) -> dict | None:
    """The least memory on the curve whose predicted KL is at most max_kl (below it, quality breaks down)."""
    ok = [point for point in curve if point["predicted_kl"] <= max_kl]
    return min(ok, key=lambda p: p["memory"]) if ok else None


def _mib(n: float) -> str:
    return f"{n / 2 ** 20:,.1f}MiB"


def check_budget(model, workload: Workload, weight_schemes, kv_specs, include_head: bool = True) -> None:
    """Refuse a budget that even the smallest options cannot meet, before any profiling: bytes do not
    depend on measured costs, so a profile of zeros sizes the problem."""
    from paperback.allocate.units import weight_units

    units = weight_units(model.config, include_head)
    schemes = [s.label for s in parse_weight_candidates(weight_schemes)]
    formats = parse_kv_candidates(kv_specs, model.config)
    skeleton = Profile.of_zeros(units, schemes, list(kv_specs), [f.label for f in formats],
                                model.config.num_layers)
    allocator = Allocator(skeleton, model, workload)
    groups = allocator.weight_groups() + allocator.kv_groups()
    if min_bytes(groups) > allocator.capacity():
        raise InfeasibleBudget(allocator.infeasible_message(groups))
