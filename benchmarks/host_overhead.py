"""Host overhead of a decode step: a model so small that the forward costs little.

    python -m benchmarks.host_overhead [--kernels cpu|torch|triton] [--seqs 256] [--adapters 32]

A random Llama of 2 layers, hidden size 64 and a 512-word vocabulary (token ids read with the
default model's tokenizer, so detokenization runs as in serving); ``--seqs`` sequences decode
together, spread round robin over ``--adapters`` random PEFT adapters of ranks cycling 8/16/32/64
(0 adapters: the base model), greedy, outputs reported as ``LLM.generate`` asks them
(``--output-kind``). After every sequence's prompt is computed, ``--steps`` decode steps are
timed; it prints wall milliseconds per step, microseconds per sequence per step, and the split by
phase: schedule, prepare (the runner's inputs), forward, sample, output (the rest of the step:
page copies, accounting, stop checks, detokenization, outputs). Phases are timed by wrapping the
engine's own methods, so the same script measures an older checkout of the engine (the JSON's
``wrapped`` names what it wrapped). ``--against CHECKOUT`` runs that checkout's engine and this
one in turns, both alive at once, and reports both and their ratio (``host_overhead_turns.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks._random_models import TOKENIZER_FILES, make_adapters
from benchmarks.throughput import machine_info

VOCAB = 512
TINY: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
PHASES = ("schedule", "prepare", "forward", "sample")
# With --against, the default steps a turn: a turn's first step runs on caches and OpenMP threads
# the other engine just left, and in short turns that cold step moves a round's median.
TURN_STEPS = 32
TURN_ROUNDS = 8  # with --against, the default rounds
BLOCK_SIZE = 16
TURN_PREFIX = "@turn "  # the --worker's protocol lines on stdout (anything else there is not read)


def make_tiny_model(out_dir: Path) -> Path:
    """The benchmark's model: random weights, ``VOCAB`` words, the default model's tokenizer files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from loraserve.models.loader import resolve_model_dir

    if (out_dir / "config.json").is_file():
        return out_dir
    tokenizer_dir = resolve_model_dir(None)
    config = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=True, **TINY)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            (out_dir / name).write_bytes((tokenizer_dir / name).read_bytes())
    return out_dir


