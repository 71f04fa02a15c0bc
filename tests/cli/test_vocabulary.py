"""One name per concept across every subcommand: the shared flags agree in meaning and in what they accept, the
dtypes take vLLM's and transformers' names, --kv-cache-dtype is a KV format everywhere (as in vLLM), and every
option's --help states its default."""

import argparse

import pytest

from paperback.cli import build_parser, main
from paperback.cli.common import HelpWithDefaults


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def options(sub: argparse.ArgumentParser):
    return [a for a in sub._actions if a.option_strings and a.help != argparse.SUPPRESS
            and not isinstance(a, (argparse._HelpAction, argparse._VersionAction))]


def test_every_option_with_a_default_says_it_in_help():
    silent = []
    for name, sub in subcommands().items():
        assert sub.formatter_class is HelpWithDefaults, name
        formatter = sub._get_formatter()
        for action in options(sub):
            if action.default in (None, False) or isinstance(action, argparse._StoreTrueAction):
                continue
            text = formatter._get_help_string(action) % {**vars(action), "prog": sub.prog}
            if "default" not in text.lower():
                silent.append(f"{name} {action.option_strings[0]}")
    assert not silent
    # ... as --help prints it
    assert "--port PORT port to listen on (default: 8000)" in " ".join(subcommands()["serve"].format_help().split())


def test_a_flag_shared_by_commands_means_one_thing():
    seen: dict[str, tuple] = {}
    for name, sub in subcommands().items():
        for action in options(sub):
            for flag in action.option_strings:
                seen.setdefault(flag, []).append((name, action.dest, action.type))
    for flag, uses in seen.items():
        assert len({dest for _, dest, _ in uses}) == 1, (flag, uses)
    # the value parsers of the flags that name dtypes and KV formats are one per flag (export's --dtype keeps auto)
    assert len({t for _, _, t in seen["--kv-cache-dtype"]}) == 1
    assert len({t for n, _, t in seen["--dtype"] if n != "export"}) == 1


@pytest.mark.parametrize("command", ["generate", "eval", "bench", "info", "serve", "moefy"])
@pytest.mark.parametrize("given, meant", [("half", "fp16"), ("float16", "fp16"), ("bfloat16", "bf16"),
                                          ("float32", "fp32"), ("float", "fp32"), ("auto", "fp32"), ("bf16", "bf16")])
def test_dtypes_take_vllms_names(command, given, meant):
    sub = subcommands()[command]
    action = next(a for a in sub._actions if "--dtype" in a.option_strings)
    assert action.type(given) == meant


def test_kv_cache_dtype_takes_vllms_names_in_every_command():
    for name, sub in subcommands().items():
        action = next((a for a in sub._actions if "--kv-cache-dtype" in a.option_strings), None)
        if action is not None:
            assert action.type("fp8_e4m3") == "fp8" and action.type("half") == "fp16", name
            assert action.type("kivi2:g=64,r=64") == "kivi2:g=64,r=64"
            with pytest.raises(argparse.ArgumentTypeError, match="fp8_e5m2 is not supported here; fp8"):
                action.type("fp8_e5m2")


def test_a_quantized_kv_format_in_an_exact_cache_command_is_refused_by_name(capsys):
    assert main(["generate", "Hello", "--kv-cache-dtype", "int8", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert "keeps the KV cache exact" in err and "--kv-cache-dtype int8 is served by `paperback serve`" in err
    assert len(err.strip().splitlines()) == 1


def test_export_spells_dtypes_as_every_other_command(tmp_path, capsys):
    sub = subcommands()["export"]
    args = sub.parse_args([str(tmp_path), "-o", str(tmp_path / "x"), "--dtype", "bfloat16"])
    assert args.dtype == "bf16"
    assert sub.parse_args([str(tmp_path), "-o", str(tmp_path / "x")]).dtype == "auto"


def test_plan_takes_the_default_model_as_every_command(capsys):
    assert main(["plan", "--memory", "4GiB", "--json"]) == 0
    assert "SmolLM2" in capsys.readouterr().out
