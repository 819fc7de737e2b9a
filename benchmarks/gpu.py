"""GPU check and benchmark: the Triton kernels and the engine on CUDA, against Hugging Face.

Nothing is downloaded: the models are random weights of real shapes, with the default
model's tokenizer (``--tokenizer``). Each part prints what it measured and the script goes
on when one fails; ``--out`` also gets a JSON of every figure.

1. ``tests``: the Triton kernel and engine tests, compiled on the GPU (pytest, with
   pytest-xdist's workers where it is installed).
2. ``kernels``: the one-launch paged attention against SDPA on a contiguous cache (decode,
   split-KV, a mixed step) and the per-token-slot LoRA against a dense matmul of the same rank.
3. ``throughput``: a Llama-3.2-1B-shaped model in bfloat16: loraserve without adapters and with
   ``--adapters`` adapters round robin (``triton`` kernels with decode CUDA graphs, then eager,
   then the ``torch`` references; Triton compilations during each timed run; ms per step of a
   full decode batch), against ``generate`` at batch 1 and a padded static batch, and PEFT's
   mixed-adapter batch (those three over ``--baseline-tokens`` new tokens). Each engine and the
   baselines are measured apart: one failing leaves the others' figures.
4. ``exact``: greedy tokens of loraserve (``triton`` and ``torch`` kernels, float32) against
   Hugging Face + PEFT one request at a time, on a SmolLM2-135M-shaped model with 4 adapters
   (ranks 8-64, all projections) and prompts of 5 to 1,100 tokens.
5. ``profile``: cProfile of the engine's host-side step loop.
6. ``attention``: the decode-only paged attention kernel, Triton against the torch reference.
7. ``host_overhead``: ``benchmarks.host_overhead`` on the device.

The parts run in this order (what a short GPU slot needs most first); ``results.json`` is
rewritten after every figure, so a run stopped at its time limit keeps what it measured.

Run: ``python -m benchmarks.gpu --out DIR`` (``--smoke`` for a CPU dry run of
the code paths, with tiny shapes, under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from benchmarks._gpu_report import OUT, free_gpu_cache, guarded, log, record
from benchmarks._random_models import make_adapters, make_model, random_prompts, setup_default_model_dir
from benchmarks._workload import ROOT
from benchmarks.gpu_kernels import part_kernels
from benchmarks.gpu_throughput import part_throughput


def part_tests(args: argparse.Namespace) -> None:
    """The Triton tests; conftest's default-model fixtures only need the tokenizer files."""
    from loraserve.models.loader import DEFAULT_MODEL_NAME, cache_root

    if not (cache_root() / "models" / DEFAULT_MODEL_NAME / "config.json").is_file():
        raise RuntimeError("no default model directory for the test fixtures (see LORASERVE_GPU_TOKENIZER)")
    files = ["tests/test_triton_kernels.py", "tests/test_triton_unified_attention.py", "tests/test_triton_fused.py",
             "tests/test_triton_lora_slots.py", "tests/test_triton_engine.py",
             "tests/test_decode_graphs.py", "tests/test_decode_path.py", "tests/test_pool_storage.py"]  # fmt: skip
    import importlib.util

    workers = ["-n", str(args.test_workers)] if args.test_workers > 1 and importlib.util.find_spec("xdist") else []
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *workers, *files],
                         cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)  # fmt: skip
    log(run.stdout[-4000:] + run.stderr[-2000:])
    record("tests", {"returncode": run.returncode, "summary": run.stdout.strip().splitlines()[-1:]})


