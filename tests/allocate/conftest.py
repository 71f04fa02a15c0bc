import pytest
import torch

from helpers import CharTokenizer, tiny_llama_hf, write_llama_gguf
from paperback.allocate.gguf_fit import GGUFFit, GGUFFitConfig
from paperback.loading import load_model
from paperback.loading.sources import bundled_model_path


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


# A GGUF fit small enough for the suite; the fixtures below are built once per session, every module shares them
SMALL_GGUF_FIT = {"calib_samples": 4, "window_tokens": 128, "probe_windows": 2, "probe_tokens": 64, "check_windows": 2,
         "eval_windows": 2, "eval_context": 128, "check_samples": 4}


@pytest.fixture(scope="session")
def tok_gguf(tmp_path_factory):
    """A tiny tied Llama with SmolLM2's tokenizer: rows of 64 (legacy types only) and an MLP of 256 (whose
    down projection k-quants tile)."""
    hf = tiny_llama_hf(num_hidden_layers=2, vocab_size=49152, hidden_size=64, intermediate_size=256,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                       max_position_embeddings=1024)
    with torch.no_grad():  # random weights sharp enough that a quantized tensor moves the output clearly
        for name, p in hf.named_parameters():
            if p.dim() == 2:
                p.mul_(50 if "embed" in name else 5)
    return write_llama_gguf(hf, tmp_path_factory.mktemp("tok") / "tok.gguf", tokenizer_from=bundled_model_path("smollm2"))


@pytest.fixture(scope="session")
def fitted(tok_gguf, tmp_path_factory):
    """One fit at 4 MB and its result."""
    work = tmp_path_factory.mktemp("fit")
    fit = GGUFFit(str(tok_gguf), GGUFFitConfig(**SMALL_GGUF_FIT), work / "fit.gguf", size=4_000_000,
                  cache_dir=work / "cache", progress=False)
    return fit, fit.run()


@pytest.fixture(scope="session")
def plain_gguf(tmp_path_factory):
    """A tiny Llama with no tokenizer: the checks below refuse before anything would need one."""
    hf = tiny_llama_hf(num_hidden_layers=2, vocab_size=256, hidden_size=64, intermediate_size=256,
                       num_attention_heads=4, num_key_value_heads=2)
    return write_llama_gguf(hf, tmp_path_factory.mktemp("plain") / "plain.gguf")


@pytest.fixture
def small_gguf_fit_config():
    return GGUFFitConfig(**SMALL_GGUF_FIT)
