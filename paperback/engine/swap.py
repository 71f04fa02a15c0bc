"""Preemption by swapping: a preempted sequence's KV blocks copied to host memory and back, when cheaper.

When the pool runs out of blocks the scheduler preempts the newest running
sequence. Recomputation (vLLM's default) frees its blocks and prefills its
prompt and output again later: cheap for a short sequence, a whole prefill
for a long one. Swapping copies its blocks (and, in quantized formats, its
staged exact tokens) out of the pool into host memory and back into fresh
blocks when the pool has room: a copy of its bytes twice, however long it
is, bounded by `swap_space`. On a GPU host memory is the CPU's; on a CPU
engine it is memory outside the KV budget the pool was sized to.

`mode` picks: "recompute", "swap" (when the swap space has room, else
recompute), or "auto": swap when the copy, out and back, is predicted to
cost less than the prefill it saves. Both sides are measured here, not
assumed: the copy's fixed cost and cost per byte are timed on the pool
when first needed, and the prefill cost per token is the engine's own steps' (a running
mean of step seconds per token over steps that prefill).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cached_property

import torch

from paperback.engine.block_manager import EVICTED
from paperback.engine.cache_groups import GroupedBlocks
from paperback.engine.paged_cache import PagedKVPool, SwappedKV
from paperback.errors import PaperbackError

PREEMPTION_MODES = ("recompute", "swap", "auto")
DEFAULT_SWAP_SPACE = 4 * 2 ** 30  # bytes of host memory for swapped-out blocks (vLLM's default, 4 GiB)


def check_preemption(mode: str) -> None:
    if mode not in PREEMPTION_MODES:
        raise PaperbackError(f"preemption must be one of {', '.join(PREEMPTION_MODES)}, got {mode!r}")


@dataclass
class SwappedSequence:
    blocks: list  # per cache group, the block manager's saved table (`BlockManager.swap_out`)
    kv: SwappedKV


class HostSwap:
    """Swaps sequences out of the pool (`GroupedBlocks` and `PagedKVPool` both) and back; decides, per
    preemption, whether swapping beats recomputation."""

    def __init__(self, blocks: GroupedBlocks, pool: PagedKVPool, mode: str = "auto",
                 capacity: int = DEFAULT_SWAP_SPACE):
        check_preemption(mode)
        if capacity < 0:
            raise PaperbackError(f"swap_space must be at least 0 bytes, got {capacity}")
        self.blocks, self.pool, self.mode, self.capacity = blocks, pool, mode, capacity
        self.saved: dict[int, SwappedSequence] = {}
        self.used = 0  # bytes held for swapped-out sequences
        self.swaps_out = self.swaps_in = 0
        self.bytes_moved = 0
        self.seconds = 0.0  # spent copying, out and in
        self.recomputes = 0  # preemptions left to recomputation
        self._prefill_seconds = self._prefill_tokens = 0.0

    # --- the cost model ------------------------------------------------------------------------------------
    @cached_property
    def _copy_cost(self) -> tuple[float, float]:
        """(seconds per copy, seconds per byte) of copying blocks out of every layer, timed on one block and on
        up to 32 (the best of three each), so `predicted_copy_seconds` is measured on this pool. Timed when
        first asked (an engine that never preempts never pays for it). The fixed cost is the one-block copy
        and the cost per byte the whole of the larger copy's time over its bytes: a slight overestimate, never
        zero (the difference of two short timings can be, on a small pool)."""
        def best(ids: torch.Tensor) -> tuple[float, int]:
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                moved = sum(t.index_select(0, ids).cpu().nbytes for layer in self.pool.layers for t in layer.tensors())
                times.append(time.perf_counter() - t0)
            return min(times), moved

        many = min(32, min(self.pool.num_blocks))
        one_s, one_b = best(torch.zeros(1, dtype=torch.long, device=self.pool.device))
        many_s, many_b = best(torch.arange(many, device=self.pool.device))
        return one_s, many_s / many_b

    @property
    def copy_fixed(self) -> float:
        return self._copy_cost[0]

    @property
    def copy_per_byte(self) -> float:
        return self._copy_cost[1]

    def observe_step(self, tokens: int, sequences: int, seconds: float) -> None:
        """An engine step's size and time: steps with more tokens than sequences prefill, and price recompute."""
        if tokens > sequences:
            self._prefill_seconds += seconds
            self._prefill_tokens += tokens

    def predicted_copy_seconds(self, nbytes: int) -> float:
        """Out and back in."""
        return 2 * (self.copy_fixed + self.copy_per_byte * nbytes)

    @property
    def prefill_seconds_per_token(self) -> float | None:
        """The engine's measured prefill cost per token (None: no prefill measured yet)."""
        return self._prefill_seconds / self._prefill_tokens if self._prefill_tokens else None

    def predicted_recompute_seconds(self, tokens: int) -> float | None:
        """Prefilling `tokens` again at the engine's measured prefill speed (None: no prefill measured yet)."""
        per_token = self.prefill_seconds_per_token
        return None if per_token is None else tokens * per_token

    def held_bytes(self, seq_id: int) -> int:
        """Bytes a swap-out of the sequence would copy: its blocks in every layer and its staging."""
        tables = self.blocks.tables(seq_id)
        total = 0
        for layer in self.pool.layers:
            held = sum(1 for b in tables[layer.group] if b != EVICTED)
            total += held * sum(t[0].numel() * t.element_size() for t in layer.tensors())
            if not layer.native:
                staged = len(self.pool.seqs[seq_id].stage)
                total += staged * 2 * layer.stage_keys[0].numel() * layer.stage_keys.element_size()
        return total

    def should_swap(self, seq) -> bool:
        if self.mode == "recompute":
            return False
        nbytes = self.held_bytes(seq.seq_id)
        if self.used + nbytes > self.capacity:
            return False
        if self.mode == "swap":
            return True
        recompute = self.predicted_recompute_seconds(seq.num_computed)
        return recompute is not None and self.predicted_copy_seconds(nbytes) < recompute

    # --- moving bytes --------------------------------------------------------------------------------------
    def swap_out(self, seq) -> bool:
        """Swap a preempted sequence out when the mode and the swap space say so (its blocks are then free);
        False: the caller frees its blocks for recomputation."""
        if not self.should_swap(seq):
            self.recomputes += 1
            return False
        t0 = time.perf_counter()
        kv = self.pool.swap_out(seq.seq_id, [list(t) for t in self.blocks.tables(seq.seq_id)])
        self.saved[seq.seq_id] = SwappedSequence(self.blocks.swap_out(seq.seq_id), kv)
        self.used += kv.nbytes
        self.bytes_moved += kv.nbytes
        self.swaps_out += 1
        self.seconds += time.perf_counter() - t0
        return True

    def can_swap_in(self, seq, keep_free: int = 0) -> bool:
        saved = self.saved[seq.seq_id]
        return self.blocks.can_swap_in(saved.blocks, keep_free) and self.pool.can_swap_in(saved.kv)

    def swap_in(self, seq) -> None:
        t0 = time.perf_counter()
        saved = self.saved.pop(seq.seq_id)
        tables = self.blocks.swap_in(seq.seq_id, saved.blocks)
        self.pool.swap_in(seq.seq_id, saved.kv, tables)
        self.used -= saved.kv.nbytes
        self.bytes_moved += saved.kv.nbytes
        self.swaps_in += 1
        self.seconds += time.perf_counter() - t0

    def drop(self, seq) -> None:
        """A swapped-out sequence finished without coming back (aborted): its host copy goes."""
        saved = self.saved.pop(seq.seq_id, None)
        if saved is not None:
            self.used -= saved.kv.nbytes

    def stats(self) -> dict:
        return {"preemption": self.mode, "swap_space": self.capacity, "swap_used": self.used,
                "swaps_out": self.swaps_out, "swaps_in": self.swaps_in, "recomputes": self.recomputes,
                "swap_bytes": self.bytes_moved, "swap_seconds": self.seconds}
