"""The engine loop and the offline API: `LLM(model).generate(prompts, SamplingParams(...))`.

One engine step: the scheduler picks sequences and token counts, the block
manager's copy-on-write copies are applied, all new tokens run through the
model packed in one row (`StepBatch`), each sequence whose step reached its
last token samples the next one with its own generator, and sequences that
hit EOS, a stop string or max_tokens finish and free their blocks. With
`n > 1` the prompt is prefilled once and forked into n sequences that share
its blocks.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import replace

import torch

from paperback.engine.cache_groups import GroupedBlocks
from paperback.engine.outputs import (CompletionOutput, CompletionState, RequestOutput, RequestState,  # noqa: F401
                                      TokenLogprob, token_logprob)
from paperback.engine.paged_cache import PagedKVPool, StepBatch, StepSequence
from paperback.engine.pool_layout import pool_layout
from paperback.engine.scheduler import Scheduler, SchedulerConfig, Sequence, Status
from paperback.engine.swap import DEFAULT_SWAP_SPACE, HostSwap
from paperback.errors import PaperbackError
from paperback.generation.generate import check_fits
from paperback.generation.sampling import SamplingParams, apply_penalties, make_generator, sample, sampled_logprobs
from paperback.generation.structured import GrammarMatcher
from paperback.generation.text_stream import TextStream
from paperback.kv.policy import KVPolicy, build_policy


def default_kv_amax(lm) -> dict:
    """FP8 KV scales calibrated as `paperback eval --kv-cache-dtype fp8:scale=calibrated` does: 16 x 512 pydoc
    tokens."""
    from paperback.kv import calibrate_kv_amax
    from paperback.quantization.calibration import CalibrationConfig, calibration_batch

    if lm.tokenizer is None:
        raise PaperbackError("calibrated FP8 scales need the model's tokenizer, or pass kv_amax")
    batch = calibration_batch(lm.tokenizer, CalibrationConfig("pydoc", num_samples=16, seq_len=512))
    return calibrate_kv_amax(lm.model, batch, progress=False)


class LLMEngine:
    """kv: a KV format for every layer (fp32, fp16, bf16, fp8, int8, int4, kivi2, ...; see paperback.kv),
    or a KVPolicy. The block size grows to a multiple of every format's token group (KIVI: 32).
    Quantized formats also reserve exact 16-bit staging for each running sequence's recent window; the
    sequences that run at once are capped so that staging fits the budget (`paperback.engine.pool_layout`,
    which sizes everything here). Prefix-cache hits serve every format: a quantized layer's exact recent window
    and sinks come from kept exact copies (`PagedKVPool.usable_prefix`).

    Layers that free blocks alike form a cache group with its own pool and block tables
    (`paperback.engine.cache_groups`): sliding-window layers and layers whose format evicts hold only
    their window. `kv_memory` is split between the groups so that each runs out at the same number of
    sequences of `max_model_len` tokens (default: the model's context); `num_blocks` gives every group
    that many blocks instead (or a list: each group its own).
    """

    def __init__(self, lm, kv: str | KVPolicy = "fp32", kv_memory: int | None = None,
                 num_blocks: int | list[int] | None = None,
                 block_size: int = 16, prefix_caching: bool = True, scheduler: SchedulerConfig = SchedulerConfig(),
                 kv_amax: dict | None = None, max_model_len: int | None = None, swap_space: int = DEFAULT_SWAP_SPACE):
        self.lm, self.model, self.tokenizer = lm, lm.model, lm.tokenizer
        config = self.model.config
        policy = kv if isinstance(kv, KVPolicy) else build_policy(config, kv)
        self.policy = policy
        if kv_amax is None and policy.needs_fp8_calibration(config.num_layers):
            kv_amax = default_kv_amax(lm)
        self.max_model_len = config.max_position_embeddings if max_model_len is None else max_model_len
        if self.max_model_len < 1:
            raise PaperbackError(f"max_model_len must be at least 1 token, got {self.max_model_len}")
        if self.max_model_len > config.max_position_embeddings:
            raise PaperbackError(f"max_model_len {self.max_model_len} exceeds the model's context of "
                                 f"{config.max_position_embeddings} tokens")
        self.layout = pool_layout(config, policy, kv_memory, num_blocks, block_size, scheduler.max_num_seqs,
                                  scheduler.max_step_tokens, self.max_model_len)
        # Fewer sequences run at once when their exact staging would not fit the budget otherwise.
        scheduler = replace(scheduler, max_num_seqs=self.layout.max_num_seqs)
        block_size = self.layout.block_size
        self.pool = PagedKVPool(config, policy, self.layout, self.model.dtype, self.model.device, kv_amax)
        self.prefix_caching = prefix_caching
        salt = json.dumps(policy.to_dict(config.num_layers), sort_keys=True).encode()
        self.blocks = GroupedBlocks(list(self.layout.groups), list(self.layout.num_blocks), block_size,
                                    self.prefix_caching, salt, scheduler.max_step_tokens, self.pool.usable_prefix)
        self.swap = HostSwap(self.blocks, self.pool, scheduler.preemption, swap_space)
        self.scheduler = Scheduler(self.blocks, scheduler, on_admit=self._admit, on_free=self._release,
                                   swap=self.swap)
        self.requests: dict[str, RequestState] = {}
        self.positions_computed = 0  # token positions run through the model, recomputed ones included
        self.prompt_tokens = 0  # prompt tokens of requests that reached their first token (each counted once)
        self.generation_tokens = 0  # tokens sampled
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()

    # --- requests -------------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise a PaperbackError (ContextLengthError for length) naming why this request could never run here:
        the one check of prompts against the context and the pool, used by every entry point."""
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in prompt_ids):
            raise PaperbackError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        check_fits(len(prompt_ids), params.max_tokens, self.max_model_len,
                   "this engine's context (max_model_len)")
        if params.top_k > self.vocab_size:
            raise PaperbackError(f"top_k {params.top_k} exceeds the vocabulary of {self.vocab_size} tokens")
        if params.largest_token_id() >= self.vocab_size:
            raise PaperbackError(f"token id {params.largest_token_id()} (in logit_bias or stop_token_ids) is not in "
                                 f"the vocabulary of {self.vocab_size} tokens")
        if params.structured is not None and self.tokenizer is None:
            raise PaperbackError("structured output needs the model's tokenizer")
        self.scheduler.check(params, len(prompt_ids))

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        request_id = request_id or f"req-{next(self._request_ids)}"
        if request_id in self.requests:
            raise PaperbackError(f"request id {request_id} is already in use")
        prompt_ids = list(prompt_ids)
        self.check_request(prompt_ids, params)
        seq = Sequence(next(self._seq_ids), request_id, prompt_ids, params)
        request = RequestState(request_id, params, prompt_ids, [seq])
        request.completions[seq.seq_id] = self._completion(prompt_ids, params)
        seq.generator = make_generator(params)
        self.scheduler.add(seq)
        self.requests[request_id] = request
        return request_id

    def _completion(self, prompt_ids: list[int], params: SamplingParams,
                    matcher: GrammarMatcher | None = None) -> CompletionState:
        stream = TextStream(self.tokenizer, prompt_ids, params.stop) if self.tokenizer else None
        if matcher is None and params.structured is not None:
            matcher = GrammarMatcher(params.structured, self.tokenizer, self._stop_ids(params), self.vocab_size)
        return CompletionState(stream, matcher)

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        eos = frozenset() if params.ignore_eos or self.tokenizer is None else self.tokenizer.eos_token_ids
        return eos | frozenset(params.stop_token_ids)

    def abort(self, request_id: str) -> None:
        """Cancel a request: its sequences finish at once and free their blocks."""
        request = self.requests.pop(request_id, None)
        if request:
            for seq in request.seqs:
                if seq.status is not Status.FINISHED:
                    self.scheduler.finish(seq, "abort")

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_swapped(self) -> int:
        return len(self.scheduler.swapped)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # --- the step ---------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns what each request reports of it (by its output_kind: by default the
        requests that finished). A request that fails inside the step finishes alone with `error` set."""
        plan = self.scheduler.schedule()
        for group, src, dst in plan.copies:
            self.pool.copy_block(group, src, dst)
        if not plan.work:
            if (self.scheduler.waiting or self.scheduler.swapped) and not self.scheduler.running:
                raise PaperbackError("the KV pool cannot hold the next waiting request")
            return []
        started = time.perf_counter()
        device = self.pool.device
        seqs = [StepSequence(s.seq_id, n, s.num_computed + n,
                             tuple(torch.tensor(t, device=device) for t in self.blocks.tables(s.seq_id)))
                for s, n in plan.work]
        touched = {s.request_id for s, _ in plan.work}
        try:
            batch = StepBatch(self.pool, seqs)
            ids = torch.tensor([[t for s, n in plan.work for t in s.tokens[s.num_computed:s.num_computed + n]]],
                               device=device)
            hidden = self.model.hidden_states(ids, kv_cache=batch, positions=batch.positions)[0]
        except Exception as exc:  # the model failed on this step's batch: its requests fail, the others go on
            for request_id in touched:
                self._fail(self.requests[request_id], exc)
            return self._outputs(touched)
        self.positions_computed += ids.shape[1]
        self.swap.observe_step(ids.shape[1], len(plan.work), time.perf_counter() - started)
        ends, samplers = [], []
        offset = 0
        for seq, n in plan.work:
            if self.requests[seq.request_id].params.prompt_logprobs is not None:
                self._score_prompt(seq, hidden[offset:offset + n])
            offset += n
            seq.num_computed += n
            self._commit(seq, self.pool.final_blocks(seq.seq_id, seq.num_computed))
            self.blocks.evict(seq.seq_id, seq.num_computed)
            if seq.num_computed == seq.num_tokens:  # this step reached its last token: sample the next
                ends.append(offset - 1)
                samplers.append(seq)
        if samplers:
            logits = self.model.logits(hidden[ends]).float().cpu()  # sampling runs on CPU, seeded per request
            for seq, row in zip(samplers, logits):
                request = self.requests[seq.request_id]
                if not request.prompt_counted:
                    request.prompt_counted = True
                    self.prompt_tokens += len(request.prompt_ids)
                try:
                    if request.params.max_tokens == 0:  # the prompt alone was to be scored
                        self.scheduler.finish(seq, "length")
                        continue
                    for target in self._fork_if_needed(seq):
                        self._append_token(target, row)
                except Exception as exc:  # bad state of this request alone (a grammar dead end, a sampler error)
                    self._fail(request, exc)
        return self._outputs(touched)

    def _admit(self, seq: Sequence, cached_tokens: int) -> None:
        names = self.blocks.hashes(seq.seq_id) if self.prefix_caching else None
        self.pool.start(seq.seq_id, cached_tokens // self.layout.block_size, names)

    def _commit(self, seq: Sequence, final_blocks: int) -> None:
        """Register the sequence's final blocks in the prefix cache; the pool learns their names."""
        if self.prefix_caching:
            self.blocks.commit(seq.seq_id, seq.tokens[:seq.num_computed], final_blocks)
            self.pool.name(seq.seq_id, self.blocks.hashes(seq.seq_id))

    def _release(self, seq: Sequence) -> None:
        """A sequence leaves the pool (finished, aborted, or preempted to be recomputed): with prefix caching,
        its recent window is encoded first so that the cache keeps all of its full blocks."""
        if self.prefix_caching and self.pool.quantized and seq.finish_reason != "error" \
                and seq.seq_id in self.pool.seqs:
            self._commit(seq, self.pool.finalize(seq.seq_id, self.blocks.tables(seq.seq_id), seq.num_computed))
        self.pool.release(seq.seq_id)

    def _outputs(self, touched: set[str]) -> list[RequestOutput]:
        outputs = []
        for request_id in touched:
            request = self.requests.get(request_id)
            if request is None:
                continue
            output = request.output()
            if request.finished:
                self.requests.pop(request_id)
            if output is not None:
                outputs.append(output)
        return outputs

    def _fail(self, request: RequestState, exc: Exception) -> None:
        request.error = str(exc) or type(exc).__name__
        for seq in request.seqs:
            if seq.status is not Status.FINISHED:
                self.scheduler.finish(seq, "error")

    def _score_prompt(self, seq: Sequence, hidden: torch.Tensor) -> None:
        """Log-probabilities of the prompt tokens this chunk's positions predict (position p predicts p + 1)."""
        request = self.requests[seq.request_id]
        if request.prompt_scored:
            return  # recomputed after a preemption
        if request.prompt_logprobs is None:
            request.prompt_logprobs = [None]
        start, prompt = seq.num_computed, request.prompt_ids
        top = request.params.prompt_logprobs
        for lo in range(0, hidden.shape[0], 64):  # a vocabulary-wide row per position: a few at a time
            rows = torch.log_softmax(self.model.logits(hidden[lo:lo + 64]).float().cpu(), dim=-1)
            for i, row in enumerate(rows):
                target = start + lo + i + 1
                if target < len(prompt) and target == len(request.prompt_logprobs):
                    request.prompt_logprobs.append(token_logprob(row, prompt[target], top))

    def _fork_if_needed(self, seq: Sequence) -> list[Sequence]:
        """The n sequences of a request that just finished its prefill (forked here), else seq alone."""
        request = self.requests[seq.request_id]
        if request.forked or request.params.n == 1 or len(request.seqs) > 1:
            request.forked = True
            return [seq]
        request.forked = True
        parent = request.completions[seq.seq_id]
        for i in range(1, request.params.n):
            params = request.params
            child = Sequence(next(self._seq_ids), seq.request_id, list(seq.prompt_ids), params,
                             arrival=seq.arrival, num_computed=seq.num_computed)
            child.first_scheduled_time = seq.first_scheduled_time
            seeded = replace(params, seed=None if params.seed is None else (params.seed + i) % 2 ** 64)
            child.generator = make_generator(seeded)
            self.blocks.fork(seq.seq_id, child.seq_id)
            self.pool.fork(seq.seq_id, child.seq_id)
            self.scheduler.add_running(child)
            request.seqs.append(child)
            matcher = parent.matcher.fork() if parent.matcher else None
            request.completions[child.seq_id] = self._completion(seq.prompt_ids, params, matcher)
        return list(request.seqs)

    def _append_token(self, seq: Sequence, logits: torch.Tensor) -> None:
        params = seq.params
        state = self.requests[seq.request_id].completions[seq.seq_id]
        logits = apply_penalties(logits, params, seq.prompt_ids, seq.output_ids)
        if state.matcher is not None:
            allowed = state.matcher.allowed()
            if not allowed.any():
                raise PaperbackError("the grammar allows no next token")
            logits = logits.masked_fill(~allowed, float("-inf"))
        token = int(sample(logits[None], params, seq.generator)[0])
        self.generation_tokens += 1
        now = time.perf_counter()
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.token_times.append(now)
        if params.logprobs is not None:
            state.logprobs.append(token_logprob(sampled_logprobs(logits[None], params)[0], token, params.logprobs))
        if token in self._stop_ids(params):
            state.stop_reason = token if token in params.stop_token_ids else None  # EOS has none, as in vLLM
            self.scheduler.finish(seq, "stop")
            return
        if state.matcher is not None:
            state.matcher.accept(token)
        seq.output_ids.append(token)
        if state.stream is not None and state.stream.push(token):
            state.stop_reason = state.stream.stop_string
            self.scheduler.finish(seq, "stop")
            return
        if len(seq.output_ids) >= params.max_tokens:
            self.scheduler.finish(seq, "length")
        elif state.matcher is not None and state.matcher.done:
            self.scheduler.finish(seq, "stop")

    def stats(self) -> dict:
        """Queue depths, pool use and prefix-cache counts, for metrics and monitoring."""
        return {"running": self.num_running, "waiting": self.num_waiting, "swapped": self.num_swapped,
                "blocks_used": self.blocks.num_used,
                "blocks_free": self.blocks.num_free, "kv_cache_usage": self.blocks.usage,
                "prefix_query_tokens": self.blocks.prefix_query_tokens,
                "prefix_hit_tokens": self.blocks.prefix_hit_tokens, "prefix_hit_rate": self.blocks.prefix_hit_rate,
                "preemptions": self.scheduler.preemptions, "prompt_tokens": self.prompt_tokens,
                "generation_tokens": self.generation_tokens, **self.swap.stats()}

    def run(self) -> list[RequestOutput]:
        """Step until every request has finished; the finished outputs in the order requests finished."""
        done = []
        while self.scheduler.has_work:
            done += [o for o in self.step() if o.finished]
        return done


