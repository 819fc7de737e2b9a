"""Engine configuration: frozen dataclasses validated on construction."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch

from loraserve.decode_path import ADAPTER_DECODE_PATHS

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

PREEMPTION_MODES = ("recompute", "swap")
ADAPTER_REGIONS = ("unified", "fixed")  # where resident adapters' pages come from
KV_ALLOCATIONS = ("paged", "reserve")  # when a request's KV pages are taken
KERNEL_CHOICES = ("auto", "torch", "cpu", "triton")  # see loraserve/kernel_backend.py
# "auto" or a GemmKernel (models/packed_linear.py)
CPU_GEMM_CHOICES = ("auto", "panels", "onednn", "torch", "dot", "amx")
CPU_TILE_CHOICES = ("auto", "amx", "vector")  # lora/tile_choice.py, models/attention_choice.py
CPU_DECODE_ATTENTION_CHOICES = ("auto", "pairs", "avx512", "vec8")  # models/decode_attention_choice.py


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the option."""


@dataclass(frozen=True)
class EngineConfig:
    """Options of one engine instance.

    The page pool is sized either by ``num_pages`` or, when that is ``None``, by
    ``memory_budget_mb`` (bytes of pool storage across all layers); it holds the KV
    cache and the resident adapters. ``max_num_batched_tokens`` bounds a step's tokens (``None``:
    ``step_token_budget``'s default for the device and dtype). ``registry`` is where adapters are registered:
    a directory (``dir:/path`` or a plain path) or ``redis://...``; ``None`` is a
    private temporary directory. ``host_adapter_cache_mb`` bounds the parsed
    adapters kept in host memory. ``kernels`` picks the kernel backend: ``torch``
    (the reference implementations), ``cpu`` (compiled C++), ``triton`` (GPU kernels),
    ``auto`` (``cpu`` on a CPU device when it builds, ``triton`` on CUDA, else ``torch``).
    ``cpu_gemm`` picks the GEMM kernel of the linear layers under the ``cpu`` backend: ``auto``
    (timed per layer shape and row count on this CPU at start, the choice cached per CPU kind),
    or ``panels``, ``onednn``, ``torch``, ``dot`` or ``amx`` for every layer (``models/gemm_choice.py``).
    ``cpu_lora``: under the ``cpu`` backend, how LoRA segments of 3 or more tokens run: ``auto`` (per
    segment length, the fastest of the vector loops, MKL's GEMM beyond 32 tokens and, with a
    bfloat16 pool on a CPU with AMX, AMX tiles, timed on this CPU at start and cached per CPU kind),
    ``amx`` (always the tiles; an error without them) or ``vector`` (always the vector loops).
    ``cpu_prefill_attention``: the same choice for the prefill attention of a bfloat16 model
    (``auto``: timed on the model's head shape at start, cached per CPU kind).
    ``cpu_decode_attention``: the variant of the compiled decode attention, ``auto`` (timed on the
    model's head shape at start where more than one tiles it, cached per CPU kind), ``pairs``
    (bfloat16 scores by AVX512-BF16 pair dots), ``avx512`` (16 lanes; each an error where the build
    lacks it) or ``vec8`` (8 lanes).
    ``max_lora_rank`` and ``max_adapters``: the largest adapter rank, and the most adapters, the
    registry accepts (an operator's limits; there is no rank limit in the design).
    ``adapter_region``: ``unified`` (adapters take pages from the one pool the KV cache uses, any
    number of them, each as many pages as its ranks need) or ``fixed`` (what vLLM and SGLang do:
    a separate region of ``max_loras`` slots, each the pages of an adapter of every module at
    ``max_lora_rank``, kept from the KV cache; at most ``max_loras`` adapters resident at once).
    ``kv_allocation``: ``paged`` (KV pages taken as tokens arrive) or ``reserve`` (a request takes
    pages for its prompt plus ``max_tokens`` when it is admitted, as servers without paging do).
    Both non-default values exist to measure what the defaults buy (``benchmarks.many_adapters``).
    ``enforce_eager``: under the ``triton`` kernels, run decode steps eagerly as they come instead
    of padded to a captured size and replayed as CUDA graphs (``decode_graphs.py``).
    ``async_scheduling``: schedule and launch each step before the last one's tokens reach the
    host, so the host's work overlaps the GPU's (vLLM's ``--async-scheduling``; ``launched_step.py``).
    ``adapter_decode_path``: with decode graphs, how decode-only steps with adapters run:
    ``graph`` (replayed, adapters by slot), ``eager`` (adapters by segment) or ``auto`` (both
    timed on the first such steps of each batch size, the faster kept; ``decode_path.py``).
    """

    model: str | None = None
    block_size: int = 16
    num_pages: int | None = None
    memory_budget_mb: int = 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    watermark: float = 0.01
    preemption_mode: str = "recompute"
    num_swap_pages: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    max_model_len: int | None = None
    num_threads: int | None = None
    registry: str | None = None
    enable_prefix_caching: bool = True
    host_adapter_cache_mb: int = 2048
    kernels: str = "auto"
    cpu_gemm: str = "auto"
    cpu_lora: str = "auto"
    cpu_prefill_attention: str = "auto"
    cpu_decode_attention: str = "auto"
    enforce_eager: bool = False
    async_scheduling: bool = False
    adapter_decode_path: str = "auto"
    max_lora_rank: int = 512
    max_adapters: int = 10_000
    adapter_region: str = "unified"
    max_loras: int | None = None
    kv_allocation: str = "paged"

    def __post_init__(self) -> None:
        _check_types(self)
        _require(
            self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
            f"block_size must be a positive power of two, got {self.block_size}",
        )
        _require(
            self.num_pages is None or self.num_pages >= 2,
            f"num_pages must be at least 2, got {self.num_pages}",
        )
        _require(self.memory_budget_mb > 0, f"memory_budget_mb must be positive, got {self.memory_budget_mb}")
        _require(self.max_lora_rank >= 1, f"max_lora_rank must be positive, got {self.max_lora_rank}")
        _require(self.max_adapters >= 1, f"max_adapters must be positive, got {self.max_adapters}")
        _require(
            self.adapter_region in ADAPTER_REGIONS,
            f"adapter_region must be one of {ADAPTER_REGIONS}, got {self.adapter_region!r}",
        )
        _require(
            (self.max_loras is not None) == (self.adapter_region == "fixed"),
            f"max_loras sizes the fixed adapter region: give it with adapter_region='fixed' and only then "
            f"(got adapter_region={self.adapter_region!r}, max_loras={self.max_loras})",
        )
        _require(self.max_loras is None or self.max_loras >= 1, f"max_loras must be positive, got {self.max_loras}")
        _require(
            self.kv_allocation in KV_ALLOCATIONS,
            f"kv_allocation must be one of {KV_ALLOCATIONS}, got {self.kv_allocation!r}",
        )
        _require(self.max_num_seqs > 0, f"max_num_seqs must be positive, got {self.max_num_seqs}")
        _require(
            self.max_num_batched_tokens is None or self.max_num_batched_tokens > 0,
            f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}",
        )
        _require(0.0 <= self.watermark < 1.0, f"watermark must be in [0, 1), got {self.watermark}")
        _require(
            self.preemption_mode in PREEMPTION_MODES,
            f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}",
        )
        _require(self.num_swap_pages >= 0, f"num_swap_pages must be >= 0, got {self.num_swap_pages}")
        _require(
            self.preemption_mode != "swap" or self.num_swap_pages > 0,
            "preemption_mode='swap' needs num_swap_pages > 0 (host pages to swap into)",
        )
        _require(
            self.num_swap_pages == 0 or self.preemption_mode == "swap",
            f"num_swap_pages={self.num_swap_pages} are host pages for preemption_mode='swap'; with "
            f"preemption_mode={self.preemption_mode!r} they would be allocated and never used",
        )
        _require(self.dtype in DTYPES, f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        _require(
            self.max_model_len is None or self.max_model_len > 0,
            f"max_model_len must be positive, got {self.max_model_len}",
        )
        _require(
            self.num_threads is None or self.num_threads > 0,
            f"num_threads must be positive, got {self.num_threads}",
        )
        _require(
            self.host_adapter_cache_mb >= 0, f"host_adapter_cache_mb must be >= 0, got {self.host_adapter_cache_mb}"
        )
        _require(
            self.adapter_decode_path in ADAPTER_DECODE_PATHS,
            f"adapter_decode_path must be one of {ADAPTER_DECODE_PATHS}, got {self.adapter_decode_path!r}",
        )
        _require(
            not (self.enforce_eager and self.adapter_decode_path != "auto"),
            f"adapter_decode_path={self.adapter_decode_path!r} chooses how decode steps with adapters use the "
            "decode graphs, which enforce_eager turns off",
        )
        _require(self.kernels in KERNEL_CHOICES, f"kernels must be one of {KERNEL_CHOICES}, got {self.kernels!r}")
        try:
            device_type = torch.device(self.device).type
        except RuntimeError as error:
            raise ConfigError(f"device {self.device!r} is not a valid torch device: {error}") from None
        _require(device_type in ("cpu", "cuda"), f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        _require(
            self.kernels != "cpu" or device_type == "cpu",
            f"kernels='cpu' (compiled C++) runs on the CPU, not on device {self.device!r}",
        )
        _require(
            self.adapter_decode_path == "auto"
            or self.kernels == "triton"
            or (self.kernels == "auto" and device_type == "cuda"),
            f"adapter_decode_path={self.adapter_decode_path!r} chooses how the Triton backend's decode graphs "
            f"take adapters: it needs kernels 'triton' (or 'auto' on CUDA), not kernels={self.kernels!r} on "
            f"device {self.device!r}",
        )
        cpu_options = (
            ("cpu_gemm", self.cpu_gemm, CPU_GEMM_CHOICES),
            ("cpu_lora", self.cpu_lora, CPU_TILE_CHOICES),
            ("cpu_prefill_attention", self.cpu_prefill_attention, CPU_TILE_CHOICES),
            ("cpu_decode_attention", self.cpu_decode_attention, CPU_DECODE_ATTENTION_CHOICES),
        )
        for name, value, choices in cpu_options:  # the compiled CPU backend's kernel choices
            _require(value in choices, f"{name} must be one of {choices}, got {value!r}")
            _require(
                value == "auto" or (self.kernels in ("auto", "cpu") and torch.device(self.device).type == "cpu"),
                f"{name}={value!r} applies to the compiled CPU backend only (kernels 'cpu' or 'auto' on "
                f"a CPU device), not kernels={self.kernels!r} on device {self.device!r}",
            )

    @property
    def step_token_budget(self) -> int:
        """``max_num_batched_tokens``; by default 2,048, except 1,024 for float32 on a CPU; at least
        ``max_num_seqs`` (a decode step of every running sequence must fit). Measured over HTTP
        (benchmarks/RESULTS.md): a CPU computes a float32 prompt token as fast in steps of 1,024
        as of 2,048, and smaller chunks finish the first prompts of a burst sooner; in bfloat16
        (AMX, AVX512-BF16) steps of 2,048 gave more tokens/s and no later first tokens."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        cpu_float32 = torch.device(self.device).type == "cpu" and self.dtype == "float32"
        return max(1024 if cpu_float32 else 2048, self.max_num_seqs)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @classmethod
    def from_options(cls, model: str | None = None, **options: Any) -> EngineConfig:
        """Build from keyword options, naming any unknown option in the error."""
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown engine option(s) {unknown}; known options: {sorted(known)}")
        return cls(model=os.fspath(model) if isinstance(model, os.PathLike) else model, **options)


_SCALAR_TYPES: dict[str, tuple[type, ...]] = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,)}


def _check_types(config: Any) -> None:
    """Each field holds its annotated type (options read from YAML, JSON or the environment come as
    strings: ``"false"`` is not taken for False); a bool is not taken for an int, an int is for a float."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        kinds = [kind.strip() for kind in str(field.type).split("|")]
        if value is None and "None" in kinds:
            continue
        allowed = tuple(t for kind in kinds for t in _SCALAR_TYPES.get(kind, ()))
        if not allowed:
            continue
        fits = isinstance(value, allowed) and (bool in allowed or not isinstance(value, bool))
        wanted = " or ".join(kind for kind in kinds)
        _require(fits, f"{field.name} must be {wanted}, got {value!r} ({type(value).__name__})")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)
