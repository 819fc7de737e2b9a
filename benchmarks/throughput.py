"""Throughput benchmark: loraserve continuous batching vs Hugging Face ``generate``.

One seeded workload of random-token prompts; every request is greedy with
``ignore_eos`` so it generates exactly its ``max_tokens``. Measured in one run:
loraserve at several concurrencies (``max_num_seqs``), HF at batch 1 and as padded
static batches, and loraserve's KV-slot utilisation step by step. See
``benchmarks/README.md`` for what each number means.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from benchmarks._quick import parse_with_quick

FIRST_PLAIN_TOKEN = 32  # skip the special tokens at the start of the vocabulary
TARGET_VS_BATCH1 = 10.0
TARGET_VS_STATIC = 1.5
TARGET_MIN_CONCURRENCY = 32
QUICK = {"requests": 8, "min_len": 4, "max_len": 24, "rounds": 1, "concurrency": [1, 8], "hf_batch1_requests": 1}


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @classmethod
    def make(cls, num_requests: int, min_len: int, max_len: int, vocab: int, seed: int) -> Workload:
        """Prompt and output lengths uniform in ``[min_len, max_len)``, token ids uniform."""
        rng = random.Random(seed)
        lens = [rng.randrange(min_len, max_len) for _ in range(num_requests)]
        prompts = [[rng.randrange(FIRST_PLAIN_TOKEN, vocab) for _ in range(n)] for n in lens]
        return cls(prompts, [rng.randrange(min_len, max_len) for _ in range(num_requests)])


@dataclass
class Row:
    """One measured configuration; ``tokens`` counts only each request's own output."""

    system: str
    mode: str
    size: int
    requests: int
    tokens: int
    wall_s: float
    cpu_s: float
    kv_util: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s


def machine_info() -> dict[str, Any]:
    import transformers
    from loraserve.kernels import cpu_features

    info = cpu_features.cpu_info()
    cpu = f"{info.model_name}, {info.identity}" if info.identity else info.model_name
    return {"cpu": cpu, "isa": info.vector_isa, "cpu_flags": " ".join(info.features),
            "logical_cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
            "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "torch_threads": torch.get_num_threads(),
            "load_avg_at_start": [round(x, 2) for x in os.getloadavg()]}  # fmt: skip


