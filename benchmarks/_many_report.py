"""``benchmarks.many_adapters``'s results: one ``RunResult`` per system and adapter count, its
summary (throughput, latency percentiles, SLO attainment, pool pages), the markdown table, the JSON."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks._arrivals import Stream, Timing, latency_summary

# The systems, in the order they run and are listed; the keys are --systems' words.
SYSTEMS = {
    "loraserve": "loraserve (unified pool, paged KV)",
    "fixed": "loraserve, fixed adapter region",
    "reserve": "loraserve, KV reserved at admission",
    "peft-one": "PEFT one adapter at a time",
    "peft-mixed": "PEFT mixed-adapter batches",
}
KINDS = ("kv", "adapter", "adapter_idle", "prefix_cache", "free")  # PageKind values, timeline columns
TARGET_N1000_VS_N1, TARGET_VS_PEFT_ONE = 0.85, 30.0


@dataclass
class RunResult:
    """One system serving the stream with ``num_adapters`` adapters. Times in seconds from the run's
    start (the moment request 0's arrival clock starts); ``wall_s``: start to the last finish (or to
    the time cap). ``timeline``: ``[t, *pages of KINDS, kv_util, adapters running]`` after every engine
    step (kv_util 0 while no KV page is held)."""

    system: str
    num_adapters: int
    expected: list[int]  # each request's output length
    timings: list[Timing]
    wall_s: float = 0.0
    timed_out: bool = False
    skipped: str | None = None  # why it did not run at all
    stats: dict[str, Any] = field(default_factory=dict)
    timeline: list[list[float]] = field(default_factory=list)

    @property
    def done(self) -> list[int]:
        """Requests finished with their exact output length."""
        return [i for i, t in enumerate(self.timings) if t.finish is not None and t.tokens == self.expected[i]]

    def summary(self, slo_ttft: float) -> dict[str, Any]:
        done = self.done
        # Every token made within the wall counts (a run cut by its time cap made some of the cut
        # batch's); latency and SLO over ALL requests (one never served misses the SLO).
        tokens = sum(min(t.tokens, n) for t, n in zip(self.timings, self.expected, strict=True))
        wall = self.wall_s
        return {
            "system": self.system, "label": SYSTEMS[self.system], "num_adapters": self.num_adapters,
            "requests": len(self.expected), "done": len(done), "timed_out": self.timed_out, "skipped": self.skipped,
            "wall_s": self.wall_s, "output_tokens": tokens, "req_s": len(done) / wall if wall else None,
            "tok_s": tokens / wall if wall else None,
            **latency_summary(self.timings, slo_ttft),
            **self.stats,
        }  # fmt: skip

    def to_json(self, slo_ttft: float) -> dict[str, Any]:
        out = self.summary(slo_ttft)
        out["per_request"] = {
            "tokens": [t.tokens for t in self.timings],
            "ttft_s": [t.ttft for t in self.timings],
            "tpot_s": [t.tpot for t in self.timings],
            "finish_s": [t.finish for t in self.timings],
        }
        out["timeline_columns"] = ["t_s", *KINDS, "kv_util", "adapters_running"]
        out["timeline"] = self.timeline
        return out


def skipped(system: str, num_adapters: int, stream: Stream, why: str) -> RunResult:
    return RunResult(system, num_adapters, stream.output_lens, [Timing(a) for a in stream.arrivals], skipped=why)


def _fmt(value: Any, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


HEADER = (
    "| system | N | used | done | wall s | req/s | tok/s | TTFT p50 s | TTFT p99 s | TPOT p50 ms | TPOT p99 ms "
    "| SLO | peak KV pages | peak adapter pages (pinned) | KV util | adapters/step | preempt. | adapter loads |"
)


def row(s: dict[str, Any]) -> str:
    if s["skipped"]:
        return f"| {s['label']} | {s['num_adapters']} | | not run: {s['skipped']} |" + " |" * 14
    done = f"{s['done']}/{s['requests']}" + (" (timed out)" if s["timed_out"] else "")
    adapter = "-"
    if s.get("peak_adapter_pages") is not None:
        adapter = f"{s['peak_adapter_pages']} ({s['peak_adapter_pinned_pages']})"
    return (
        f"| {s['label']} | {s['num_adapters']} | {s.get('adapters_used', '-')} | {done} | {s['wall_s']:.1f} "
        f"| {_fmt(s['req_s'], '.3f')} | {_fmt(s['tok_s'], '.1f')} | {_fmt(s['ttft_p50_s'], '.2f')} "
        f"| {_fmt(s['ttft_p99_s'], '.2f')} | {_fmt(s['tpot_p50_s'], '.0f', 1e3)} | {_fmt(s['tpot_p99_s'], '.0f', 1e3)} "
        f"| {_fmt(s['slo_attainment'], '.0%')} | {s.get('peak_kv_pages', '-')} "
        f"| {adapter} "
        f"| {_fmt(s.get('kv_util_mean'), '.0%')} | {_fmt(s.get('adapters_per_step_mean'), '.1f')} "
        f"| {s.get('preemptions', '-')} | {s.get('adapter_loads', '-')} |"
    )  # fmt: skip


def targets(summaries: list[dict[str, Any]]) -> list[str]:
    """The issue's targets, where this run measured both sides."""
    by = {(s["system"], s["num_adapters"]): s for s in summaries if not s["skipped"]}
    lines = []

    def ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
        return a["tok_s"] / b["tok_s"] if a and b and b["tok_s"] and not (a["timed_out"] or b["timed_out"]) else None

    ns = sorted({n for _, n in by})
    if len(ns) > 1 and (r := ratio(by.get(("loraserve", ns[-1])), by.get(("loraserve", ns[0])))) is not None:
        met = "met" if r >= TARGET_N1000_VS_N1 else "NOT met"
        lines.append(f"loraserve tok/s at N={ns[-1]} / N={ns[0]}: {r:.0%} (target {TARGET_N1000_VS_N1:.0%} at "
                     f"N=1000 vs N=1: {met if (ns[0], ns[-1]) == (1, 1000) else 'not this run'})")  # fmt: skip
    for n in ns:
        peft = by.get(("peft-one", n))
        if peft and peft["tok_s"] and by.get(("loraserve", n)):
            r = by[("loraserve", n)]["tok_s"] / peft["tok_s"]
            part = " (PEFT timed out: its rate over what it finished)" if peft["timed_out"] else ""
            goal = f" (target {TARGET_VS_PEFT_ONE:.0f}x at N=100)" if n == 100 else ""
            lines.append(f"loraserve / PEFT one-at-a-time tok/s at N={n}: {r:.1f}x{part}{goal}")
        if n >= 100 and (r := ratio(by.get(("loraserve", n)), by.get(("fixed", n)))) is not None:
            lines.append(f"unified pool / fixed region tok/s at N={n}: {r:.2f}x (target > 1 at N >= 100)")
        if (r := ratio(by.get(("loraserve", n)), by.get(("reserve", n)))) is not None:
            lines.append(f"paged KV / reserved KV tok/s at N={n}: {r:.2f}x")
    return lines


