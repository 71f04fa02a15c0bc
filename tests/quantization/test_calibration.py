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
