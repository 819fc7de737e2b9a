"""``host_overhead --against CHECKOUT``: this tree's engine and another checkout's, in turns.

A VM's speed drifts by tens of percent within minutes, so runs one after the other compare
badly. Here both engines live at once, each in steady state (the other one in a worker process
that imports the checkout's ``loraserve`` and this tree's ``benchmarks``), and they take turns:
``--rounds`` turns each of ``--steps / --rounds`` decode steps, the first engine to go
alternating. Each round gives a ratio of the two engines' median step times, measured seconds
apart; the summary reports both engines' figures and the median of those ratios.

The checkout is laid out as this repository (``loraserve/``, ``kernels/``, ``adapters/``,
``api/`` at the top, mapped into one package by pyproject.toml); the worker sees it through a
package of symlinks, and builds its compiled kernels in a cache of its own
(``<loraserve cache>/host-overhead-against``) so the two builds never overwrite each other.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

from benchmarks.host_overhead import PHASES, TURN_PREFIX, DecodeBench, bench_dirs, summarize

BENCHMARKS = Path(__file__).resolve().parent
MAPPED = {"kernels": "kernels", "adapters": "adapters", "api": "api"}  # package dir -> checkout dir


def package_view(checkout: Path, into: Path) -> Path:
    """A directory where ``import loraserve`` finds ``checkout``'s package: ``loraserve/`` of
    symlinks to its entries, plus the top-level folders pyproject.toml maps into it."""
    package = into / "loraserve"
    package.mkdir(parents=True)
    for entry in (checkout / "loraserve").iterdir():
        (package / entry.name).symlink_to(entry.resolve())
    for name, folder in MAPPED.items():
        if not (package / name).exists() and (checkout / folder).is_dir():
            (package / name).symlink_to((checkout / folder).resolve())
    return into


def worker_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--kernels", args.kernels, "--device", args.device, "--seqs", str(args.seqs), "--adapters",
            str(args.adapters), "--prompt-len", str(args.prompt_len), "--warmup", str(args.warmup), "--steps",
            str(args.steps), "--output-kind", args.output_kind, "--worker"]  # fmt: skip
    argv += ["--async-scheduling"] if args.async_scheduling else []  # an older checkout without it refuses it
    return argv + (["--threads", str(args.threads)] if args.threads else [])


def read_turn(worker: subprocess.Popen[str], log: IO[str]) -> dict[str, Any]:
    """The worker's next protocol line (RuntimeError with its log's tail if it ends first)."""
    assert worker.stdout is not None
    for line in worker.stdout:
        if line.startswith(TURN_PREFIX):
            answer: dict[str, Any] = json.loads(line[len(TURN_PREFIX) :])
            return answer
    worker.wait(30)
    log.seek(0)
    tail = log.read()[-3000:]
    raise RuntimeError(f"the --against engine ended (exit {worker.returncode}) before answering:\n{tail}")


def ask_turn(worker: subprocess.Popen[str], log: IO[str], steps: int) -> dict[str, Any]:
    """Has the worker time its next ``steps`` steps and returns its answer (0: it ends, no answer)."""
    assert worker.stdin is not None
    worker.stdin.write(f"{steps}\n")
    worker.stdin.flush()
    return read_turn(worker, log) if steps else {}


def compare(args: argparse.Namespace) -> dict[str, Any]:
    """Both engines in turns; this tree's figures, the checkout's, and their ratios."""
    from loraserve.models.loader import cache_root

    steps_per_round = args.steps // args.rounds
    with tempfile.TemporaryDirectory(prefix="loraserve-turns-") as tmp, open(Path(tmp) / "worker.log", "w+") as log:
        view = package_view(args.against, Path(tmp) / "package")
        (Path(tmp) / "bench").mkdir()
        (Path(tmp) / "bench" / "benchmarks").symlink_to(BENCHMARKS)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(view), str(Path(tmp) / "bench")]),
                   LORASERVE_CACHE=str(cache_root() / "host-overhead-against"))  # fmt: skip
        command = [sys.executable, "-m", "benchmarks.host_overhead", *worker_argv(args)]
        worker = subprocess.Popen(command, cwd=tmp, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=log, text=True)  # fmt: skip
        try:
            hello = read_turn(worker, log)
            bench = DecodeBench(args, *bench_dirs(), args.steps)
            ours: list[float] = []
            theirs: list[float] = []
            their_phases = dict.fromkeys(PHASES, 0.0)
            ratios: list[float] = []
            for round_index in range(args.rounds):
                if round_index % 2 == 0:  # the checkout goes first in even rounds
                    answer = ask_turn(worker, log, steps_per_round)
                    mine = bench.time(steps_per_round)
                else:
                    mine = bench.time(steps_per_round)
                    answer = ask_turn(worker, log, steps_per_round)
                for phase, seconds in answer["phases"].items():
                    their_phases[phase] += seconds
                theirs += answer["seconds"]
                ours += mine
                ratios.append(statistics.median(answer["seconds"]) / statistics.median(mine))
            ask_turn(worker, log, 0)  # ends the worker
            worker.wait(120)
            bench.finish()
        finally:
            if worker.poll() is None:
                worker.kill()
    this = summarize(args, ours, bench.timer.seconds)
    other_summary = summarize(args, theirs, their_phases)
    ratio = other_summary["us_per_seq_step"] / this["us_per_seq_step"]
    per_round = statistics.median(ratios)
    return {
        "kernels": bench.engine.kernels.name,
        "against_kernels": hello["kernels"],
        "seqs": args.seqs,
        "adapters": args.adapters,
        "output_kind": args.output_kind,
        "rounds": args.rounds,
        "steps_per_round": steps_per_round,
        "this": this,
        "against": other_summary,
        "ratio": round(ratio, 3),  # the checkout's median step / this tree's
        "round_ratios": [round(r, 3) for r in ratios],
        "round_ratio_median": round(per_round, 3),
        "preemptions": {"this": bench.timed_preemptions, "against": answer["preemptions"]},
        "wrapped": {"this": bench.wrapped, "against": hello["wrapped"]},
        "summary": (
            f"host overhead in turns, {args.rounds} rounds x {steps_per_round} steps, {args.seqs} seqs, "
            f"{args.adapters} adapters: this tree {this['us_per_seq_step']:.2f} us per sequence per step, "
            f"{args.against} {other_summary['us_per_seq_step']:.2f} ({ratio:.2f}x; per-round median "
            f"{per_round:.2f}x, range {min(ratios):.2f}-{max(ratios):.2f}x); preemptions in the timed steps: "
            f"{bench.timed_preemptions} and {answer['preemptions']}"
        ),
    }
