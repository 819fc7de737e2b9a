"""Compile the LoRA kernels for a Hopper GPU (sm_90) on this machine and print, as JSON, the
global loads of each variant (``test_triton_codegen.py`` runs this in a process of its own:
the tests' process runs Triton's interpreter, whose kernels cannot be compiled).

    python tests/hopper_codegen.py
"""

from __future__ import annotations

import inspect
import json
import re
from collections import Counter
from typing import Any

import triton
from loraserve.kernels import triton_lora, triton_lora_slots
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

BF16_ARGS = {"x_ptr", "v_ptr", "out0_ptr", "out1_ptr", "out2_ptr", "weights_ptr"}
FP32_ARGS = {"scales_ptr", "part_ptr"}  # the slot kernels' partial sums are float32
PAGE_ELEMS = 16 * 8 * 64 * 2  # a KV page of a Llama-3.2-1B shape: 16 tokens, 8 KV heads of 64, K and V


def compile_for_hopper(kernel: Any, constexprs: dict[str, Any]) -> str:
    """The PTX of ``kernel`` for sm_90 with bfloat16 tensors, int64 metadata, float32 scales and
    Triton's launch specialisations (16-divisible pointers and integers unless excluded)."""
    names = list(inspect.signature(kernel.fn).parameters)
    signature: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, name in enumerate(names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        pointer = name.endswith("_ptr")
        dtype = "*bf16" if name in BF16_ARGS else "*fp32" if name in FP32_ARGS else "*i64"
        signature[name] = dtype if pointer else "i32"
        excluded = kernel.do_not_specialize_on_alignment if pointer else kernel.do_not_specialize
        if name not in excluded and i not in excluded:
            attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32))
    ptx: str = compiled.asm["ptx"]
    return ptx


def loads(ptx: str) -> dict[str, int]:
    """Global loads and stores by kind: ``ld.global.b16`` (one bf16), ``st.global.v4.b32`` (16 bytes),
    ``cp.async:16`` (a 16-byte async copy), ..."""
    counts: Counter[str] = Counter(re.findall(r"(?:ld|st)\.global(?:\.[a-z0-9]+)+", ptx))
    for size in re.findall(r"cp\.async\.c[ag]\.shared\.global \[[^]]*\], \[[^]]*\], (0x[0-9a-f]+)", ptx):
        counts[f"cp.async:{int(size, 16)}"] += 1
    return dict(counts)


def main() -> None:
    shrink = dict(PAGE_ELEMS=PAGE_ELEMS, PRECISION="tf32", BLOCK_T=16, DOT_FP32=False,
                  BLOCK_R=triton_lora.SHRINK_BLOCK_R, BLOCK_K=triton_lora.SHRINK_WIDTHS[0])  # fmt: skip
    expand = dict(PAGE_ELEMS=PAGE_ELEMS, PRECISION="tf32", BLOCK_T=16, DOT_FP32=False,
                  BLOCK_N=triton_lora.EXPAND_BLOCK_N, BLOCK_R=triton_lora.EXPAND_BLOCK_R)  # fmt: skip
    slots = triton_lora_slots
    slot_shrink = dict(PAGE_ELEMS=PAGE_ELEMS, BLOCK_T=slots.BLOCK_T, BLOCK_R=slots.SHRINK_BLOCK_R,
                       BLOCK_K=slots.SHRINK_WIDTHS[0], PRECISION="tf32", DOT_FP32=False)  # fmt: skip
    slot_expand = dict(PAGE_ELEMS=PAGE_ELEMS, BLOCK_T=slots.BLOCK_T, BLOCK_R=slots.EXPAND_BLOCK_R,
                       BLOCK_N=slots.EXPAND_BLOCK_N, CHUNKS=4, PRECISION="tf32", DOT_FP32=False)  # fmt: skip
    result: dict[str, dict[str, int]] = {}
    for aligned in (True, False):
        shrink_ptx = compile_for_hopper(triton_lora._shrink_kernel, dict(shrink, ALIGNED=aligned))
        result[f"shrink aligned={aligned}"] = loads(shrink_ptx)
        expand_ptx = compile_for_hopper(triton_lora._expand_kernel, dict(expand, ALIGNED=aligned))
        result[f"expand aligned={aligned}"] = loads(expand_ptx)
        slot_shrink_ptx = compile_for_hopper(slots._slot_shrink_kernel, dict(slot_shrink, ALIGNED=aligned))
        result[f"slot shrink aligned={aligned}"] = loads(slot_shrink_ptx)
        slot_expand_ptx = compile_for_hopper(slots._slot_expand_kernel, dict(slot_expand, ALIGNED=aligned))
        result[f"slot expand aligned={aligned}"] = loads(slot_expand_ptx)
    wide = dict(shrink, BLOCK_K=triton_lora.WIDE_SHRINK_WIDTHS[0], ALIGNED=True)  # runs of 64, each from its page
    result["shrink aligned=True wide"] = loads(compile_for_hopper(triton_lora._shrink_kernel, wide))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
