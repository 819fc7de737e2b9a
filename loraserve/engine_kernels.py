"""What the engine runs its model with, decided once at start from the config: the kernel
backend, the CPU GEMM policy, the prefill and decode attention's kernels and whether decode steps
replay CUDA graphs."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace
from typing import Any

import torch

from loraserve.config import ConfigError, EngineConfig
from loraserve.kernel_backend import KernelBackend, select_backend
from loraserve.kernels import cpu
from loraserve.models.attention_choice import (
    AttentionShape,
    PrefillAttentionPlan,
    PrefillAttentionPolicy,
    prefill_attention_kernels,
)
from loraserve.models.decode_attention_choice import (
    DecodeAttentionPlan,
    DecodeAttentionPolicy,
    choose_decode_attention,
)
from loraserve.models.gemm_choice import GemmPolicy
from loraserve.models.loader import cache_root
from loraserve.models.model_kernels import ModelKernels

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineKernels:
    """``backend``: the kernel backend; ``model``: the kernels given to the model (the backend's,
    with the prefill attention chosen); ``gemm_policy``: how the CPU GEMM kernels are chosen (None
    off the ``cpu`` backend); ``attention_plan``: how the prefill attention was chosen (None where
    there was no choice); ``decode_attention_plan``: the compiled decode attention's variant and how
    it was chosen (None off the ``cpu`` backend); ``decode_graphs``: decode steps replay CUDA graphs; ``fallbacks``:
    compiled kernels that run their fallback."""

    backend: KernelBackend
    model: ModelKernels
    gemm_policy: GemmPolicy | None
    attention_plan: PrefillAttentionPlan | None
    decode_attention_plan: DecodeAttentionPlan | None
    decode_graphs: bool
    fallbacks: tuple[str, ...]

    @classmethod
    def choose(cls, config: EngineConfig, hf_config: Any, device: torch.device) -> EngineKernels:
        """The kernels for ``config`` on ``device``; options that need another backend are refused
        (``ConfigError``); the prefill attention's tile choice is timed here or read from its cache."""
        backend = select_backend(config.kernels, device, config.torch_dtype)
        fallbacks = tuple(cpu.fallbacks()) if backend.name == "cpu" else ()
        for name in fallbacks:
            logger.warning("compiled kernel %s runs its fallback: a library symbol is missing from torch", name)
        gemm_policy = None
        if backend.pack_linears:
            gemm_policy = GemmPolicy(
                config.cpu_gemm,
                max_rows=config.step_token_budget,
                row_limits=(("lm_head", config.max_num_seqs),),  # one row per sampled sequence
                cache_dir=cache_root() / "cpu_gemm",
            )
        elif config.cpu_gemm != "auto":
            raise ConfigError(f"cpu_gemm={config.cpu_gemm!r} needs the compiled CPU kernels (kernels 'cpu')")
        # Where the compiled prefill attention can use AMX tiles: whether it does, timed or cached.
        shape = AttentionShape.of_model(hf_config, config.block_size)
        model_kernels, attention_plan = prefill_attention_kernels(
            backend.name,
            backend.model,
            shape,
            config.torch_dtype,
            config.step_token_budget,
            PrefillAttentionPolicy(config.cpu_prefill_attention, cache_root() / "cpu_attention"),
        )
        decode_attention_plan = None
        if backend.name == "cpu":
            policy = DecodeAttentionPolicy(config.cpu_decode_attention, cache_root() / "cpu_attention")
            decode_attention_plan = choose_decode_attention(shape, config.torch_dtype, config.max_num_seqs, policy)
            plan = decode_attention_plan
            instead = "" if plan.kernel == plan.variant else f" {plan.variant!r}, which does not tile this model"
            logger.info("CPU decode attention: %s (%s%s)", plan.kernel, plan.source, instead)
            attend = functools.partial(cpu.paged_decode_attention, variant=decode_attention_plan.variant)
            model_kernels = replace(model_kernels, decode_attention=attend)
        elif config.cpu_decode_attention != "auto":
            raise ConfigError(
                f"cpu_decode_attention={config.cpu_decode_attention!r} needs the compiled CPU kernels (kernels 'cpu')"
            )
        decode_graphs = backend.decode_graphs and not config.enforce_eager
        if config.adapter_decode_path != "auto" and not decode_graphs:
            raise ConfigError(
                f"adapter_decode_path={config.adapter_decode_path!r} chooses between decode graphs and eager "
                f"steps: it needs the triton kernels (kernels: {backend.name})"
            )
        return cls(backend, model_kernels, gemm_policy, attention_plan, decode_attention_plan, decode_graphs, fallbacks)