def part_exact(args: argparse.Namespace) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from loraserve import LLM, SamplingParams

    shape = "tiny" if args.smoke else "smollm2-135m"
    model_dir = make_model(shape, args.tokenizer, args.work / f"{shape}-fp32", torch.float32, args.device)
    adapters = make_adapters(model_dir, args.work / f"{shape}-adapters", [8, 16, 32, 64])
    lens = [5, 17, 64, 128, 300, 513, 1100, 33] if not args.smoke else [5, 17, 40]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(args.device).eval()
    vocab = hf.config.vocab_size
    prompts = random_prompts(lens, vocab, seed=1)
    names: list[str | None] = [None if i % 5 == 4 else adapters[i % len(adapters)][0] for i in range(len(lens))]
    peft = PeftModel.from_pretrained(hf, str(adapters[0][1]), adapter_name=adapters[0][0])
    for extra_name, path in adapters[1:]:
        peft.load_adapter(str(path), adapter_name=extra_name)
    peft.eval()
    new = args.exact_tokens
    reference = []
    with torch.inference_mode():
        for prompt, name in zip(prompts, names, strict=True):
            ids = torch.tensor([prompt], device=args.device)
            kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
            if name is None:
                with peft.disable_adapter():
                    out = peft.generate(input_ids=ids, **kwargs)
            else:
                peft.set_adapter(name)
                out = peft.generate(input_ids=ids, **kwargs)
            reference.append(out[0, len(prompt) :].tolist())
    del peft, hf
    free_gpu_cache()
    for kernels in ("triton", "torch"):
        llm = LLM(str(model_dir), kernels=kernels, device=args.device, memory_budget_mb=2048)
        for name, path in adapters:
            llm.add_adapter(name, path)
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True),
                               adapters=names, use_tqdm=False)  # fmt: skip
        got = [o.token_ids for o in outputs]
        first_diff = [next((i for i, (a, b) in enumerate(zip(g, r, strict=True)) if a != b), None)
                      for g, r in zip(got, reference, strict=True)]  # fmt: skip
        same = sum(d is None for d in first_diff)
        log(f"exact[{kernels}]: {same}/{len(prompts)} requests equal HF+PEFT token for token "
            f"({new} tokens, prompts {lens}); first differing index per request: {first_diff}")  # fmt: skip
        record(f"exact_{kernels}", {"equal": same, "requests": len(prompts), "first_diff": first_diff})
        del llm


