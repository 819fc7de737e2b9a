"""The engine's command-line options: one table of (flag, ``EngineConfig`` field, type, help),
shared by ``loraserve serve`` and ``loraserve generate``."""

from __future__ import annotations

import argparse
from typing import Any

from loraserve.config import (
    CPU_DECODE_ATTENTION_CHOICES,
    CPU_GEMM_CHOICES,
    CPU_TILE_CHOICES,
    DTYPES,
    KERNEL_CHOICES,
    PREEMPTION_MODES,
)
from loraserve.decode_path import ADAPTER_DECODE_PATHS

# Engine options: (flag, EngineConfig field, type, help).
ENGINE_OPTIONS: tuple[tuple[str, str, type, str], ...] = (
    ("--block-size", "block_size", int, "tokens per KV page (a power of two; default 16)"),
    ("--num-pages", "num_pages", int, "pages in the unified pool (default: sized by --memory-budget-mb)"),
    ("--memory-budget-mb", "memory_budget_mb", int, "MiB of pool storage when --num-pages is not given (default 1024)"),
    ("--max-num-seqs", "max_num_seqs", int, "most sequences running at once (default 64)"),
    (
        "--max-num-batched-tokens",
        "max_num_batched_tokens",
        int,
        "tokens a step (default 2048, 1024 in float32 on CPU, at least --max-num-seqs; a smaller value is "
        "taken, unlike vLLM: decode then runs that many sequences a step)",
    ),
    ("--max-model-len", "max_model_len", int, "context length limit, at most the model's (default: the model's)"),
    (
        "--watermark",
        "watermark",
        float,
        "share of the pool's pages kept free when admitting a request, in [0, 1) (default 0.01)",
    ),
    (
        "--preemption-mode",
        "preemption_mode",
        str,
        f"what a preempted sequence's KV becomes, one of {PREEMPTION_MODES}: recompute (freed, recomputed "
        "on resumption; default) or swap (copied to --num-swap-pages host pages)",
    ),
    ("--num-swap-pages", "num_swap_pages", int, "host pages for --preemption-mode swap (default 0)"),
    (
        "--host-adapter-cache-mb",
        "host_adapter_cache_mb",
        int,
        "MiB of parsed adapters kept in host memory, ready to load into the pool (default 2048)",
    ),
    ("--device", "device", str, "torch device, e.g. cpu or cuda:0 (default cpu)"),
    ("--dtype", "dtype", str, f"weights and pool dtype, one of {sorted(DTYPES)} (default float32)"),
    ("--seed", "seed", int, "seed of unseeded sampling (default 0)"),
    ("--num-threads", "num_threads", int, "torch CPU threads (default: torch's; under --ray-address local, a share)"),
    ("--max-lora-rank", "max_lora_rank", int, "largest adapter rank accepted at registration (default 512)"),
    ("--max-adapters", "max_adapters", int, "most registered adapters (default 10000)"),
    (
        "--adapter-region",
        "adapter_region",
        str,
        "where adapters' pages come from: unified (the pool the KV cache uses; default) or fixed (a separate "
        "region of --max-loras slots at --max-lora-rank, as vLLM and SGLang do)",
    ),
    ("--max-loras", "max_loras", int, "slots of the fixed adapter region (with --adapter-region fixed only)"),
    (
        "--kv-allocation",
        "kv_allocation",
        str,
        "paged (KV pages as tokens arrive; default) or reserve (prompt + max_tokens taken at admission)",
    ),
    ("--kernels", "kernels", str, f"kernels, one of {KERNEL_CHOICES} (default auto: C++ on CPU, Triton on CUDA)"),
    (
        "--cpu-gemm",
        "cpu_gemm",
        str,
        f"GEMM kernel of the linear layers on the CPU, one of {CPU_GEMM_CHOICES} (default auto: timed on this "
        "CPU per layer shape and row count at the first start, the choice cached per CPU kind)",
    ),
    (
        "--cpu-lora",
        "cpu_lora",
        str,
        f"LoRA of 3+ token segments on the CPU, one of {CPU_TILE_CHOICES}: amx (AMX tiles; a bfloat16 pool on a "
        "CPU with AMX), vector (vector loops, longer segments in pieces); default auto: per segment length the "
        "fastest of those and MKL's GEMM (33+ tokens), timed at the first start, cached per CPU kind",
    ),
    (
        "--cpu-prefill-attention",
        "cpu_prefill_attention",
        str,
        f"prefill attention of a bfloat16 model on a CPU with AMX, one of {CPU_TILE_CHOICES}: amx (tiles), "
        "vector (vector loops); default auto: timed on the model's head shape at the first start, cached per "
        "CPU kind",
    ),
    (
        "--cpu-decode-attention",
        "cpu_decode_attention",
        str,
        f"variant of the compiled decode attention, one of {CPU_DECODE_ATTENTION_CHOICES}: pairs (bfloat16 "
        "scores by AVX512-BF16 pair dots, where the build targets it), avx512 (16 lanes, where the build targets "
        "AVX-512), vec8 (8 lanes); default auto: timed on the model's head shape at the first start, cached per "
        "CPU kind",
    ),
    (
        "--adapter-decode-path",
        "adapter_decode_path",
        str,
        f"Triton kernels with decode graphs: decode steps with adapters, one of {ADAPTER_DECODE_PATHS}: graph "
        "(replayed, adapters by slot), eager (adapters by segment); default auto: both timed on the first "
        "steps of each batch size, the faster kept",
    ),
)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The EngineConfig options as flags (shared by ``serve`` and ``generate``)."""
    engine = parser.add_argument_group("engine options")
    for flag, _, kind, help_text in ENGINE_OPTIONS:
        engine.add_argument(flag, type=kind, default=None, help=help_text)
    engine.add_argument(
        "--no-enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        default=None,
        help="do not share KV blocks between requests with the same prefix (default: shared)",
    )
    engine.add_argument(
        "--enforce-eager",
        dest="enforce_eager",
        action="store_true",
        default=None,
        help="Triton kernels: run decode steps eagerly, no CUDA graphs (default: graphs per padded batch size)",
    )
    engine.add_argument(
        "--async-scheduling",
        dest="async_scheduling",
        action="store_true",
        default=None,
        help="schedule each step before the last one's tokens reach the host, overlapping host and GPU work",
    )


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options given on the command line (others keep their defaults)."""
    fields = [field for _, field, _, _ in ENGINE_OPTIONS] + [
        "enable_prefix_caching",
        "enforce_eager",
        "async_scheduling",
    ]
    return {field: getattr(args, field) for field in fields if getattr(args, field, None) is not None}
