import torch

from helpers import max_rel_error
from paperback.generation import ContiguousKVCache, SamplingParams, generate, generate_tokens
from paperback.generation.generate import IncrementalDetokenizer


def test_cached_decoding_equals_full_forward(smollm2, gemma3):
    """Logits of prefill + one-token steps through the cache equal one full forward."""
    for lm in (smollm2, gemma3):
        torch.manual_seed(0)
        ids = torch.randint(100, 5000, (2, 40))
        cache = ContiguousKVCache(lm.config, 2, 40, torch.float32)
        with torch.no_grad():
            full = lm.model(ids)
            steps = [lm.model(ids[:, :30], 0, cache)]
            for pos in range(30, 40):
                steps.append(lm.model(ids[:, pos:pos + 1], pos, cache))
        assert max_rel_error(torch.cat(steps, 1), full) < 1e-5


def test_a_16_bit_cache_under_an_fp32_model(smollm2, gemma3):
    """An fp16 (or bf16) cache for an fp32 model: prefill attends over the rounded keys, decode steps read them
    in place (Gemma past its window too); the logits stay near the fp32 cache's, greedy text mostly the same."""
    torch.manual_seed(0)
    for lm, length, dtypes in ((smollm2, 40, (torch.float16, torch.bfloat16)), (gemma3, 520, (torch.float16,))):
        ids = torch.randint(100, 5000, (1, length))
        with torch.no_grad():
            full = lm.model(ids)[:, -9:]
            for dtype in dtypes:
                cache = ContiguousKVCache(lm.config, 1, length, dtype)
                assert cache.keys[0].dtype == dtype
                steps = [lm.model(ids[:, :length - 9], 0, cache)[:, -1:]]
                steps += [lm.model(ids[:, p:p + 1], p, cache) for p in range(length - 9, length)]
                error = max_rel_error(torch.cat(steps, 1)[:, 1:], full)
                assert 0 < error < (0.01 if dtype == torch.float16 else 0.05)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    text = generate(smollm2, "The history of the Roman Empire", params).token_ids
    half = generate(smollm2, "The history of the Roman Empire", params, cache_dtype=torch.float16).token_ids
    assert sum(a == b for a, b in zip(text, half)) >= 12


def test_sliding_window_cache_beyond_the_window(gemma3):
    """Decoding past Gemma's 512-token window through the cache equals a full forward."""
    torch.manual_seed(1)
    ids = torch.randint(100, 5000, (1, 530))
    cache = ContiguousKVCache(gemma3.config, 1, 530, torch.float32)
    with torch.no_grad():
        full = gemma3.model(ids)[:, -12:]
        gemma3.model(ids[:, :500], 0, cache)
        steps = [gemma3.model(ids[:, 500:518], 500, cache)]  # a chunk crossing the window edge
        steps += [gemma3.model(ids[:, p:p + 1], p, cache) for p in range(518, 530)]
    assert max_rel_error(torch.cat(steps, 1)[:, -12:], full) < 1e-5


def test_streamed_text_equals_final_text_and_decode(smollm2):
    pieces = []
    r = generate(smollm2, "The history of the Roman Empire", SamplingParams(max_tokens=40, ignore_eos=True),
                 on_text=pieces.append)
    assert "".join(pieces) == r.text == smollm2.tokenizer.decode(r.token_ids)
    assert r.finish_reason == "length" and len(r.token_ids) == 40


def test_stop_string_truncates_and_is_never_streamed(smollm2):
    free = generate(smollm2, "The history of the Roman Empire", SamplingParams(max_tokens=40, ignore_eos=True))
    words = free.text.split()
    stop = " " + words[len(words) // 2]
    pieces = []
    r = generate(smollm2, "The history of the Roman Empire",
                 SamplingParams(max_tokens=40, ignore_eos=True, stop=(stop,)), on_text=pieces.append)
    assert r.finish_reason == "stop" and r.stop_reason == stop
    assert r.text == free.text[:free.text.index(stop)]
    assert "".join(pieces) == r.text


def test_chat_generation_stops_at_end_of_turn(smollm2):
    r = generate(smollm2, "What is the capital of France?", SamplingParams(max_tokens=60), chat=True)
    assert r.finish_reason == "stop" and r.stop_reason in smollm2.tokenizer.end_of_turn_ids
    assert "Paris" in r.text


def test_seeded_sampling_is_repeatable(smollm2):
    p = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, top_k=40, seed=7, ignore_eos=True)
    assert generate(smollm2, "Once upon a time", p).token_ids == generate(smollm2, "Once upon a time", p).token_ids


def test_batch_rows_decode_like_single_rows(smollm2, wikitext_ids):
    ids = torch.tensor([wikitext_ids[:32], wikitext_ids[100:132]])
    batch = torch.stack(list(generate_tokens(smollm2.model, ids, SamplingParams(max_tokens=12))), 1)
    for row in range(2):
        single = torch.stack(list(generate_tokens(smollm2.model, ids[row:row + 1], SamplingParams(max_tokens=12))), 1)
        assert batch[row].tolist() == single[0].tolist()


def test_incremental_detokenizer_handles_multibyte_characters(gemma3):
    tok = gemma3.tokenizer
    text = "Zürich – 東京 naïve café 🙂 end"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    assert "".join(detok.push(i) for i in ids) == tok.decode(ids)
