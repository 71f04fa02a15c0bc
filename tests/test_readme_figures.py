"""The README's measured tables still say what their JSON under benchmarks/results/ holds: a benchmark rerun
that moves a figure fails here until the README is updated with it."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def measured(filename: str) -> dict:
    """A results JSON, checked to record the commit and CPU it was measured on."""
    result = json.loads((RESULTS / filename).read_text())
    assert result["provenance"]["commit"] and result["provenance"]["cpu"], filename
    return result


def flat(relative: str) -> str:
    """A page's text with every run of whitespace made one space (a sentence may wrap anywhere)."""
    return " ".join((ROOT / relative).read_text().split())


def readme_table(title_start: str) -> list[list[str]]:
    """The rows (cells stripped of bold) of the README table whose header row starts with `title_start`."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {title_start}"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip().replace("**", "") for cell in line.strip("|").split("|")])
    assert rows, title_start
    return rows


def pair(cell: str) -> tuple[float, float]:
    """'1.455 / 1.535' (and anything after it) -> (1.455, 1.535)."""
    first, second = re.match(r"([\d.]+) / ([\d.]+)", cell).groups()
    return float(first), float(second)


def decimals(cell: str) -> int:
    return len(re.match(r"[\d]+\.(\d+)", cell).group(1))


@pytest.mark.parametrize("model, title", [("smollm2", "SmolLM2-135M, weights at the bytes of"),
                                          ("gemma3", "Gemma 3 270M, weights at the bytes of")])
def test_the_allocation_tables_match_their_json(model, title):
    cells = measured(f"allocation_{model}.json")["cells"]
    kl = {(c["budget"], c["policy"]): (c["wikitext2"]["kl"], c["ptb"]["kl"]) for c in cells}
    for row in readme_table(title):
        bits, group = re.match(r"W(\d) g(\d+)", row[0]).groups()
        budget = f"W{bits}a-g{group}"
        for cell, policy in zip(row[1:], ("uniform", "llama.cpp", "paperback")):
            places = decimals(cell)
            assert pair(cell) == tuple(round(v, places) for v in kl[budget, policy]), (budget, policy)


def test_the_kv_allocation_table_matches_its_json():
    cells = {c["name"]: c for c in measured("kv_allocation_smollm2.json")["cells"]}
    fp16 = cells["fp16"]["perplexity"]

    def said(name: str, kl_places: int) -> str:
        cell = cells[name]
        found = f"{sum(n['correct'] for n in cell['needles'])}/{len(cell['needles'])}"
        return f"{100 * (cell['perplexity'] / fp16 - 1):+.1f}%, {cell['kl']:.{kl_places}f}, {found}"

    rows = {row[0]: row[1:] for row in readme_table("SmolLM2's KV cache at 4,096 tokens")}
    assert rows["KIVI-2"] == [said("kivi2", 3), said("paperback @ kivi2", 3),
                              said("paperback+evict, lookup KL <= 0.001 @ kivi2", 3)]
    assert rows["INT4"] == [said("int4", 4), said("paperback @ int4", 4), ""]


def test_the_gguf_table_matches_its_json():
    result = measured("gguf_recipes.json")
    kld = {(r["recipe"], r["tool"], r["text"]): r["kld"] for r in result["rows"] if r["model"] == "smollm2"}
    speed = {(s["recipe"], s["tool"]): s for s in result["speed"] if s["model"] == "smollm2"}
    for row in readme_table("SmolLM2, size of"):
        recipe = row[0].split()[0]
        for cell, tool in zip(row[1:4], ("llama.cpp", "llama.cpp + imatrix", "paperback fit (rtn)")):
            expected = tuple(round(kld[recipe, tool, text], 4) for text in ("wikitext2", "ptb"))
            assert pair(cell) == expected, (recipe, tool)
        prompt, generate = (float(x) for x in re.findall(r"([\d.]+)x", row[4]))
        fit = speed[recipe, "paperback fit (rtn)"]
        assert (prompt, generate) == (round(fit["prompt"]["ratio"], 2), round(fit["generate"]["ratio"], 2)), recipe


# The README's llama.cpp table, row by row: (model of benchmarks/results/llamacpp_<model>.json, its row), 2 threads
LLAMACPP_ROWS = [("llama-3.2-1b", "llama.cpp Q4_0"), ("llama-3.2-1b", "paperback W4s-g32, head W4a-g32"),
                 ("llama-3.2-1b", "llama.cpp Q4_K_M"), ("llama-3.2-1b", "paperback W4a-g128, head W8"),
                 ("llama-3.2-3b", "llama.cpp Q4_0"), ("llama-3.2-3b", "paperback W4s-g32, head W4a-g32"),
                 ("llama-3.2-3b", "llama.cpp Q4_K_M"), ("llama-3.2-3b", "paperback W4a-g128, head W8"),
                 ("smollm2", "llama.cpp bundled GGUF (Q4_1, Q8_0 head)"), ("smollm2", "paperback W4a-g32, head W8"),
                 ("smollm2", "paperback W4a-g128, head W8")]


def test_the_llamacpp_table_matches_its_json():
    cells_by_row = readme_table("2 threads | weight MiB / step")
    assert len(cells_by_row) == len(LLAMACPP_ROWS)

    def value(cell: str) -> tuple:
        """'19.2 (1.18x)' -> (19.2, 1.18); '16.3' -> (16.3, None); '-' -> (None, None)"""
        found = re.match(r"([\d.]+)(?: \(([\d.]+)x\))?", cell)
        return (float(found.group(1)), float(found.group(2)) if found.group(2) else None) if found else (None, None)

    for cells, (model, name) in zip(cells_by_row, LLAMACPP_ROWS):
        result = measured(f"llamacpp_{model}.json")
        row = next(r for r in result["rows"] if r["threads"] == 2 and r["row"] == name)
        assert int(cells[1]) == round(row["weight_MiB"]), name
        for cell, key, ratio in ((cells[2], "prefill_tokens_per_s", "prefill_vs"),
                                 (cells[3], "decode_tokens_per_s", "decode_vs"),
                                 (cells[5], "batch8_tokens_per_s", "batch8_vs")):
            expected = (round(row[key], 1) if row[key] else None,
                        round(row[ratio], 2) if row.get(ratio) else None)
            assert value(cell) == expected, (model, name, key)
        assert cells[4] == f"{round(100 * row['roofline_fraction'])}%", name


def test_the_amx_llamacpp_line_matches_its_json():
    result = measured("llamacpp_llama-3.2-1b_amx.json")
    assert result["provenance"]["kernels"]["simd"] == "amx" and result["config"]["prefill_matmul"] == "bf16"
    assert "AMX off" in result["llamacpp_built_for"]
    rows = [r for r in result["rows"] if r["threads"] == 2]
    ours = [r for r in rows if r["vs"]]
    prefill = sorted(round(r["prefill_vs"], 2) for r in ours)
    decode = sorted(round(r["decode_vs"], 2) for r in ours)
    best_scaling = max(round(r["batch8_scaling"], 1) for r in ours)
    theirs = sorted(round(r["batch8_scaling"], 1) for r in rows if not r["vs"])
    line = flat("README.md")
    assert (f"prefills {prefill[0]:.2f}-{prefill[-1]:.2f}x llama.cpp's, decode runs {decode[0]:.2f}-{decode[-1]:.2f}x "
            f"and batch 8 reaches {best_scaling:.1f}x batch 1 (llama.cpp {theirs[0]:.1f}-{theirs[-1]:.1f}x)") in line


def test_the_serving_ratios_match_their_json():
    throughput = measured("serving_smollm2.json")["throughput"]
    readme = flat("README.md")
    assert f"{throughput['speedup']:.2f}x transformers' output tokens/s" in readme
    assert f"and {throughput['user_speedup']:.2f}x with the W4 checkpoint" in readme


def test_the_demo_table_matches_its_json():
    demo = measured("demo_smollm2.json")
    rows = {cells[0]: cells[1:] for cells in readme_table("SmolLM2-135M, 8 users x 8,192 tokens")}

    def mib(n: float) -> str:
        return f"{n / 2 ** 20:,.0f} MiB"

    full, fitted = demo["full"], demo["fitted"]
    assert rows["weights"][0] == mib(full["weight_bytes"])
    assert rows["weights"][1].startswith(mib(fitted["weight_bytes"]))
    assert rows["KV cache"][0] == mib(full["kv_bytes"]) and rows["KV cache"][1].startswith(mib(fitted["kv_bytes"]))
    assert rows["runtime allowance"] == [mib(full["runtime_bytes"]), mib(fitted["runtime_bytes"])]
    assert rows["total"] == [mib(full["weight_bytes"] + full["kv_bytes"] + full["runtime_bytes"]),
                             mib(fitted["total_bytes"])]
    ppl = next(cells for name, cells in rows.items() if name.startswith("WikiText-2 perplexity"))
    assert ppl == [f"{full['wikitext2']['perplexity']:.3f}", f"{fitted['wikitext2']['perplexity']:.3f}"]
    assert rows["KL to the full model"][1].startswith(f"{fitted['wikitext2']['kl_divergence']:.4f} nats/token")
    speed = rows["decode tokens/s, batch 1 (exact cache)"]
    assert speed == [f"{full['decode_tokens_per_s']:.1f}", f"{fitted['decode_tokens_per_s']:.1f}"]


def test_the_llamaserver_line_matches_its_json():
    result = measured("llamaserver_smollm2.json")
    level = {(r["clients"], r["engine"]): r for r in result["levels"]}
    readme = flat("README.md")
    paperback = {c: level[c, "paperback"] for c in (1, 16, 64)}
    assert f"{paperback[16]['throughput_vs_llamaserver']:.2f}x its output tokens/s at 16 clients" in readme
    assert (f"({paperback[16]['ttft_p99_s']:.1f} s against {level[16, 'llama-server']['ttft_p99_s']:.1f} s), "
            f"{paperback[64]['throughput_vs_llamaserver']:.2f}x at 64, but "
            f"{paperback[1]['throughput_vs_llamaserver']:.2f}x at one client") in readme


def test_the_prefix_hit_figures_match_their_json():
    result = measured("llamaserver_smollm2_prefix.json")
    hits = [r["prefix_hit_rate"] for r in result["levels"] if r["engine"] == "paperback" and r["prefix_caching"]]
    assert {r["kv_cache_dtype"] for r in result["levels"] if r["prefix_caching"]} == {"fp16", "int8", "kivi4"}
    readme = flat("README.md")
    share = f"{min(hits):.0%}" if f"{min(hits):.0%}" == f"{max(hits):.0%}" else f"{min(hits):.0%}-{max(hits):.0%}"
    assert f"({share.replace('%-', '-')} of prompt tokens in fp16, int8 and KIVI-4" in readme
    serving = flat("docs/serving.md")
    for r in result["levels"]:
        if r["engine"] == "paperback":
            cache = "on" if r["prefix_caching"] else "off"
            row = (f"| paperback | {r['kv_cache_dtype']} | {cache} | {r['output_tokens_per_s']:.1f} "
                   f"({r['throughput_vs_llamaserver']:.2f}x) | {r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} |")
            assert row in serving, row


def hit_rate(run: dict) -> str:
    return f"{run['prefix_hit_rate']:.0%}" if run["prefix_hit_rate"] is not None else "-"


def assert_rows_in(page: str, rows: list[str]) -> None:
    missing = [row for row in rows if row not in flat(page)]
    assert not missing, missing


def test_the_1b_llamaserver_table_and_line_match_their_json():
    result = measured("llamaserver_llama-3.2-1b.json")
    assert_rows_in("docs/serving.md", [
        f"| {r['clients']} | {r['engine']} | {r['output_tokens_per_s']:.1f} ({r['throughput_vs_llamaserver']:.2f}x) "
        f"| {r['requests_per_s']:.2f} | {r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | {1e3 * r['itl_p99_s']:.0f} "
        f"| {r['failed']} | {hit_rate(r)} |" for r in result["levels"]])
    level = {(r["clients"], r["engine"]): r for r in result["levels"]}
    readme = flat("README.md")
    assert (f"{level[16, 'paperback']['throughput_vs_llamaserver']:.2f}x at 16 clients (TTFT p99 "
            f"{level[16, 'paperback']['ttft_p99_s']:.1f} s against {level[16, 'llama-server']['ttft_p99_s']:.1f} s) "
            f"and {level[64, 'paperback']['throughput_vs_llamaserver']:.2f}x at 64") in readme


def test_the_engine_prefix_hit_table_matches_its_json():
    result = measured("prefix_hits_smollm2.json")
    assert_rows_in("docs/serving.md", [
        f"| {r['budget']:g}x ({r['kv_bytes'] / 2 ** 20:.0f} MiB) | {r['kv_cache_dtype']} | "
        f"{'on' if r['prefix_caching'] else 'off'} | {r['max_num_seqs']} | {r['positions_computed']:,} | {hit_rate(r)} "
        f"| {r['output_tokens_per_s']:.1f} ({r['gain_from_hits']:.2f}x) |" for r in result["runs"]])
    gains = [r["gain_from_hits"] for r in result["runs"] if r["prefix_caching"]]
    readme = flat("README.md")
    assert f"worth {min(gains):.2f}-{max(gains):.2f}x inside the engine" in readme


def test_the_soak_table_matches_its_json():
    result = measured("soak_int8.json")
    assert result["minutes"] == 30 and result["clients"] == 64
    assert all(c["passed"] for c in result["checks"])
    serving = flat("docs/serving.md")
    rss = next(c for c in result["checks"] if c["check"].startswith("peak RSS"))
    assert f"| {rss['measured']} | yes |" in serving
    assert f"| 0 of {result['requests']:,} requests | yes |" in serving
    first, last = result["latency_p99_s"]["first"], result["latency_p99_s"]["last"]
    assert f"{first['latency_s']:.1f} -> {last['latency_s']:.1f} s" in serving
    assert f"{result['shutdown']['exited_s']:.0f} s (it finishes" in serving


def test_the_real_size_quantize_and_amx_tables_match_their_json():
    page = flat("docs/real-sizes.md")
    labels = {("rtn", "streamed"): "rtn, streamed", ("rtn", "in memory"): "rtn, the model loaded whole",
              ("gptq", "in memory"): "gptq (loads the model whole)", ("awq", "in memory"): "awq (loads the model whole)"}
    methods = measured("quantize_memory_methods.json")
    for r in methods["rows"]:
        row = (f"| {labels[r['method'], r['how']]} | {r['peak_rss_bytes'] / 2 ** 30:.2f} | {r['seconds']:.0f} | "
               f"{r['seconds_per_billion_parameters']:.0f} |")
        assert row in page, row
    assert methods["earlier_runs"] and "15.10 GiB in 458 s" in page  # the first GPTQ run, named by its commit

    def ratio(r, key):
        return f" ({r[key]:.2f}x)" if r.get(key) else ""

    for r in measured("llamacpp_llama-3.2-1b_amx.json")["rows"]:
        row = (f"| {r['threads']} | {r['row']} | {round(r['weight_MiB'])} | {r['prefill_tokens_per_s']:.1f}"
               f"{ratio(r, 'prefill_vs')} | {r['decode_tokens_per_s']:.1f}{ratio(r, 'decode_vs')} | "
               f"{round(100 * r['roofline_fraction'])}% | {r['batch8_tokens_per_s']:.1f}{ratio(r, 'batch8_vs')} | "
               f"{r['batch8_scaling']:.1f} | {round(r['peak_rss_MiB'])} |")
        assert row in page, row


def test_the_serving_rerun_table_matches_its_json():
    result = measured("serving_smollm2.json")
    assert result["earlier_runs"]  # the sharing and capacity parts were not rerun with the throughput
    page = flat("docs/serving.md")
    rows = {r["tool"]: r for r in result["throughput"]["rows"]}
    for label, tool in (("paperback paged, fp32 (", "paperback paged"),
                        ("transformers static batches, fp32", "transformers static batches"),
                        ("paperback paged, W4 + KIVI-2, bf16 tiles", "paperback paged, W4 checkpoint + quantized KV")):
        r = rows[tool]
        cells = (f"| {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.1f} | {r['ttft_p50_s']:.0f} | "
                 f"{r['ttft_p99_s']:.0f} | {100 * r['kv_utilization']:.1f}% | {r['positions_computed']:,} | "
                 f"{r['positions_computed'] / r['seconds']:.0f} | {r['linear_seconds']:.0f} of {r['seconds']:.0f} |")
        assert any(label in line and cells in line for line in page.split("| paperback")
                   + page.split("| transformers")), tool
    t = result["throughput"]
    assert (f"Same weights and cache (fp32 against fp32): {t['speedup']:.2f}x transformers; what a user runs "
            f"(W4 + KIVI-2): {t['user_speedup']:.2f}x.") in page


def allocation_rows(model: str) -> list[str]:
    """docs/allocation.md's equal-bytes rows for `model` (without the bold), from its JSON and the head-one-unit
    ablation's."""
    cells = {(c["budget"], c["policy"]): c for c in measured(f"allocation_{model}.json")["cells"]}
    for c in measured(f"allocation_{model}_head_one_unit.json")["cells"]:
        cells[c["budget"], "head one unit"] = c
    names = {"uniform": "uniform", "llama.cpp": "llama.cpp", "head one unit": "paperback, head one unit",
             "paperback": "paperback", "paperback-all": "paperback, head one unit, every cell measured"}
    rows = []
    for (budget, policy), c in cells.items():
        name = names[policy]
        if policy == "head one unit" and any(s["chosen"] and s["name"].startswith("even") for s in c["second_pass"]):
            name += " (even bits kept)"
        predicted = "-" if c["predicted_kl"] is None else f"{c['predicted_kl']:.3f}"
        rows.append(f"| {budget} | {name} | {c['bits_per_weight']:.3f} | {predicted} | {c['wikitext2']['kl']:.4f} "
                    f"| {c['ptb']['kl']:.4f} | {c['wikitext2']['perplexity']:.2f} | {c['ptb']['perplexity']:.2f} |")
    return rows


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_the_allocation_pages_tables_match_their_json(model):
    page = flat("docs/allocation.md").replace("**", "")
    missing = [row for row in allocation_rows(model) if row not in page]
    assert not missing, missing
