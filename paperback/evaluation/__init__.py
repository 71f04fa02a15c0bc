"""Quality measurement: perplexity, KL divergence to a reference, top-1 agreement."""

from paperback.evaluation.datasets import DATASETS, load_text
from paperback.evaluation.perplexity import EvalResult, EvalWindow, evaluate, make_windows, window_ids

__all__ = ["DATASETS", "load_text", "EvalResult", "EvalWindow", "evaluate", "make_windows", "window_ids"]
