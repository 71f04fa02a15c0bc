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
import math
import time
from dataclasses import dataclass, field, replace

import torch

from paperback.engine.cache_groups import GroupedBlocks, cache_groups, split_blocks
from paperback.engine.paged_cache import PagedKVPool, StepBatch, StepSequence
from paperback.engine.scheduler import Scheduler, SchedulerConfig, Sequence, Status
from paperback.errors import ContextLengthError, PaperbackError
from paperback.generation.generate import IncrementalDetokenizer, _find_stop
from paperback.generation.sampling import SamplingParams, make_generator, sample
from paperback.kv.policy import KVPolicy, build_policy
from paperback.kv.schemes import paged_block_size
from paperback.memory import dtype_bytes


def block_bytes(config, policy: KVPolicy, block_size: int, layers=None) -> int:
    """Bytes one block takes in each of `layers` (default: all), in each layer's format (the same bits the
    formats report)."""
    elements = 2 * config.num_kv_heads * block_size * config.head_dim
    layers = range(config.num_layers) if layers is None else layers
    return sum(math.ceil(elements * policy.scheme_for(i).bits_per_element(config.head_dim) / 8) for i in layers)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" or "length"


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    timings: dict = field(default_factory=dict)  # arrival-relative seconds: first_token, finished; preemptions


@dataclass
class _Request:
    request_id: str
    params: SamplingParams
    seqs: list[Sequence]
    detoks: dict[int, IncrementalDetokenizer]
    texts: dict[int, str]
    forked: bool = False


def default_kv_amax(lm) -> dict:
    """FP8 KV scales calibrated as `paperback eval --kv fp8:scale=calibrated` does: 16 x 512 pydoc tokens."""
    from paperback.kv import calibrate_kv_amax
    from paperback.quantization.calibration import CalibrationConfig, calibration_batch

    if lm.tokenizer is None:
        raise PaperbackError("calibrated FP8 scales need the model's tokenizer, or pass kv_amax")
    batch = calibration_batch(lm.tokenizer, CalibrationConfig("pydoc", num_samples=16, seq_len=512))
    return calibrate_kv_amax(lm.model, batch, progress=False)


