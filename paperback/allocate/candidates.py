"""Candidate solutions for the allocator's second pass: the exact solve with the output head held at each scheme.

Why the head (allocate.second_pass): a tied head's error changes every
block's input, so its cost does not add to the blocks' at the margin the
solve trades on; each candidate here is the exact optimum given the head's
scheme, and the second pass measures them whole.
"""

from __future__ import annotations

from dataclasses import dataclass

from paperback.allocate.profile_data import AdditivityCheck
from paperback.allocate.solver import Group, InfeasibleBudget, Option, solve
from paperback.allocate.units import HEAD_BAND_UNIT, HEAD_UNIT

# Solutions by head scheme kept by default: the solve's own choice and the next head scheme by prediction (on
# Gemma 3 at the W4 g64 budget the second is 0.007 nats behind by prediction and level when measured; the rest
# trail by 0.3 or more, and each candidate measured now costs a whole quantization).
DEFAULT_CANDIDATES = 2

# How much lower a mix's measured KL must be than even bits' for the second pass to keep the mix. It measures on
# the text the profile read, which the mix was chosen for and even bits was not, so a mix's gain there runs ahead
# of its gain on other text. The eight budgets of bench_allocation (two models, profiled on pydoc) put the line:
# the mixes that kept a lead on WikiText-2 and PTB led even bits by 13-31% on pydoc, the two that lost (Gemma 3,
# W3 g128 and W4 g64, by 0.5-2%) led by 7% and 3% (docs/allocation.md).
EVEN_MARGIN = 0.10


@dataclass
class Candidate:
    name: str  # what distinguishes it, e.g. "head W4a-g64"
    chosen: dict[str, Option]
    predicted: float
    measured: float | None = None
    even: bool = False  # every weight unit at one scheme: the bits spread evenly

    def labels(self) -> dict[str, str]:
        return {name: option.label for name, option in self.chosen.items()}

    def summary(self) -> dict:
        return {"name": self.name, "predicted_kl": self.predicted, "measured_kl": self.measured,
                "bytes": sum(o.bytes for o in self.chosen.values())}


def head_candidates(groups: list[Group], capacity: float, count: int = DEFAULT_CANDIDATES,
                    layout_bytes: int = 0) -> list[Candidate]:
    """The exact solve with the head held at each of its options, best `count` by predicted KL first (the
    first is the unconstrained optimum). Without a head unit, the one solve. A head in bands
    (`banded_candidates`) pays `layout_bytes` for its layout."""
    if any(g.name.startswith(HEAD_BAND_UNIT) for g in groups):
        return banded_candidates(groups, capacity, count, layout_bytes)
    head = next((g for g in groups if g.name == HEAD_UNIT), None)
    if head is None or count <= 1:
        chosen = solve(groups, capacity)
        name = f"head {chosen[HEAD_UNIT].label}" if head is not None else "solve"
        return [Candidate(name, chosen, sum(o.cost for o in chosen.values()))]
    candidates = []
    for option in head.options:
        held = [Group(g.name, (option,)) if g is head else g for g in groups]
        try:
            chosen = solve(held, capacity)
        except InfeasibleBudget:
            continue
        candidates.append(Candidate(f"head {option.label}", chosen, sum(o.cost for o in chosen.values())))
    if not candidates:
        raise InfeasibleBudget("no scheme of the output head leaves room for the rest")
    return sorted(candidates, key=lambda c: c.predicted)[:count]


