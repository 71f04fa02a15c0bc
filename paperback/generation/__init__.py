"""Generation with the contiguous reference cache."""

from paperback.generation.generate import GenerationResult, generate, generate_tokens
from paperback.generation.kv_cache import ContiguousKVCache
from paperback.generation.sampling import SamplingParams, sample

__all__ = ["GenerationResult", "generate", "generate_tokens", "ContiguousKVCache", "SamplingParams", "sample"]
