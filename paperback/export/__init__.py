"""Checkpoints in the formats other engines load (llama.cpp's GGUF so far)."""