def banded_candidates(groups: list[Group], capacity: float, count: int, layout_bytes: int) -> list[Candidate]:
    """With the head in bands of vocabulary rows: the solve with every band free (the layout's bytes paid),
    then the solves with every band held at one scheme (a plain head, no layout), best `count` by predicted
    KL, the free solve first."""
    bands = {g.name for g in groups if g.name.startswith(HEAD_BAND_UNIT)}
    candidates = []
    try:
        chosen = solve(groups, capacity - layout_bytes)
        candidates.append(Candidate("head in bands", chosen, sum(o.cost for o in chosen.values())))
    except InfeasibleBudget:
        pass
    if count > 1 or not candidates:
        labels = set.intersection(*({o.label for o in g.options} for g in groups if g.name in bands))
        plain = []
        for label in sorted(labels):
            held = [Group(g.name, tuple(o for o in g.options if o.label == label)) if g.name in bands else g
                    for g in groups]
            try:
                chosen = solve(held, capacity)
            except InfeasibleBudget:
                continue
            plain.append(Candidate(f"head {label}", chosen, sum(o.cost for o in chosen.values())))
        known = [c.labels() for c in candidates]
        candidates += [c for c in sorted(plain, key=lambda c: c.predicted) if c.labels() not in known]
    if not candidates:
        raise InfeasibleBudget("no scheme of the output head leaves room for the rest")
    return candidates[:max(count, 1)]


def even_weight_candidate(groups: list[Group], capacity: float) -> Candidate | None:
    """The exact solve with every weight unit held at one scheme, for the scheme that predicts least among
    those that fit (the KV groups, when present, solved for the bytes left): the bits spread evenly. The
    second pass measures it beside the mixed solutions, so a mix is kept only when it measures better than
    even bits by EVEN_MARGIN; a mix's predicted gain at 4 bits (3-8% on Gemma 3) is within what the sum misjudges.
    None when no single scheme fits."""
    weights = [g for g in groups if not g.name.startswith("kv.")]
    labels = set.intersection(*({o.label for o in g.options} for g in weights)) if weights else set()
    best = None
    for label in sorted(labels):
        held = [g if g.name.startswith("kv.") else Group(g.name, tuple(o for o in g.options if o.label == label))
                for g in groups]
        try:
            chosen = solve(held, capacity)
        except InfeasibleBudget:
            continue
        candidate = Candidate(f"even {label}", chosen, sum(o.cost for o in chosen.values()), even=True)
        if best is None or candidate.predicted < best.predicted:
            best = candidate
    return best


def second_pass_candidates(groups: list[Group], capacity: float, count: int = DEFAULT_CANDIDATES,
                           layout_bytes: int = 0) -> list[Candidate]:
    """What the second pass measures: the best `count` solves by head scheme, and the best even-bits solve
    (unless it is one of them). With count 1, the solve alone, unmeasured. `layout_bytes`: what a head in
    bands pays for its layout."""
    candidates = head_candidates(groups, capacity, count, layout_bytes)
    if count <= 1:
        return candidates
    even = even_weight_candidate(groups, capacity)
    if even is not None and all(c.labels() != even.labels() for c in candidates):
        candidates.append(even)
    return candidates


def kept_candidate(candidates: list[Candidate], margin: float = EVEN_MARGIN) -> Candidate:
    """The measured candidate to keep: the least KL, except that even bits stay unless the best mix measures
    below even bits' KL by more than `margin` (a fraction of it)."""
    if not 0 <= margin < 1:
        raise ValueError(f"the even-bits margin must be in [0, 1), got {margin}")
    best = min(candidates, key=lambda c: c.measured)
    even = next((c for c in candidates if c.even), None)
    if even is None or best is even or best.measured < even.measured * (1 - margin):
        return best
    return even


def within_additivity(candidates: list[Candidate], additivity: AdditivityCheck | None) -> list[Candidate]:
    """The candidates a measurement could still rank first: those whose prediction, at the lowest
    measured/predicted ratio the profile's additivity check saw, is not above the best prediction at the
    highest. The rest would need the sum to be further off than it ever was, so they are not measured (on
    SmolLM2's demo budget the head-W4 solutions are predicted 36x worse than the W8 one)."""
    ratios = additivity.ratio_range if additivity is not None else None
    if ratios is None or not candidates:
        return candidates
    low, high = ratios
    best = min(c.predicted for c in candidates)
    return [c for c in candidates if c.predicted * low <= best * high]
