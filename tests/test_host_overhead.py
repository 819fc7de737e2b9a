"""``benchmarks.host_overhead``: a smoke run, and ``--against`` running two engines in turns.

The two engines here are both this tree (the checkout given is the repository itself), on the
``torch`` kernels so the worker builds nothing; what is checked is the protocol and the report,
not a speed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--kernels", "torch", "--seqs", "8", "--adapters", "2", "--warmup", "1"]


def run_benchmark(*argv: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "benchmarks.host_overhead", *SMALL, *argv]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_smoke_run_reports_steps_and_phases(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    done = run_benchmark("--steps", "4", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["kernels"] == "torch" and result["steps"] == 4 and result["seqs"] == 8
    assert result["preemptions"] == 0
    assert result["us_per_seq_step"] > 0
    assert set(result["phase_ms_mean"]) == {"schedule", "prepare", "forward", "sample", "output"}
    assert len(result["wrapped"]) == 4  # schedule, prepare, forward and sample were found and wrapped


def test_against_runs_two_engines_in_turns(tmp_path: Path) -> None:
    out = tmp_path / "turns.json"
    done = run_benchmark("--steps", "6", "--rounds", "3", "--against", str(ROOT), "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["rounds"] == 3 and result["steps_per_round"] == 2
    assert result["kernels"] == result["against_kernels"] == "torch"
    assert len(result["round_ratios"]) == 3 and all(r > 0 for r in result["round_ratios"])
    assert result["this"]["us_per_seq_step"] > 0 and result["against"]["us_per_seq_step"] > 0
    expected = result["against"]["us_per_seq_step"] / result["this"]["us_per_seq_step"]
    assert abs(result["ratio"] - expected) < 0.01
    assert len(result["wrapped"]["this"]) == len(result["wrapped"]["against"]) == 4
    assert "host overhead in turns, 3 rounds x 2 steps" in done.stdout
    assert result["preemptions"] == {"this": 0, "against": 0}  # the pool holds every sequence whole


def test_against_refuses_what_is_not_a_checkout(tmp_path: Path) -> None:
    done = run_benchmark("--against", str(tmp_path))
    assert done.returncode == 2
    assert "not a checkout of loraserve" in done.stderr


def test_rounds_without_against_is_refused() -> None:
    done = run_benchmark("--rounds", "4")
    assert done.returncode == 2
    assert "--rounds sets the turns of --against" in done.stderr


def test_turns_are_32_steps_unless_told() -> None:
    """With ``--against``, the steps default to 32 a turn (a turn's first step runs cold)."""
    from benchmarks.host_overhead import parse_args

    assert parse_args([]).steps == 32
    assert (parse_args(["--against", str(ROOT)]).steps, parse_args(["--against", str(ROOT)]).rounds) == (256, 8)
    assert parse_args(["--against", str(ROOT), "--rounds", "3"]).steps == 96
    assert parse_args(["--against", str(ROOT), "--steps", "10"]).steps == 10
    with pytest.raises(SystemExit):
        parse_args(["--against", str(ROOT), "--rounds", "-3"])


def test_phase_timer_counts_nested_calls_of_a_phase_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode graphs' eager forward calls the model's forward: both are "forward", counted once."""
    import itertools
    from types import SimpleNamespace

    from benchmarks import host_overhead
    from benchmarks.host_overhead import PhaseTimer, instrument

    ticks = itertools.count()
    monkeypatch.setattr(host_overhead.time, "perf_counter", lambda: float(next(ticks)))  # one second a reading

    calls: list[str] = []

    class Graphs:
        def run(self, batch: object) -> None:
            calls.append("run")
            engine.model.forward()  # as DecodeGraphs.forward does through the model

    model = SimpleNamespace(forward=lambda: calls.append("forward"))
    runner = SimpleNamespace(prepare=lambda: None, sampler=lambda: None, decode_graphs=Graphs())
    engine = SimpleNamespace(scheduler=SimpleNamespace(schedule=lambda: None), runner=runner, model=model)
    timer = PhaseTimer()
    wrapped = instrument(engine, timer)
    assert "forward=Graphs.run" in wrapped and len(wrapped) == 5
    timer.enabled = True
    engine.runner.decode_graphs.run(None)
    assert calls == ["run", "forward"]
    assert timer.seconds["forward"] == 1.0  # two readings (nested timing: four, and 1 + 3 s)


def test_against_passes_async_scheduling_to_the_other_checkout() -> None:
    from benchmarks.host_overhead import parse_args
    from benchmarks.host_overhead_turns import worker_argv

    assert "--async-scheduling" in worker_argv(parse_args(["--against", str(ROOT), "--async-scheduling"]))
    assert "--async-scheduling" not in worker_argv(parse_args(["--against", str(ROOT)]))
