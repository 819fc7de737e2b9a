"""Prefix-caching benchmark: one long shared system prompt, many requests on many adapters.

Request ``i`` is ``system prompt + a short distinct question`` (token ids, so the prefix is
exact) on adapter ``i % num_adapters``, greedy with ``ignore_eos`` (exactly
``--output-tokens`` tokens). All requests are queued at once and the engine is stepped to the
end, with ``enable_prefix_caching`` on and off (a fresh engine each, same pool), sampling the
pool after every step. Cached KV is keyed by adapter digest: only same-adapter requests share.

Columns: ``cpu s`` is this process's CPU time (all threads; less sensitive than wall time to
other load). ``tok/s`` = (prompt + generated tokens) / wall s, cached prompt tokens included;
``gen tok/s`` generated only. ``live pages``: referenced by running sequences or resident
adapters (``num_pages - free - evictable``); ``kv pages``: the KV part; ``cached pages``: idle
prefix-cache blocks (evictable); all peaks. ``hit rate``: matched / looked-up prompt tokens.

    python -m benchmarks.prefix_cache --quick
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from tqdm.auto import tqdm

from loraserve import LLM, SamplingParams
from loraserve.page_pool import PageKind

ROOT = Path(__file__).resolve().parent.parent
RULES = [
    "Answer in plain English and keep every answer short, precise and polite.",
    "If a question is ambiguous, state the most likely reading and answer that one.",
    "Never invent facts; say that you do not know when you are not sure.",
    "Use metric units, and give both units when the question uses imperial ones.",
    "Cite the relevant rule number of this policy when you refuse a request.",
    "Format lists with one item per line and numbers only when order matters.",
    "Prefer concrete examples over abstract explanations when teaching a concept.",
    "Do not repeat the question back to the user before answering it.",
]
FULL = {"num_requests": 100, "num_adapters": 10, "system_tokens": 1000}
QUICK = {"num_requests": 8, "num_adapters": 2, "system_tokens": 512}
TOPICS = ["rivers", "volcanoes", "prime numbers", "bread", "bicycles", "comets", "tides", "bees", "glass", "clocks"]


@dataclass
class Result:
    """One engine run over the whole workload."""

    prefix_caching: bool
    requests: int
    prompt_tokens: int
    generated_tokens: int
    wall_s: float
    cpu_s: float
    tokens_per_s: float
    generated_per_s: float
    peak_live_pages: int
    peak_kv_pages: int
    peak_cached_pages: int
    num_pages: int
    block_size: int
    hit_rate: float | None
    cached_tokens: int
    prefix_cache_evictions: int
    steps: int


def load_adapter_factory() -> ModuleType:
    """``tests/adapter_factory.py``, imported by path (tests/ is not a package)."""
    spec = importlib.util.spec_from_file_location("adapter_factory", ROOT / "tests" / "adapter_factory.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_adapters(model_dir: Path, out_dir: Path, num_adapters: int) -> list[tuple[str, Path]]:
    """Seeded PEFT adapters (ranks 8/16, q/v or all linear modules), written once into ``out_dir``."""
    from transformers import AutoConfig

    factory = load_adapter_factory()
    config = AutoConfig.from_pretrained(model_dir)
    adapters = []
    for i in range(num_adapters):
        rank = 8 if i % 2 == 0 else 16
        targets: Any = ["q_proj", "v_proj"] if i % 4 < 2 else "all-linear"
        path = out_dir / f"bench-{i}-r{rank}-{'qv' if isinstance(targets, list) else 'all'}"
        if not (path / "adapter_model.safetensors").is_file():
            factory.make_peft_adapter_for_config(config, path, rank=rank, target_modules=targets, seed=1000 + i)
        adapters.append((f"bench-{i}", path))
    return adapters


def make_prompts(tokenizer: Any, system_tokens: int, num_requests: int) -> tuple[list[list[int]], int]:
    """``num_requests`` token-id prompts sharing a system prompt of at least ``system_tokens`` tokens."""
    lines = ["You are the support assistant of an encyclopedia. Follow this policy exactly."]
    system_ids: list[int] = []
    while len(system_ids) < system_tokens:
        number = len(lines)
        lines.append(f"Rule {number}: {RULES[number % len(RULES)]} (section {number // len(RULES) + 1})")
        system_ids = tokenizer.encode("\n".join(lines) + "\n\n")
    prompts = []
    for i in range(num_requests):
        question = f"Question {i + 1}: tell me one surprising fact about {TOPICS[i % len(TOPICS)]}, item {i}.\nAnswer:"
        prompts.append(system_ids + tokenizer.encode(question, add_special_tokens=False))
    return prompts, len(system_ids)


def run(
    args: argparse.Namespace, prefix_caching: bool, prompts: list[list[int]], adapters: list[tuple[str, Path]]
) -> tuple[Result, list[list[int]]]:
    """Serve every prompt on a fresh engine; return the measurements and the generated token ids."""
    options: dict[str, Any] = {"enable_prefix_caching": prefix_caching, "device": args.device}
    options.update(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    if args.num_pages:
        options["num_pages"] = args.num_pages
    if args.num_threads:
        options["num_threads"] = args.num_threads
    llm = LLM(args.model, **options)
    for name, path in adapters:
        llm.add_adapter(name, path)
    engine, pool = llm.engine, llm.engine.pool
    llm.generate([prompts[0][-8:]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)  # warm-up
    index = engine.kv_manager.prefix_cache
    lookups_before = (index.num_queried_tokens, index.num_hit_tokens) if index is not None else (0, 0)
    evictions_before = pool.num_evictions.get(PageKind.PREFIX_CACHE, 0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    peak_live = peak_kv = peak_cached = steps = 0
    finished: dict[str, Any] = {}
    start, cpu_start = time.perf_counter(), time.process_time()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params, adapters[i % len(adapters)][0])
    label = "prefix caching " + ("on" if prefix_caching else "off")
    with tqdm(total=len(prompts), desc=label, unit="req", disable=args.no_progress) as progress:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    progress.update(1)
            steps += 1
            by_kind = pool.num_pages_by_kind()
            peak_live = max(peak_live, pool.num_pages - pool.num_free_pages - pool.num_evictable_pages)
            peak_kv = max(peak_kv, by_kind.get(PageKind.KV, 0))
            peak_cached = max(peak_cached, by_kind.get(PageKind.PREFIX_CACHE, 0))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    outputs = [finished[f"r{i}"] for i in range(len(prompts))]
    prompt_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    generated = sum(len(out.token_ids) for out in outputs)
    hit_rate = None
    if index is not None:  # this run's lookups only (not the warm-up's)
        queried, hits = index.num_queried_tokens - lookups_before[0], index.num_hit_tokens - lookups_before[1]
        hit_rate = hits / queried if queried else 0.0
    result = Result(
        prefix_caching=prefix_caching,
        requests=len(prompts),
        prompt_tokens=prompt_tokens,
        generated_tokens=generated,
        wall_s=wall,
        cpu_s=cpu,
        tokens_per_s=(prompt_tokens + generated) / wall,
        generated_per_s=generated / wall,
        peak_live_pages=peak_live,
        peak_kv_pages=peak_kv,
        peak_cached_pages=peak_cached,
        num_pages=pool.num_pages,
        block_size=llm.config.block_size,
        hit_rate=hit_rate,
        cached_tokens=sum(out.num_cached_tokens for out in outputs),
        prefix_cache_evictions=pool.num_evictions.get(PageKind.PREFIX_CACHE, 0) - evictions_before,
        steps=steps,
    )
    token_ids = [list(out.token_ids) for out in outputs]
    del llm, engine, pool
    gc.collect()
    return result, token_ids


def machine_info(device: str) -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError, StopIteration):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    info: dict[str, Any] = {
        "cpu": cpu,
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "device": device,
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def table_header() -> str:
    header = (
        f"{'prefix caching':<15}{'wall s':>8}{'cpu s':>8}{'tok/s':>9}{'gen tok/s':>10}{'live pages':>11}{'kv pages':>9}"
        f"{'cached pages':>13}{'hit rate':>9}{'cached tok':>11}{'evictions':>10}"
    )
    return header + "\n" + "-" * len(header)


def table_row(r: Result) -> str:
    hit = f"{r.hit_rate:.1%}" if r.hit_rate is not None else "-"
    return (
        f"{'on' if r.prefix_caching else 'off':<15}{r.wall_s:>8.1f}{r.cpu_s:>8.1f}"
        f"{r.tokens_per_s:>9.1f}{r.generated_per_s:>10.2f}"
        f"{r.peak_live_pages:>11}{r.peak_kv_pages:>9}{r.peak_cached_pages:>13}{hit:>9}{r.cached_tokens:>11}"
        f"{r.prefix_cache_evictions:>10}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.prefix_cache", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--num-requests", type=int, default=None, help="default 100 (--quick: 8)")
    parser.add_argument("--num-adapters", type=int, default=None, help="default 10 (--quick: 2)")
    parser.add_argument(
        "--system-tokens", type=int, default=None, help="minimum system prompt length, default 1000 (--quick: 512)"
    )
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-pages", type=int, default=None, help="pool size (default: the engine's memory budget)")
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--adapter-dir",
        type=Path,
        default=Path.home() / ".cache" / "loraserve" / "bench-prefix-adapters",
        help="where the generated adapters are cached (per model)",
    )
    parser.add_argument(
        "--modes", default="on,off", help="prefix caching modes to run, in order (default on,off; e.g. off)"
    )
    parser.add_argument("--quick", action="store_true", help="8 requests, 2 adapters, 512-token system prompt")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    args = parser.parse_args(argv)
    args.modes = [mode.strip() for mode in args.modes.split(",")]
    if not args.modes or any(mode not in ("on", "off") for mode in args.modes):
        parser.error(f"--modes takes 'on', 'off' or both, got {args.modes}")
    preset = QUICK if args.quick else FULL
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv: list[str] | None = None) -> None:
    from loraserve.models.loader import resolve_model_dir

    args = parse_args(argv)
    model_dir = resolve_model_dir(args.model)
    adapters = make_adapters(model_dir, args.adapter_dir / model_dir.name, args.num_adapters)
    from transformers import AutoTokenizer

    prompts, system_len = make_prompts(AutoTokenizer.from_pretrained(model_dir), args.system_tokens, args.num_requests)
    machine = machine_info(args.device)
    print(f"machine: {machine['cpu']}, {machine['usable_cores']} cores, torch {machine['torch']}", end="")
    print(f" ({machine['torch_threads']} threads), device {args.device} {machine.get('gpu', '')}".rstrip())
    print(f"load average at start: {machine['load_avg_at_start']}")
    print(
        f"model {model_dir.name}; {args.num_requests} requests on {args.num_adapters} adapters; system prompt "
        f"{system_len} tokens; prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens; "
        f"{args.output_tokens} output tokens each (greedy, ignore_eos)"
    )
    print(table_header(), flush=True)
    results, outputs = [], []
    for mode in args.modes:  # each row is printed as soon as its run ends
        result, token_ids = run(args, mode == "on", prompts, adapters)
        print(table_row(result), flush=True)
        results.append(result)
        outputs.append(token_ids)
    summary = f"pool {results[0].num_pages} pages of {results[0].block_size} tokens"
    same = None
    if len(results) == 2 and results[0].prefix_caching != results[1].prefix_caching:
        on, off = sorted(results, key=lambda r: not r.prefix_caching)
        same = sum(a == b for a, b in zip(*outputs, strict=True))
        summary += (
            f"; speed-up {on.tokens_per_s / off.tokens_per_s:.2f}x (cpu time {off.cpu_s / on.cpu_s:.2f}x less); "
            f"peak live pages {off.peak_live_pages} -> {on.peak_live_pages}; outputs identical on/off: "
            f"{same}/{len(prompts)}"
        )
    print(f"{summary}; load average at end: {[round(x, 2) for x in os.getloadavg()]}")
    if args.json:
        payload = {"machine": machine, "args": {k: str(v) for k, v in vars(args).items()}, "identical": same}
        payload["results"] = [asdict(r) for r in results]
        args.json.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
