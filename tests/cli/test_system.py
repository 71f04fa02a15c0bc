"""`paperback info --system` says what runs: each C kernel built or not and why, the SIMD path, threads, the torch
build; a kernel that is not built is named once on stderr with the slower path and the fix, and setup fails on it."""

import json

import pytest

import paperback.system as system
from paperback.cli import RUNS_KERNELS, build_parser, main


def test_info_system_reports_kernels_simd_threads_and_torch(capsys):
    assert main(["info", "--system", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [k["name"] for k in report["kernels"]] == ["packed weights", "paged attention", "fused decode"]
    assert report["simd"] in ("amx", "avx512vnni", "avx512", "avxvnni", "avx2", "portable", "unavailable")
    assert report["torch"]["version"].startswith("2.13.0") and report["threads"] >= 1
    assert main(["info", "--system"]) == 0
    table = capsys.readouterr().out
    assert "packed weights kernel" in table and "kernel path" in table


@pytest.fixture
def one_missing(monkeypatch):
    missing = system.Kernel("imaginary", "paperback._no_such_kernel", "the slow path runs")
    monkeypatch.setattr(system, "KERNELS", (*system.KERNELS, missing))
    monkeypatch.setattr(system, "_warned", False)
    return missing


def test_a_kernel_not_built_is_named_once_with_its_slower_path_and_the_fix(one_missing, capsys):
    system.warn_missing_kernels()
    system.warn_missing_kernels()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "the imaginary kernel is not built" in err[0] and "the slow path runs" in err[0]
    assert "C compiler" in err[0] and "scripts/setup.sh" in err[0]
    assert [k.name for k in system.missing_kernels()] == ["imaginary"]


def test_setup_fails_when_a_kernel_does_not_import(one_missing, capsys):
    with pytest.raises(SystemExit, match="without 1 of its C kernels.*the slow path runs.*Install gcc"):
        system.require_kernels()
    assert "paperback._no_such_kernel" in capsys.readouterr().err


def test_the_built_kernels_pass_setups_check():
    system.require_kernels()  # the suite runs where setup.sh built them


def test_every_command_that_runs_kernels_exists():
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert RUNS_KERNELS <= set(commands)


def test_the_code_version_is_dirty_for_changed_code_and_not_for_changed_results_or_pages(tmp_path):
    import subprocess

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "model.py").write_text("x = 1\n")
    (tmp_path / "benchmarks" / "results" / "r.json").write_text("{}")
    (tmp_path / "README.md").write_text("# x\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "one")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    (tmp_path / "benchmarks" / "results" / "r.json").write_text('{"rows": [1]}')  # a run writing its results
    (tmp_path / "README.md").write_text("# x, measured\n")
    assert system.code_version(tmp_path) == head
    (tmp_path / "model.py").write_text("x = 2\n")
    assert system.code_version(tmp_path) == head + "+dirty"
    assert system.code_version(tmp_path / "benchmarks" / "results" / "r.json") == "unknown"  # not a checkout
