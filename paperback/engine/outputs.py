"""What a request has produced, and what each engine step reports of it.

Each request keeps, per completion, its text stream (stop strings held back;
paperback.generation.text_stream), its token ids and log-probabilities, and
how much of them has been reported. `SamplingParams.output_kind` chooses what
a step reports, as vLLM's RequestOutputKind does: "final" (the default) one
output when the request finishes, "delta" each step's new text, ids and
log-probabilities, "cumulative" everything so far at every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from paperback.engine.scheduler import Status
from paperback.generation.sampling import SamplingParams
from paperback.generation.structured import GrammarMatcher
from paperback.generation.text_stream import TextStream

LOGPROB_FLOOR = -9999.0  # what -inf (a token the filters removed) is reported as, as vLLM does: JSON has no -inf


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # the most likely tokens, best first


def token_logprob(logprobs: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """TokenLogprob of `token` under the distribution `logprobs` (V,), with its `top` best alternatives."""
    best = torch.topk(logprobs, top) if top else None
    alternatives = [] if best is None else [(int(i), max(float(v), LOGPROB_FLOOR))
                                            for v, i in zip(best.values, best.indices)]
    return TokenLogprob(token, max(float(logprobs[token]), LOGPROB_FLOOR), alternatives)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", "error"; None while running
    logprobs: list[TokenLogprob] | None = None
    stop_reason: str | int | None = None  # the stop string or stop token that ended it


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    timings: dict = field(default_factory=dict)  # arrival-relative seconds; preemptions; token times
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token; the first has none
    error: str | None = None  # the request failed inside a step (it alone)


@dataclass
class CompletionState:
    """One completion's progress: its text stream, log-probabilities, grammar, and what was reported."""

    stream: TextStream | None
    matcher: GrammarMatcher | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    stop_reason: str | int | None = None
    sent_tokens: int = 0
    sent_logprobs: int = 0


@dataclass
class RequestState:
    request_id: str
    params: SamplingParams
    prompt_ids: list[int]
    seqs: list = field(default_factory=list)  # paperback.engine.scheduler.Sequence, forks included
    completions: dict[int, CompletionState] = field(default_factory=dict)  # by seq_id
    prompt_logprobs: list[TokenLogprob | None] | None = None
    sent_prompt_logprobs: bool = False
    forked: bool = False
    prompt_counted: bool = False
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(s.status is Status.FINISHED for s in self.seqs)

    @property
    def prompt_scored(self) -> bool:
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) == len(self.prompt_ids)

    def output(self) -> RequestOutput | None:
        """What this step reports of the request under its output kind (None: nothing to report)."""
        kind, finished = self.params.output_kind, self.finished
        if kind == "final" and not finished:
            return None
        outputs = []
        for index, seq in enumerate(self.seqs):
            state = self.completions[seq.seq_id]
            done = seq.finish_reason is not None
            if kind == "delta":
                text = state.stream.take(final=done) if state.stream else ""
                ids, lps = seq.output_ids[state.sent_tokens:], state.logprobs[state.sent_logprobs:]
                state.sent_tokens, state.sent_logprobs = len(seq.output_ids), len(state.logprobs)
            else:
                text = "" if state.stream is None else state.stream.text if done else \
                    state.stream.text[:max(0, len(state.stream.text) - state.stream.holdback)]
                ids, lps = list(seq.output_ids), list(state.logprobs)
            outputs.append(CompletionOutput(index, text, ids, seq.finish_reason,
                                            lps if self.params.logprobs is not None else None, state.stop_reason))
        prompt_lps = None
        if self.prompt_scored and (kind != "delta" or not self.sent_prompt_logprobs):
            prompt_lps, self.sent_prompt_logprobs = self.prompt_logprobs, True
        if kind == "delta" and not finished and prompt_lps is None and \
                not any(o.text or o.token_ids or o.finish_reason for o in outputs):
            return None
        return RequestOutput(self.request_id, self.prompt_ids, outputs, finished, self._timings(), prompt_lps,
                             self.error)

    def _timings(self) -> dict:
        first = self.seqs[0]
        firsts = [s.first_token_time for s in self.seqs if s.first_token_time is not None]
        ends = [s.finish_time for s in self.seqs if s.finish_time is not None]
        scheduled = [s.first_scheduled_time for s in self.seqs if s.first_scheduled_time is not None]
        return {"time_to_first_token_s": min(firsts) - first.arrival if firsts else None,
                "total_s": max(ends) - first.arrival if ends and self.finished else None,
                "queue_s": min(scheduled) - first.arrival if scheduled else None,
                "preemptions": sum(s.preemptions for s in self.seqs),
                # every token's time, once at the end (copying them every step would grow with the output)
                "token_times": [list(s.token_times) for s in self.seqs] if self.finished else []}
