"""A fit's report: one self-contained HTML file (plots embedded as PNG data, no external URL).

Sections: the budget split, per-layer weight schemes and KV formats, where
each layer's attention goes, predicted against measured quality (the
profile's additivity check and the fitted model itself), and predicted
quality against budget with the chosen point, the breakdown point and the
margin kept above it.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

from paperback.allocate.allocation import head_label
from paperback.allocate.fit import needle_score
from paperback.allocate.profile_data import Agreement, Assignment, Estimates, Profile
from paperback.allocate.units import BLOCK_UNITS
from paperback.kv.schemes import parse_kv_scheme


def _png(fig) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _mib(n: float) -> str:
    return f"{n / 2 ** 20:,.1f} MiB"


def _table(header: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _budget_plot(result: dict) -> str:
    import matplotlib.pyplot as plt

    a = result["allocation"]
    parts = [("weights", a["weight_bytes"]), ("KV cache", a["kv_bytes"]), ("runtime", a["runtime_bytes"])]
    fig, ax = plt.subplots(figsize=(7, 1.6))
    left = 0.0
    for (name, value), color in zip(parts, ("#4c72b0", "#dd8452", "#8c8c8c")):
        ax.barh([0], [value / 2 ** 20], left=left, color=color, label=f"{name} {value / 2 ** 20:,.0f} MiB")
        left += value / 2 ** 20
    ax.axvline(a["budget"] / 2 ** 20, color="k", linestyle="--", label=f"budget {a['budget'] / 2 ** 20:,.0f} MiB")
    ax.set_yticks([])
    ax.set_xlabel("MiB")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=4, fontsize=8, frameon=False)
    return _png(fig)


def _layers_plot(result: dict, schemes: list[str], formats: list[str]) -> str:
    import matplotlib.pyplot as plt

    layers = result["layers"]
    units = list(BLOCK_UNITS)
    order = {label: i for i, label in enumerate(schemes)}
    grid = [[order[row[u]] for row in layers] for u in units]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(max(6, len(layers) * 0.28), 3.6), sharex=True,
                                  gridspec_kw={"height_ratios": [4, 1]})
    image = ax.imshow(grid, aspect="auto", cmap="viridis_r", vmin=0, vmax=max(1, len(schemes) - 1))
    ax.set_yticks(range(len(units)), units)
    ax.set_title("weight scheme per unit (darker = fewer bits)")
    bar = fig.colorbar(image, ax=[ax, ax2], ticks=range(len(schemes)))
    bar.ax.set_yticklabels(schemes, fontsize=7)
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    formats = [parse_kv_scheme(spec).format_label for spec in formats]
    kv_order = {label: i for i, label in enumerate(formats)}
    colors = plt.get_cmap("tab10").colors[: len(formats)]
    ax2.imshow([[kv_order[row["kv"]] for row in layers]], aspect="auto", cmap=ListedColormap(colors), vmin=-0.5,
               vmax=len(formats) - 0.5)
    ax2.set_yticks([0], ["KV"])
    ax2.set_xlabel("layer")
    ax2.legend(handles=[Patch(color=c, label=f) for c, f in zip(colors, formats)], loc="upper center",
               bbox_to_anchor=(0.5, -0.9), ncol=min(len(formats), 7), fontsize=7, frameon=False)
    return _png(fig)


def _additivity_plot(points: list[Assignment], fitted: tuple[float, float] | None) -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.8, 4.2))
    colors = {"weights": "#4c72b0", "kv": "#dd8452", "joint": "#55a868", "head bands": "#8172b3"}
    for kind, color in colors.items():
        group = [p for p in points if p.kind == kind]
        if group:
            ax.scatter([p.predicted for p in group], [p.measured for p in group], s=18, color=color,
                       label=f"{kind} (profile text)")
    if fitted is not None:
        ax.scatter([fitted[0]], [fitted[1]], marker="*", s=160, color="crimson", label="fitted model (held out)")
    values = [p.predicted for p in points] + [p.measured for p in points]
    positive = [v for v in values if v > 0]
    if positive:
        lo, hi = min(positive), max(positive)
        ax.plot([lo, hi], [lo, hi], color="k", linewidth=0.8, label="measured = predicted")
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel("predicted KL (sum of unit costs)")
    ax.set_ylabel("measured KL")
    ax.legend(fontsize=7)
    return _png(fig)


def _curve_plot(curve: list[dict], chosen: dict, breakdown: dict | None) -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot([p["memory"] / 2 ** 20 for p in curve], [p["predicted_kl"] for p in curve], marker=".",
            label="best allocation (predicted)")
    ax.scatter([chosen["memory"] / 2 ** 20], [chosen["predicted_kl"]], color="crimson", zorder=3, s=50,
               label="chosen budget")
    if breakdown is not None:
        ax.axvline(breakdown["memory"] / 2 ** 20, color="gray", linestyle="--", label="breakdown point")
    ax.set_yscale("log")
    ax.set_xlabel("memory budget (MiB)")
    ax.set_ylabel("predicted KL to the full model")
    ax.legend(fontsize=8)
    return _png(fig)


STYLE = """body{font-family:system-ui,sans-serif;max-width:1000px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.6em 0}td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px;
text-align:right}th{background:#f2f2f2}img{max-width:100%}h2{margin-top:1.6em}.note{color:#555;font-size:13px}"""


def render_report(result: dict, profile: Profile) -> str:
    """The report's HTML for a fit result (as `Fit.run` returns it) and the profile it used."""
    a, w, q = result["allocation"], result["workload"], result["quality"]
    e = q["eval"]
    curve = result["curve"]
    chosen = {"memory": w["memory"], "predicted_kl": a["predicted_kl"]}
    breakdown = result.get("breakdown")
    parts = [f"<h1>paperback fit: {html.escape(profile.model.label or 'model')}</h1>",
             f"<p>{w['users']} user(s) x {w['context']:,} tokens in {_mib(w['memory'])}; profiled on "
             f"{html.escape(str(profile.text.source))} (first {profile.text.span:.0%}, "
             f"{profile.text.profiled_tokens:,} tokens), evaluated on the held-out rest.</p>",
             "<h2>Budget split</h2>", f'<img src="{_budget_plot(result)}" alt="budget split">',
             _table(["part", "bytes"], [["weights", _mib(a["weight_bytes"])], ["KV cache (all users)",
                                                                              _mib(a["kv_bytes"])],
                                        ["runtime allowance", _mib(a["runtime_bytes"])],
                                        ["total", _mib(a["total_bytes"])], ["budget", _mib(a["budget"])]]),
             "<h2>Quality on held-out text</h2>"]
    rows = [["perplexity", f"{e['reference_perplexity']:.3f}", f"{e['perplexity']:.3f}"],
            ["KL to the full model", "0", f"{e['kl_divergence']:.4f}"],
            ["predicted KL (profile)", "", f"{q['predicted_kl']:.4f}"],
            ["top-1 agreement", "1", f"{e['top1_agreement']:.3f}"]]
    if "needles" in q:
        n = q["needles"]
        rows.append([f"needles at {n['length']:,} tokens", needle_score(n["full"]), needle_score(n["fitted"])])
    parts.append(_table(["", "full model", "fitted"], rows))
    parts.append(f"<p class=note>{e['tokens_scored']:,} tokens scored in {e['windows']} window(s) of "
                 f"{e['context']:,}.</p>")
    parts += ["<h2>Per layer</h2>",
              f'<img src="{_layers_plot(result, profile.weights.schemes, profile.kv.specs)}" '
              'alt="per-layer choices">']
    head = head_label(a["weights"])
    token_layers = (result.get("tokens") or {}).get("layers") or []
    header = ["layer", *BLOCK_UNITS, "KV format", "retention", "sink mass", "recent mass", "middle mass"]
    table_rows = []
    for row in result["layers"]:
        t = token_layers[row["layer"]] if row["layer"] < len(token_layers) else {}
        table_rows.append([row["layer"], *(row[u] for u in BLOCK_UNITS), row["kv"], row.get("retention", "all"),
                           *(f"{t[k]:.2f}" if k in t else "" for k in ("sink_mass", "recent_mass", "middle_mass"))])
    parts.append(_table(header, table_rows))
    if head:
        tied = " (tied to the embedding)" if profile.model.tied else ""
        parts.append(f"<p>Output head{tied}: {html.escape(head)}. Weight bits over the allocated units: "
                     f"{a['bits_per_weight']:.2f}.</p>")
    parts.append("<p class=note>Retention: 'all' keeps every token in the layer's format; 'sinks N exact' keeps "
                 "the first N tokens at 16 bits as well; 'sinks N + last W' evicts everything else (StreamingLLM, "
                 "chosen only with --evict). The attention mass columns (queries in the second half of a "
                 "profiling window: first 4 tokens, last 128, the rest) show where each layer reads.</p>")
    bound = result.get("config", {}).get("retrieval_kl")
    if bound is not None:
        parts.append(f"<p>Long-range lookups: every layer's KV option costs a fact planted far back in the profiling "
                     f"text at most {bound:g} nats per answer token (the profile's retrieval part), so the layers "
                     "that do the lookup neither evict nor round it away.</p>")
    parts.append(_additivity_section(profile, (q["predicted_kl"], e["kl_divergence"])))
    parts.append(_second_pass_section(result.get("second_pass") or []))
    parts.append(_estimates_section(profile.estimates))
    parts += ["<h2>Quality against budget</h2>", f'<img src="{_curve_plot(curve, chosen, breakdown)}" alt="curve">']
    if breakdown is not None:
        margin = w["memory"] - breakdown["memory"]
        parts.append(f"<p>Breakdown point (least memory with predicted KL at most {result['breakdown_kl']}): "
                     f"{_mib(breakdown['memory'])}. Margin kept above it: {_mib(margin)} "
                     f"({margin / w['memory']:.0%} of the budget).</p>")
    else:
        parts.append(f"<p>No budget on the curve keeps the predicted KL at most {result['breakdown_kl']}.</p>")
    body = "\n".join(parts)
    return f"<!doctype html><html><head><meta charset=utf-8><title>paperback fit</title><style>{STYLE}</style>" \
           f"</head><body>{body}</body></html>"


def _summary_row(name: str, summary: Agreement) -> list:
    return [name, summary.samples, f"{summary.pearson:.3f}", f"{summary.spearman:.3f}",
            f"{summary.median_measured_over_predicted:.2f}"]


def _additivity_section(profile: Profile, fitted: tuple[float, float]) -> str:
    """The profile's additivity check (random mixed assignments) and, for a head in bands, the bands' own
    check (random banded heads), predicted sums against whole-model measurements."""
    add = profile.additivity
    bands = profile.weights.head_bands
    band_check = bands.check if bands is not None else None
    parts = ["<h2>Predicted against measured quality</h2>"]
    points = (add.points if add else ()) + (band_check.points if band_check else ())
    if points:
        parts.append(f'<img src="{_additivity_plot(points, fitted)}" alt="additivity">')
    rows = []
    if add:
        rows = [_summary_row("all", add.overall), *(_summary_row(kind, s) for kind, s in add.by_kind.items())]
    else:
        parts.append("<p>The profile has no additivity check (it was run with 0 samples).</p>")
    if band_check:
        rows.append(_summary_row("head bands", band_check.overall))
    if rows:
        parts.append(_table(["assignments", "n", "Pearson", "Spearman", "median measured / predicted"], rows))
    if band_check:
        parts.append("<p class=note>Head bands: the tied head cut into bands of vocabulary rows by how much text "
                     "uses them, each band priced per scheme; random banded heads (every other unit at full "
                     "precision) measured whole against the sum of their bands' costs.</p>")
    return "\n".join(parts)


def _second_pass_section(candidates: list[dict]) -> str:
    if not candidates:
        return ""
    rows = [[html.escape(c["name"]) + (" (kept)" if c["chosen"] else ""), f"{c['predicted_kl']:.4f}",
             "-" if c["measured_kl"] is None else f"{c['measured_kl']:.4f}", _mib(c["bytes"])] for c in candidates]
    return ("<h3>Second pass</h3><p>The exact solve with the output head held at each of its schemes (a tied "
            "head's error changes every block's input, so its cost does not add to theirs; a head in bands of "
            "vocabulary rows: the solve with its bands free, and with every band at one scheme), and the best solve "
            "with every weight unit at one scheme (even bits). Those a measurement could still rank first "
            "(within the profile's additivity check) were each quantized as the checkpoint is (same method and "
            "calibration) and measured whole on the profiled text; the least measured KL was kept and written. "
            "'-': ruled out by prediction alone.</p>"
            + _table(["candidate", "predicted KL", "measured KL", "allocated bytes"], rows))


def _estimates_section(estimates: Estimates | None) -> str:
    if estimates is None:
        return "<p>Every cell of the profile was measured (--measure all).</p>"
    text = (f"<p>Each weight unit's KL was measured at {html.escape(estimates.weight_anchor)} and each layer's "
            f"KV cache in {html.escape(estimates.kv_anchor)}; the other cells are that anchor's KL per unit of "
            "block output error times their own block error.")
    check = estimates.check
    if check is None or not check.positive:
        return text + " No estimated cell was measured as a check.</p>"
    rows = [[kind, samples, f"{median:.2f}" if median is not None else ""]
            for kind, (samples, median) in check.by_kind.items()]
    return (text + f" {check.samples} estimated cells were measured as well: median |log(estimate / measured)| "
            f"{check.median_abs_log_ratio:.2f} (90th percentile {check.p90_abs_log_ratio:.2f}), Spearman "
            f"{check.spearman:.3f}.</p>" + _table(["cells", "n", "median |log ratio|"], rows))


def write_report(result: dict, profile: Profile, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    path = Path(path)
    path.write_text(render_report(result, profile), encoding="utf-8")
    return path
