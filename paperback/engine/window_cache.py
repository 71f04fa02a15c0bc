"""The paged engine's storage as the cache `evaluate()` feeds a window through: eval measures what is served.

`paperback eval --kv FORMAT --paged` scores each window through a
`PagedKVPool` and `StepBatch`, the same blocks, staging, encoding and paged
attention that `paperback serve` decodes with, instead of the dense
`QuantizedKVCache`. The two agree up to summation order (tests/engine).
"""

from __future__ import annotations

import math

import torch

from paperback.engine.block_manager import BlockManager
from paperback.engine.paged_cache import PagedKVPool, StepBatch, StepSequence
from paperback.errors import PaperbackError
from paperback.kv.policy import KVPolicy

SEQ_ID = 0


class PagedWindowCache:
    """One sequence of up to `max_len` tokens in its own pool; each model call is one step of it."""

    def __init__(self, model, policy: KVPolicy, max_len: int, chunk: int, kv_amax: dict | None = None,
                 block_size: int = 16):
        config = model.config
        schemes = [policy.scheme_for(i) for i in range(config.num_layers)]
        block_size = math.lcm(block_size, *(s.flush_group for s in schemes))
        # As the engine sizes it for one running sequence: its sinks and recent window plus one step's new tokens.
        per_seq = PagedKVPool.stage_blocks_per_seq(block_size, schemes)
        stage = per_seq + -(-chunk // block_size) if per_seq else 0
        self.blocks = BlockManager(-(-max_len // block_size), block_size, prefix_caching=False)
        self.blocks.allocate(SEQ_ID, [0] * max_len)
        self.pool = PagedKVPool(config, policy, self.blocks.num_blocks, block_size, model.dtype, stage,
                                model.device, kv_amax)
        self.pool.start(SEQ_ID, 0)
        # Every cache group's pool has the window's blocks: one table serves them all (nothing is evicted).
        table = torch.tensor(self.blocks.table(SEQ_ID), device=model.device)
        self.tables = (table,) * len(self.pool.groups)
        self.chunk = chunk
        self.length = 0
        self.step: StepBatch | None = None

    def attention(self, layer_idx: int, q, k, v, scaling: float, window: int | None) -> torch.Tensor:
        if layer_idx == 0:  # the first layer of a new model call: the next chunk of the window
            new = q.shape[2]
            if new > self.chunk:
                raise PaperbackError(f"a step of {new} tokens is longer than the {self.chunk} this cache stages")
            self.length += new
            self.step = StepBatch(self.pool, [StepSequence(SEQ_ID, new, self.length, self.tables)])
        return self.step.attention(layer_idx, q, k, v, scaling, window)

    def nbytes(self) -> int:
        return self.pool.nbytes

    @classmethod
    def factory(cls, model, policy: KVPolicy, chunk: int, kv_amax: dict | None = None):
        """A function of n making a paged cache for a window of n tokens (what evaluate() takes)."""
        return lambda n: cls(model, policy, n, chunk, kv_amax)
