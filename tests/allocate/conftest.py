import pytest

from helpers import tiny_llama_hf, write_llama_gguf
from paperback.loading import load_model


class CharTokenizer:
    """Enough of a tokenizer for profiling a tiny random model: one id per character."""

    bos_token_id = None
    adds_bos = False

    def __init__(self, vocab: int):
        self.vocab = vocab

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % self.vocab for c in text]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    # head_dim 32: every KV format's channel groups fit; 512 positions: windows past a short recent window.
    hf = tiny_llama_hf(num_hidden_layers=2, vocab_size=256, hidden_size=128, intermediate_size=192,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return write_llama_gguf(hf, tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture
def tiny_lm(tiny_gguf):
    return load_model(str(tiny_gguf), with_tokenizer=False)


@pytest.fixture
def char_tokenizer():
    return CharTokenizer(256)


@pytest.fixture(scope="module")
def tied_gguf(tmp_path_factory):
    """The tiny model with its head tied to the embedding, so the head is allocated in bands."""
    hf = tiny_llama_hf(num_hidden_layers=2, vocab_size=256, hidden_size=128, intermediate_size=192,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       tie_word_embeddings=True)
    return write_llama_gguf(hf, tmp_path_factory.mktemp("tied") / "tied.gguf")


@pytest.fixture
def tied_lm(tied_gguf):
    return load_model(str(tied_gguf), with_tokenizer=False)
