"""CPU performance (issue 6): loraserve without and with LoRA vs PEFT's mixed-adapter batches, in one run.

Measures tokens/s of (a) loraserve with no adapters, (b) loraserve with the workload's adapters
(round robin), (c) PEFT's mixed-adapter ``generate(adapter_names=...)`` in left-padded batches,
the ratios (b)/(a) and (b)/(c), and a ``torch.profiler`` breakdown of a full-batch decode step.
See ``benchmarks/CPU_PERF.md``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from benchmarks._quick import given_options
from benchmarks._workload import Workload, adapter_name, add_workload_args, ensure_adapters, parse_workload_args
from benchmarks.cpu_perf_profile import PARTS, profile_decode
from loraserve.config import CPU_DECODE_ATTENTION_CHOICES, CPU_GEMM_CHOICES, CPU_TILE_CHOICES
from loraserve.lora.tile_choice import LoRAKernelPlan

TARGET_LORA_VS_BASE = 0.85  # (b)/(a): LoRA tok/s at least this share of the base model's
TARGET_VS_PEFT = 5.0


@dataclass
class Run:
    """One measured system; ``tokens`` are generated tokens, ``wall_s`` the time to generate them."""

    system: str
    requests: int
    tokens: int
    wall_s: float
    cpu_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s


def run_loraserve(llm: Any, work: Workload, with_adapters: bool) -> Run:
    """All requests through ``LLM.generate`` (continuous batching); wall = add first to finish last."""
    from loraserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=work.max_tokens, ignore_eos=True)
    adapters = [adapter_name(a) for a in work.adapter_of] if with_adapters else None
    start, cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate(work.prompts, params, use_tqdm=False, adapters=adapters)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    lens = [len(o.outputs[0].token_ids) for o in outputs]
    if lens != [work.max_tokens] * len(work.prompts):
        raise RuntimeError("loraserve did not generate exactly max_tokens for every request")
    system = "(b) loraserve, adapters round robin" if with_adapters else "(a) loraserve, no adapters"
    return Run(
        system, len(lens), sum(lens), wall, cpu, {"cached_prompt_tokens": sum(o.num_cached_tokens for o in outputs)}
    )


class PeftRunner:
    """PEFT's mixed-adapter batches: one PeftModel holding every adapter, ``generate(adapter_names=...)``."""

    def __init__(self, args: argparse.Namespace, adapters: list[tuple[str, Path]]) -> None:
        import transformers
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        from loraserve.models.loader import default_model_dir

        transformers.logging.set_verbosity_error()
        warnings.filterwarnings("ignore", module="transformers|peft")
        dtype = getattr(torch, args.dtype)
        model = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=dtype).eval()
        peft_model = PeftModel.from_pretrained(model, str(adapters[0][1]), adapter_name=adapters[0][0])
        for name, path in adapters[1:]:
            peft_model.load_adapter(str(path), adapter_name=name)
        self.model = peft_model.to(dtype).eval()
        self.pad = int(model.config.pad_token_id if model.config.pad_token_id is not None else 0)
        self.batch_size = args.peft_batch
        self.generate([[1] * 8], [adapters[0][0]], 2)  # warm-up

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], names: list[str], new: int) -> int:
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):  # left padding
            ids[row, width - len(prompt) :], mask[row, width - len(prompt) :] = torch.tensor(prompt), 1
        out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                  do_sample=False, pad_token_id=self.pad, adapter_names=names)  # fmt: skip
        if out.shape[1] - width != new:
            raise RuntimeError(f"PEFT generated {out.shape[1] - width} tokens, expected {new}")
        return len(prompts) * new

    def run(self, work: Workload, requests: range) -> Run:
        """The given requests, in consecutive batches of ``batch_size``."""
        tokens, start, cpu = 0, time.perf_counter(), time.process_time()
        for lo in range(requests.start, requests.stop, self.batch_size):
            hi = min(requests.stop, lo + self.batch_size)
            tokens += self.generate(work.prompts[lo:hi], [adapter_name(a) for a in work.adapter_of[lo:hi]],
                                    work.max_tokens)  # fmt: skip
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        return Run(f"(c) PEFT mixed-adapter batch of {self.batch_size}", len(requests), tokens, wall, cpu)


