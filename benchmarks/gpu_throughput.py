"""``benchmarks.gpu``'s ``throughput`` part: the engine on a Llama-3.2-1B-shaped model in
bfloat16, with and without adapters, decode CUDA graphs and eager, against HF and PEFT."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks._gpu_report import free_gpu_cache, guarded, log, record, synchronize
from benchmarks._random_models import make_adapters, make_model, random_prompts


def triton_compilations() -> int | None:
    from loraserve.kernels.triton_compilations import compiled_variants

    return compiled_variants()


def fill_decode_batch(llm: Any, prompts: list[list[int]], names: list[str] | None, tag: str, max_tokens: int) -> None:
    """Admit every prompt and step until all are past their prefills, and one decode step more."""
    from loraserve import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params, names[i] if names else None)
    for _ in range(256):
        if not engine.scheduler.num_waiting and all(
            seq.num_computed_tokens >= seq.num_prompt_tokens for r in engine.requests.values() for seq in r.seqs
        ):
            break
        engine.step()
    engine.step()
    synchronize()


def finish(llm: Any) -> None:
    while llm.engine.has_unfinished_requests():
        llm.engine.step()


def timed_decode_steps(llm: Any, prompts: list[list[int]], names: list[str] | None, steps: int) -> dict[str, float]:
    """ms per step of a full decode batch, and the process's CPU seconds per second of wall meanwhile
    (above 1: threads besides the step loop's are busy)."""
    fill_decode_batch(llm, prompts, names, "decode", steps + 16)
    for _ in range(2):
        llm.engine.step()
    synchronize()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        llm.engine.step()
    synchronize()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    finish(llm)
    return {"ms_per_step": wall / steps * 1e3, "seqs": len(prompts), "cpu_per_wall": cpu / wall,
            "torch_threads": torch.get_num_threads()}  # fmt: skip


def profiled_decode_steps(llm: Any, prompts: list[list[int]], names: list[str] | None, steps: int) -> str:
    """The device kernels of ``steps`` full decode steps (``torch.profiler``), by total device time:
    which kernels a step's time goes to; then the host's functions over as many steps (cProfile, by
    own time: it slows Python down, so only the split is meaningful)."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    fill_decode_batch(llm, prompts, names, "profile", 2 * steps + 8)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            llm.engine.step()
        synchronize()
    sort = "device_time_total" if torch.cuda.is_available() else "cpu_time_total"
    device_table = str(prof.key_averages().table(sort_by=sort, row_limit=22, max_name_column_width=60))
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        llm.engine.step()
    synchronize()
    profiler.disable()
    finish(llm)
    host = io.StringIO()
    pstats.Stats(profiler, stream=host).sort_stats("tottime").print_stats(20)
    return f"{device_table}\nhost, cProfile of {steps} steps:\n{host.getvalue()[-5000:]}"


def timed_generate(llm: Any, prompts: list[list[int]], names: list[str] | None, new: int) -> dict[str, float]:
    from loraserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    # Warm-up: compiles the kernels and makes every adapter resident (a request of each), so the
    # timed run serves resident adapters rather than reading their files.
    warm = list(dict.fromkeys(names)) if names else [None] * 4
    warm_names = None if names is None else [name for name in warm if name is not None]
    llm.generate([prompts[i % len(prompts)] for i in range(len(warm))],
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), adapters=warm_names,
                 use_tqdm=False)  # fmt: skip
    synchronize()
    start, cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params, adapters=names, use_tqdm=False)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(o.token_ids) for o in outputs)
    return {"wall_s": wall, "cpu_s": cpu, "tokens": tokens, "tok_per_s": tokens / wall}


def part_throughput(args: argparse.Namespace) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from loraserve import LLM

    shape = "tiny" if args.smoke else "llama-1b"
    dtype = torch.bfloat16
    model_dir = make_model(shape, args.tokenizer, args.work / f"{shape}-bf16", dtype, args.device)
    ranks = [[8, 16, 32, 64][i % 4] for i in range(args.adapters)]
    adapters = make_adapters(model_dir, args.work / f"{shape}-adapters", ranks)
    gen = torch.Generator().manual_seed(2)
    lens = torch.randint(args.min_prompt, args.max_prompt + 1, (args.requests,), generator=gen).tolist()
    hf: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
    prompts = random_prompts(lens, hf.config.vocab_size, seed=3)
    names = [adapters[i % len(adapters)][0] for i in range(args.requests)]
    new = args.max_tokens
    results: dict[str, Any] = {"workload": f"{args.requests} requests, prompts {args.min_prompt}-{args.max_prompt}, "
                               f"{new} new tokens, {args.adapters} adapters of ranks 8-64 on all projections, "
                               f"bfloat16, random {shape}"}  # fmt: skip
    engine_options = dict(device=args.device, dtype="bfloat16", max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=8192, memory_budget_mb=args.pool_mb)  # fmt: skip

    def engine_runs(kernels: str, runs: list[tuple[str, list[str] | None]], **extra: Any) -> None:
        llm = LLM(str(model_dir), kernels=kernels, **engine_options, **extra)
        for name, path in adapters:
            llm.add_adapter(name, path)
        mode = " eager" if extra.get("enforce_eager") else " async" if extra.get("async_scheduling") else ""
        for label, request_adapters in runs:
            key = f"loraserve[{kernels}{mode}] {label}"
            compiled = triton_compilations()
            results[key] = timed_generate(llm, prompts, request_adapters, new)
            after = triton_compilations()
            results[key]["compilations_during_run"] = None if compiled is None or after is None else after - compiled
            log(f"{key}: {results[key]}")
            record("throughput", results)
        for label, request_adapters in runs:  # one full decode batch, ms per step
            key = f"loraserve[{kernels}{mode}] decode step, {label}"
            results[key] = timed_decode_steps(llm, prompts[: args.max_num_seqs], request_adapters, 16 if args.smoke
                                              else 50)  # fmt: skip
            log(f"{key}: {results[key]}")
            record("throughput", results)
        if extra.get("enforce_eager"):  # where a decode step's device and host time go
            for label, request_adapters in runs:
                table = profiled_decode_steps(llm, prompts[: args.max_num_seqs], request_adapters, 2 if args.smoke
                                              else 5)  # fmt: skip
                log(f"loraserve[{kernels}{mode}] decode step kernels, {label}:\n{table}")
                record(f"kernel profile, {kernels}{mode}, {label}", table)
        graphs = llm.engine.runner.decode_graphs
        if graphs is not None and graphs.capture:  # the GPU time alone of a full decode step
            for label, request_adapters in runs:
                key = f"loraserve[{kernels}{mode}] decode step GPU time (graph replay), {label}"
                results[key] = {"ms": graphs.replay_ms(args.max_num_seqs, request_adapters is not None)}
                log(f"{key}: {results[key]}")
                record("throughput", results)
        if graphs is not None:
            results[f"loraserve[{kernels}{mode}] graphs"] = {
                "captures": graphs.num_captures,
                "replays": graphs.num_replays,
                # decode steps with adapters: the path timed faster per padded size (decode_path.py)
                "adapter_decode_paths": llm.engine.stats().adapter_decode_paths,
                "adapter_decode_us_graph_eager": llm.engine.runner.adapter_decode.measured_us,
            }
        del llm
        free_gpu_cache()

    runs = [("no adapters", None), (f"{args.adapters} adapters", names)]
    guarded("throughput, triton with graphs", lambda: engine_runs("triton", runs))
    # The host's scheduling and output work overlapped with the GPU's (--async-scheduling).
    guarded("throughput, triton with graphs, async", lambda: engine_runs("triton", runs, async_scheduling=True))
    guarded("throughput, triton eager", lambda: engine_runs("triton", runs, enforce_eager=True))

    def hf_generate(model: Any, batch: list[list[int]], adapter_names: list[str] | None) -> int:
        width = max(map(len, batch))
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(batch):  # left padding
            ids[row, width - len(prompt) :], mask[row, width - len(prompt) :] = torch.tensor(prompt), 1
        extra = {"adapter_names": adapter_names} if adapter_names else {}
        out = model.generate(input_ids=ids.to(args.device), attention_mask=mask.to(args.device),
                             max_new_tokens=baseline_new, min_new_tokens=baseline_new, do_sample=False, pad_token_id=0,
                             **extra)  # fmt: skip
        return (out.shape[1] - width) * len(batch)

    def measure(key: str, fn: Callable[[], int]) -> None:
        synchronize()
        start = time.perf_counter()
        tokens = fn()
        synchronize()
        wall = time.perf_counter() - start
        results[key] = {"wall_s": wall, "tokens": tokens, "tok_per_s": tokens / wall}
        log(f"{key}: {results[key]}")
        record("throughput", results)

    batch, baseline_new = min(args.hf_batch, args.requests), args.baseline_tokens

    def baselines() -> None:
        with torch.inference_mode():
            hf_generate(hf, prompts[:1], None)  # warm-up
            measure(f"HF generate batch 1 (first 4 requests, {baseline_new} new tokens)",
                    lambda: sum(hf_generate(hf, [p], None) for p in prompts[:4]))  # fmt: skip
            measure(f"HF generate padded batch {batch} ({baseline_new} new tokens)",
                    lambda: hf_generate(hf, prompts[:batch], None))  # fmt: skip
            peft: Any = PeftModel.from_pretrained(hf, str(adapters[0][1]), adapter_name=adapters[0][0])
            for name, path in adapters[1:]:
                peft.load_adapter(str(path), adapter_name=name)
            peft.eval()
            measure(f"PEFT mixed-adapter batch {batch} ({baseline_new} new tokens)",
                    lambda: hf_generate(peft, prompts[:batch], names[:batch]))  # fmt: skip

    if args.baselines:
        guarded("throughput, HF and PEFT baselines", baselines)
    hf = None  # frees its GPU memory before the next engine
    free_gpu_cache()
    if args.torch_references:
        guarded("throughput, torch references", lambda: engine_runs("torch", [(f"{args.adapters} adapters", names)]))
