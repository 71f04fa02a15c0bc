"""Continuous batching: which sequences run in the next step, and with how many tokens.

Iteration-level scheduling as vLLM does it. Every step the running sequences
go first, in arrival order: a decoding sequence brings one token, one still
prefilling brings the next chunk of its prompt that fits the step's token
budget (chunked prefill). Then waiting requests are admitted, first come
first served, while the budget, the cap on running sequences and the free
blocks allow. When a running sequence needs a block and none is free, the
most recently admitted sequence is preempted: by recomputation, its blocks
are freed and it returns to the front of the waiting queue, to be prefilled
again (prompt and output so far) when blocks free up; or, where the engine
swaps (`paperback.engine.swap`, when the copy costs less), its blocks are
copied to host memory and back into fresh blocks before any waiting request
is admitted. No request is dropped.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

import torch

from paperback.engine.block_manager import NoFreeBlocks
from paperback.engine.cache_groups import GroupedBlocks
from paperback.engine.swap import check_preemption
from paperback.errors import PaperbackError
from paperback.generation.sampling import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted, its blocks in host memory
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0  # leading tokens whose keys and values are in the cache
    generator: torch.Generator | None = None
    finish_reason: str | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    preemptions: int = 0
    admitted_step: int = -1
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each output token was sampled

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32
    max_step_tokens: int = 512  # token budget of one step (prefill chunks plus decode tokens)
    # How a preempted sequence gives its blocks back: "recompute", "swap" (to host memory), or "auto"
    # (swap when the copy is predicted cheaper than the prefill it saves; paperback.engine.swap).
    preemption: str = "auto"

    def __post_init__(self):
        if self.max_num_seqs < 1 or self.max_step_tokens < 1:
            raise PaperbackError("max_num_seqs and max_step_tokens must be positive")
        check_preemption(self.preemption)


@dataclass
class ScheduledStep:
    work: list[tuple[Sequence, int]]  # (sequence, new tokens this step)
    copies: list[tuple[int, int, int]]  # copy-on-write block copies to perform first: (group, source, destination)
    preempted: list[Sequence]


class Scheduler:
    """on_admit(seq, cached_tokens) and on_free(seq) let the engine's pool follow admissions and releases
    (on_free comes before the sequence's blocks are freed).

    A cache group whose layers evict (sinks and a window, or a sliding window) holds a bounded number of
    blocks per sequence; its blocks for a prompt come a chunk at a time, step by step, while a group that
    keeps every token gets the whole prompt's at admission.
    """

    def __init__(self, blocks: GroupedBlocks, config: SchedulerConfig = SchedulerConfig(),
                 on_admit=None, on_free=None, swap=None):
        """swap: a `paperback.engine.swap.HostSwap` (None: every preemption recomputes)."""
        self.blocks = blocks
        self.swap = swap
        self.swapped: list[Sequence] = []
        self.config = config
        self.on_admit = on_admit or (lambda seq, cached: None)
        self.on_free = on_free or (lambda seq: None)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.steps = 0
        self.preemptions = 0

    def check(self, params: SamplingParams, num_tokens: int) -> None:
        """Whether a request could ever run: its n completions side by side, its longest sequence in the pool."""
        if params.n > self.config.max_num_seqs:
            raise PaperbackError(f"n = {params.n} completions exceed the engine's {self.config.max_num_seqs} "
                                 f"running sequences (max_num_seqs)")
        if not self.blocks.fits(num_tokens + params.max_tokens):
            raise PaperbackError(f"the request needs more KV blocks than the whole pool holds "
                                 f"({num_tokens} + {params.max_tokens} tokens)")

    def add(self, seq: Sequence) -> None:
        self.check(seq.params, seq.num_tokens)
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence forked from a running one (parallel sampling) joins the running set."""
        seq.status = Status.RUNNING
        seq.admitted_step = self.steps
        self.running.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason, seq.finish_time = Status.FINISHED, reason, time.perf_counter()
        if seq in self.running:
            self.running.remove(seq)
            self.on_free(seq)  # while its blocks are still its own (the pool may finalize them)
            self.blocks.free(seq.seq_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
            self.swap.drop(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.preemptions += 1
        self.preemptions += 1
        if self.swap is not None and self.swap.swap_out(seq):  # its blocks copied out and freed
            seq.status = Status.SWAPPED
            self.swapped.append(seq)
            return
        self.on_free(seq)
        self.blocks.free(seq.seq_id)
        seq.status, seq.num_computed = Status.WAITING, 0
        self.waiting.appendleft(seq)

    def _swap_in(self, budget: int, work: list, copies: list) -> int:
        """Swapped-out sequences back into the pool, oldest first, while each leaves a free block per running
        sequence beside the blocks its next tokens take (alone in the pool it always fits: `check` saw to
        that); returns the budget left."""
        for seq in sorted(self.swapped, key=lambda s: s.arrival):
            new = min(seq.num_tokens - seq.num_computed, budget)
            keep_free = len(self.running) + self.blocks.blocks_needed(new) + 1 if self.running else 0
            if budget == 0 or len(self.running) + self._width(seq) > self.config.max_num_seqs or \
                    not self.swap.can_swap_in(seq, keep_free):
                break
            self.swapped.remove(seq)
            self.swap.swap_in(seq)
            copies += [(seq, *copy) for copy in self.blocks.ensure_slots(seq.seq_id, seq.num_computed + new)]
            seq.status, seq.admitted_step = Status.RUNNING, self.steps
            self.running.append(seq)
            work.append((seq, new))
            budget -= new
        return budget

    def schedule(self) -> ScheduledStep:
        self.steps += 1
        budget = self.config.max_step_tokens
        work: list[tuple[Sequence, int]] = []
        copies: list[tuple[Sequence, int, int]] = []
        preempted: list[Sequence] = []
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if seq.status is not Status.RUNNING or budget == 0:
                continue
            new = min(seq.num_tokens - seq.num_computed, budget)
            while True:
                try:
                    copies += [(seq, *copy) for copy in self.blocks.ensure_slots(seq.seq_id, seq.num_computed + new)]
                    break
                except NoFreeBlocks:
                    victim = max(self.running, key=lambda s: (s.admitted_step, s.arrival))
                    self._preempt(victim)
                    preempted.append(victim)
                    work = [(s, n) for s, n in work if s is not victim]
                    if victim is seq:
                        break
            if seq.status is Status.RUNNING:
                work.append((seq, new))
                budget -= new
        # Swapped-out sequences come back first (they arrived before any waiting request), and nothing is
        # admitted while one waits.
        if self.swapped and not preempted:
            budget = self._swap_in(budget, work, copies)
        # Admit waiting requests only when nothing was preempted this step, and only while one free block
        # per running sequence remains for its growth: otherwise a new request is admitted, prefilled, and
        # preempted again a few steps later, its prefill wasted (measured: 150 preemptions for 200 requests
        # in benchmarks/bench_serving.py without this rule).
        while self.waiting and budget > 0 and not preempted and not self.swapped:
            seq = self.waiting[0]
            # A request of n completions forks into n sequences after its prefill: count them all now.
            # A prompt whose log-probabilities are asked for is computed, never read from the prefix cache.
            use_cache = seq.params.prompt_logprobs is None
            if len(self.running) + self._width(seq) > self.config.max_num_seqs or \
                    not self.blocks.can_allocate(seq.tokens, len(self.running), budget, use_cache):
                break
            self.waiting.popleft()
            seq.num_computed = self.blocks.allocate(seq.seq_id, seq.tokens, budget, use_cache)
            self.on_admit(seq, seq.num_computed)
            seq.status, seq.admitted_step = Status.RUNNING, self.steps
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.perf_counter()
            self.running.append(seq)
            new = min(seq.num_tokens - seq.num_computed, budget)
            work.append((seq, new))
            budget -= new
        # A preempted sequence's copies would write into blocks it no longer owns.
        return ScheduledStep(work, [tuple(copy) for s, *copy in copies if s not in preempted], preempted)

    def _width(self, seq: Sequence) -> int:
        """Sequences this one will be once forked: n before its first token, 1 after."""
        return seq.params.n if not seq.output_ids else 1

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)