class PhaseTimer:
    """Accumulates the seconds spent in wrapped callables, per phase name (a call inside another
    of the same phase counts once: the decode graphs' eager forward calls the model's)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.enabled = False
        self._active: set[str] = set()

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.enabled or phase in self._active:
                return fn(*args, **kwargs)
            self._active.add(phase)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start
                self._active.discard(phase)

        return timed


def instrument(engine: Any, timer: PhaseTimer) -> list[str]:
    """Wrap the engine's schedule, prepare, forward and sample callables; return what was wrapped.
    A decode step run by the decode graphs is "forward" too (on CUDA: the replay's launch, and the
    wait for the GPU where the step waits)."""
    targets = [
        ("schedule", engine.scheduler, "schedule"),
        ("prepare", engine.runner, "prepare"),
        ("forward", engine.model, "forward"),
        ("forward", engine.runner.decode_graphs, "run"),
        ("sample", engine.runner, "sampler"),
    ]
    wrapped = []
    for phase, owner, name in targets:
        if owner is not None and hasattr(owner, name):
            setattr(owner, name, timer.wrap(phase, getattr(owner, name)))
            wrapped.append(f"{phase}={type(owner).__name__}.{name}")
    return wrapped


class DecodeBench:
    """One engine with ``--seqs`` sequences decoding in steady state (prompts and ``--warmup``
    steps done); ``time(k)`` times its next ``k`` steps. ``total_steps``: every step it will time."""

    def __init__(self, args: argparse.Namespace, model_dir: Path, adapter_dir: Path, total_steps: int) -> None:
        from loraserve import LLM, SamplingParams

        # Room for every sequence's whole length (no preemption in the timed steps) and for every
        # adapter at the largest rank (a rank-64 adapter of this model fits in 64 pages).
        seq_pages = math.ceil((args.prompt_len + args.warmup + total_steps + 2) / BLOCK_SIZE) + 1
        llm = LLM(str(model_dir), kernels=args.kernels, device=args.device, max_num_seqs=args.seqs,
                  max_num_batched_tokens=4096, num_pages=args.seqs * seq_pages + 64 * max(args.adapters, 1),
                  block_size=BLOCK_SIZE, num_threads=args.threads,
                  **({"async_scheduling": True} if args.async_scheduling else {}))  # fmt: skip
        self.engine = engine = llm.engine
        ranks = [(8, 16, 32, 64)[i % 4] for i in range(args.adapters)]
        names: list[str | None] = [None]
        if args.adapters:
            names = [name for name, path in make_adapters(model_dir, adapter_dir, ranks)]
            for name, path in make_adapters(model_dir, adapter_dir, ranks):
                llm.add_adapter(name, path)
        self.timer = PhaseTimer()
        self.timed_preemptions = 0  # in the timed steps (the pool is sized for none)
        self.wrapped = instrument(engine, self.timer)
        max_tokens = args.warmup + total_steps + 2
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, output_kind=args.output_kind)
        gen = torch.Generator().manual_seed(0)
        for i in range(args.seqs):
            prompt = torch.randint(32, VOCAB, (args.prompt_len,), generator=gen).tolist()
            engine.add_request(str(i), prompt, params, names[i % len(names)])
        steps = 0
        while not all(s.num_output_tokens >= 1 for r in engine.requests.values() for s in r.seqs):
            engine.step()  # prompts (and adapter loads)
            steps += 1
            if steps > 10 * args.seqs:
                raise RuntimeError("the prompts did not finish")
        for _ in range(args.warmup):
            engine.step()

    def time(self, steps: int) -> list[float]:
        """Seconds of each of the next ``steps`` steps (their phases add to ``timer``)."""
        seconds: list[float] = []
        preemptions = self.engine.scheduler.num_preemptions
        self.timer.enabled = True
        for _ in range(steps):
            start = time.perf_counter()
            self.engine.step()
            seconds.append(time.perf_counter() - start)
        self.timer.enabled = False
        self.timed_preemptions += self.engine.scheduler.num_preemptions - preemptions
        return seconds

    def finish(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()


def summarize(args: argparse.Namespace, step_seconds: list[float], phase_seconds: dict[str, float]) -> dict[str, Any]:
    """Wall ms per step (median, mean), us per sequence per step and the phases' mean ms."""
    steps = len(step_seconds)
    total = sum(step_seconds)
    split = {phase: 1e3 * s / steps for phase, s in phase_seconds.items()}
    split["output"] = 1e3 * total / steps - sum(split.values())
    median_ms = 1e3 * statistics.median(step_seconds)
    return {
        "ms_per_step_median": round(median_ms, 3),
        "ms_per_step_mean": round(1e3 * total / steps, 3),
        "us_per_seq_step": round(1e3 * median_ms / args.seqs, 2),
        "phase_ms_mean": {k: round(v, 3) for k, v in split.items()},
    }