def run_loraserve(work: Workload, count: int, concurrency: int, options: dict[str, Any]) -> Row:
    """Serve the first ``count`` requests at ``max_num_seqs=concurrency``, driving ``step()`` ourselves."""
    from loraserve import LLM, SamplingParams
    from loraserve.sequence import SequenceStatus

    llm = LLM(max_num_seqs=concurrency, **options)
    engine, pool, block_size = llm.engine, llm.engine.pool, llm.engine.config.block_size
    llm.generate([work.prompts[0][:8]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
    for i in range(count):
        params = SamplingParams(temperature=0, max_tokens=work.output_lens[i], ignore_eos=True)
        engine.add_request(str(i), work.prompts[i], params)
    seqs = [seq for request in engine.requests.values() for seq in request.seqs]
    utils: list[float] = []
    steps = decode_tokens = 0
    decode_s = bookkeeping_s = 0.0
    out_lens: dict[int, int] = {}
    progress = tqdm(total=sum(work.output_lens[:count]), desc=f"loraserve c={concurrency}", unit="tok")
    start, cpu_start = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        before = [seq.num_computed_tokens for seq in seqs]
        t0 = time.perf_counter()
        outputs = engine.step()
        t1 = time.perf_counter()
        steps += 1
        computed = sum(max(0, seq.num_computed_tokens - b) for seq, b in zip(seqs, before, strict=True))
        if computed == len(outputs):  # every token computed this step was a decode token
            decode_tokens, decode_s = decode_tokens + computed, decode_s + t1 - t0
        live = sum(seq.num_computed_tokens for seq in seqs if seq.status is SequenceStatus.RUNNING)
        if allocated := pool.num_pages - pool.num_free_pages - pool.num_evictable_pages:
            utils.append(live / (allocated * block_size))
        out_lens.update({int(o.request_id): len(o.outputs[0].token_ids) for o in outputs if o.finished})
        progress.update(len(outputs))
        bookkeeping_s += time.perf_counter() - t1
    wall, cpu = time.perf_counter() - start - bookkeeping_s, time.process_time() - cpu_start
    progress.close()
    if out_lens != {i: work.output_lens[i] for i in range(count)}:
        raise RuntimeError("loraserve did not generate exactly max_tokens for every request")
    extra = {"steps": steps, "decode_step_tok_s": decode_tokens / decode_s if decode_s else None,
             "prefill_step_time_frac": 1 - decode_s / wall, "preemptions": engine.scheduler.num_preemptions,
             "kv_util_min": min(utils, default=None), "pages_in_pool": pool.num_pages,
             "pages_left_allocated": pool.num_pages - pool.num_free_pages - pool.num_evictable_pages}  # fmt: skip
    del llm, engine
    gc.collect()
    util = sum(utils) / len(utils) if utils else None
    return Row("loraserve", "continuous", concurrency, count, sum(out_lens.values()), wall, cpu, util, extra)


def load_hf_model() -> Any:
    import transformers
    from transformers import AutoModelForCausalLM

    from loraserve.models.loader import default_model_dir

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", module="transformers")
    return AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()


@torch.inference_mode()
def hf_batch(model: Any, prompts: list[list[int]], outs: list[int]) -> tuple[float, float, list[float]]:
    """One left-padded ``generate`` call: wall seconds, CPU seconds, per-step padded-cache utilisation."""
    pad = int(model.config.pad_token_id if model.config.pad_token_id is not None else 0)
    width, new = max(map(len, prompts)), max(outs)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :], mask[row, width - len(prompt) :] = torch.tensor(prompt), 1
    start, cpu_start = time.perf_counter(), time.process_time()
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=pad
    )
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    if out.shape[1] != width + new:
        raise RuntimeError(f"HF generated {out.shape[1] - width} tokens, expected {new}")
    # After decode step t the cache holds width + t slots per row; row i needs len(p_i) + min(t, o_i) of them.
    needed = [sum(len(p) + min(t, o) for p, o in zip(prompts, outs, strict=True)) for t in range(1, new + 1)]
    return seconds, cpu, [n / (len(prompts) * (width + t)) for t, n in enumerate(needed, start=1)]


def run_hf(model: Any, work: Workload, count: int, batch_size: int) -> Row:
    """HF ``generate`` over the first ``count`` requests in consecutive batches of ``batch_size``."""
    hf_batch(model, [work.prompts[0][:8]], [2])  # warm-up
    seconds, cpu, utils = 0.0, 0.0, list[float]()
    with tqdm(total=count, desc=f"hf batch={batch_size}", unit="req") as progress:
        for lo in range(0, count, batch_size):
            hi = min(count, lo + batch_size)
            dt, dcpu, batch_utils = hf_batch(model, work.prompts[lo:hi], work.output_lens[lo:hi])
            seconds, cpu, utils = seconds + dt, cpu + dcpu, utils + batch_utils
            progress.update(hi - lo)
    mode = "batch-1" if batch_size == 1 else "static padded"
    return Row("hf", mode, batch_size, count, sum(work.output_lens[:count]), seconds, cpu, sum(utils) / len(utils))


def batch1_around(rows: list[Row], index: int) -> tuple[float, str] | None:
    """HF batch-1 tok/s for the row at ``index``: the mean of the batch-1 runs just before and just
    after it in run order (the machine's speed drifts), or the one that exists; None if neither."""
    before = next((r for r in reversed(rows[:index]) if r.mode == "batch-1"), None)
    after = next((r for r in rows[index + 1 :] if r.mode == "batch-1"), None)
    runs = [r for r in (before, after) if r is not None]
    if not runs:
        return None
    label = "HF batch-1, " + (" and ".join(("before", "after")[i] for i, r in enumerate((before, after)) if r))
    return sum(r.tok_s for r in runs) / len(runs), label


