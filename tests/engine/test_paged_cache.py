"""Several sequences packed in one step through paged blocks give each sequence's own logits."""

import pytest
import torch

from helpers import tiny_hf, tiny_llama_hf
from paperback.engine import BlockManager
from paperback.engine.paged_cache import PagedKVPool, StepBatch, StepSequence
from paperback.engine.pool_layout import pool_layout
from paperback.kv import build_policy
from paperback.loading import load_model


def load_tiny(tmp_path, hf):
    hf.save_pretrained(tmp_path)
    return load_model(str(tmp_path), with_tokenizer=False).model


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_packed_prefill_and_decode_match_each_sequence_alone(tmp_path, kind):
    model = load_tiny(tmp_path, tiny_llama_hf(max_position_embeddings=256) if kind == "llama" else tiny_hf("gemma3"))
    torch.manual_seed(0)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (5, 13, 22)]
    bm = BlockManager(32, block_size=4, prefix_caching=False)
    policy = build_policy(model.config, "fp32")
    pool = PagedKVPool(model.config, policy, pool_layout(model.config, policy, num_blocks=32, block_size=4),
                       torch.float32)
    tokens = {i: list(p) for i, p in enumerate(prompts)}
    for i, p in enumerate(prompts):
        bm.allocate(i, p)
        pool.start(i, 0)

    def step(new: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        # One block manager's tables serve every cache group here (each group's pool has 32 blocks).
        seqs = [StepSequence(i, len(t), bm.seqs[i].num_tokens, (torch.tensor(bm.table(i)),) * len(pool.groups))
                for i, t in new.items()]
        batch = StepBatch(pool, seqs)
        ids = torch.tensor([sum(new.values(), [])])
        with torch.no_grad():
            logits = model(ids, kv_cache=batch, positions=batch.positions)[0]
        ends = torch.tensor([len(t) for t in new.values()]).cumsum(0) - 1
        return {i: logits[e] for i, e in zip(new, ends.tolist())}

    last = step({i: list(p) for i, p in enumerate(prompts)})  # packed prefill of all three
    for _ in range(6):  # packed decode steps
        new = {}
        for i in tokens:
            tokens[i].append(int(last[i].argmax()))
            bm.append_slots(i)
            new[i] = [tokens[i][-1]]
        last = step(new)
    for i, seq in tokens.items():
        with torch.no_grad():
            ref = model(torch.tensor([seq]))[0, -1]
        assert torch.allclose(last[i], ref, atol=1e-4), (i, (last[i] - ref).abs().max())
