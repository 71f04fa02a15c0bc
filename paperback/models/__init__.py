"""Model definitions: plain PyTorch, one file per architecture family."""

from paperback.models.blocks import DecoderLM
from paperback.models.config import ModelConfig, MoEConfig, RopeConfig
from paperback.models.gemma3 import Gemma3ForCausalLM
from paperback.models.llama import LlamaForCausalLM
from paperback.models.moe import MoEForCausalLM

MODEL_CLASSES: dict[str, type[DecoderLM]] = {
    "llama": LlamaForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "moe": MoEForCausalLM,
}


def build_model(config: ModelConfig) -> DecoderLM:
    """An uninitialised model for `config` (callers load weights into it)."""
    return MODEL_CLASSES[config.family](config)


__all__ = ["DecoderLM", "ModelConfig", "MoEConfig", "RopeConfig", "MODEL_CLASSES", "build_model"]