class LLMEngine:
    """kv: a KV format for every layer (fp32, fp16, bf16, fp8, int8, int4, kivi2, ...; see paperback.kv),
    or a KVPolicy. The block size grows to a multiple of every format's token group (KIVI: 32).
    Quantized formats also reserve exact staging blocks for each running sequence's recent window.

    Layers that free blocks alike form a cache group with its own pool and block tables
    (`paperback.engine.cache_groups`): sliding-window layers and layers whose format evicts hold only
    their window. `kv_memory` is split between the groups so that each runs out at the same number of
    sequences of `max_model_len` tokens (default: the model's context); `num_blocks` gives every group
    that many blocks instead (or a list: each group its own).
    """

    def __init__(self, lm, kv: str | KVPolicy = "fp32", kv_memory: int | None = None,
                 num_blocks: int | list[int] | None = None,
                 block_size: int = 16, prefix_caching: bool = True, scheduler: SchedulerConfig = SchedulerConfig(),
                 kv_amax: dict | None = None, max_model_len: int | None = None):
        self.lm, self.model, self.tokenizer = lm, lm.model, lm.tokenizer
        config = self.model.config
        policy = kv if isinstance(kv, KVPolicy) else build_policy(config, kv)
        self.policy = policy
        if kv_amax is None and policy.needs_fp8_calibration(config.num_layers):
            kv_amax = default_kv_amax(lm)
        schemes = [policy.scheme_for(i) for i in range(config.num_layers)]
        block_size = paged_block_size(schemes, block_size)
        groups = cache_groups(config, schemes)
        self.max_model_len = config.max_position_embeddings if max_model_len is None else max_model_len
        if self.max_model_len < 1:
            raise PaperbackError(f"max_model_len must be at least 1 token, got {self.max_model_len}")
        if self.max_model_len > config.max_position_embeddings:
            raise PaperbackError(f"max_model_len {self.max_model_len} exceeds the model's context of "
                                 f"{config.max_position_embeddings} tokens")
        stage_blocks = 0
        per_block = [block_bytes(config, policy, block_size, g.layers) for g in groups]
        per_seq = PagedKVPool.stage_blocks_per_seq(block_size, schemes)
        if per_seq:
            # Exact blocks for the sinks and recent window of every running sequence (the scheduler counts a
            # request's n forks before admitting it), plus the blocks one step's new tokens fill before they are
            # encoded.
            stage_blocks = scheduler.max_num_seqs * per_seq + -(-scheduler.max_step_tokens // block_size)
        stage_bytes = stage_blocks * 2 * config.num_layers * config.num_kv_heads * config.head_dim * block_size \
            * dtype_bytes(self.model.dtype)
        if num_blocks is None:
            if kv_memory is None:
                raise PaperbackError("give the KV cache a memory budget (kv_memory) or a number of blocks")
            pools = split_blocks(groups, per_block, kv_memory - stage_bytes, self.max_model_len, block_size,
                                 scheduler.max_step_tokens)
        else:
            pools = [num_blocks] * len(groups) if isinstance(num_blocks, int) else list(num_blocks)
        if min(pools) < 1:
            raise PaperbackError(f"a KV budget of {kv_memory} bytes holds no block of {sum(per_block)} bytes "
                                 f"(after {stage_bytes} bytes of staging for the exact recent windows)")
        salt = json.dumps(policy.to_dict(config.num_layers), sort_keys=True).encode()
        self.blocks = GroupedBlocks(groups, pools, block_size, prefix_caching, salt, scheduler.max_step_tokens)
        self.pool = PagedKVPool(config, policy, pools, block_size, self.model.dtype, stage_blocks,
                                self.model.device, kv_amax, groups)
        self.scheduler = Scheduler(self.blocks, scheduler,
                                   on_admit=lambda seq, cached: self.pool.start(seq.seq_id, cached // block_size),
                                   on_free=lambda seq: self.pool.release(seq.seq_id))
        self.requests: dict[str, _Request] = {}
        self.positions_computed = 0  # token positions run through the model, recomputed ones included
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()

    # --- requests -------------------------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        request_id = request_id or f"req-{next(self._request_ids)}"
        limit = self.max_model_len
        if not prompt_ids:
            raise PaperbackError("the prompt is empty")
        if len(prompt_ids) + params.max_tokens > limit:
            raise ContextLengthError(f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) "
                                     f"exceeds the engine's context of {limit} tokens (max_model_len)")
        seq = Sequence(next(self._seq_ids), request_id, list(prompt_ids), params)
        seq.generator = make_generator(params)
        self.scheduler.add(seq)
        self.requests[request_id] = _Request(request_id, params, [seq], {seq.seq_id: self._detok(prompt_ids)},
                                             {seq.seq_id: ""})
        return request_id

    def abort(self, request_id: str) -> None:
        """Cancel a request: its sequences finish at once and free their blocks."""
        request = self.requests.pop(request_id, None)
        if request:
            for seq in request.seqs:
                if seq.status is not Status.FINISHED:
                    self.scheduler.finish(seq, "abort")

    def _detok(self, prompt_ids):
        return IncrementalDetokenizer(self.tokenizer, prompt_ids) if self.tokenizer else None

    # --- the step ---------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that finished in it."""
        plan = self.scheduler.schedule()
        for group, src, dst in plan.copies:
            self.pool.copy_block(group, src, dst)
        if not plan.work:
            if self.scheduler.waiting and not self.scheduler.running:
                raise PaperbackError("the KV pool cannot hold the next waiting request")
            return []
        device = self.pool.device
        seqs = [StepSequence(s.seq_id, n, s.num_computed + n,
                             tuple(torch.tensor(t, device=device) for t in self.blocks.tables(s.seq_id)))
                for s, n in plan.work]
        batch = StepBatch(self.pool, seqs)
        ids = torch.tensor([[t for s, n in plan.work for t in s.tokens[s.num_computed:s.num_computed + n]]],
                           device=device)
        hidden = self.model.hidden_states(ids, kv_cache=batch, positions=batch.positions)[0]
        self.positions_computed += ids.shape[1]
        ends, samplers = [], []
        offset = 0
        for seq, n in plan.work:
            offset += n
            seq.num_computed += n
            final = self.pool.final_blocks(seq.seq_id, seq.num_computed)
            self.blocks.commit(seq.seq_id, seq.tokens[:seq.num_computed], final)
            self.blocks.evict(seq.seq_id, seq.num_computed)
            if seq.num_computed == seq.num_tokens:  # this step reached its last token: sample the next
                ends.append(offset - 1)
                samplers.append(seq)
        finished: list[RequestOutput] = []
        if samplers:
            logits = self.model.logits(hidden[ends]).float().cpu()  # sampling runs on CPU, seeded per request
            for seq, row in zip(samplers, logits):
                for target in self._fork_if_needed(seq):
                    self._append_token(target, row)
        for request in list(self.requests.values()):
            if all(s.status is Status.FINISHED for s in request.seqs):
                finished.append(self._output(self.requests.pop(request.request_id)))
        return finished

    def _fork_if_needed(self, seq: Sequence) -> list[Sequence]:
        """The n sequences of a request that just finished its prefill (forked here), else seq alone."""
        request = self.requests[seq.request_id]
        if request.forked or request.params.n == 1 or len(request.seqs) > 1:
            request.forked = True
            return [seq]
        request.forked = True
        for i in range(1, request.params.n):
            params = request.params
            child = Sequence(next(self._seq_ids), seq.request_id, list(seq.prompt_ids), params,
                             arrival=seq.arrival, num_computed=seq.num_computed)
            seeded = replace(params, seed=None if params.seed is None else params.seed + i)
            child.generator = make_generator(seeded)
            self.blocks.fork(seq.seq_id, child.seq_id)
            self.pool.fork(seq.seq_id, child.seq_id)
            self.scheduler.add_running(child)
            request.seqs.append(child)
            request.detoks[child.seq_id] = self._detok(seq.prompt_ids)
            request.texts[child.seq_id] = ""
        return list(request.seqs)

    def _append_token(self, seq: Sequence, logits: torch.Tensor) -> None:
        params = seq.params
        token = int(sample(logits[None], params, seq.generator)[0])
        now = time.perf_counter()
        if seq.first_token_time is None:
            seq.first_token_time = now
        request = self.requests[seq.request_id]
        eos = () if params.ignore_eos or self.tokenizer is None else self.tokenizer.eos_token_ids
        if token in eos or token in params.stop_token_ids:
            self.scheduler.finish(seq, "stop")
            return
        seq.output_ids.append(token)
        detok = request.detoks[seq.seq_id]
        if detok is not None:
            text = request.texts[seq.seq_id] + detok.push(token)
            hit = _find_stop(text, params.stop, len(request.texts[seq.seq_id]) - max(map(len, params.stop), default=0))
            if hit is not None:
                request.texts[seq.seq_id] = text[:hit[0]]
                self.scheduler.finish(seq, "stop")
                return
            request.texts[seq.seq_id] = text
        if len(seq.output_ids) >= params.max_tokens:
            self.scheduler.finish(seq, "length")

    def _output(self, request: _Request) -> RequestOutput:
        first = request.seqs[0]
        outputs = [CompletionOutput(i, request.texts[s.seq_id], s.output_ids, s.finish_reason)
                   for i, s in enumerate(request.seqs)]
        firsts = [s.first_token_time for s in request.seqs if s.first_token_time is not None]
        timings = {"time_to_first_token_s": min(firsts) - first.arrival if firsts else None,
                   "total_s": max(s.finish_time for s in request.seqs) - first.arrival,
                   "preemptions": sum(s.preemptions for s in request.seqs)}
        return RequestOutput(request.request_id, first.prompt_ids, outputs, timings)

    def run(self) -> list[RequestOutput]:
        """Step until every request has finished; outputs in the order requests finished."""
        done = []
        while self.scheduler.has_work:
            done += self.step()
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