def run(args: argparse.Namespace, model_dir: Path, adapter_dir: Path) -> dict[str, Any]:
    bench = DecodeBench(args, model_dir, adapter_dir, args.steps)
    step_seconds = bench.time(args.steps)
    bench.finish()
    return {
        "kernels": bench.engine.kernels.name,
        "seqs": args.seqs,
        "adapters": args.adapters,
        "steps": args.steps,
        "output_kind": args.output_kind,
        **summarize(args, step_seconds, bench.timer.seconds),
        "preemptions": bench.timed_preemptions,
        "wrapped": bench.wrapped,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", default="cpu", choices=["cpu", "torch", "triton"], help="kernel backend (cpu)")
    parser.add_argument("--device", default="cpu", help="the engine's device (cpu; cuda with --kernels triton)")
    parser.add_argument("--seqs", type=int, default=256, help="sequences decoding together (256)")
    parser.add_argument("--adapters", type=int, default=32, help="adapters, round robin; 0: base model (32)")
    parser.add_argument("--prompt-len", type=int, default=8, help="prompt tokens per sequence (8)")
    parser.add_argument("--warmup", type=int, default=4, help="decode steps before timing (4)")
    parser.add_argument(
        "--steps", type=int, default=None, help="timed decode steps (32; with --against, in all: 32 a turn, 256)"
    )
    parser.add_argument(
        "--output-kind",
        default="final_only",
        choices=["final_only", "cumulative"],
        help="final_only (LLM.generate's, default) or cumulative (a streamed request's)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument(
        "--async-scheduling", action="store_true", help="the engine's --async-scheduling (host work overlaps the GPU's)"
    )
    parser.add_argument(
        "--against", type=Path, default=None, help="a loraserve checkout (git worktree add DIR COMMIT) to run in turns"
    )
    parser.add_argument("--rounds", type=int, default=None, help="turns of each engine with --against (8)")
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # --against's other engine
    args = parser.parse_args(argv)
    if args.against is not None and args.rounds is None:
        args.rounds = TURN_ROUNDS
    if args.rounds is not None and args.rounds < 1:
        parser.error("--rounds must be positive")
    if args.steps is None:
        args.steps = TURN_STEPS * args.rounds if args.against is not None else 32
    if args.seqs < 1 or args.adapters < 0 or args.steps < 1 or args.prompt_len < 1:
        parser.error("--seqs, --steps and --prompt-len must be positive, --adapters >= 0")
    if args.against is None and args.rounds is not None:
        parser.error("--rounds sets the turns of --against: give it with --against")
    if args.against is not None and args.rounds > args.steps:
        parser.error("--rounds must be between 1 and --steps")
    if args.against is not None and not (args.against / "loraserve" / "__init__.py").is_file():
        parser.error(f"--against {args.against}: not a checkout of loraserve (no loraserve/__init__.py)")
    return args


def bench_dirs() -> tuple[Path, Path]:
    """The model (built once) and the adapters' directory under the loraserve cache."""
    from loraserve.models.loader import cache_root

    root = cache_root() / "bench-host-overhead"
    return make_tiny_model(root / "model"), root / "adapters"


def measure(args: argparse.Namespace) -> dict[str, Any]:
    return run(args, *bench_dirs())


def serve_turns(args: argparse.Namespace) -> None:
    """``--worker``: the other engine of ``--against``. Says it is ready on stdout, then for each
    number ``n`` read on stdin times ``n`` steps and answers with their seconds and phases
    (protocol lines start with ``TURN_PREFIX``; 0 ends it)."""
    bench = DecodeBench(args, *bench_dirs(), args.steps)
    print(TURN_PREFIX + json.dumps({"kernels": bench.engine.kernels.name, "wrapped": bench.wrapped}), flush=True)
    for line in sys.stdin:
        steps = int(line)
        if steps == 0:
            break
        before = dict(bench.timer.seconds)
        seconds = bench.time(steps)
        phases = {phase: bench.timer.seconds[phase] - before[phase] for phase in before}
        answer = {"seconds": seconds, "phases": phases, "preemptions": bench.timed_preemptions}
        print(TURN_PREFIX + json.dumps(answer), flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        serve_turns(args)
        return
    if args.against is not None:
        from benchmarks.host_overhead_turns import compare

        result = compare(args)
        print(result["summary"])
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
        return
    result = measure(args)
    result["machine"] = machine_info()
    phases = "  ".join(f"{k} {v:.2f}" for k, v in result["phase_ms_mean"].items())
    print(f"host overhead, {result['kernels']} backend, {args.seqs} seqs, {args.adapters} adapters, "
          f"{VOCAB}-word vocabulary, {args.steps} decode steps")  # fmt: skip
    print(f"  {result['ms_per_step_median']:.2f} ms per step (median), {result['us_per_seq_step']:.2f} us per "
          f"sequence per step; mean ms by phase: {phases}")  # fmt: skip
    print(f"  machine: {result['machine'].get('cpu')} ({result['machine'].get('isa')})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
