"""The serving engine: block manager, scheduler, model runner over a paged KV cache."""

from paperback.engine.block_manager import BlockManager, NoFreeBlocks

__all__ = ["BlockManager", "NoFreeBlocks"]
