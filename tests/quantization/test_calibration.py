import pytest
import torch

from paperback.errors import DatasetError, PaperbackError
from paperback.quantization.calibration import CalibrationConfig, calibration_batch, calibration_starts


class PositionTokenizer:
    """Token id = the word's position in the text, so a window shows where it came from."""

    def encode(self, text, add_special_tokens=False):
        return list(range(len(text.split())))


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(" ".join(["word"] * 5000))
    return str(path)


def test_windows_are_seeded_contiguous_and_sized(corpus):
    config = CalibrationConfig(corpus, num_samples=16, seq_len=64, seed=3)
    batch = calibration_batch(PositionTokenizer(), config)
    assert batch.shape == (16, 64) and batch.dtype == torch.long
    assert (batch[:, 1:] - batch[:, :-1] == 1).all()  # each row is one contiguous stretch of text
    assert torch.equal(batch, calibration_batch(PositionTokenizer(), config))
    assert not torch.equal(batch, calibration_batch(PositionTokenizer(), CalibrationConfig(corpus, 16, 64, seed=4)))


def test_starts_say_where_each_window_came_from(corpus):
    config = CalibrationConfig(corpus, num_samples=8, seq_len=64, seed=5)
    batch = calibration_batch(PositionTokenizer(), config)
    assert batch[:, 0].tolist() == calibration_starts(5000, config)


def test_span_keeps_windows_in_the_leading_part(corpus):
    batch = calibration_batch(PositionTokenizer(), CalibrationConfig(corpus, 64, 32, span=0.5))
    assert batch.max() < 2500


def test_calibration_errors(corpus):
    with pytest.raises(DatasetError, match="too few"):
        calibration_batch(PositionTokenizer(), CalibrationConfig(corpus, 4, 4000, span=0.5))
    with pytest.raises(PaperbackError, match="span"):
        CalibrationConfig(corpus, span=0)
    with pytest.raises(PaperbackError, match="at least 1 sample"):
        CalibrationConfig(corpus, num_samples=0)


def test_generated_windows_are_the_models_own_text_seeded(smollm2):
    config = CalibrationConfig("generated", num_samples=3, seq_len=24, seed=7)
    batch = calibration_batch(smollm2.tokenizer, config, smollm2.model)
    separator = smollm2.tokenizer.hf.get_vocab()["<|endoftext|>"]  # SmolLM2's BOS starts a chat turn instead
    assert batch.shape == (3, 24) and batch.dtype == torch.long and (batch[:, 0] == separator).all()
    assert len({tuple(row) for row in batch.tolist()}) == 3  # sampled, not one greedy text three times
    assert torch.equal(batch, calibration_batch(smollm2.tokenizer, config, smollm2.model))
    other = calibration_batch(smollm2.tokenizer, CalibrationConfig("generated", 3, 24, seed=8), smollm2.model)
    assert not torch.equal(batch, other)
    with torch.no_grad():  # text from the model's distribution: far likelier to it than uniform tokens
        logits = smollm2.model(batch, 0, None)
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten())
    assert nll < 0.5 * torch.log(torch.tensor(float(logits.shape[-1])))


def test_generated_windows_need_the_model():
    with pytest.raises(PaperbackError, match="sampled from the model"):
        calibration_batch(PositionTokenizer(), CalibrationConfig("generated", 2, 16))


def test_a_document_starts_at_bos_where_every_text_gets_one(gemma3):
    assert gemma3.tokenizer.adds_bos and gemma3.tokenizer.document_start_id == gemma3.tokenizer.bos_token_id