def total(runs: list[Run]) -> Run:
    """One system's rounds summed: tokens, wall and CPU seconds; tok/s of each round in ``extra``."""
    merged = Run(runs[0].system, sum(r.requests for r in runs), sum(r.tokens for r in runs),
                 sum(r.wall_s for r in runs), sum(r.cpu_s for r in runs))  # fmt: skip
    merged.extra["rounds_tok_s"] = [round(r.tok_s, 1) for r in runs]
    for key in runs[0].extra:
        merged.extra[key] = sum(r.extra[key] for r in runs)
    return merged


def run_rounds(llm: Any, work: Workload, peft: PeftRunner | None, num_rounds: int) -> list[list[Run]]:
    """Interleaved rounds: (a) and (b) on the whole workload, then (c) on the round's share of it.

    Interleaving puts every system into every stretch of the run, so a drift of the machine's
    speed (this VM's varies by a quarter within minutes) does not land on one system only; (a)
    and (b) swap places every other round (a, b, b, a, ...), so neither always runs first. The
    prefix cache is emptied before each loraserve run: every run computes every prompt. Each
    round's list is in the order (a), (b), (c).
    """
    rounds: list[list[Run]] = []
    shares = [range(len(work.prompts) * i // num_rounds, len(work.prompts) * (i + 1) // num_rounds)
              for i in range(num_rounds)]  # fmt: skip
    for index, share in enumerate(tqdm(shares, desc="rounds", unit="round")):
        timed: dict[bool, Run] = {}
        for with_adapters in (False, True) if index % 2 == 0 else (True, False):
            if not llm.reset_prefix_cache():
                raise RuntimeError("the prefix cache could not be emptied: requests still running")
            timed[with_adapters] = run_loraserve(llm, work, with_adapters)
        runs = [timed[False], timed[True]]
        if peft is not None and len(share):
            runs.append(peft.run(work, share))
        tqdm.write(f"round {index + 1}: " + ", ".join(f"{r.system.split()[0]} {r.tok_s:.1f} tok/s" for r in runs))
        rounds.append(runs)
    return rounds


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def lora_segments_kernel(plan: LoRAKernelPlan | None) -> str:
    """How the compiled LoRA kernel runs segments of 3 or more tokens in this run."""
    if plan is None:
        return "torch (the compiled kernels could not be built)"
    return f"{plan.summary()} (amx: AMX tiles; vector: vector loops, longer segments in pieces; gemm: MKL)"


def report(info: dict[str, Any], work: Workload, args: argparse.Namespace, runs: list[Run], rounds: list[list[Run]],
           ratios: list[dict[str, Any]], profiles: dict[str, dict[str, Any]]) -> str:  # fmt: skip
    """Markdown: machine, workload, tokens/s per system, target ratios, decode-step profile."""
    lines = [
        f"Machine: {info['cpu']} ({info['isa']}: {info['cpu_flags']}), {info['usable_cores']} usable of "
        f"{info['logical_cores']} cores, torch "
        f"{info['torch']} ({info['torch_threads']} threads), transformers {info['transformers']}, {args.dtype}; "
        f"load average {info['load_avg_at_start']} at start, {info['load_avg_at_end']} at end",
        f"Workload: {work.describe(args)}; loraserve max_num_seqs={args.max_num_seqs}",
        f"loraserve's CPU GEMM ({info['cpu_gemm']['source']}, kernel per row bucket): "
        + "; ".join(f"{shape} {'/'.join(by_rows.values())}" for shape, by_rows in info["cpu_gemm"]["layers"].items()),
        f"loraserve's LoRA kernel for segments of 3+ tokens: {info['lora_segments']}; prefill attention: "
        f"{info['prefill_attention']}; decode attention: {info['decode_attention']}",
        "",
    ]
    rows = [[r.system, str(r.requests), str(r.tokens), f"{r.wall_s:.1f}", f"{r.tok_s:.1f}", f"{r.cpu_s / r.wall_s:.2f}"]
            for r in runs]  # fmt: skip
    lines += [*_table(["system", "requests", "gen. tokens", "wall s", "tok/s", "cores busy"], rows), ""]
    rows = [[r["name"], f"{r['ratio']:.2f}x", f"{r['target']}x", "yes" if r["met"] else "NO"] for r in ratios]
    lines += _table(["ratio", "value", "target", "met"], rows)
    if len(rounds) > 1:
        lines += ["", "Rounds (interleaved; tok/s of each system in each round and the round's ratios):", ""]
        rows = []
        for index, round_runs in enumerate(rounds):
            a, b, *c = round_runs
            rows.append([str(index + 1), *(f"{r.tok_s:.1f}" for r in round_runs), *([""] * (3 - len(round_runs))),
                         f"{b.tok_s / a.tok_s:.2f}x", f"{b.tok_s / c[0].tok_s:.2f}x" if c else ""])  # fmt: skip
        lines += _table(["round", "(a)", "(b)", "(c)", "(b)/(a)", "(b)/(c)"], rows)
    if not profiles:
        return "\n".join(lines)
    first = next(iter(profiles.values()))
    lines += ["", f"Decode step at batch {first['batch']}, mean of {first['steps']} steps under torch.profiler "
              "(op self times bucketed by scope; python overhead = step wall - all op self times):", ""]  # fmt: skip
    rows = [[part] + [f"{p['parts_ms'][part]:.1f} ({p['parts_ms'][part] / p['step_ms']:.0%})" for p in
                      profiles.values()] for part in PARTS]  # fmt: skip
    rows.append(["step (profiled)"] + [f"{p['step_ms']:.1f}" for p in profiles.values()])
    rows.append(["step (unprofiled)"] + [f"{p['unprofiled_step_ms']:.1f}" for p in profiles.values()])
    lines += _table(["part", *(f"{name}: ms/step (%)" for name in profiles)], rows)
    scopes = sorted({s for p in profiles.values() for s in p["scopes_ms"]})
    rows = [[scope] + [f"{p['scopes_ms'].get(scope, 0.0):.1f}" for p in profiles.values()] for scope in scopes]
    lines += ["", "Inclusive wall of each scope (its ops and its Python):", ""]
    lines += _table(["scope", *(f"{name}: ms/step" for name in profiles)], rows)
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser)
    add = parser.add_argument
    add("--max-num-seqs", type=int, default=64, help="loraserve batch size (max_num_seqs, default 64)")
    add("--dtype", choices=["float32", "bfloat16"], default="float32", help="weights and KV dtype (default float32)")
    add("--threads", type=int, default=None, help="torch threads for every system (default: torch's)")
    add("--memory-budget-mb", type=int, default=None, help="loraserve page pool size (default: the engine's)")
    add("--max-num-batched-tokens", type=int, default=None, help="loraserve's tokens a step (default: the engine's)")
    add("--cpu-gemm", choices=CPU_GEMM_CHOICES, default="auto", help="loraserve's GEMM kernel (default auto: timed)")
    add("--cpu-lora", choices=CPU_TILE_CHOICES, default="auto",
        help="loraserve's LoRA of 3+ token segments in bfloat16: amx or vector (default auto: timed)")  # fmt: skip
    add("--cpu-prefill-attention", choices=CPU_TILE_CHOICES, default="auto",
        help="loraserve's bfloat16 prefill attention: amx or vector (default auto: timed)")  # fmt: skip
    add("--cpu-decode-attention", choices=CPU_DECODE_ATTENTION_CHOICES, default="auto",
        help="loraserve's decode attention: pairs, avx512 (16 lanes) or vec8 (default auto: timed)")  # fmt: skip
    add("--peft-batch", type=int, default=16, help="PEFT mixed-adapter batch size (default 16)")
    add("--no-peft", action="store_true", help="skip PEFT (c)")
    add("--rounds", type=int, default=4, help="interleaved rounds, (c) on 1/rounds of the requests in each (default 4)")
    add("--profile-steps", type=int, default=8, help="decode steps timed and then profiled (default 8, 0: none)")
    add("--json", type=Path, default=None, help="also write the results to this JSON file")
    args = parse_workload_args(parser, argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    most = max(0, (args.max_tokens - 2) // 2)  # profiled steps follow as many timed ones, after the first token
    if "profile_steps" in given_options(parser, argv) and not 0 <= args.profile_steps <= most:
        parser.error(f"--profile-steps must be in [0, {most}] with --max-tokens {args.max_tokens}")
    args.profile_steps = min(args.profile_steps, most)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from benchmarks.throughput import machine_info
    from loraserve import LLM, SamplingParams
    from loraserve.models.loader import default_model_dir, load_hf_config

    hf_config = load_hf_config(default_model_dir())
    work = Workload.make(args, int(hf_config.vocab_size))
    adapters = ensure_adapters(args, hf_config)
    info = {**machine_info(), "dtype": args.dtype}
    options = {"max_num_seqs": args.max_num_seqs, "dtype": args.dtype, "num_threads": args.threads,
               "memory_budget_mb": args.memory_budget_mb, "cpu_gemm": args.cpu_gemm,
               "cpu_lora": args.cpu_lora, "cpu_prefill_attention": args.cpu_prefill_attention,
               "cpu_decode_attention": args.cpu_decode_attention,
               "max_num_batched_tokens": args.max_num_batched_tokens}  # fmt: skip
    llm = LLM(**{k: v for k, v in options.items() if v is not None})
    info["cpu_gemm"] = llm.engine.gemm_plan.as_dict()
    info["lora_segments"] = lora_segments_kernel(llm.engine.lora_plan)
    plan = llm.engine.attention_plan
    info["prefill_attention"] = f"{plan.as_dict()['kernel']} ({plan.source})" if plan is not None else "torch"
    decode = llm.engine.decode_attention_plan
    info["decode_attention"] = f"{decode.kernel} ({decode.source})" if decode is not None else "torch"
    info["max_num_batched_tokens"] = llm.engine.config.step_token_budget
    for name, path in adapters:
        llm.add_adapter(name, path)
    names: list[str | None] = [None, *(name for name, _ in adapters)]
    warm = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([work.prompts[0][:8]] * len(names), warm, use_tqdm=False, adapters=names)  # warm-up, adapters loaded
    peft = None if args.no_peft else PeftRunner(args, adapters)
    rounds = run_rounds(llm, work, peft, args.rounds)
    runs = [total([r[i] for r in rounds if len(r) > i]) for i in range(max(map(len, rounds)))]
    profiles: dict[str, dict[str, Any]] = {}
    if args.profile_steps:
        for label, with_adapters in (("no adapters", False), ("adapters", True)):
            profiles[label] = profile_decode(llm, work, with_adapters, args.profile_steps)
    del llm, peft
    gc.collect()
    info["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    pairs = [("(b)/(a): LoRA vs no adapters", runs[1], runs[0], TARGET_LORA_VS_BASE)]
    if not args.no_peft:
        pairs.append(("(b)/(c): LoRA vs PEFT", runs[1], runs[2], TARGET_VS_PEFT))
    ratios = [{"name": name, "ratio": a.tok_s / b.tok_s, "target": target, "met": a.tok_s / b.tok_s >= target}
              for name, a, b, target in pairs]  # fmt: skip
    print(report(info, work, args, runs, rounds, ratios, profiles), flush=True)
    if args.json:
        results = [{**asdict(r), "tok_s": r.tok_s} for r in runs]
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        per_round = [[{**asdict(r), "tok_s": r.tok_s} for r in round_runs] for round_runs in rounds]
        payload = {"machine": info, "args": settings, "results": results, "rounds": per_round, "ratios": ratios,
                   "profile": profiles}  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