class LLM:
    """Offline batch generation through the paged engine.

    LLM("smollm2", kv="fp16", kv_memory=2 * 2**30).generate(["Hello"], SamplingParams(max_tokens=32))
    """

    def __init__(self, model="smollm2", dtype: str = "fp32", kv: str | KVPolicy | None = None,
                 kv_memory: int | None = 2 ** 30, **engine_args):
        """kv: a format or policy; None: the policy a fitted checkpoint carries, else fp32."""
        from paperback.loading import LoadedModel, load_model
        from paperback.quantization.checkpoint import checkpoint_kv_policy

        lm = model if isinstance(model, LoadedModel) else load_model(model, dtype)
        if kv is None:
            fitted = checkpoint_kv_policy(lm.source.path)
            kv = build_policy(lm.config, spec=fitted) if fitted else "fp32"
        self.engine = LLMEngine(lm, kv=kv, kv_memory=kv_memory, **engine_args)
        self.tokenizer = lm.tokenizer

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] = SamplingParams()
                 ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in prompt order (token-id prompts are used as given)."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = []
        for prompt, p in zip(prompts, params_list):
            prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            ids.append(self.engine.add_request(prompt_ids, p))
        results = {r.request_id: r for r in self.engine.run()}
        return [results[i] for i in ids]
