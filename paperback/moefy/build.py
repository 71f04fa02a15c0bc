"""MoEfication: turn a dense model's MLPs into mixtures of experts, from calibration text alone.

Per layer, on the inputs the MLP sees when the layers before it are already MoE (as GPTQ passes layers):
1. each neuron's contribution to the output, |act(gate) * up| times its down column's norm, per token;
2. optionally the neurons contributing most on average go into one shared expert every token runs;
3. the other neurons are split into experts of equal size by balanced k-means over which tokens they
   fire on (their contribution is among the token's top quarter), so neurons that fire together share an
   expert;
4. a linear router (the Mixtral format has no bias) is fitted by least squares to each expert's share of
   the token's MLP output, and picks the top k;
5. the chosen experts weigh equally (the dense MLP adds every neuron with weight one), so the router's
   scores are shrunk until its softmax over the chosen k is uniform to 1e-3, and each expert's down
   projection is multiplied by k; with `compensate`, the down projections are instead refitted jointly by
   ridge regression to the dense MLP's output given the routing, so kept neurons absorb part of what the
   dropped ones carried (kept only where it lowers the error on held-out calibration tokens).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from paperback.errors import PaperbackError
from paperback.models import DecoderLM, ModelConfig, MoEConfig
from paperback.models.layers import gated_mlp_act
from paperback.moefy.clustering import balanced_kmeans
from paperback.progress import progress as stage_progress
from paperback.quantization.calibration import CalibrationConfig

# Router logits are scaled to this spread (std over experts): the top-k softmax weights then differ from
# 1/k by about this much, while the order, which is all routing uses, is kept.
ROUTER_SPREAD = 1e-3
FIRES_QUANTILE = 0.75  # a neuron "fires" on a token when its contribution is in the token's top quarter
HELD_OUT = 8  # every 8th calibration token is kept out of the fits to measure the router's recall


@dataclass(frozen=True)
class MoefyConfig:
    num_experts: int = 8
    experts_per_token: int = 2
    shared_fraction: float = 0.0  # of each MLP's neurons, in a shared expert (Qwen2-MoE layout) when > 0
    compensate: bool = True
    ridge: float = 1e-3  # relative to the mean diagonal of the regression's Gram matrix
    calibration: CalibrationConfig = field(default_factory=lambda: CalibrationConfig(num_samples=32, seq_len=512))
    seed: int = 0

    def __post_init__(self):
        if self.num_experts < 2 or not 1 <= self.experts_per_token <= self.num_experts:
            raise PaperbackError(f"need at least 2 experts and 1 <= top-k <= experts, got {self.num_experts} "
                                 f"experts, top-k {self.experts_per_token}")
        if not 0.0 <= self.shared_fraction < 1.0:
            raise PaperbackError(f"shared fraction must be in [0, 1), got {self.shared_fraction}")
        if self.ridge <= 0:
            raise PaperbackError("ridge must be positive")

    def sizes(self, intermediate_size: int) -> tuple[int, int]:
        """(shared neurons, neurons per routed expert) of an MLP of `intermediate_size`."""
        shared = round(intermediate_size * self.shared_fraction)
        routed = intermediate_size - shared
        if routed % self.num_experts:
            raise PaperbackError(f"{routed} routed neurons (of {intermediate_size}, {shared} shared) do not split "
                                 f"into {self.num_experts} equal experts")
        return shared, routed // self.num_experts

    def moe_config(self, intermediate_size: int) -> MoEConfig:
        shared, per_expert = self.sizes(intermediate_size)
        return MoEConfig(num_experts=self.num_experts, experts_per_token=self.experts_per_token,
                         expert_intermediate_size=per_expert, normalize_top_k=True,
                         shared_intermediate_size=shared, shared_gate=shared > 0)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class LayerReport:
    router_recall: float  # held-out tokens: share of the k experts with the largest output the router picks
    error_routed: float  # ||MoE - dense|| / ||dense|| of the MLP output, held-out tokens, before refitting
    error: float  # the same as built: after refitting the down projections where that lowered it


def _solve_ridge(features: torch.Tensor, targets: torch.Tensor, ridge: float) -> torch.Tensor:
    """argmin_W ||features W - targets||^2 + lambda ||W||^2 in float64, lambda relative to the Gram diagonal."""
    f64 = features.double()
    gram = f64.T @ f64
    gram.diagonal().add_(ridge * gram.diagonal().mean().clamp_min(1e-12))
    return torch.linalg.solve(gram, f64.T @ targets.double()).float()


def moefy_mlp(mlp, x: torch.Tensor, act: str, config: MoefyConfig, seed: int):
    """One dense gated MLP and its inputs x (N, C) -> (paperback MoE tensors named under `mlp.`, LayerReport)."""
    wg, wu, wd = mlp.gate_proj.weight.float(), mlp.up_proj.weight.float(), mlp.down_proj.weight.float()
    inner = wg.shape[0]
    num_shared, per_expert = config.sizes(inner)
    k, num_experts = config.experts_per_token, config.num_experts
    x = x.float()
    fit = torch.ones(len(x), dtype=torch.bool)
    fit[::HELD_OUT] = False
    held = ~fit
    acts = gated_mlp_act(act)(x @ wg.T) * (x @ wu.T)  # (N, I)
    dense = acts @ wd.T  # (N, C)
    contribution = acts.abs() * wd.norm(dim=0)
    order = torch.argsort(contribution[fit].mean(0), descending=True)
    shared, rest = order[:num_shared], order[num_shared:]
    fires = contribution[:, rest] >= contribution[:, rest].quantile(FIRES_QUANTILE, dim=1, keepdim=True)
    labels = balanced_kmeans(fires[fit].T.float(), num_experts, seed=seed)
    experts = [rest[labels == e] for e in range(num_experts)]
    outputs = torch.stack([acts[:, g] @ wd[:, g].T for g in experts], 1)  # (N, E, C)
    share = outputs.norm(dim=2)
    share = share / share.sum(1, keepdim=True).clamp_min(1e-12)
    router = _solve_ridge(x[fit], share[fit], config.ridge).T  # (E, C)
    logits = x @ router.T
    router = router * (ROUTER_SPREAD / logits.std(dim=1).mean().clamp_min(1e-12))
    chosen = (x @ router.T).topk(k, dim=1)[1]  # (N, k)
    best = share.topk(k, dim=1)[1]
    recall = (chosen[held, :, None] == best[held, None, :]).any(-1).float().mean().item()
    mask = torch.zeros(len(x), num_experts).scatter_(1, chosen, 1.0)  # (N, E)
    shared_out = acts[:, shared] @ wd[:, shared].T
    routed_out = (outputs * mask[:, :, None]).sum(1)

    def rel_error(approx):
        return ((approx[held] - dense[held]).norm() / dense[held].norm().clamp_min(1e-12)).item()

    error_routed = rel_error(shared_out + routed_out)
    downs = [wd[:, g] * k for g in experts]  # the router's 1/k weights undone
    shared_down = wd[:, shared]
    error = error_routed
    if config.compensate:
        columns = torch.cat([shared, *experts])
        gates = torch.cat([torch.ones(len(x), num_shared), mask.repeat_interleave(per_expert, dim=1)], 1)
        features = acts[:, columns] * gates
        refit = _solve_ridge(features[fit], dense[fit], config.ridge).T  # (C, I) over `columns`
        refit_error = rel_error(features @ refit.T)
        if refit_error < error_routed:  # on too little calibration the refit overfits: kept only if it helps
            error, shared_down = refit_error, refit[:, :num_shared]
            downs = [refit[:, num_shared + e * per_expert: num_shared + (e + 1) * per_expert] * k
                     for e in range(num_experts)]
    tensors = {"mlp.gate.weight": router}
    for e, g in enumerate(experts):
        tensors.update({f"mlp.experts.{e}.gate_proj.weight": wg[g], f"mlp.experts.{e}.up_proj.weight": wu[g],
                        f"mlp.experts.{e}.down_proj.weight": downs[e]})
    if num_shared:
        # Qwen2-MoE scales the shared expert by sigmoid(x . gate): a zero gate is a constant 1/2, undone here.
        tensors.update({"mlp.shared_expert.gate_proj.weight": wg[shared], "mlp.shared_expert.up_proj.weight": wu[shared],
                        "mlp.shared_expert.down_proj.weight": shared_down * 2,
                        "mlp.shared_expert_gate.weight": torch.zeros(1, x.shape[1])})
    return {name: t.contiguous() for name, t in tensors.items()}, LayerReport(recall, error_routed, error)


def moefy(model: DecoderLM, calibration: torch.Tensor, config: MoefyConfig,
          progress: bool = True) -> tuple[DecoderLM, list[LayerReport]]:
    """The dense Llama-family `model` as an MoE model (family "moe"), built layer by layer on `calibration`
    (B, T) token ids; the dense model is left as it was."""
    from paperback.loading import assemble_model

    dense_config: ModelConfig = model.config
    if dense_config.family != "llama":
        raise PaperbackError(f"MoEfication takes a Llama-family model (its blocks are the MoE family's), not "
                             f"{dense_config.family}")
    moe_config = dataclasses.replace(dense_config, family="moe", moe=config.moe_config(dense_config.intermediate_size),
                                     name=f"{dense_config.name} MoEfied")
    tensors = {name: p.detach() for name, p in model.state_dict().items() if ".mlp." not in name}
    reports = []
    positions = torch.arange(calibration.shape[1])
    with torch.no_grad():
        hidden = [model.embed(b) for b in calibration.split(4)]
        layers = model.model.layers
        for idx, layer in enumerate(stage_progress(layers, desc="MoEfying", unit="layer", enabled=progress)):
            cos, sin = model.rotary_for(idx)(positions, model.dtype)
            inputs = []
            hook = layer.mlp.register_forward_pre_hook(lambda _m, args: inputs.append(args[0].reshape(
                -1, args[0].shape[-1])))
            try:
                after_attention = [h + layer.self_attn(layer.input_layernorm(h), cos, sin, 0, None) for h in hidden]
                for h in after_attention:
                    layer.mlp(layer.post_attention_layernorm(h))
            finally:
                hook.remove()
            layer_tensors, report = moefy_mlp(layer.mlp, torch.cat(inputs), dense_config.hidden_act, config,
                                              config.seed + idx)
            reports.append(report)
            tensors.update({f"model.layers.{idx}.{name}": t for name, t in layer_tensors.items()})
            moe_layer = _moe_layer(moe_config, idx, layer, layer_tensors)
            hidden = [h + moe_layer(layer.post_attention_layernorm(h)) for h in after_attention]
    moe = assemble_model(moe_config, tensors.items(), model.dtype, moe_config.name, len(tensors))
    return moe, reports


def _moe_layer(config: ModelConfig, idx: int, layer, tensors: dict) -> torch.nn.Module:
    """The MoE MLP of one layer, for passing the calibration on to the next layer."""
    from paperback.models.moe import SparseMoE

    with torch.device("meta"):
        mlp = SparseMoE(config)
    mlp.load_state_dict({name[len("mlp."):]: t for name, t in tensors.items()}, assign=True, strict=True)
    return mlp.eval()
