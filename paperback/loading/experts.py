"""Check an MoE checkpoint's routers and experts against its config from tensor shapes alone, before any
weight is read: a wrong expert count or a missing expert gets one line naming the layer, not a shape error
deep in loading."""

from __future__ import annotations

import re
from collections import defaultdict

from paperback.errors import ModelFileError
from paperback.loading.weight_names import EXPERT_PLACEHOLDER
from paperback.models.config import ModelConfig

ROUTER = re.compile(r"model\.layers\.(\d+)\.mlp\.gate\.weight$")
EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+|" + re.escape(EXPERT_PLACEHOLDER)
                    + r")\.(gate_proj|up_proj|down_proj)\.weight$")
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def check_experts(config: ModelConfig, shapes: dict[str, tuple[int, ...]], label: str) -> None:
    """shapes: {paperback parameter name: shape}; a GGUF stack of experts is named with EXPERT_PLACEHOLDER
    and shaped (experts, out, in)."""
    moe = config.moe
    if moe is None:
        return
    routers: dict[int, int] = {}
    experts: dict[tuple[int, str], set[int]] = defaultdict(set)
    for name, shape in shapes.items():
        if match := ROUTER.match(name):
            routers[int(match[1])] = int(shape[0])
        elif match := EXPERT.match(name):
            numbers = range(int(shape[0])) if match[2] == EXPERT_PLACEHOLDER else (int(match[2]),)
            experts[(int(match[1]), match[3])].update(numbers)
    expected = set(range(moe.num_experts))
    for layer in range(config.num_layers):
        if not config.is_moe_layer(layer):
            if layer in routers:
                raise ModelFileError(f"{label}: layer {layer} has a router (mlp.gate) but the config makes it a "
                                     f"dense layer")
            continue
        if layer not in routers:
            raise ModelFileError(f"{label}: MoE layer {layer} has no router (mlp.gate.weight)")
        if routers[layer] != moe.num_experts:
            raise ModelFileError(f"{label}: the router of layer {layer} scores {routers[layer]} experts but the "
                                 f"config says {moe.num_experts}")
        for projection in PROJECTIONS:
            found = experts[(layer, projection)]
            if missing := sorted(expected - found):
                raise ModelFileError(f"{label}: expert {missing[0]} of layer {layer} is missing ({projection}"
                                     f"{f' and {len(missing) - 1} more experts' if len(missing) > 1 else ''}); "
                                     f"the config says {moe.num_experts} experts")
            if extra := sorted(found - expected):
                raise ModelFileError(f"{label}: layer {layer} stores expert {extra[0]} ({projection}) but the "
                                     f"config says {moe.num_experts} experts")