def part_attention(args: argparse.Namespace) -> None:
    import triton.testing
    from loraserve.kernels import paged_attention, triton_attention

    rows = []
    for num_seqs, context in [(4, 40)] if args.smoke else [(64, 1024), (256, 512), (256, 2048)]:
        heads, kv_heads, head_dim, block = 32, 8, 64, 16
        blocks = -(-context // block)
        num_pages = num_seqs * blocks + 1
        kv = torch.randn(num_pages, 2, block, kv_heads, head_dim, device=args.device, dtype=torch.bfloat16)
        tables = torch.randperm(num_pages - 1, device=args.device)[: num_seqs * blocks].view(num_seqs, blocks) + 1
        query = torch.randn(num_seqs, heads, head_dim, device=args.device, dtype=torch.bfloat16)
        lens = torch.full((num_seqs,), context, device=args.device)
        ref = paged_attention.paged_decode_attention(query, kv, tables, lens, 0.125)
        out = triton_attention.paged_decode_attention(query, kv, tables, lens, 0.125)
        error = (out.float() - ref.float()).abs().max().item()
        if args.smoke:
            rows.append((num_seqs, context, error, 0.0, 0.0, 0.0))
            continue
        inputs = (query, kv, tables, lens, 0.125)
        t_triton = triton.testing.do_bench(lambda x=inputs: triton_attention.paged_decode_attention(*x))
        t_torch = triton.testing.do_bench(lambda x=inputs: paged_attention.paged_decode_attention(*x))
        kv_bytes = num_seqs * context * 2 * kv_heads * head_dim * 2
        rows.append((num_seqs, context, error, t_triton, t_torch, kv_bytes / t_triton / 1e6))  # ms -> GB/s
    for num_seqs, context, error, t_triton, t_torch, gbps in rows:
        log(f"attention bf16 seqs={num_seqs} ctx={context}: max |triton-ref| {error:.2e}; triton {t_triton:.3f} ms "
            f"({gbps:.0f} GB/s of KV), torch reference {t_torch:.3f} ms")  # fmt: skip
    record("attention", rows)


def part_profile(args: argparse.Namespace) -> None:
    """Where the host's time goes in the engine's steps (cProfile; it slows Python down, so only
    the split is meaningful): the engine on the GPU is bound by its Python step loop."""
    import cProfile
    import io
    import pstats

    from loraserve import LLM, SamplingParams

    shape = "tiny" if args.smoke else "llama-1b"
    model_dir = make_model(shape, args.tokenizer, args.work / f"{shape}-bf16", torch.bfloat16, args.device)
    adapters = make_adapters(model_dir, args.work / f"{shape}-adapters", [[8, 16, 32, 64][i % 4] for i in range(8)])
    llm = LLM(str(model_dir), device=args.device, dtype="bfloat16", max_num_seqs=args.max_num_seqs,
              memory_budget_mb=args.pool_mb)  # fmt: skip
    for name, path in adapters:
        llm.add_adapter(name, path)
    prompts = random_prompts([128] * args.max_num_seqs, llm.tokenizer.vocab_size, seed=4)
    names = [adapters[i % len(adapters)][0] for i in range(len(prompts))]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    llm.generate(prompts[:4], params, adapters=names[:4], use_tqdm=False)
    profiler = cProfile.Profile()
    profiler.enable()
    llm.generate(prompts, params, adapters=names, use_tqdm=False)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(18)
    log(text.getvalue()[-6000:])
    record("profile", text.getvalue()[-6000:])


def part_host_overhead(args: argparse.Namespace) -> None:
    """``benchmarks.host_overhead`` on the device: ms per decode step of a tiny model (256
    sequences, 32 adapters), by phase, on the triton and torch backends."""
    from benchmarks import host_overhead

    for kernels, overlap in (("triton", False), ("triton", True), ("torch", False)):
        argv = ["--device", args.device, "--kernels", kernels] + (["--async-scheduling"] if overlap else [])
        # The decode path's choice (decode_path.py) times ~8 steps of graph and eager at a new size:
        # warm up past it, so no trial step falls into the timed ones.
        argv += ["--warmup", "12"] if kernels == "triton" else []
        if args.smoke:
            argv += ["--seqs", "8", "--adapters", "2", "--steps", "4", "--warmup", "1"]
        result = host_overhead.measure(host_overhead.parse_args(argv))
        label = kernels + (", async scheduling" if overlap else "")
        log(f"host overhead, {label}: {result['ms_per_step_median']:.2f} ms per step, "
            f"{result['us_per_seq_step']:.2f} us per sequence, phases {result['phase_ms_mean']}")  # fmt: skip
        record(f"host_overhead_{kernels}" + ("_async" if overlap else ""), result)


PARTS: dict[str, Callable[[argparse.Namespace], None]] = {  # in order of what a short GPU slot needs most
    "tests": part_tests,
    "kernels": part_kernels,
    "throughput": part_throughput,
    "exact": part_exact,
    "profile": part_profile,
    "attention": part_attention,
    "host_overhead": part_host_overhead,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="directory for results.json")
    parser.add_argument("--work", type=Path, default=Path("/tmp/loraserve-gpu"), help="models and adapters")
    parser.add_argument("--tokenizer", type=Path, default=None, help="tokenizer dir (default: the default model's)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {list(PARTS)}")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, for a dry run of the code paths")
    parser.add_argument("--exact-tokens", type=int, default=32)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--adapters", type=int, default=32,
                        help="adapters of the throughput part (the other parts keep their own)")  # fmt: skip
    parser.add_argument("--min-prompt", type=int, default=64)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--hf-batch", type=int, default=64)
    parser.add_argument("--baseline-tokens", type=int, default=32, help="new tokens per HF/PEFT request (tok/s)")
    parser.add_argument("--baselines", action=argparse.BooleanOptionalAction, default=True,
                        help="throughput also of HF generate and PEFT's mixed-adapter batch")  # fmt: skip
    parser.add_argument("--torch-references", action=argparse.BooleanOptionalAction, default=True,
                        help="throughput also of the engine on its torch reference kernels")  # fmt: skip
    parser.add_argument("--test-workers", type=int, default=8, help="pytest-xdist workers for the tests part")
    parser.add_argument("--pool-mb", type=int, default=24000)
    parser.add_argument("--timeout", type=int, default=180, help="seconds for the tests part")
    args = parser.parse_args(argv)
    for option in ("requests", "adapters", "max_tokens", "hf_batch", "baseline_tokens", "test_workers", "timeout"):
        if getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} must be at least 1, got {getattr(args, option)}")
    if not 1 <= args.min_prompt <= args.max_prompt:
        parser.error(f"prompts of {args.min_prompt}-{args.max_prompt} tokens: need 1 <= --min-prompt <= --max-prompt")
    unknown = set(args.parts.split(",")) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; the parts are {list(PARTS)}")
    if args.smoke:
        args.requests, args.adapters, args.max_tokens, args.min_prompt, args.max_prompt = 6, 3, 4, 8, 24
        args.hf_batch, args.pool_mb, args.max_num_seqs, args.exact_tokens = 3, 256, 8, 6
        args.baseline_tokens = 4
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from loraserve.models.loader import default_model_dir

    args.tokenizer = args.tokenizer or default_model_dir()
    args.work.mkdir(parents=True, exist_ok=True)
    info = {"torch": torch.__version__, "device": args.device, "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    import triton

    info["triton"] = triton.__version__
    if args.out:
        OUT.append(args.out)
    record("machine", info)
    log(f"machine: {info}")
    for name in args.parts.split(","):
        start = time.perf_counter()
        guarded(name, partial(PARTS[name], args))
        log(f"part {name}: {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    if os.environ.get("LORASERVE_GPU_TOKENIZER"):
        setup_default_model_dir(Path(os.environ["LORASERVE_GPU_TOKENIZER"]))
    main()
