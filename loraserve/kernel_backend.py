"""Which kernels the engine runs: a small registry of backends chosen by ``EngineConfig.kernels``.

* ``torch``: the torch implementations in ``kernels/`` (the references; any device, any dtype).
* ``cpu``: the compiled C++ kernels of ``kernels/cpu.py`` (CPU): paged decode attention and
  the KV write (any dtype), and for float32 also the LoRA segments, fused RMSNorm / RoPE and the model's
  linear layers on oneDNN-packed weights for decode-sized batches (``models/packed_linear.py``).
* ``auto``: ``cpu`` on a CPU device when the extension builds, else ``torch``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loraserve.adapter_manager import AdapterManager
from loraserve.kernels import cpu
from loraserve.kernels.paged_attention import paged_decode_attention, write_kv
from loraserve.lora_batch import LoRAApplier
from loraserve.lora_compiled import CompiledLoRAApplier
from loraserve.models.llama import DecodeAttention, FusedRMSNorm, FusedRope, LoRAHook, WriteKV

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KernelBackend:
    """Kernels of one backend; ``rms_norm``/``rope`` None means the model's torch ops;
    ``pack_linears``: run the linear layers as ``PackedLinear`` (oneDNN) for small batches."""

    name: str
    decode_attention: DecodeAttention
    write_kv: WriteKV
    make_lora_hook: Callable[[AdapterManager], LoRAHook]
    rms_norm: FusedRMSNorm | None = None
    rope: FusedRope | None = None
    pack_linears: bool = False


def _torch_backend(dtype: torch.dtype) -> KernelBackend:
    return KernelBackend("torch", paged_decode_attention, write_kv, LoRAApplier)


def _cpu_backend(dtype: torch.dtype) -> KernelBackend:
    if cpu.load_extension() is None:
        raise RuntimeError("kernels='cpu' needs the compiled CPU kernels, which could not be built (see the log)")
    if dtype != torch.float32:  # the fused and LoRA kernels are float32; attention takes any dtype
        return KernelBackend("cpu", cpu.paged_decode_attention, cpu.write_kv_, LoRAApplier)
    return KernelBackend(
        "cpu", cpu.paged_decode_attention, cpu.write_kv_, CompiledLoRAApplier, cpu.rms_norm, cpu.rope_, True
    )


BACKENDS: dict[str, Callable[[torch.dtype], KernelBackend]] = {"torch": _torch_backend, "cpu": _cpu_backend}


def select_backend(name: str, device: torch.device, dtype: torch.dtype) -> KernelBackend:
    """The backend for ``EngineConfig.kernels``; ``auto`` falls back to ``torch`` if ``cpu`` cannot build."""
    if name == "auto":
        name = "cpu" if device.type == "cpu" and cpu.load_extension() is not None else "torch"
    if name == "cpu" and device.type != "cpu":
        raise RuntimeError(f"kernels='cpu' runs on the CPU, but the device is {device}")
    backend = BACKENDS[name](dtype)
    logger.info("kernels: %s", backend.name)
    return backend
