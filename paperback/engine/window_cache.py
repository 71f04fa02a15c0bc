"""The paged engine's storage as the cache `evaluate()` feeds a window through: eval measures what is served.

`paperback eval --kv-cache-dtype FORMAT --paged` scores each window through a
`PagedKVPool` and `StepBatch`, the same blocks, staging, encoding and paged
attention that `paperback serve` decodes with, instead of the dense
`QuantizedKVCache`. The two agree up to summation order (tests/engine).
"""

from __future__ import annotations

import torch

from paperback.engine.block_manager import BlockManager
from paperback.engine.paged_cache import PagedKVPool, StepBatch, StepSequence
from paperback.engine.pool_layout import layer_schemes, pool_layout
from paperback.errors import PaperbackError
from paperback.kv.policy import KVPolicy
from paperback.kv.schemes import paged_block_size
from paperback.models.cache import KVCache

SEQ_ID = 0


class PagedWindowCache(KVCache):
    """One sequence of up to `max_len` tokens in its own pool; each model call is one step of it."""

    owns_attention = True

    def __init__(self, model, policy: KVPolicy, max_len: int, chunk: int, kv_amax: dict | None = None,
                 block_size: int = 16):
        block_size = paged_block_size(layer_schemes(model.config, policy), block_size)
        num_blocks = -(-max_len // block_size)
        # Sized as the engine sizes it for one running sequence: its sinks, its recent window and one step.
        self.layout = pool_layout(model.config, policy, num_blocks=num_blocks, block_size=block_size,
                                  max_num_seqs=1, max_step_tokens=chunk)
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching=False)
        self.blocks.allocate(SEQ_ID, [0] * max_len)
        self.pool = PagedKVPool(model.config, policy, self.layout, model.dtype, model.device, kv_amax)
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
