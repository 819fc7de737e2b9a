"""Multi-adapter throughput: the same request stream served with 1, 10, 100 and 1000 adapters.

Adapters are random, non-zero PEFT LoRA adapters for the default model (written with
``tests/adapter_factory.py``), adapter ``i`` of rank ``ranks[i % len(ranks)]`` (S-LoRA's
cycling), generated once into a registry directory under the cache and reused. Request ``i``
draws ``u_i`` once (uniform, or S-LoRA's power law ``u ~ power(alpha)`` with ``--alpha``) and
uses adapter ``int(u_i * N)``, so every N serves the same prompts and output lengths; greedy,
``ignore_eos``. The clock runs from the first ``add_request`` (which starts reading the
adapter's files on the manager's loader thread) to the last finished request. Target (issue 3):
tokens/s at 1000 adapters >= 80% of the single-adapter figure.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import platform
import random
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
FIRST_PLAIN_TOKEN = 32  # skip the special tokens at the start of the vocabulary
TARGET_RATIO = 0.8
# Parts of the wall clock; an indented part is inside the one above it.
TIMERS = (
    "scheduler.schedule",
    "runner.execute (loads+forward+sample)",
    "  page copies and adapter page writes (loads)",
    "  LoRA hook",
    "resolve_nowait (add_request, step)",
    "  registry.parse (parse+validate+hash)",
    "store read on the loader thread (overlaps the parts above)",
)


@dataclass
class Stream:
    prompts: list[list[int]]
    output_lens: list[int]
    draws: list[float]  # in [0, 1): request i uses adapter int(draws[i] * N)

    @classmethod
    def make(cls, args: argparse.Namespace, vocab: int) -> Stream:
        rng = random.Random(args.seed)
        lens = [rng.randrange(args.min_len, args.max_len) for _ in range(args.requests)]
        prompts = [[rng.randrange(FIRST_PLAIN_TOKEN, vocab) for _ in range(n)] for n in lens]
        outs = [rng.randrange(args.min_len, args.max_len) for _ in range(args.requests)]
        draws = [rng.random() ** (1 / (args.alpha or 1.0)) for _ in range(args.requests)]
        return cls(prompts, outs, draws)

    def adapter_of(self, i: int, num_adapters: int) -> int:
        return min(num_adapters - 1, int(self.draws[i] * num_adapters))


@dataclass
class Result:
    num_adapters: int
    tokens: int
    wall_s: float
    distinct: int
    mean_rank: float
    stats: dict[str, Any] = field(default_factory=dict)
    timers: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s


def adapter_name(i: int, ranks: list[int]) -> str:
    return f"a{i:04d}-r{ranks[i % len(ranks)]}"


def prepare_adapters(args: argparse.Namespace, hf_config: Any, count: int) -> Path:
    """Make sure adapters 0..count-1 exist in the registry directory; return that directory."""
    from loraserve.adapters import AdapterRegistry, BaseModelShapes, LocalDirStore, read_adapter_dir

    spec = importlib.util.spec_from_file_location("adapter_factory", ROOT / "tests" / "adapter_factory.py")
    assert spec is not None and spec.loader is not None
    factory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(factory)
    store_dir = args.cache_dir / f"{'+'.join(t[0] for t in args.targets)}-{args.adapter_dtype}"
    registry = AdapterRegistry(LocalDirStore(store_dir), BaseModelShapes.from_hf_config(hf_config))
    missing = [i for i in range(count) if not registry.contains(adapter_name(i, args.ranks))]
    with tempfile.TemporaryDirectory() as tmp:
        for i in tqdm(missing, desc=f"writing adapters to {store_dir}", unit="adapter", disable=not missing):
            rank = args.ranks[i % len(args.ranks)]
            path = factory.make_peft_adapter_for_config(
                hf_config,
                Path(tmp) / str(i),
                rank=rank,
                target_modules=args.targets,
                seed=i,
                dtype=getattr(torch, args.adapter_dtype),
            )
            registry.register(adapter_name(i, args.ranks), read_adapter_dir(path))
    return store_dir


def timed(timers: dict[str, float], key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            timers[key] += time.perf_counter() - start

    return wrapper


def instrument(engine: Any, result: Result) -> None:
    """Time the parts of a step by wrapping bound methods of this engine instance (no engine edits)."""
    timers, manager, runner = result.timers, engine.adapters, engine.runner
    registry = engine.adapter_registry
    manager.resolve_nowait = timed(timers, TIMERS[4], manager.resolve_nowait)
    registry.parse = timed(timers, TIMERS[5], registry.parse)
    registry.store.get = timed(timers, TIMERS[6], registry.store.get)
    take_loads = manager.take_loads

    def take_and_count() -> Any:
        loads = take_loads()
        fragmented = sum(not load.pages.is_contiguous for load in loads)
        result.stats["fragmented_loads"] = result.stats.get("fragmented_loads", 0) + fragmented
        return loads

    manager.take_loads = take_and_count
    runner.copy_pages = timed(timers, TIMERS[2], runner.copy_pages)
    engine.scheduler.schedule = timed(timers, TIMERS[0], engine.scheduler.schedule)
    runner.execute = timed(timers, TIMERS[1], runner.execute)
    hook = runner.lora_hook

    def lora_hook(x: Any, layer: int, group: str, outputs: Any, batch: Any) -> None:
        if layer == 0 and group == "qkv" and batch.lora is not None:
            result.stats.setdefault("segments", []).append(len(batch.lora.segments))
        hook(x, layer, group, outputs, batch)

    runner.lora_hook = timed(timers, TIMERS[3], lora_hook)


def serve(args: argparse.Namespace, stream: Stream, store_dir: Path, num_adapters: int) -> Result:
    from loraserve import LLM, SamplingParams

    llm = LLM(
        registry=f"dir:{store_dir}",
        max_num_seqs=args.max_num_seqs,
        memory_budget_mb=args.memory_budget_mb,
        host_adapter_cache_mb=args.host_cache_mb,
        num_threads=args.threads,
    )
    engine, pool = llm.engine, llm.engine.pool
    llm.generate([stream.prompts[0][:8]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
    used = [stream.adapter_of(i, num_adapters) for i in range(args.requests)]
    ranks = [args.ranks[a % len(args.ranks)] for a in used]
    tokens = sum(stream.output_lens)
    mean_rank = sum(r * n for r, n in zip(ranks, stream.output_lens, strict=True)) / tokens
    result = Result(num_adapters, tokens, 0.0, len(set(used)), mean_rank)
    instrument(engine, result)
    kinds: list[dict[str, int]] = []
    finished: dict[str, int] = {}
    bookkeeping = 0.0
    progress = tqdm(total=tokens, desc=f"N={num_adapters}", unit="tok")
    start = time.perf_counter()
    for i in range(args.requests):
        params = SamplingParams(temperature=0, max_tokens=stream.output_lens[i], ignore_eos=True)
        engine.add_request(f"r{i}", stream.prompts[i], params, adapter_name(used[i], args.ranks))
    while engine.has_unfinished_requests():
        outputs = engine.step()
        t0 = time.perf_counter()
        kinds.append(pool.num_pages_by_kind())
        for output in outputs:
            if output.finished:
                finished[output.request_id] = len(output.outputs[0].token_ids)
        progress.update(len(outputs))
        bookkeeping += time.perf_counter() - t0
    result.wall_s = time.perf_counter() - start - bookkeeping
    progress.close()
    if finished != {f"r{i}": n for i, n in enumerate(stream.output_lens)}:
        raise RuntimeError("wrong number of outputs or output lengths")
    manager = engine.adapters
    segments = result.stats.pop("segments", [0])
    result.stats.update(
        loads=manager.num_loads,
        preemptions=engine.scheduler.num_preemptions,
        evictions=manager.num_evictions,
        segments_mean=sum(segments) / len(segments),
        segments_max=max(segments),
        pages=pool.num_pages,
        **{f"{k}_mean": sum(d.get(k, 0) for d in kinds) / len(kinds) for k in ("adapter", "adapter_idle", "kv")},
        **{f"{k}_max": max(d.get(k, 0) for d in kinds) for k in ("adapter", "adapter_idle", "kv")},
    )
    del llm, engine
    gc.collect()
    return result


def machine() -> str:
    import transformers

    cpu = "unknown"
    with contextlib.suppress(OSError, StopIteration):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    return (
        f"{cpu}, {len(os.sched_getaffinity(0))} usable of {os.cpu_count()} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), transformers {transformers.__version__}, "
        f"Python {platform.python_version()}, float32"
    )


HEADER = (
    "| N | used | mean rank | tok/s | vs N=1 | wall s | loads | evict. | frag. loads | preempt. | adapters/step "
    "| adapter pages pinned mean/max | idle adapter pages mean | KV pages mean/max |\n" + "|---:" * 14 + "|"
)


def row(r: Result, base: float) -> str:
    s = r.stats
    return (
        f"| {r.num_adapters} | {r.distinct} | {r.mean_rank:.0f} | {r.tok_s:.1f} | {r.tok_s / base:.0%} "
        f"| {r.wall_s:.1f} | {s['loads']} | {s['evictions']} | {s.get('fragmented_loads', 0)} | {s['preemptions']} "
        f"| {s['segments_mean']:.1f} (max {s['segments_max']}) | {s['adapter_mean']:.0f}/{s['adapter_max']} "
        f"| {s['adapter_idle_mean']:.0f} | {s['kv_mean']:.0f}/{s['kv_max']} |"
    )


def report(args: argparse.Namespace, results: list[Result], load: tuple[list[float], list[float]]) -> str:
    base = results[0].tok_s
    popularity = f"power law alpha={args.alpha}" if args.alpha else "uniform"
    lines = [
        f"Machine: {machine()}; load average {load[0]} at start, {load[1]} at end",
        f"Stream: {args.requests} requests, seed {args.seed}, prompt/output lengths uniform in [{args.min_len}, "
        f"{args.max_len}), greedy, ignore_eos; adapter popularity {popularity}",
        f"Adapters: {','.join(args.targets)}, ranks cycling {args.ranks}, {args.adapter_dtype} files; engine "
        f"max_num_seqs={args.max_num_seqs}, pool {args.memory_budget_mb} MiB ({results[0].stats['pages']} pages), "
        f"host adapter cache {args.host_cache_mb} MiB",
        "",
        HEADER,
        *(row(r, base) for r in results),
    ]
    lines += [
        "",
        "Seconds of the wall clock (indented: part of the line above; adapter loads run on a",
        "thread of their own, beside the steps):",
        "",
    ]
    lines += ["| part | " + " | ".join(f"N={r.num_adapters}" for r in results) + " |"]
    lines += ["|---|" + "---:|" * len(results)]
    for key in TIMERS:
        lines.append(f"| {key} | " + " | ".join(f"{r.timers.get(key, 0.0):.2f}" for r in results) + " |")
    last = max(results, key=lambda r: r.num_adapters)  # N=1 may be repeated last to show drift
    met = "met" if last.tok_s >= TARGET_RATIO * base else "NOT met"
    lines += ["", f"Target: N={last.num_adapters} at >= {TARGET_RATIO:.0%} of N=1: {last.tok_s / base:.0%}, {met}."]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from loraserve.models.loader import cache_root

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    parser.add_argument("--adapters", type=ints, default=[1, 10, 100, 1000], help="adapter counts N (1,10,100,1000)")
    parser.add_argument("--requests", type=int, default=256, help="requests in the stream (default 256)")
    parser.add_argument("--min-len", type=int, default=8, help="min prompt/output length (default 8)")
    parser.add_argument("--max-len", type=int, default=128, help="max prompt/output length, exclusive (128)")
    parser.add_argument("--alpha", type=float, default=None, help="S-LoRA power-law popularity (default uniform)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ranks", type=ints, default=[8, 16, 32, 64], help="ranks, cycled over adapters")
    parser.add_argument(
        "--targets",
        type=lambda t: t.split(","),
        default=["q_proj", "v_proj"],
        help="target modules (default q_proj,v_proj: 1000 adapters take 6.9 GB in float32)",
    )
    parser.add_argument("--adapter-dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    parser.add_argument("--cache-dir", type=Path, default=cache_root() / "bench-adapters", help="adapter registry")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--memory-budget-mb", type=int, default=1024, help="page pool size (engine default 1024)")
    parser.add_argument("--host-cache-mb", type=int, default=2048, help="host adapter cache (engine default 2048)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="smoke test: N=1,10,100, 32 requests, lengths 4..32")
    args = parser.parse_args(argv)
    if args.quick:
        args.adapters, args.requests, args.min_len, args.max_len = [1, 10, 100], 32, 4, 32
    if not 1 <= args.min_len < args.max_len or not args.adapters or min(args.adapters) < 1:
        parser.error("need 1 <= --min-len < --max-len and adapter counts >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from loraserve.models.loader import default_model_dir, load_hf_config

    hf_config = load_hf_config(default_model_dir())
    store_dir = prepare_adapters(args, hf_config, max(args.adapters))
    stream = Stream.make(args, int(hf_config.vocab_size))
    load_start = [round(x, 2) for x in os.getloadavg()]
    results: list[Result] = []
    for n in args.adapters:  # rows as they come, so a long run shows partial results
        results.append(serve(args, stream, store_dir, n))
        tqdm.write(row(results[-1], results[0].tok_s) + " " + json.dumps(dict(results[-1].timers)))
    print(report(args, results, (load_start, [round(x, 2) for x in os.getloadavg()])), flush=True)


if __name__ == "__main__":
    main()
