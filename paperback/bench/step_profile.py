"""Where a decode step's time goes: `paperback bench --profile`.

Timers wrap the parts of a step while a greedy decode runs (after the
prompt's prefill): the linear layers (q/k/v and gate/up through
`run_linears`, o/down as modules), attention over the cache, RoPE, the
norms, cache writes, the output head, the rest of the model's forward (the
embedding, residual adds, the MLP activation, Python between calls), and
what lies outside the forward (sampling, the loop). Each region counts its
own time less the regions inside it, so the parts add up to the wall time of
the steps; the timers' own cost lands in "model, other" and is small against
milliseconds per step. Where the decoder layers run as one C call
(generation.fused_decode: packed models over a dense cache), the call times
its own parts (linears, attention, cache writes, norms, RoPE and
activations together, and an MoE's routing) and those are added to the parts
of the same names;
what the call spends outside them is "fused call, other".
PAPERBACK_FUSED_DECODE=0 shows the module path's breakdown instead.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

import torch
from torch import nn

FUSED_ELEMENTWISE = "norms, rope, activations (fused)"
FUSED_ROUTING = "expert routing (fused)"  # an MoE's router, top k, gathering rows and summing expert outputs
PARTS = ("linears", "output head", "attention", "rope", "norms", "kv cache writes", FUSED_ELEMENTWISE,
         FUSED_ROUTING, "fused call, other", "model, other", "sampling and loop")
# the fused call's own parts -> the parts above they are added to
_FUSED_PARTS = {"linears": "linears", "attention": "attention", "kv cache writes": "kv cache writes",
                "norms, rope, activations": FUSED_ELEMENTWISE, "expert routing": FUSED_ROUTING}


class StepTimers:
    """Exclusive time per named region; regions nest."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self._stack: list[list] = []  # [name, start, time spent in children]
        self.active = False

    def enter(self, name: str) -> None:
        if self.active:
            self._stack.append([name, time.perf_counter(), 0.0])

    def leave(self) -> None:
        if not self.active or not self._stack:
            return
        name, start, children = self._stack.pop()
        elapsed = time.perf_counter() - start
        self.seconds[name] += elapsed - children
        if self._stack:
            self._stack[-1][2] += elapsed

    def wrap(self, fn: Callable, name: str) -> Callable:
        def timed(*args, **kwargs):
            self.enter(name)
            try:
                return fn(*args, **kwargs)
            finally:
                self.leave()

        return timed


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "QuantLinear"


def profile_decode(model, prompt_ids: torch.Tensor, new_tokens: int, cache_dtype: torch.dtype | None = None) -> dict:
    """Milliseconds per decode step by part (PARTS), for a greedy decode of `new_tokens` after `prompt_ids` (the
    cache in `cache_dtype`, as `generate_tokens`)."""
    from paperback.generation import SamplingParams, generate_tokens
    from paperback.generation.fused_decode import FusedDecoder
    from paperback.kernels.fused import _fused_decode
    from paperback.models import blocks
    from paperback.models.layers import RMSNorm

    timers = StepTimers()
    patched = [(blocks, "run_linears", "linears"), (blocks, "attend", "attention"), (blocks, "apply_rope", "rope"),
               (blocks.Attention, "_store", "kv cache writes"), (FusedDecoder, "step", "fused call, other")]
    originals = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in patched]
    hooks = []
    for module in model.modules():
        name = "norms" if isinstance(module, RMSNorm) else "linears" if _is_linear(module) else None
        if name is not None:
            hooks.append(module.register_forward_pre_hook(lambda *_, n=name: timers.enter(n)))
            hooks.append(module.register_forward_hook(lambda *_: timers.leave()))
    model_forward, model_logits = model.forward, model.logits
    try:
        for owner, attr, name in patched:
            setattr(owner, attr, timers.wrap(getattr(owner, attr), name))
        model.logits = timers.wrap(model_logits, "output head")
        model.forward = timers.wrap(model_forward, "model, other")
        steps, start = 0, None
        with torch.inference_mode():
            params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
            for _ in generate_tokens(model, prompt_ids, params, cache_dtype):
                if start is None:  # the prompt's prefill is done: time the steps from here
                    start, timers.active = time.perf_counter(), True
                    if _fused_decode is not None:
                        _fused_decode.timing(True)
                else:
                    steps += 1
            wall = time.perf_counter() - start
    finally:
        fused = _fused_decode.timings() if _fused_decode is not None else {}
        if _fused_decode is not None:
            _fused_decode.timing(False)
        for owner, attr, original in originals:
            setattr(owner, attr, original)
        vars(model).pop("forward", None)  # back to the class's methods
        vars(model).pop("logits", None)
        for hook in hooks:
            hook.remove()
    for part, seconds in fused.items():  # inside the fused call's own exclusive time
        timers.seconds[_FUSED_PARTS[part]] += seconds
        timers.seconds["fused call, other"] -= seconds
    inside = sum(timers.seconds.values())
    parts = {name: 1e3 * timers.seconds.get(name, 0.0) / steps for name in PARTS[:-1]}
    parts["sampling and loop"] = 1e3 * (wall - inside) / steps
    return {"steps": steps, "ms_per_step": 1e3 * wall / steps, "parts_ms": parts}
