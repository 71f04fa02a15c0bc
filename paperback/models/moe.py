"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE / Qwen3-MoE, DeepSeek-V3-style routing (dots.llm1).

The attention and norms are Llama's (q/k/v bias and q/k norm by config flag); the MLP of each layer is a
router over `num_experts` gated MLPs, of which each token runs `experts_per_token`, plus optional shared
experts that every token runs. Parameter names follow Qwen-MoE (`mlp.gate`, `mlp.experts.N.gate_proj`,
`mlp.shared_expert`); loaders rename Mixtral's (`block_sparse_moe.experts.N.w1`) and DeepSeek's
(`mlp.shared_experts`) onto them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paperback.models.blocks import GatedMLP
from paperback.models.config import ModelConfig, MoEConfig
from paperback.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class Router(nn.Module):
    """Scores the experts of each token and picks the top k: (N, C) -> weights (N, k) fp32, experts (N, k)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        moe = config.moe
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, config.hidden_size))
        # DeepSeek-V3's load-balancing bias: shifts which experts are chosen, not how much they weigh.
        self.e_score_correction_bias = nn.Parameter(torch.zeros(moe.num_experts)) if moe.score_correction else None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """(N, C) -> (N, E) router logits: in the model dtype for softmax routers (as Mixtral and Qwen compute
        them), in fp32 for sigmoid ones (as DeepSeek-V3 does)."""
        if self.moe.scoring == "sigmoid":
            return F.linear(x.float(), self.weight.float())
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        moe = self.moe
        logits = self.logits(x)
        if moe.scoring == "softmax":
            scores = torch.softmax(logits.float(), dim=-1)
            weights, experts = torch.topk(scores, moe.experts_per_token, dim=-1)
        else:
            scores = logits.sigmoid()
            choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias.float()
            if moe.num_groups > 1:
                choice = self._best_groups_only(choice)
            experts = torch.topk(choice, moe.experts_per_token, dim=-1)[1]
            weights = scores.gather(1, experts)
        if moe.normalize_top_k:
            # DeepSeek adds 1e-20 so that all-zero sigmoid scores cannot divide by zero; softmax scores cannot
            weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if moe.scoring == "sigmoid" else 0.0))
        if moe.routed_scale != 1.0:
            weights = weights * moe.routed_scale
        return weights, experts

    def _best_groups_only(self, choice: torch.Tensor) -> torch.Tensor:
        """Scores outside each token's best `groups_per_token` groups (a group scores as its two best experts)
        set to -inf."""
        moe = self.moe
        grouped = choice.view(choice.shape[0], moe.num_groups, -1)  # (N, groups, experts per group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        best = torch.topk(group_scores, moe.groups_per_token, dim=-1)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep[:, :, None], float("-inf")).view_as(choice)


def run_experts(experts: nn.ModuleList, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """sum_k weights[n, k] * experts[chosen[n, k]](x[n]) for x (N, C): the tokens grouped by expert, so each
    expert runs once a step on all of its tokens (one matrix product per expert, never one per token)."""
    out = torch.zeros_like(x)
    flat = chosen.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    token_of = order // chosen.shape[1]
    weight_of = weights.flatten()[order]
    start = 0
    for expert, count in zip(experts, counts):
        if count:
            rows = token_of[start:start + count]
            y = expert(x[rows]) * weight_of[start:start + count, None]
            out.index_add_(0, rows, y.to(out.dtype))
            start += count
    return out


class SparseMoE(nn.Module):
    """A router, its experts and the optional shared experts of one layer."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        moe: MoEConfig = config.moe
        self.gate = Router(config)
        self.experts = nn.ModuleList(GatedMLP(config, moe.expert_intermediate_size) for _ in range(moe.num_experts))
        self.shared_expert = GatedMLP(config, moe.shared_intermediate_size) if moe.shared_intermediate_size else None
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False) if moe.shared_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, C)
        weights, chosen = self.gate(flat)
        out = run_experts(self.experts, flat, weights, chosen)
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        return out.view(shape)


class MoEDecoderLayer(LlamaDecoderLayer):
    """Llama's block with a mixture of experts for its MLP (or a dense MLP on the config's dense layers)."""

    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return SparseMoE(config) if config.is_moe_layer(layer_idx) else GatedMLP(config)


class MoEForCausalLM(LlamaForCausalLM):
    layer_class = MoEDecoderLayer
