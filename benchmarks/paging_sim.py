"""PagedAttention's memory study, replayed on loraserve's real ``Scheduler`` and ``KVCacheManager``.

No model runs: the scheduler and the KV cache manager (over the real ``PagePool``) do all the
admission, allocation and recompute preemption, and a cost model stands in for the forward. A step
that decodes costs ``(weight bytes + KV bytes per token x tokens its decoding sequences attend to) /
memory bandwidth``; prefill is free. Every request ignores EOS and ends at its drawn output length.

Defaults (the vLLM paper's setting): 2,000 requests queued at t=0; prompt lengths log-normal with
median 584 and 95th percentile 2,155 tokens, output lengths log-normal with mean 374 and 95th
percentile 1,118, total clipped to 4,096; Llama-3-8B (16.06e9 weight bytes, 131,072 KV bytes per
token) on 3.35e12 B/s; a 60 GB KV cache.

Policies: ``paged`` (the scheduler as the engine runs it: ``--block-size``, ``--watermark``);
``reserve`` (each admitted request holds KV slots for ``--max-len`` tokens) and ``oracle`` (for its
exact final KV length) are the same scheduler over ``ReservingKVCacheManager``, the real manager
asked at admission for every slot the request will ever get, on 1-token pages (a contiguous
allocator's exact reservation). Preemption is the scheduler's own (recompute).

Numbers, averaged over simulated time (a decode step weighs its duration, prefill-only steps none):
``avg_batch`` (sequences decoding), ``utilization`` (tokens held in KV by running sequences / slots
of allocated pages), ``pool_used`` (allocated / all slots). ``tokens_per_s``: output tokens /
simulated time to serve every request; ``queued_tokens_per_s``: the same over the steps after
which requests still wait (the cache full, before the queue drains). ``preemptions`` and
``recompute_tokens`` (tokens computed beyond each request's prompt + output - 1).
``mean_waste_tokens``: allocated slots minus tokens held, at each sequence's end.

    python -m benchmarks.paging_sim                                # 60 GB, all policies (<1 minute)
    python -m benchmarks.paging_sim --cache-gb 20 --policy paged --block-size 32 --watermark 0.05
    python -m benchmarks.paging_sim --sweep --json sweep.json --plot benchmarks/results/paging_sim.png
    python -m benchmarks.paging_sim --quick                        # 200 requests on 6 GB: seconds
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from loraserve.kv_cache_manager import KVCacheManager, ReservingKVCacheManager, tokens_at_most
from loraserve.page_pool import PagePool
from loraserve.sampling_params import SamplingParams
from loraserve.scheduler import Scheduler
from loraserve.sequence import FinishReason, Sequence
from loraserve.stop_checker import Stop, never_stops_early

Z95 = 1.6448536269514722  # the standard normal's 95th percentile
POLICIES = ("reserve", "oracle", "paged")
SWEEP_CACHES, SWEEP_BLOCKS, SWEEP_WATERMARKS = (60.0, 20.0), (16, 32, 128, 512), (0.0, 0.01, 0.05)


@dataclass(frozen=True)
class CostModel:
    weight_bytes: float = 16.06e9
    kv_bytes_per_token: int = 131_072
    bandwidth: float = 3.35e12

    def decode_step_s(self, num_attended_tokens: int) -> float:
        return (self.weight_bytes + num_attended_tokens * self.kv_bytes_per_token) / self.bandwidth


def lognormal_from_median(median: float, p95: float) -> tuple[float, float]:
    return math.log(median), math.log(p95 / median) / Z95


def lognormal_from_mean(mean: float, p95: float) -> tuple[float, float]:
    """mu + sigma^2/2 = ln(mean) and mu + z*sigma = ln(p95): the smaller root for sigma."""
    gap = math.log(p95 / mean)
    sigma = Z95 - math.sqrt(Z95 * Z95 - 2 * gap)
    return math.log(mean) - sigma * sigma / 2, sigma


def draw_workload(num_requests: int, seed: int, max_len: int) -> list[tuple[int, int]]:
    """(prompt, output) lengths, the total clipped to ``max_len`` (prompt first, then output)."""
    rng = random.Random(seed)
    prompt_mu, prompt_sigma = lognormal_from_median(584, 2155)
    output_mu, output_sigma = lognormal_from_mean(374, 1118)
    work = []
    for _ in range(num_requests):
        prompt = min(max(1, round(rng.lognormvariate(prompt_mu, prompt_sigma))), max_len - 1)
        output = min(max(1, round(rng.lognormvariate(output_mu, output_sigma))), max_len - prompt)
        work.append((prompt, output))
    return work


def label(result: dict[str, Any]) -> str:
    if result["policy"] != "paged":
        return str(result["policy"])
    return f"paged b{result['block_size']} w{result['watermark']:.0%}"


def simulate(
    policy: str, cache_gb: float, block_size: int, watermark: float, work: list[tuple[int, int]],
    cost: CostModel, max_len: int, max_num_seqs: int, budget: int,
) -> dict[str, Any]:  # fmt: skip
    """Serve ``work`` to the end; return the run's numbers (see the module docstring)."""
    started = time.perf_counter()
    page = block_size if policy == "paged" else 1
    pool = PagePool(int(cache_gb * 1e9) // cost.kv_bytes_per_token // page)
    manager: KVCacheManager
    if policy == "paged":
        manager = KVCacheManager(pool, page, int(watermark * pool.num_pages))  # as LLMEngine sizes it
    elif policy == "reserve":
        manager = ReservingKVCacheManager(pool, page, lambda seq: max_len)
    else:  # the exact KV it ends with: every token but the last sampled one
        manager = ReservingKVCacheManager(pool, page, tokens_at_most)
    waste: list[int] = []

    def stop_checker(seq: Sequence, token: int) -> Stop | None:
        stop = never_stops_early(seq, token)  # max_tokens only: EOS ignored
        if stop is not None:  # before the scheduler frees its pages
            waste.append(len(seq.block_ids) * page - seq.num_computed_tokens)
        return stop

    sched = Scheduler(manager, max_num_seqs, budget, "recompute", stop_checker=stop_checker)
    seqs = [Sequence(f"r{i}", [0] * p, SamplingParams(max_tokens=o, ignore_eos=True)) for i, (p, o) in enumerate(work)]
    for seq in seqs:
        sched.add(seq)
    clock = batch_s = util_s = used_s = full_s = 0.0
    steps = decode_steps = max_batch = generated = scheduled_tokens = full_tokens = 0
    desc = f"{cache_gb:g} GB {label({'policy': policy, 'block_size': block_size, 'watermark': watermark})}"
    with tqdm(total=len(seqs), desc=desc, unit="req", leave=False) as bar:
        while sched.num_unfinished:
            batch = sched.schedule()
            if batch.is_empty:
                raise RuntimeError(f"no progress with {sched.num_unfinished} requests left (too small a cache?)")
            steps += 1
            scheduled_tokens += batch.num_tokens
            num_decoding = attended = 0
            for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
                if num_new == 1 and seq.num_output_tokens and seq.num_computed_tokens + 1 == seq.num_tokens:
                    num_decoding += 1
                    attended += seq.num_tokens
            live = sum(seq.num_computed_tokens for seq in sched.running) + batch.num_tokens
            allocated = (pool.num_pages - pool.num_free_pages) * page
            step_s = cost.decode_step_s(attended) if num_decoding else 0.0  # prefill is free
            clock += step_s
            batch_s += num_decoding * step_s
            util_s += live / allocated * step_s if step_s else 0.0
            used_s += allocated / (pool.num_pages * page) * step_s
            if num_decoding:
                decode_steps += 1
                max_batch = max(max_batch, num_decoding)
            sampled = [0 if batch.samples(i) else None for i in range(len(batch.seqs))]
            changed = sched.update_from_output(batch, sampled)
            generated += len(changed)
            if sched.waiting:  # the queue is not drained: memory (or the budget) limits the batch
                full_s += step_s
                full_tokens += len(changed)
            bar.update(sum(seq.is_finished for seq in changed))
    ended = [
        s.finish_reason is FinishReason.LENGTH and s.num_output_tokens == w[1] for s, w in zip(seqs, work, strict=True)
    ]
    if generated != sum(o for _, o in work) or not all(ended) or pool.num_free_pages != pool.num_pages:
        raise RuntimeError(f"{desc}: a request did not end at its length, or pages leaked")
    return {
        "policy": policy, "cache_gb": cache_gb, "block_size": page,
        "watermark": watermark if policy == "paged" else 0.0,
        "requests": len(work), "kv_slots": pool.num_pages * page, "pages": pool.num_pages,
        "steps": steps, "decode_steps": decode_steps, "sim_s": clock, "tokens": generated,
        "tokens_per_s": generated / clock, "requests_per_s": len(work) / clock,
        "queued_s": full_s, "queued_tokens_per_s": full_tokens / full_s if full_s else math.nan,
        "avg_batch": batch_s / clock, "max_batch": max_batch, "utilization": util_s / clock,
        "pool_used": used_s / clock,
        "preemptions": sched.num_preemptions,
        "recompute_tokens": scheduled_tokens - sum(p + o - 1 for p, o in work),
        "mean_waste_tokens": sum(waste) / len(waste), "wall_s": time.perf_counter() - started,
    }  # fmt: skip


COLUMNS = (
    ("cache GB", "cache_gb", "{:g}"), ("policy", "label", "{}"), ("avg batch", "avg_batch", "{:.1f}"),
    ("max batch", "max_batch", "{}"), ("KV util", "utilization", "{:.1%}"),
    ("pool used", "pool_used", "{:.1%}"), ("tok/s", "tokens_per_s", "{:,.0f}"),
    ("vs reserve", "vs_reserve", "{:.2f}x"), ("tok/s queued", "queued_tokens_per_s", "{:,.0f}"),
    ("preempt.", "preemptions", "{:,}"), ("recomputed tok", "recompute_tokens", "{:,}"),
    ("waste/seq at end", "mean_waste_tokens", "{:.1f}"), ("sim s", "sim_s", "{:.1f}"), ("wall s", "wall_s", "{:.1f}"),
)  # fmt: skip


def markdown_table(results: list[dict[str, Any]]) -> str:
    reserve = {r["cache_gb"]: r["tokens_per_s"] for r in results if r["policy"] == "reserve"}
    lines = ["| " + " | ".join(name for name, _, _ in COLUMNS) + " |", "|---" * len(COLUMNS) + "|"]
    for r in results:
        row = {**r, "label": label(r), "vs_reserve": r["tokens_per_s"] / reserve.get(r["cache_gb"], math.nan)}
        lines.append("| " + " | ".join(fmt.format(row[key]) for _, key, fmt in COLUMNS) + " |")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(label(r) for r in results))
    caches = list(dict.fromkeys(r["cache_gb"] for r in results))
    fig, axes = plt.subplots(1, 2, figsize=(max(8.0, 0.7 * len(labels) + 4), 4.5))
    width = 0.8 / len(caches)
    for ax, key, title in ((axes[0], "avg_batch", "average batch (sequences)"), (axes[1], "tokens_per_s", "tokens/s")):
        for j, cache in enumerate(caches):
            by_label = {label(r): r[key] for r in results if r["cache_gb"] == cache}
            xs = [i + (j - (len(caches) - 1) / 2) * width for i in range(len(labels))]
            ax.bar(xs, [by_label.get(name, 0.0) for name in labels], width, label=f"{cache:g} GB KV cache")
        ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=8)
        ax.set_title(title)
        ax.set_ylim(top=1.2 * max(r[key] for r in results))
        ax.legend(fontsize=8, loc="upper center", ncol=len(caches))
    fig.suptitle("Llama-3-8B cost model on loraserve's scheduler (vLLM paper's workload)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # fmt: off
    parser.add_argument("--policy", choices=(*POLICIES, "all"), default="all", help="default all")
    parser.add_argument("--cache-gb", type=lambda s: [float(x) for x in s.split(",")], default=None,
                        help="KV cache size(s) in GB (1e9 bytes), comma-separated (default 60; --sweep: 60,20)")
    parser.add_argument("--block-size", type=int, default=16, help="paged: tokens per page (default 16)")
    parser.add_argument("--watermark", type=float, default=0.01,
                        help="paged: fraction of pages kept free at admission (default 0.01, the engine's)")
    parser.add_argument("--requests", type=int, default=2000, help="requests, all queued at t=0 (default 2000)")
    parser.add_argument("--max-len", type=int, default=4096, help="prompt + output cap; reserve's size (4096)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="scheduler's cap (default: no cap)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192, help="token budget per step (8192)")
    parser.add_argument("--weight-bytes", type=float, default=16.06e9, help="model weights (Llama-3-8B bf16)")
    parser.add_argument("--kv-bytes-per-token", type=int, default=131_072, help="KV bytes per token (Llama-3-8B)")
    parser.add_argument("--bandwidth", type=float, default=3.35e12, help="memory bandwidth, B/s (H100 SXM)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument("--quick", action="store_true", help="smoke test: 200 requests, a tenth of the default cache")
    parser.add_argument("--sweep", action="store_true",
                        help="cache 60,20 GB x reserve, oracle, paged blocks 16/32/128/512 x watermarks 0/1%%/5%%")
    parser.add_argument("--json", type=Path, help="write the config and the results here")
    parser.add_argument("--plot", type=Path, help="write a PNG of batch size and tokens/s per policy (matplotlib)")
    # fmt: on
    args = parser.parse_args(argv)
    caches = args.cache_gb or (list(SWEEP_CACHES) if args.sweep else [60.0])
    if args.quick:  # a tenth of the study: 200 requests, and a tenth of the default cache (the same pressure)
        args.requests = min(args.requests, 200)
        caches = args.cache_gb or [cache / 10 for cache in caches]
    if args.requests < 1 or args.block_size < 1 or not 0 <= args.watermark < 1 or min(caches) <= 0:
        parser.error("need --requests >= 1, --block-size >= 1, 0 <= --watermark < 1 and --cache-gb > 0")
    cost = CostModel(args.weight_bytes, args.kv_bytes_per_token, args.bandwidth)
    work = draw_workload(args.requests, args.seed, args.max_len)
    runs: list[tuple[str, float, int, float]] = []
    for cache in caches:
        if args.sweep:
            runs += [("reserve", cache, 1, 0.0), ("oracle", cache, 1, 0.0)]
            runs += [("paged", cache, b, w) for b in SWEEP_BLOCKS for w in SWEEP_WATERMARKS]
        else:
            policies = POLICIES if args.policy == "all" else (args.policy,)
            runs += [(p, cache, args.block_size, args.watermark) for p in policies]
    prompts, outputs = [p for p, _ in work], [o for _, o in work]
    config = {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "cache_gb": caches,
              "mean_prompt": sum(prompts) / len(work), "mean_output": sum(outputs) / len(work),
              "max_total": max(p + o for p, o in work)}  # fmt: skip
    print("config: " + ", ".join(f"{k}={v}" for k, v in config.items() if v not in (None, False)))
    started = time.perf_counter()
    results = [
        simulate(policy, cache, block, wm, work, cost, args.max_len, args.max_num_seqs or len(work),
                 args.max_num_batched_tokens)
        for policy, cache, block, wm in tqdm(runs, desc="runs", unit="run", disable=len(runs) == 1)
    ]  # fmt: skip
    print(markdown_table(results))
    print(f"{len(results)} runs in {time.perf_counter() - started:.1f} s wall")
    if args.json:
        args.json.write_text(json.dumps({"config": config, "results": results}, indent=2) + "\n")
    if args.plot:
        plot(results, args.plot)
    return results


if __name__ == "__main__":
    main()
