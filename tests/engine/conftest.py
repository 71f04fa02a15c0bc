import pytest

from helpers import tiny_llama_hf
from paperback.loading import load_model


@pytest.fixture(scope="module")
def tiny32(tmp_path_factory):
    """A 2-layer Llama with 128-wide hidden states (heads of 32 channels: every KV format's groups fit)."""
    path = tmp_path_factory.mktemp("tiny32")
    tiny_llama_hf(max_position_embeddings=512, hidden_size=128, num_hidden_layers=2).save_pretrained(path)
    return load_model(str(path), with_tokenizer=False)
