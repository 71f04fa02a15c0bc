"""MoEfication: balanced clustering, exactness when every expert runs, and a written directory that
transformers and paperback load alike."""

import json

import pytest
import torch

from helpers import SMALL, max_rel_error
from paperback.errors import PaperbackError
from paperback.moefy.build import MoefyConfig, moefy
from paperback.moefy.clustering import balanced_kmeans


def test_balanced_kmeans_gives_equal_clusters_and_finds_planted_ones():
    torch.manual_seed(0)
    centres = torch.randn(4, 16) * 3
    points = torch.cat([centres[c] + 0.3 * torch.randn(10, 16) for c in range(4)])
    labels = balanced_kmeans(points, 4, seed=1)
    assert torch.bincount(labels).tolist() == [10] * 4
    for c in range(4):  # each planted group lands in one cluster
        assert len(set(labels[c * 10:(c + 1) * 10].tolist())) == 1


@pytest.fixture(scope="module")
def dense(tmp_path_factory, smollm2):
    """A tiny random Llama with SmolLM2's tokenizer (calibration needs real text)."""
    import transformers as tf

    from paperback.loading import load_model

    path = tmp_path_factory.mktemp("dense")
    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(**{**SMALL, "vocab_size": smollm2.config.vocab_size})).save_pretrained(path)
    smollm2.tokenizer.hf.save_pretrained(path)
    return load_model(str(path))


def calibration(lm, samples=8, length=64):
    from paperback.quantization.calibration import CalibrationConfig, calibration_batch

    return calibration_batch(lm.tokenizer, CalibrationConfig(num_samples=samples, seq_len=length))


@pytest.mark.parametrize("shared", [0.0, 0.5])
def test_every_expert_running_reproduces_the_dense_model(dense, shared):
    """k = E: the equal weights (1/k each, to ROUTER_SPREAD) times k-scaled down projections are the dense MLP."""
    config = MoefyConfig(num_experts=4, experts_per_token=4, shared_fraction=shared, compensate=False)
    moe, reports = moefy(dense.model, calibration(dense), config, progress=False)
    assert moe.config.family == "moe" and moe.config.moe.shared_gate == (shared > 0)
    ids = torch.randint(0, 1000, (2, 24))
    with torch.no_grad():
        assert max_rel_error(moe(ids), dense.model(ids)) < 5e-3
    assert all(r.router_recall == 1.0 and r.error_routed < 5e-3 for r in reports)


def test_fewer_experts_cost_accuracy_and_refitting_recovers_some(dense):
    ids = torch.randint(0, 1000, (2, 24))
    errors = {}
    for compensate in (False, True):
        config = MoefyConfig(num_experts=4, experts_per_token=2, compensate=compensate)
        moe, reports = moefy(dense.model, calibration(dense, 16), config, progress=False)
        with torch.no_grad():
            errors[compensate] = max_rel_error(moe(ids), dense.model(ids))
        assert all(r.error <= r.error_routed + 1e-6 for r in reports) and all(r.router_recall > 0.5 for r in reports)
    assert 1e-2 < errors[True] < errors[False]


@pytest.mark.parametrize("shared, kind", [(0.0, "MixtralForCausalLM"), (0.5, "Qwen2MoeForCausalLM")])
def test_cli_writes_a_directory_transformers_and_paperback_load_alike(dense, tmp_path, shared, kind):
    from transformers import AutoModelForCausalLM

    from paperback.cli import main
    from paperback.loading import load_model

    out = tmp_path / "moe"
    assert main(["moefy", str(dense.source.path), "-o", str(out), "--experts", "4", "--experts-per-token", "2",
                 "--calib-samples", "4", "--calib-len", "64", "--shared-fraction", str(shared),
                 "--json"]) == 0
    report = json.loads((out / "moefy.json").read_text())
    assert len(report["layers"]) == SMALL["num_hidden_layers"]
    assert json.loads((out / "config.json").read_text())["architectures"] == [kind]
    ours = load_model(str(out))
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([ours.tokenizer.encode("The mixture of experts routes each token to a few of them.")])
    with torch.no_grad():
        assert max_rel_error(ours.model(ids), theirs(ids).logits) < 1e-4


def test_bad_settings_are_refused_before_work(dense, tmp_path, capsys):
    from paperback.cli import main

    with pytest.raises(PaperbackError, match="top-k"):
        MoefyConfig(num_experts=4, experts_per_token=5)
    assert main(["moefy", str(dense.source.path), "-o", str(tmp_path / "a"), "--experts", "5",
                 "--experts-per-token", "2"]) == 2
    assert "do not split into 5 equal experts" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert main(["moefy", str(dense.source.path), "-o", str(tmp_path / "full")]) == 2
    assert "not empty" in capsys.readouterr().err
