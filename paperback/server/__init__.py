"""The OpenAI-compatible HTTP server over the paged engine."""
