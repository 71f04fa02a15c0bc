"""Memory planning from a model's configuration: bytes of weights and of KV cache, and what fits."""
