"""A whole decode step in one C call (`_fused_decode`): the binding.

The plan of a model over a cache (which layers, which weights, which norms) is made by
paperback.generation.fused_decode, which reads the model; this module loads the extension and runs it. It
calls the packed-weight and attention kernels through their capsules, so they load first.
"""

from __future__ import annotations

import contextlib

import torch

from paperback.kernels import packed
from paperback.kernels.settings import settings

try:
    from paperback.kernels import _paged_kernel, _qkernel  # noqa: F401  (loaded first: their capsules)
    from paperback.kernels import _fused_decode
except ImportError:  # built without a C compiler, or without the other two kernels
    _fused_decode = None

SCORES = {"softmax": 0, "sigmoid": 1}  # router scoring, as the C enum numbers it
ACTS = {"silu": 0}  # any other gate activation name is GELU (tanh), as models.layers.gated_mlp_act reads it
MAX_BATCH = 64
MAX_HEAD_DIM = 512


def available() -> bool:
    """Whether a decode step may run fused now: the extension built, settings.fused_decode on, and the packed
    kernel (whose arithmetic it shares) in use."""
    return _fused_decode is not None and settings.fused_decode and packed.kernel_available()


def plan(shape: tuple, layers: list):
    """The C plan (a capsule) of a model's shape and its layers' pointers (generation.fused_decode builds them)."""
    return _fused_decode.plan(shape, layers)


def step(plan, x: torch.Tensor, start_pos: int, cos: tuple[int, int], sin: tuple[int, int]) -> None:
    """One decode step of `plan` on the embedded rows x (B, C) in place, at `start_pos`; cos, sin: the two RoPE
    slots' row pointers."""
    _fused_decode.step(plan, x.data_ptr(), start_pos, cos, sin, torch.get_num_threads(),
                       settings.decode_activations == "int8")


@contextlib.contextmanager
def fused_decode(flag: bool):
    """Fused decode steps on (where a model qualifies) or off inside the block."""
    previous, settings.fused_decode = settings.fused_decode, flag
    try:
        yield
    finally:
        settings.fused_decode = previous
