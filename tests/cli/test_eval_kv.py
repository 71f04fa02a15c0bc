"""`paperback eval --kv`: the cache's format, bits and KL in JSON; a policy file from disk."""

import json

from paperback.cli import main


def test_eval_with_a_kv_policy_file_reports_bits_and_kl(tmp_path, capsys):
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"default": "kivi2", "skip_layers": ["0-1"]}))
    code = main(["eval", "smollm2", "--kv-policy", str(policy), "--context", "256", "--max-windows", "1", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    kv = report["kv"]
    assert kv["layers"][:3] == ["fp16", "fp16", "kivi2"]
    # 256 tokens with a 128-token recent window: 128 tokens at 3 bits, 128 at 16, in 28 of 30 layers.
    expected = (28 * (128 * 3 + 128 * 16) / 256 + 2 * 16) / 30
    assert abs(kv["bits_at_context"]["256"] - expected) < 1e-9
    result = report["results"][0]
    assert result["kl_divergence"] > 0 and result["reference_perplexity"] < result["perplexity"] * 1.5