def ratios(rows: list[Row]) -> list[dict[str, Any]]:
    """loraserve at each concurrency >= 8 vs HF batch 1 (the runs around it) and vs the HF static
    batch of the same size."""
    static = {r.size: r for r in rows if r.mode == "static padded"}
    found = []
    for index, row in enumerate(rows):
        if row.system != "loraserve" or row.size < 8:
            continue
        bases = [batch1_around(rows, index)]
        if (batch := static.get(row.size)) is not None:
            bases.append((batch.tok_s, f"HF {batch.mode} {batch.size}"))
        for base, target in zip(bases, (TARGET_VS_BATCH1, TARGET_VS_STATIC), strict=False):
            if base is not None:
                ratio, applies = row.tok_s / base[0], row.size >= TARGET_MIN_CONCURRENCY
                met = ratio >= target if applies else None
                found.append({"concurrency": row.size, "baseline": base[1], "baseline_tok_s": base[0],
                              "ratio": ratio, "target": target, "target_applies": applies, "met": met})  # fmt: skip
    return found


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def report(info: dict[str, Any], args: argparse.Namespace, rows: list[Row], found: list[dict[str, Any]]) -> str:
    """The results as markdown: machine, workload, one row per configuration, then the target ratios."""
    lines = [
        f"Machine: {info['cpu']}, {info['usable_cores']} usable of {info['logical_cores']} cores, torch "
        f"{info['torch']} ({info['torch_threads']} threads), transformers {info['transformers']}, {info['dtype']}; "
        f"load average {info['load_avg_at_start']} at start, {info['load_avg_at_end']} at end",
        f"Workload: {args.requests} requests (seed {args.seed}), prompt and output lengths uniform in "
        f"[{args.min_len}, {args.max_len}), random token ids, greedy, ignore_eos; level N serves the first "
        f"min({args.requests}, {args.rounds}*N) requests (HF batch-1: the first {args.hf_batch1_requests}, run before "
        f"the first level and after each level >= {TARGET_MIN_CONCURRENCY}; HF static batches: at most the first "
        f"{args.hf_static_requests or 'N'})",
        "",
        "| system | mode | conc./batch | requests | gen. tokens | wall s | tok/s | decode-step tok/s "
        "| prefill-step time | KV util | preempt. | cores busy |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        util = _fmt(r.kv_util, ".1%") + (" (c)" if r.system == "hf" else "")
        lines.append(
            f"| {r.system} | {r.mode} | {r.size} | {r.requests} | {r.tokens} | {r.wall_s:.1f} | {r.tok_s:.1f} "
            f"| {_fmt(r.extra.get('decode_step_tok_s'), '.1f')} | {_fmt(r.extra.get('prefill_step_time_frac'), '.0%')} "
            f"| {util} | {r.extra.get('preemptions', '-')} | {r.cpu_s / r.wall_s:.2f} |"
        )
    lines += [
        "",
        "tok/s: generated tokens (each request's own output length) / wall s. loraserve wall = first step to last "
        "finish: scheduling, chunked prefill of every prompt, decode, sampling, detokenization (not model load or "
        "warm-up). HF wall = its generate() calls (prefill + decode). KV util: loraserve measured after each step "
        "(cached tokens / allocated pages * block size); (c): HF computed from its padded cache shapes.",
        "",
    ]
    if found:
        lines += ["| loraserve conc. | vs | ratio | target | met |", "|---:|---|---:|---:|---|"]
        for f in found:
            met = (
                ("yes" if f["met"] else "NO") if f["target_applies"] else f"(target is for >= {TARGET_MIN_CONCURRENCY})"
            )
            lines.append(
                f"| {f['concurrency']} | {f['baseline']} ({f['baseline_tok_s']:.1f} tok/s) | {f['ratio']:.2f}x "
                f"| {f['target']}x | {met} |"
            )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    add = parser.add_argument
    add("--requests", type=int, default=64, help="requests in the workload (default 64)")
    add("--min-len", type=int, default=8, help="min prompt and output length (default 8)")
    add("--max-len", type=int, default=256, help="max prompt and output length, exclusive (default 256)")
    add("--seed", type=int, default=0, help="workload seed (default 0)")
    add("--concurrency", type=ints, default=[1, 2, 4, 8, 16, 32, 64], help="loraserve max_num_seqs levels")
    add("--rounds", type=int, default=2, help="level N serves the first min(requests, rounds*N) (default 2)")
    add("--hf-batch1-requests", type=int, default=4, help="requests run one at a time by HF (default 4, 0: skip)")
    add("--hf-batch-sizes", type=ints, default=None, help="HF static batch sizes (default: concurrencies >= 8)")
    add("--hf-static-requests", type=int, default=None, help="cap on the requests of each HF static batch size")
    add("--no-hf", action="store_true", help="measure loraserve only")
    add("--block-size", type=int, default=None, help="engine block_size (default: engine default)")
    add("--num-pages", type=int, default=None, help="engine num_pages (default: from its memory budget)")
    add("--max-num-batched-tokens", type=int, default=None, help="engine token budget per step")
    add("--threads", type=int, default=None, help="torch threads for both systems (default: torch's)")
    add("--json", type=Path, default=None, help="also write the results to this JSON file")
    add("--quick", action="store_true", help="smoke test: 8 requests, lengths 4..24, concurrency 1,8")
    args = parse_with_quick(parser, argv, QUICK)
    if not 1 <= args.min_len < args.max_len:
        parser.error("need 1 <= --min-len < --max-len")
    if args.hf_batch_sizes is None:
        args.hf_batch_sizes = [c for c in args.concurrency if c >= 8]
    return args


def write_json(path: Path, info: dict[str, Any], args: argparse.Namespace, rows: list[Row]) -> None:
    results = [{**asdict(r), "tok_s": r.tok_s, "cores_busy": r.cpu_s / r.wall_s} for r in rows]
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    payload = {"machine": info, "args": settings, "results": results, "ratios": ratios(rows)}
    path.write_text(json.dumps(payload, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from loraserve.models.loader import default_model_dir, load_hf_config

    vocab = int(load_hf_config(default_model_dir()).vocab_size)
    work = Workload.make(args.requests, args.min_len, args.max_len, vocab, args.seed)
    info = {**machine_info(), "dtype": "float32"}  # both systems run in float32 (the engine's default)
    options = {"block_size": args.block_size, "num_pages": args.num_pages, "num_threads": args.threads,
               "max_num_batched_tokens": args.max_num_batched_tokens}  # fmt: skip
    options = {k: v for k, v in options.items() if v is not None}
    count = lambda size: min(args.requests, args.rounds * size)  # noqa: E731
    rows: list[Row] = []

    def record(row: Row) -> None:
        """Keep a finished row; print it and update the JSON at once, so an interrupted run leaves results."""
        rows.append(row)
        tqdm.write(f"{row.system} {row.mode} {row.size}: {row.requests} requests, {row.tokens} tokens in "
                   f"{row.wall_s:.1f} s = {row.tok_s:.1f} tok/s (cores busy {row.cpu_s / row.wall_s:.2f})")  # fmt: skip
        if args.json:
            info["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
            write_json(args.json, info, args, rows)

    model = None if args.no_hf else load_hf_model()
    batch1_count = min(args.requests, args.hf_batch1_requests)

    def batch1() -> None:
        if model is not None and batch1_count:
            record(run_hf(model, work, batch1_count, 1))

    # HF batch-1 runs before the levels and again after each level that has a target: each of
    # those is compared with the batch-1 runs on either side of it, not with one run minutes away.
    batch1()
    for c in args.concurrency:
        record(run_loraserve(work, count(c), c, options))
        if c >= TARGET_MIN_CONCURRENCY:
            batch1()
    if model is not None:
        for b in args.hf_batch_sizes:
            record(run_hf(model, work, min(count(b), args.hf_static_requests or count(b)), b))
    info["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print("\n" + report(info, args, rows, ratios(rows)), flush=True)
    if args.json:
        write_json(args.json, info, args, rows)


if __name__ == "__main__":
    main()
