"""How many variants of loraserve's Triton kernels have been compiled in this process.

Triton compiles a kernel once per combination of its constexprs and the specialisations of its
integer arguments (equal to 1, divisible by 16); a per-step value that selected a new one would
compile mid-run, stalling the step for a second or more. The engine counts them after its
warm-up (``decode_graphs.py``) and the GPU benchmark around each timed run: in steady state the
count must not move. Under Triton's interpreter nothing is compiled (the count stays 0).
"""

from __future__ import annotations

import importlib

KERNEL_MODULES = (
    "loraserve.kernels.triton_fused",
    "loraserve.kernels.triton_lora",
    "loraserve.kernels.triton_lora_slots",
    "loraserve.kernels.triton_rope_kv",
    "loraserve.kernels.triton_unified_attention",
)


def compiled_variants() -> int | None:
    """Compiled variants of every Triton kernel in ``KERNEL_MODULES``, over all devices (None when
    this Triton keeps its caches elsewhere)."""
    total = 0
    try:
        for name in KERNEL_MODULES:
            for value in vars(importlib.import_module(name)).values():
                caches = getattr(value, "device_caches", None)  # triton.JITFunction: device -> (cache, ...)
                if caches is not None:
                    total += sum(len(entry[0]) for entry in caches.values())
    except (TypeError, IndexError, AttributeError):
        return None
    return total
