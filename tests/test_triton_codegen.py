"""What the LoRA kernels compile to on a Hopper GPU (sm_90), checked without one: Triton compiles
for a named target on the CPU (``hopper_codegen.py``). Where the tiles are aligned
(``triton_lora_tiles.aligned_tiles``: every projection of real models), the weight tiles must reach
shared memory as 16-byte asynchronous copies that the software pipeliner issues ahead of the
loop's dots, instead of 2-byte loads behind a dependent page-table load per element (the latency
that made the H200 run's slot LoRA 17x a dense matmul). The figures come from
``python -m benchmarks.gpu``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
triton_lora = pytest.importorskip("loraserve.kernels.triton_lora")
triton_lora_tiles = pytest.importorskip("loraserve.kernels.triton_lora_tiles")

PAGE_ELEMS = 16 * 8 * 64 * 2  # as hopper_codegen.py's


@pytest.fixture(scope="module")
def hopper_loads() -> dict[str, dict[str, int]]:
    try:
        import triton.backends.nvidia.compiler  # noqa: F401
    except ImportError as error:  # pragma: no cover - a Triton without its NVIDIA backend
        pytest.skip(f"Triton cannot compile for CUDA here: {error}")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("hopper_codegen.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    loads: dict[str, dict[str, int]] = json.loads(done.stdout.strip().splitlines()[-1])
    return loads


def test_aligned_tiles_hold_for_real_shapes() -> None:
    for row_length in (576, 1536, 2048, 8192, 14336):  # SmolLM2, Llama-3.2-1B, Llama-3-8B
        assert triton_lora_tiles.aligned_tiles(row_length, PAGE_ELEMS, 64)
    assert not triton_lora_tiles.aligned_tiles(48, PAGE_ELEMS, 64)
    assert not triton_lora_tiles.aligned_tiles(2048, PAGE_ELEMS + 32, 64)  # a page that is not a multiple of 64
    # the shrink's wide tiles: runs of 64 from their pages, the widest that covers the row exactly
    wide = triton_lora.WIDE_SHRINK_WIDTHS
    widths = [triton_lora_tiles.shrink_width(n, PAGE_ELEMS, wide) for n in (576, 1536, 2048, 384, 48)]
    assert widths == [64, 256, 256, 128, 64]
    assert not triton_lora_tiles.aligned_tiles(576, PAGE_ELEMS, 256)


def test_shrink_loads_aligned_tiles_by_async_16_byte_copies(hopper_loads: dict[str, dict[str, int]]) -> None:
    aligned, gathered = hopper_loads["shrink aligned=True"], hopper_loads["shrink aligned=False"]
    assert gathered.get("ld.global.b16", 0) > 0  # weights element by element
    assert aligned.get("ld.global.b16", 0) == 0
    assert aligned.get("cp.async:16", 0) > gathered.get("cp.async:16", 0)


def test_wide_shrink_tiles_load_runs_by_async_16_byte_copies(hopper_loads: dict[str, dict[str, int]]) -> None:
    wide, narrow = hopper_loads["shrink aligned=True wide"], hopper_loads["shrink aligned=True"]
    assert wide.get("ld.global.b16", 0) == 0  # no weight element loaded alone
    assert wide.get("cp.async:16", 0) > narrow.get("cp.async:16", 0)  # four runs of 64 per row and step


def test_expand_loads_aligned_tiles_by_async_16_byte_copies(hopper_loads: dict[str, dict[str, int]]) -> None:
    aligned, gathered = hopper_loads["expand aligned=True"], hopper_loads["expand aligned=False"]
    assert aligned.get("cp.async:16", 0) > gathered.get("cp.async:16", 0)
    # what stays 2-byte is the read of v (its row stride is a per-step integer, not specialised)
    assert aligned.get("ld.global.b16", 0) < gathered.get("ld.global.b16", 0) / 4


def test_slot_kernels_move_aligned_tiles_16_bytes_at_a_time(hopper_loads: dict[str, dict[str, int]]) -> None:
    shrink, shrink_gathered = hopper_loads["slot shrink aligned=True"], hopper_loads["slot shrink aligned=False"]
    expand, expand_gathered = hopper_loads["slot expand aligned=True"], hopper_loads["slot expand aligned=False"]
    # A tiles as 16-byte async copies, never element by element
    assert shrink.get("cp.async:16", 0) > shrink_gathered.get("cp.async:16", 0)
    assert shrink_gathered.get("ld.global.b16", 0) > 0 and shrink.get("ld.global.b16", 0) == 0
    # B^T tiles likewise, and the outputs read and written 16 bytes at a time
    assert expand.get("cp.async:16", 0) > expand_gathered.get("cp.async:16", 0)
    assert expand_gathered.get("ld.global.b16", 0) > 0 and expand_gathered.get("st.global.b16", 0) > 0
    assert expand.get("ld.global.b16", 0) == expand.get("st.global.b16", 0) == 0
