"""Which kernels the engine runs: a small registry of backends chosen by ``EngineConfig.kernels``.

* ``torch``: the torch implementations in ``kernels/`` (the references; any device, any dtype).
* ``cpu``: the compiled C++ kernels of ``kernels/cpu.py`` (CPU): paged decode attention, the
  prefill attention of all a step's prompts in one call, and the KV write (any dtype), fused
  RMSNorm / RoPE / SiLU-and-mul and the LoRA segments (float32 and bfloat16), structured outputs'
  token mask;
  the model's float32 and bfloat16 linear layers run on the GEMM kernel timed fastest on this CPU
  for their shape and row count (``models/gemm_choice.py``).
* ``triton``: the Triton kernels (GPU): the paged attention of a whole step, decode and prefill,
  in one launch per layer (``kernels/triton_unified_attention.py``) and LoRA read in place from
  the pool pages (``kernels/triton_lora.py``), RoPE fused with the KV write
  (``kernels/triton_rope_kv.py``), residual add fused with RMSNorm, SiLU-and-mul
  (``kernels/triton_fused.py``); on a CPU device
  only under Triton's interpreter (``TRITON_INTERPRET=1``, for tests).
* ``auto``: ``cpu`` on a CPU device when the extension builds, ``triton`` on a CUDA device when
  Triton is installed, else ``torch``.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from loraserve.kernels import cpu
from loraserve.lora.apply_cpu import CompiledLoRAApplier
from loraserve.lora.apply_torch import LoRAApplier, PerBatchLoRAHook
from loraserve.models.model_kernels import ModelKernels
from loraserve.structured_outputs import TokenMask, apply_bitmasks

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KernelBackend:
    """Kernels of one backend, built once: ``model`` is given to the model at construction,
    ``make_lora_hook`` to the runner, which builds its hook over the pool's storage;
    ``pack_linears``: run the linear layers as ``PackedLinear`` on the chosen CPU GEMM kernels,
    the projections that share an input (q/k/v, gate/up) as one ``PackedLinearGroup`` each;
    ``decode_graphs``: the backend's decode forward can be captured (``decode_graphs.py``);
    ``lora_tile_choice``: its hook takes the segment lengths that run on AMX tiles and on the vector
    loops, and how the loops' expand runs (``tile_lengths``, ``loop_lengths``, ``expand_rank_block``,
    ``expand_pairs``, timed by ``lora/tile_choice.py``); ``mask_tokens``: structured outputs'
    grammar mask on the logits."""

    name: str
    model: ModelKernels
    make_lora_hook: Callable[..., PerBatchLoRAHook[Any]]  # (storage [num_layers, num_pages, page_elems])
    pack_linears: bool = False
    decode_graphs: bool = False  # decode steps padded on static buffers, adapters by slot (CUDA graphs)
    lora_tile_choice: bool = False
    mask_tokens: TokenMask = apply_bitmasks


def _torch_backend(dtype: torch.dtype) -> KernelBackend:
    return KernelBackend("torch", ModelKernels(), LoRAApplier)


def _cpu_backend(dtype: torch.dtype) -> KernelBackend:
    if cpu.load_extension() is None:
        raise RuntimeError("kernels='cpu' needs the compiled CPU kernels, which could not be built (see the log)")
    attention = (cpu.paged_decode_attention, cpu.paged_prefill_attention, cpu.write_kv_)  # any dtype
    fused = ModelKernels(*attention, cpu.rms_norm, cpu.rope_, silu_and_mul=cpu.silu_and_mul_)
    mask = cpu.mask_by_bitmask_  # the logits are float32 whatever the model's dtype
    if dtype in (torch.float32, torch.bfloat16):
        return KernelBackend(
            "cpu", fused, CompiledLoRAApplier, pack_linears=True, lora_tile_choice=True, mask_tokens=mask
        )
    return KernelBackend("cpu", ModelKernels(*attention), LoRAApplier, pack_linears=True, mask_tokens=mask)


def _triton_backend(dtype: torch.dtype) -> KernelBackend:
    if importlib.util.find_spec("triton") is None:
        raise RuntimeError("kernels='triton' needs the triton package (pip install 'loraserve[triton]')")
    # Imported here: triton is optional, and its kernels are compiled (or interpreted) on import.
    from loraserve.kernels import triton_fused, triton_rope_kv, triton_unified_attention
    from loraserve.lora.apply_triton import TritonLoRAApplier

    # The one-launch attention and the fused RoPE + KV write replace the decode, prefill and
    # write_kv kernels, so those keep their (unused) torch defaults.
    kernels = ModelKernels(
        rms_norm=triton_fused.fused_add_rms_norm,
        attention=triton_unified_attention.unified_attention,
        rope_write_kv=triton_rope_kv.rope_write_kv,
        silu_and_mul=triton_fused.silu_and_mul,
    )
    return KernelBackend("triton", kernels, TritonLoRAApplier, decode_graphs=True)


BACKENDS: dict[str, Callable[[torch.dtype], KernelBackend]] = {
    "torch": _torch_backend,
    "cpu": _cpu_backend,
    "triton": _triton_backend,
}


def _auto(device: torch.device) -> str:
    if device.type == "cpu":
        return "cpu" if cpu.load_extension() is not None else "torch"
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "torch"


def select_backend(name: str, device: torch.device, dtype: torch.dtype) -> KernelBackend:
    """The backend for ``EngineConfig.kernels``; ``auto`` falls back to ``torch`` when the native one is missing."""
    if name == "auto":
        name = _auto(device)
    if name == "cpu" and device.type != "cpu":
        raise RuntimeError(f"kernels='cpu' runs on the CPU, but the device is {device}")
    backend = BACKENDS[name](dtype)
    if name == "triton" and device.type != "cuda":
        from loraserve.kernels.triton_attention import runs_interpreted

        if not runs_interpreted():
            raise RuntimeError(
                f"kernels='triton' on device {device} runs only in Triton's interpreter: "
                "set TRITON_INTERPRET=1 before starting (or use kernels='cpu' or 'torch')"
            )
    logger.info("kernels: %s", backend.name)
    return backend
