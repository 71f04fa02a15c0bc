"""Every result a benchmark writes records what it ran on, and a file extended by a later run says which runs
its kept parts came from."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import results_io  # noqa: E402


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setattr(results_io, "RESULTS", tmp_path)
    return tmp_path


def test_a_new_result_records_its_provenance(results):
    results_io.write_results("one.json", {"threads": 2, "rows": [1]}, announce=False)
    written = json.loads((results / "one.json").read_text())
    assert written["provenance"]["threads"] == 2
    assert written["provenance"]["commit"] and written["provenance"]["cpu"] and written["provenance"]["date"]
    assert "earlier_runs" not in written


def test_a_result_kept_in_part_names_this_run_and_the_runs_it_keeps(results):
    (results / "old.json").write_text(json.dumps({"rows": [1]}))  # measured before provenance was recorded
    first = results_io.read_results("old.json")
    results_io.write_results("old.json", {**first, "rows": [1, 2]}, kept_from=first, announce=False)
    second = results_io.read_results("old.json")
    assert second["earlier_runs"] == [results_io.UNRECORDED]
    mine = second["provenance"]

    results_io.write_results("old.json", {**second, "rows": [1, 2, 3]}, kept_from=second, announce=False)
    third = results_io.read_results("old.json")
    assert third["earlier_runs"] == [results_io.UNRECORDED, mine]  # each run once, oldest first
    assert third["provenance"]["date"] >= mine["date"] and third["rows"] == [1, 2, 3]
    assert results_io.read_results("missing.json") == {}


def test_a_path_is_written_where_it_points(tmp_path, results):
    out = tmp_path / "elsewhere" / "run.json"
    assert results_io.write_results(out, {"rows": []}, announce=False) == out
    assert "provenance" in json.loads(out.read_text())


def _json_writes_outside_results_io(path: Path) -> list[int]:
    """Lines of `path` that write json.dumps(...) with write_text: a result that would skip its provenance."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "write_text"
                and node.args and isinstance(node.args[0], ast.Call)
                and ast.unparse(node.args[0].func) == "json.dumps"):
            lines.append(node.lineno)
    return lines


# Files a benchmark writes that are not results: caches of its own intermediate work.
CACHE_WRITES = {"bench_moe_allocation.py": 2}


def test_every_benchmark_writes_its_results_through_results_io():
    for script in sorted(BENCHMARKS.glob("bench_*.py")):
        writes = _json_writes_outside_results_io(script)
        assert len(writes) == CACHE_WRITES.get(script.name, 0), f"{script.name} writes JSON itself at {writes}"


def test_a_benchmarks_help_keeps_its_docstring_and_says_every_default():
    parser = results_io.benchmark_parser("One line.\n\n    .venv/bin/python benchmarks/bench_x.py [--windows 8]\n")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--data", nargs="+", default=["wikitext2"], help="texts scored")
    parser.add_argument("--fresh", action="store_true", help="redo every cell")
    text = parser.format_help()
    assert "    .venv/bin/python benchmarks/bench_x.py [--windows 8]" in text  # not refilled
    assert "default: 8" in text and "texts scored (default: ['wikitext2'])" in text
    assert "redo every cell (default" not in text  # a flag's False says nothing


def test_every_benchmark_builds_its_parser_with_benchmark_parser():
    for script in sorted(BENCHMARKS.glob("bench_*.py")):
        calls = {ast.unparse(node.func) for node in ast.walk(ast.parse(script.read_text()))
                 if isinstance(node, ast.Call)}
        assert "benchmark_parser" in calls and "argparse.ArgumentParser" not in calls, script.name
