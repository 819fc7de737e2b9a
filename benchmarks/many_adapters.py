"""Many adapters (S-LoRA's workload): loraserve, its two ablations and PEFT on one request stream.

    python -m benchmarks.many_adapters --quick                  # N=1,10,100, under 5 minutes on 2 cores
    python -m benchmarks.many_adapters --json many.json         # N=1,10,100,1000 (the issue's run)

N adapters (``--adapters``), random non-zero PEFT LoRA adapters of the model (``--targets``,
ranks cycling ``--ranks``, written once into a registry directory under ``--cache-dir`` and
reused). The stream (``benchmarks/_arrivals.py``): ``--requests`` requests arriving by a Poisson
process at ``--rate`` per second (gamma with ``--cv``; ``--rate inf``: all at t=0), prompt and
output lengths uniform in [``--min-len``, ``--max-len``), request i on adapter ``int(u_i * N)``
with ``u_i ~ power(--alpha)``, greedy, EOS ignored; the same stream for every N and system.

Systems (``--systems``): ``loraserve`` (the engine as shipped: one page pool for KV and adapters,
KV paged); ``fixed`` (``adapter_region="fixed"``: ``--max-loras`` adapter slots at
``--max-lora-rank``, apart from the KV cache) and ``reserve`` (``kv_allocation="reserve"``: KV for
prompt + max_tokens taken at admission), all three with the same ``--memory-budget-mb`` of pool;
``peft-one`` and ``peft-mixed`` (``benchmarks/_peft_baselines.py``), given ``--peft-timeout``
seconds per run and not run at larger N once they time out. The engine is driven on the arrival
clock: a request is added when its arrival time has passed, ``step()`` runs while anything is
unfinished, and after every step the script records first tokens, finishes and the pool's pages
by kind (``LLMEngine.stats()``). See ``benchmarks/README.md`` for every column.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from benchmarks._arrivals import Stream, Timing, add_arrival_args, check_arrival_args, make_stream
from benchmarks._many_report import KINDS, SYSTEMS, RunResult, describe, markdown, row, skipped
from benchmarks._quick import parse_with_quick
from benchmarks._workload import _load_factory

ROOT = Path(__file__).resolve().parents[1]


def adapter_name(i: int, ranks: list[int]) -> str:
    return f"a{i:04d}-r{ranks[i % len(ranks)]}"


def prepare_adapters(args: argparse.Namespace, model_dir: Path, hf_config: Any, count: int) -> Path:
    """Adapters 0..count-1 in a registry directory (written on first use); return the directory.

    Each ``DIR/<name>`` is a plain PEFT directory: the engine reads it through the registry, PEFT
    with ``load_adapter``."""
    import tempfile

    from loraserve.adapters import AdapterRegistry, BaseModelShapes, LocalDirStore, read_adapter_dir

    digest = hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()[:8]
    targets = "+".join(t[0] for t in args.targets)
    store_dir = args.cache_dir / f"{model_dir.name}-{digest}-{targets}-{args.adapter_dtype}"
    registry = AdapterRegistry(LocalDirStore(store_dir), BaseModelShapes.from_hf_config(hf_config))
    missing = [i for i in range(count) if not registry.contains(adapter_name(i, args.ranks))]
    factory: Any = _load_factory() if missing else None
    with tempfile.TemporaryDirectory() as tmp:
        for i in tqdm(missing, desc=f"writing adapters to {store_dir}", unit="adapter", disable=not missing):
            path = factory.make_peft_adapter_for_config(
                hf_config, Path(tmp) / str(i), rank=args.ranks[i % len(args.ranks)], target_modules=args.targets,
                seed=i, dtype=getattr(torch, args.adapter_dtype),
            )  # fmt: skip
            registry.register(adapter_name(i, args.ranks), read_adapter_dir(path))
    return store_dir


def engine_options(args: argparse.Namespace, system: str, store_dir: Path) -> dict[str, Any]:
    options: dict[str, Any] = {
        "registry": f"dir:{store_dir}", "max_num_seqs": args.max_num_seqs, "memory_budget_mb": args.memory_budget_mb,
        "host_adapter_cache_mb": args.host_cache_mb, "max_lora_rank": args.max_lora_rank, "dtype": args.dtype,
    }  # fmt: skip
    if args.threads:
        options["num_threads"] = args.threads
    if system == "fixed":
        options.update(adapter_region="fixed", max_loras=args.max_loras)
    elif system == "reserve":
        options["kv_allocation"] = "reserve"
    return options


def serve_loraserve(args: argparse.Namespace, stream: Stream, store_dir: Path, num_adapters: int,
                    system: str) -> tuple[RunResult, dict[str, Any]]:  # fmt: skip
    """One engine serving the stream on its arrival clock; also returns the engine's kernel choice."""
    from loraserve import LLM, SamplingParams
    from loraserve.page_pool import PageKind

    llm = LLM(args.model, **engine_options(args, system, store_dir))
    engine, block_size = llm.engine, llm.engine.config.block_size
    llm.generate([stream.prompts[0][:8]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
    first = engine.stats()
    kernels = {"kernels": first.kernels, "cpu_gemm": first.cpu_gemm, "num_pages": first.num_pages,
               "block_size": block_size}  # fmt: skip
    loads0, preempt0, evict0 = first.num_adapter_loads, first.num_preemptions, first.num_adapter_evictions
    adapters = stream.adapters(num_adapters)
    names = [adapter_name(a, args.ranks) for a in adapters]
    result = RunResult(system, num_adapters, stream.output_lens, [Timing(a) for a in stream.arrivals])
    waiting_first: dict[int, Any] = {}
    arrived = finished = 0
    progress = tqdm(total=len(stream), desc=f"{system} N={num_adapters}", unit="req", leave=False)
    start = time.perf_counter()
    while finished < len(stream):
        now = time.perf_counter() - start
        while arrived < len(stream) and stream.arrivals[arrived] <= now:
            i, arrived = arrived, arrived + 1
            params = SamplingParams(temperature=0, max_tokens=stream.output_lens[i], ignore_eos=True)
            waiting_first[i] = engine.add_request(f"r{i}", stream.prompts[i], params, names[i]).seqs[0]
        if not engine.has_unfinished_requests():
            if arrived == len(stream):
                raise RuntimeError(f"{system}: the engine is idle but {len(stream) - finished} requests never finished")
            time.sleep(max(0.0, stream.arrivals[arrived] - now))
            continue
        outputs = engine.step()
        t = time.perf_counter() - start
        for i in [i for i, seq in waiting_first.items() if seq.num_output_tokens >= 1]:
            result.timings[i].first = t
            del waiting_first[i]
        for output in outputs:
            if output.error:
                raise RuntimeError(f"{system}: request {output.request_id} failed: {output.error}")
            if output.finished:
                timing = result.timings[int(output.request_id[1:])]
                timing.finish, timing.tokens = t, len(output.outputs[0].token_ids)
                finished += 1
                progress.update(1)
        snap = engine.stats()
        pages = snap.pages_by_kind
        util = snap.num_kv_tokens / (pages[PageKind.KV] * block_size) if pages[PageKind.KV] else 0.0
        result.timeline.append([round(t, 4), *(pages[PageKind(k)] for k in KINDS), round(util, 4),
                                snap.num_running_adapters])  # fmt: skip
    progress.close()
    result.wall_s = max(t.finish or 0.0 for t in result.timings)
    last = engine.stats()
    result.stats = pool_stats(result.timeline, block_size)
    result.stats.update(
        adapters_used=len(set(adapters)), pool_pages=last.num_pages, preemptions=last.num_preemptions - preempt0,
        adapter_loads=last.num_adapter_loads - loads0, adapter_evictions=last.num_adapter_evictions - evict0,
    )  # fmt: skip
    if hasattr(engine, "close"):  # the registry and loader threads
        engine.close()
    del llm, engine
    gc.collect()
    return result, kernels


def pool_stats(timeline: list[list[float]], block_size: int) -> dict[str, Any]:
    """Peaks of the pages by kind over the steps, KV utilisation (mean over the steps that hold KV)
    and the distinct adapters of the running sequences (mean and peak over the steps)."""
    column = {k: 1 + j for j, k in enumerate(KINDS)}
    peak = {k: int(max((row[column[k]] for row in timeline), default=0)) for k in KINDS}
    resident = [row[column["adapter"]] + row[column["adapter_idle"]] for row in timeline]
    utils = [row[-2] for row in timeline if row[column["kv"]]]
    distinct = [row[-1] for row in timeline]
    return {
        "adapters_per_step_mean": sum(distinct) / len(distinct) if distinct else 0.0,
        "adapters_per_step_max": int(max(distinct, default=0)),
        "peak_kv_pages": peak["kv"], "peak_adapter_pages": int(max(resident, default=0)),
        "peak_adapter_pinned_pages": peak["adapter"], "peak_adapter_idle_pages": peak["adapter_idle"],
        "min_free_pages": int(min((row[column["free"]] for row in timeline), default=0)),
        "kv_util_mean": sum(utils) / len(utils) if utils else None, "steps": len(timeline), "block_size": block_size,
    }  # fmt: skip


def run_all(
    args: argparse.Namespace, stream: Stream, model_dir: Path, store_dir: Path
) -> tuple[list[RunResult], dict[str, Any]]:
    """Every system at every N, in that order (N outer); PEFT stops growing N after a time-out."""
    from benchmarks._peft_baselines import PeftBaseline
    from loraserve.config import ConfigError

    peft = PeftBaseline(model_dir, lambda i: store_dir / adapter_name(i, args.ranks),
                        lambda i: adapter_name(i, args.ranks), args.peft_batch, getattr(torch, args.dtype))  # fmt: skip
    results: list[RunResult] = []
    kernels: dict[str, Any] = {}
    timed_out: dict[str, int] = {}
    runs = [(n, system) for n in args.adapters for system in args.systems]
    for n, system in tqdm(runs, desc="runs", unit="run"):
        if system.startswith("peft") and system in timed_out and not args.peft_after_timeout:
            result = skipped(system, n, stream, f"timed out at N={timed_out[system]}")
        elif system.startswith("peft") and args.peft_max_adapters and n > args.peft_max_adapters:
            result = skipped(system, n, stream, f"--peft-max-adapters {args.peft_max_adapters}")
        elif system.startswith("peft"):
            result = peft.serve(stream, n, system, args.peft_timeout)
            if result.timed_out:
                timed_out[system] = n
        else:
            try:
                result, kernels = serve_loraserve(args, stream, store_dir, n, system)
            except ConfigError as error:  # e.g. a fixed region that leaves no KV pages
                result = skipped(system, n, stream, str(error))
        results.append(result)
        tqdm.write(row(result.summary(args.slo_ttft)))
        gc.collect()
    return results, kernels


QUICK = {
    "adapters": [1, 10, 100],
    "requests": 16,
    "min_len": 8,
    "max_len": 32,
    "rate": 4.0,
    "memory_budget_mb": 256,
    "max_loras": 2,
    "peft_timeout": 20.0,
    "peft_max_adapters": 10,
}  # --quick's run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from loraserve.models.loader import cache_root

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    add = parser.add_argument
    add("--adapters", type=ints, default=[1, 10, 100, 1000], help="adapter counts N (default 1,10,100,1000)")
    add("--requests", type=int, default=100, help="requests in the stream (default 100)")
    add("--min-len", type=int, default=8, help="shortest prompt and output (default 8)")
    add("--max-len", type=int, default=512, help="longest prompt and output, exclusive (default 512)")
    add_arrival_args(parser, rate=1.0)
    add("--seed", type=int, default=0, help="the stream's seed (default 0)")
    add("--systems", type=lambda t: t.split(","), default=list(SYSTEMS), help=f"systems (default {','.join(SYSTEMS)})")
    add("--model", default=None, help="model directory (default: the default model)")
    add("--ranks", type=ints, default=[64, 32, 16, 8], help="ranks cycled over the adapters (default 64,32,16,8)")
    add("--targets", type=lambda t: t.split(","), default=["q_proj", "v_proj"],
        help="target modules (default q_proj,v_proj: 1000 adapters take 6.9 GB in float32)")  # fmt: skip
    add("--dtype", choices=["float32", "bfloat16"], default="float32",
        help="weights and KV of every system, PEFT too (default float32)")  # fmt: skip
    add("--adapter-dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    add("--cache-dir", type=Path, default=cache_root() / "bench-adapters", help="where the adapters are kept")
    group = parser.add_argument_group("loraserve (every variant)")
    group.add_argument("--max-num-seqs", type=int, default=64, help="max_num_seqs (default 64)")
    group.add_argument("--memory-budget-mb", type=int, default=512, help="page pool of every variant (default 512)")
    group.add_argument("--max-loras", type=int, default=2, help="slots of the fixed adapter region (default 2)")
    group.add_argument("--max-lora-rank", type=int, default=64, help="max_lora_rank (default 64, the largest rank)")
    group.add_argument("--host-cache-mb", type=int, default=2048, help="host adapter cache (default 2048)")
    group.add_argument("--threads", type=int, default=None, help="torch threads, PEFT too (default: torch's)")
    group = parser.add_argument_group("PEFT")
    group.add_argument("--peft-batch", type=int, default=16, help="largest PEFT batch (default 16)")
    group.add_argument("--peft-timeout", type=float, default=900.0, help="seconds per PEFT run (default 900)")
    group.add_argument("--peft-max-adapters", type=int, default=None, help="run PEFT only up to this N")
    group.add_argument("--peft-after-timeout", action="store_true", help="run PEFT at larger N after a time-out too")
    add("--json", type=Path, default=None, help="also write everything (per request, per step) to this JSON file")
    add("--plot-dir", type=Path, default=ROOT / "benchmarks" / "results", help="PNG plots (default benchmarks/results)")
    add("--no-plots", action="store_true", help="draw no plots")
    add("--quick", action="store_true", help="smoke run: N=1,10,100, 16 requests of 8-31 tokens at 4/s, a 256 MiB "
        "pool with 2 fixed slots, PEFT up to N=10 and 20 s")  # fmt: skip
    args = parse_with_quick(parser, argv, QUICK)
    check_arrival_args(parser, args)
    if args.rate is None:
        parser.error("--rate is required")
    if not 1 <= args.min_len < args.max_len or not args.adapters or min(args.adapters) < 1 or args.requests < 1:
        parser.error("need 1 <= --min-len < --max-len, --requests >= 1 and adapter counts >= 1")
    if unknown := set(args.systems) - set(SYSTEMS):
        parser.error(f"unknown systems {sorted(unknown)}; choose from {list(SYSTEMS)}")
    args.systems = [s for s in SYSTEMS if s in args.systems]
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from benchmarks.throughput import machine_info
    from loraserve.models.loader import load_hf_config, resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    hf_config = load_hf_config(model_dir)
    store_dir = prepare_adapters(args, model_dir, hf_config, max(args.adapters))
    lens = (args.min_len, args.max_len)
    vocab = int(hf_config.vocab_size)
    stream = make_stream(args.requests, lens, lens, vocab, rate=args.rate, cv=args.cv, alpha=args.alpha, seed=args.seed)
    info = {**machine_info(), "dtype": args.dtype}
    start = time.perf_counter()
    results, kernels = run_all(args, stream, model_dir, store_dir)
    info["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    info["run_s"] = round(time.perf_counter() - start, 1)
    summaries = [r.summary(args.slo_ttft) for r in results]
    print("\n".join([*describe(args, info, kernels, store_dir), f"Run: {info['run_s']:.0f} s", "",
                     markdown(summaries)]), flush=True)  # fmt: skip
    payload = {
        "machine": info, "engine": kernels,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "stream": {"arrivals_s": stream.arrivals, "prompt_lens": [len(p) for p in stream.prompts],
                   "output_lens": stream.output_lens, "draws": stream.draws},
        "results": [r.to_json(args.slo_ttft) for r in results],
    }  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    if not args.no_plots:
        from benchmarks._many_plots import plot_all

        for path in plot_all(results, args.slo_ttft, args.plot_dir):
            print(f"plot: {path}")
    return payload


if __name__ == "__main__":
    main()
