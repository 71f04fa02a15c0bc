from paperback.evaluation import load_text
from paperback.loading.sources import bundled_model_path
from paperback.loading.tokenizer import tokenizer_from_gguf


def test_cached_tokenizer_equals_a_fresh_conversion(smollm2):
    fresh = tokenizer_from_gguf(bundled_model_path("smollm2"), use_cache=False)
    text = load_text("wikitext2")[:5000] + " <|im_start|> Zürich 東京 🙂"
    assert smollm2.tokenizer.encode(text) == fresh.encode(text)
    assert smollm2.tokenizer.chat_template == fresh.chat_template
    assert smollm2.tokenizer.eos_token_ids == fresh.eos_token_ids


def test_smollm2_chat_template_and_special_tokens(smollm2):
    tok = smollm2.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nHi<|im_end|>" in prompt
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [2]
    assert 2 in tok.eos_token_ids


def test_gemma3_adds_bos_and_has_no_chat_template(gemma3):
    tok = gemma3.tokenizer
    assert tok.encode("Hello")[0] == tok.bos_token_id == 2
    assert tok.chat_template is None
