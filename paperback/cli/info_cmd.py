"""`paperback info [MODEL]`: configuration, parameters and bytes."""

from __future__ import annotations

import argparse

from paperback.cli.common import add_dtype_arg, add_json_arg, add_model_arg
from paperback.cli.output import print_json, print_table


def register(sub) -> None:
    p = sub.add_parser("info", help="show a model's configuration, parameter count and memory per token; --system: "
                                    "what runs on this machine")
    add_model_arg(p)
    p.add_argument("--system", action="store_true",
                   help="instead of a model: the C kernels built or not (and why), the SIMD path chosen, threads, "
                        "the CPU and torch's build")
    add_dtype_arg(p)
    add_json_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from paperback.loading import load_model

    if args.system:
        return _system(args)
    from paperback.memory import dense_kv_bytes_per_token, module_bytes, parameter_count

    lm = load_model(args.model, args.dtype)
    cfg = lm.config
    facts = {
        "source": str(lm.source.path),
        "parameters": parameter_count(lm.model),
        "weight_bytes": module_bytes(lm.model),
        "kv_bytes_per_token": dense_kv_bytes_per_token(cfg, lm.dtype),
        "chat_template": lm.tokenizer.chat_template is not None,
        "config": cfg.to_dict(),
        "quantization": _quantization(lm),
    }
    if args.json:
        print_json(facts)
        return 0
    rows = [["source", facts["source"]], ["family", cfg.family], ["parameters", f"{facts['parameters']:,}"],
            [f"weights ({args.dtype})", f"{facts['weight_bytes'] / 2**20:.1f} MiB"],
            ["KV cache per token", f"{facts['kv_bytes_per_token']:,} bytes"],
            ["layers / hidden / heads / KV heads / head dim",
             f"{cfg.num_layers} / {cfg.hidden_size} / {cfg.num_heads} / {cfg.num_kv_heads} / {cfg.head_dim}"],
            ["context", f"{cfg.max_position_embeddings:,}"],
            ["sliding window", f"{cfg.sliding_window} ({cfg.layer_types.count('sliding')} layers)"
             if cfg.sliding_window else "-"],
            ["RoPE theta", f"{cfg.rope.theta:g}"], ["tied embeddings", str(cfg.tie_word_embeddings)],
            ["chat template", str(facts["chat_template"])]]
    if facts["quantization"]:
        q = facts["quantization"]
        rows.append(["quantization", f"{q['method']} {q['schemes']}, {q['layers']} layers at "
                                     f"{q['bits_per_weight']:.3f} bits/weight"])
        rows.append(["weights as stored (what `plan` counts)", f"{q['stored_bytes'] / 2**20:.1f} MiB"])
        if q["kv_policy"]:
            layers = q["kv_policy"].get("layers", {})
            rows.append(["KV policy (fitted)", f"{q['kv_policy']['default']}"
                                               + (f", {len(layers)} layers otherwise" if layers else "")])
    print_table(cfg.name or lm.source.label, ["field", "value"], rows)
    return 0


def _quantization(lm) -> dict | None:
    """Method, schemes and exact bits per weight of a paperback checkpoint's packed layers."""
    from paperback.plan.arithmetic import checkpoint_weight_bytes
    from paperback.quantization.checkpoint import quantized_layers, read_recipe
    from paperback.quantization.head_bands import split_band_key

    if lm.source.kind != "paperback":
        return None
    recipe = read_recipe(lm.source.path)
    layers = quantized_layers(recipe)
    bits = weights = 0
    for name, scheme in layers.items():
        param, band = split_band_key(name)
        module = lm.model.get_submodule(param.removesuffix(".weight"))
        if band is not None:  # a head stored in bands of vocabulary rows
            module = module.bands[band]
        bits += scheme.storage_bits(module.out_features, module.in_features)
        weights += module.out_features * module.in_features
    return {"method": recipe.get("method"), "schemes": ", ".join(sorted({s.label for s in layers.values()})),
            "layers": len({split_band_key(name)[0] for name in layers}),
            "bits_per_weight": bits / weights if weights else 0.0,
            "stored_bytes": checkpoint_weight_bytes(lm.source.path)[1].total, "kv_policy": recipe.get("kv_policy")}


def _system(args: argparse.Namespace) -> int:
    from paperback.system import system_report

    report = system_report()
    if args.json:
        print_json(report)
        return 0
    cpu, torch_facts = report["cpu"], report["torch"]
    rows = [["paperback", report["paperback"]], ["python", report["python"]],
            ["torch", f"{torch_facts['version']} ({torch_facts['build']})"],
            ["CPU", f"{cpu['model']} ({cpu['cores']} cores)"], ["SIMD features", " ".join(cpu["simd_flags"]) or "none"],
            ["threads", f"{report['threads']} (of {report['affinity']} CPUs this process may use)"],
            ["kernel path", report["simd"] + (f" (capped by PAPERBACK_SIMD={report['simd_cap']})"
                                              if report["simd_cap"] else "")]]
    rows += [[f"{k['name']} kernel", "built" if k["built"] else f"NOT BUILT ({k['error']}): {k['without']}"]
             for k in report["kernels"]]
    print_table("paperback on this machine", ["", ""], rows)
    return 0
