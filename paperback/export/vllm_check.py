"""What vLLM needs to load a compressed-tensors export, checked layer by layer against the checkpoint.

vLLM runs a `pack-quantized` checkpoint through its WNA16 scheme, whose kernels set the rules (read from vLLM's
source: `compressed_tensors/`, `kernels/linear/`, `utils/marlin_utils.py`, mid-2026):

- 4 or 8 bits. Zero points (asymmetric) at 4 bits on Marlin and Machete; at 8 bits only on Machete, which runs
  on Hopper (compute capability 9.0) with input size % 64 and output size % 128.
- Groups of 32, 64 or 128 or per channel (Marlin), dividing each rank's share of a row-parallel layer's inputs.
- Marlin before its padding of odd shapes (vLLM with `marlin_padded_nk`) needs input size % 128 and output
  size % 64; such a layer otherwise needs that newer vLLM.
- vLLM fuses q/k/v into qkv_proj and gate/up into gate_up_proj and gives the fused layer its first shard's
  group without checking the others: the shards must share a scheme (paperback's fits keep them together).
- A quantized lm_head is read only by newer vLLM and only through a target naming it; a tied head is the
  embedding, which vLLM keeps dense (and the export writes dense).
- One KV cache dtype for every layer: FP8 E4M3 with per-tensor scales, or none (the export's KV note says
  which this checkpoint has).
- The CPU backend runs 4 bits only (its WNA16 kernel takes uint4 with inputs and outputs % 32), not 8.
- Tensor parallelism: the attention heads (and KV heads, unless replicated) split evenly.

Findings are advice about another engine, written down where this export can see them; nothing here runs vLLM.
"""

from __future__ import annotations

from paperback.quantization.scheme import QuantScheme

FUSED = {"self_attn.q_proj": "qkv_proj", "self_attn.k_proj": "qkv_proj", "self_attn.v_proj": "qkv_proj",
         "mlp.gate_proj": "gate_up_proj", "mlp.up_proj": "gate_up_proj"}
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")  # inputs split across ranks
MARLIN_GROUPS = (None, 32, 64, 128)


def fused_name(module: str) -> str | None:
    """The vLLM layer `module` is a shard of ("model.layers.0.self_attn.qkv_proj"), or None."""
    for suffix, fused in FUSED.items():
        if module.endswith(suffix):
            return module[: -len(suffix)] + suffix.split(".")[0] + "." + fused
    return None


def vllm_findings(config, schemes: dict[str, QuantScheme], shapes: dict[str, tuple[int, int]]) -> dict:
    """{"loads": bool, "blockers": [...], "notes": [...], "tensor_parallel_sizes": [...]} for the packed linears
    `schemes` ({module: scheme}) with `shapes` ({module: (out, in)})."""
    blockers, notes = [], []
    by_fused: dict[str, set[QuantScheme]] = {}
    for module, scheme in schemes.items():
        fused = fused_name(module)
        if fused is not None:
            by_fused.setdefault(fused, set()).add(scheme)
    split = sorted(name for name, found in by_fused.items() if len(found) > 1)
    if split:
        more = f" (and {len(split) - 1} more fused layers)" if len(split) > 1 else ""
        blockers.append(f"{split[0]}{more} mixes schemes across its shards; vLLM fuses them and would read every "
                        "shard with the first one's")
    odd_bits = sorted({s.label for s in schemes.values() if s.bits not in (4, 8)})
    if odd_bits:
        blockers.append(f"{', '.join(odd_bits)}: vLLM's kernels run 4 and 8 bits")
    odd_groups = sorted({s.label for s in schemes.values() if s.group_size not in MARLIN_GROUPS})
    if odd_groups:
        blockers.append(f"{', '.join(odd_groups)}: vLLM's kernels take groups of 32, 64, 128 or per channel")
    layers = engine_layers(schemes, shapes)
    for layer, (scheme, (out_features, in_features)) in layers.items():
        if scheme.bits == 8 and not scheme.symmetric:
            if in_features % 64 or out_features % 128:
                blockers.append(f"{layer} is {scheme.label}: 8-bit zero points run only on Machete, which needs "
                                f"inputs % 64 and outputs % 128 (here {in_features} -> {out_features})")
                break
            notes.append("8-bit zero points run only on Machete: Hopper GPUs (compute capability 9.0)")
            break
    if "lm_head" in schemes:
        notes.append("lm_head is packed: vLLM reads a quantized lm_head only in versions with compressed-tensors "
                     "lm_head support, through the target naming it (written); older ones need it dense")
    narrow = sorted({name.rsplit(".", 1)[-1] for name, (_, (o, i)) in layers.items() if i % 128 or o % 64})
    if narrow:
        notes.append(f"{', '.join(narrow)} have inputs not a multiple of 128 (or outputs of 64): Marlin runs them "
                     "only in vLLM that pads odd shapes (marlin_padded_nk, mid-2026); older vLLM needs Machete "
                     "(Hopper) or its Triton W4A16 fallback (4 bits)")
    if any(s.bits == 8 for s in schemes.values()):
        notes.append("vLLM's CPU backend runs 4-bit layers only: the 8-bit ones need a GPU")
    return {"loads": not blockers, "blockers": blockers, "notes": notes,
            "tensor_parallel_sizes": tensor_parallel_sizes(config, schemes, shapes)}


def engine_layers(schemes: dict[str, QuantScheme], shapes: dict[str, tuple[int, int]]) -> dict:
    """{vLLM's layer: (scheme, (out, in))}: q/k/v and gate/up fused (outputs stacked), the rest as they are; a
    fused layer whose shards differ takes its first shard's scheme, as vLLM does."""
    layers: dict[str, tuple[QuantScheme, tuple[int, int]]] = {}
    for module, scheme in schemes.items():
        name = fused_name(module) or module
        out_features, in_features = shapes[module]
        if name in layers:
            first, (out_before, _) = layers[name]
            layers[name] = (first, (out_before + out_features, in_features))
        else:
            layers[name] = (scheme, (out_features, in_features))
    return layers


def tensor_parallel_sizes(config, schemes: dict[str, QuantScheme], shapes: dict[str, tuple[int, int]],
                          largest: int = 8) -> list[int]:
    """The --tensor-parallel-size values up to `largest` that split the heads evenly and leave every grouped
    row-parallel layer's share of inputs a whole number of groups."""
    sizes = []
    for tp in range(1, largest + 1):
        if config.num_heads % tp or (config.num_kv_heads % tp and tp % config.num_kv_heads):
            continue  # KV heads split evenly, or are replicated to a divisor of tp
        if all(s.group_size is None or (shapes[m][1] // tp) % s.group_size == 0 and shapes[m][1] % tp == 0
               for m, s in schemes.items() if m.endswith(ROW_PARALLEL)):
            sizes.append(tp)
    return sizes