def markdown(summaries: list[dict[str, Any]]) -> str:
    lines = [HEADER, "|---|" + "---:|" * (HEADER.count("|") - 2)]
    lines += [row(s) for s in summaries]
    if extra := targets(summaries):
        lines += ["", *extra]
    return "\n".join(lines)


def describe(args: argparse.Namespace, info: dict[str, Any], kernels: dict[str, Any], store_dir: Path) -> list[str]:
    process = "Poisson" if args.cv == 1 else f"gamma cv={args.cv}"
    rate = "all at t=0" if math.isinf(args.rate) else f"{args.rate}/s, {process}"
    lines = [
        f"Machine: {info['cpu']} ({info['isa']}: {info['cpu_flags']}), {info['usable_cores']} usable of "
        f"{info['logical_cores']} cores, torch {info['torch']} ({info['torch_threads']} threads), transformers "
        f"{info['transformers']}, {args.dtype}; load average {info['load_avg_at_start']} at start, "
        f"{info.get('load_avg_at_end')} at end",
        f"Stream: {args.requests} requests (seed {args.seed}), arrivals {rate}, prompt and output lengths uniform in "
        f"[{args.min_len}, {args.max_len}), greedy, EOS ignored; adapter int(u*N), u ~ power({args.alpha})",
        f"Adapters: {','.join(args.targets)}, ranks cycling {args.ranks}, {args.adapter_dtype} files in {store_dir}",
        f"loraserve: max_num_seqs={args.max_num_seqs}, pool {args.memory_budget_mb} MiB = {kernels.get('num_pages')} "
        f"pages of {kernels.get('block_size', 16)} tokens for every variant; fixed region: max_loras={args.max_loras} "
        f"at max_lora_rank={args.max_lora_rank}; PEFT: batches of {args.peft_batch}, {args.peft_timeout:.0f} s cap",
    ]
    if kernels:
        gemm = kernels.get("cpu_gemm") or {}
        plan = "; ".join(f"{shape} {'/'.join(by.values())}" for shape, by in gemm.get("layers", {}).items())
        lines.append(f"loraserve kernels: {kernels['kernels']}" + (f"; CPU GEMM ({gemm['source']}, kernel per row "
                                                                    f"bucket): {plan}" if plan else ""))  # fmt: skip
    return lines
