"""Benchmark options that a run would ignore, or take outside what it can do, are refused by name."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import cpu_perf, sampling_parity, serving
from benchmarks._quick import given_options


def refused(capsys: pytest.CaptureFixture[str], parse: object, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)  # type: ignore[operator]
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_given_options_are_those_the_command_line_names_even_at_their_defaults() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--a", type=int, default=1)
    parser.add_argument("--b", type=int, default=2)
    parser.add_argument("--flag", action="store_true")
    parser.add_argument("--many", action="append", default=[])
    assert given_options(parser, ["--a", "1", "--many", "x"]) == {"a", "many"}
    assert given_options(parser, ["--flag"]) == {"flag"}
    assert vars(parser.parse_args([])) == {"a": 1, "b": 2, "flag": False, "many": []}  # defaults restored


def test_serving_refuses_options_its_mode_ignores(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--cv", "2"], ["--alpha", "0.5"], ["--min-output", "4"]):
        assert "give --rate" in refused(capsys, serving.parse_args, argv)
    err = refused(capsys, serving.parse_args, ["--rate", "2", "--concurrency", "8"])
    assert "--concurrency bounds the closed loop" in err
    err = refused(capsys, serving.parse_args, ["--dtype", "bfloat16", "--threads", "2"])
    assert "--dtype, --threads configure the server --start-loraserve starts" in err
    assert serving.parse_args(["--dtype", "bfloat16", "--start-loraserve"]).dtype == "bfloat16"
    args = serving.parse_args(["--rate", "5", "--alpha", "0.5", "--min-output", "4", "--quick"])
    assert (args.rate, args.alpha, args.min_output) == (5.0, 0.5, 4)


def test_cpu_perf_refuses_profile_steps_it_cannot_take(capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(capsys, cpu_perf.parse_args, ["--max-tokens", "10", "--profile-steps", "5"])
    assert "--profile-steps must be in [0, 4] with --max-tokens 10" in err
    assert "--profile-steps must be in" in refused(capsys, cpu_perf.parse_args, ["--profile-steps", "-1"])
    assert cpu_perf.parse_args(["--max-tokens", "10"]).profile_steps == 4  # the default fits itself to the run
    assert cpu_perf.parse_args(["--max-tokens", "10", "--profile-steps", "4"]).profile_steps == 4


def test_sampling_parity_names_unknown_settings_and_bad_urls(capsys: pytest.CaptureFixture[str]) -> None:
    urls = ["--url", "a=http://127.0.0.1:9", "--url", "b=http://127.0.0.1:9"]
    err = refused(capsys, sampling_parity.main, [*urls, "--settings", "greedy;nope"])
    assert "unknown setting(s) ['nope']" in err and "known:" in err
    err = refused(capsys, sampling_parity.main, ["--url", "http://127.0.0.1:9", "--url", "b=x"])
    assert "--url expects NAME=BASE_URL" in err
