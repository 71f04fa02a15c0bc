"""Long work says where it is in a log: a line when a stage starts, a line every half minute, a line at its end
(a bar on a terminal; nothing when progress is off)."""

import paperback.progress as progress_module
from paperback.cli.output import stage
from paperback.progress import progress


def test_a_stage_in_a_log_prints_its_start_and_its_end(capsys):
    assert list(progress(range(3), desc="quantize W4", unit="block")) == [0, 1, 2]
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == "[paperback] quantize W4: 3 blocks"
    assert lines[-1].startswith("[paperback] quantize W4: done: 3 blocks in ") and len(lines) == 2


def test_a_long_stage_prints_a_line_as_it_goes(capsys, monkeypatch):
    monkeypatch.setattr(progress_module, "LINE_EVERY_S", 0.0)
    bar = progress(total=4, desc="gptq", unit="block")
    for _ in range(4):
        bar.update()
    bar.close()
    bar.close()  # closing twice says it once
    lines = capsys.readouterr().err.strip().splitlines()
    assert "[paperback] gptq: 2/4 blocks, " in lines[2] and lines[-1].startswith("[paperback] gptq: done: 4 blocks")
    assert sum("done" in line for line in lines) == 1


def test_progress_off_prints_nothing(capsys):
    assert list(progress(range(2), desc="x", enabled=False)) == [0, 1]
    assert capsys.readouterr().err == ""


def test_a_cli_stage_off_a_terminal_is_two_lines(capsys):
    with stage("WikiText-2: the full model"):
        pass
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == "[paperback] WikiText-2: the full model ..." and "done in" in lines[1]
