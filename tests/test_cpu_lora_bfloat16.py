"""The compiled segmented LoRA over a bfloat16 pool (``kernels/cpu.py``): weights widened to
float32 as they are read (or multiplied in bfloat16 pairs on AMX tiles), sums in float32, each
output rounded once; against the float32 reference on every path, bit for bit on rounding, and in a
bfloat16 engine with adapters. Segments of 3 or more tokens run each way: on the tiles where the
CPU has AMX (the "amx-tiles" cases are skipped by name elsewhere), on the vector loops and MKL, and on
the vector loops alone (longer segments in pieces); where the CPU has avx512_bf16 the vector loops'
shrink runs on bfloat16 pair dots."""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from amx_marks import needs_amx
from kernel_cases import NUM_ADAPTERS, POPULARITY, SegmentsKernel, run_segments
from loraserve.kernels import cpu, cpu_features

from tests.adapter_factory import make_peft_adapter

pytestmark = pytest.mark.skipif(cpu.load_extension() is None, reason="the C++ CPU kernels could not be built")


def cpu_bfloat16(
    x: torch.Tensor,
    outputs: tuple[torch.Tensor, ...],
    storage: torch.Tensor,
    *args: Any,
    tile_lengths: int = 0,
    loop_lengths: int = 0,
) -> None:
    """``kernel_cases.SegmentsKernel`` over ``cpu.lora_segments`` with x, outputs and pool in bfloat16."""
    results = tuple(out.to(torch.bfloat16) for out in outputs)
    cpu.lora_segments(x.to(torch.bfloat16), results, storage.to(torch.bfloat16), *args, tile_lengths, loop_lengths)
    for out, result in zip(outputs, results, strict=True):
        out.copy_(result.float())


@pytest.fixture(params=[pytest.param("amx-tiles", marks=needs_amx), "vector-loops", "loops-in-pieces"])
def segment_kernel(request: pytest.FixtureRequest) -> SegmentsKernel:
    """``cpu_bfloat16`` with segments of 3 or more tokens on AMX tiles (where built in and granted;
    the expand of 3-8 tokens on the vector loops), on the vector loops and MKL (every CPU), or on the
    vector loops only (longer segments in pieces of at most 32 tokens)."""
    amx = request.param == "amx-tiles"
    loops = request.param == "loops-in-pieces"
    tiles, pieces = cpu.EVERY_TILE_LENGTH if amx else 0, cpu.EVERY_LOOP_LENGTH if loops else 0
    return functools.partial(cpu_bfloat16, tile_lengths=tiles, loop_lengths=pieces)


def test_the_amx_tiles_and_pair_dots_are_used_where_the_cpu_has_them() -> None:
    """Built in and granted on every CPU with AMX bfloat16 tiles (no silent fall back there)."""
    info = cpu_features.cpu_info()
    has_amx = all(info.has(f) for f in ("amx_tile", "amx_bf16", "avx512_bf16", "avx512bw"))
    assert cpu.lora_amx() is has_amx
    assert cpu.lora_pair_dots() is info.has("avx512_bf16")  # the vector loops' shrink on pair dots
    assert cpu.lora_tile_length_bounds() == (8, 16, 32, 64, 128, 256, 512)


@needs_amx
@pytest.mark.parametrize("scattered", [False, True], ids=["consecutive-pages", "scattered-pages"])
def test_each_segment_length_class_takes_the_way_its_bit_chooses(scattered: bool) -> None:
    """One call with segments in every length class and every other class on the tiles: each
    segment's outputs are bit for bit those of the same segment in a call with every class on the
    tiles, or with none, as its class's bit says (the two ways round differently), and all match
    the float32 reference."""
    # length classes: 0 1 - 2 3 4 5 6, then each bound and the length past it (0 1, 2 3, 5 6, 6 7), and 7
    lengths = [5, 12, 2, 20, 40, 100, 200, 300, 8, 9, 32, 33, 256, 257, 512, 513, 600]
    mixed = 0b01010101  # classes 0, 2, 4, 6 on the tiles
    indices = [i % NUM_ADAPTERS for i, num in enumerate(lengths) for _ in range(num)]
    checked: list[int] = []

    def three_ways(x: torch.Tensor, outputs: tuple[torch.Tensor, ...], storage: torch.Tensor, *args: Any) -> None:
        ways = {}
        for mask in (mixed, cpu.EVERY_TILE_LENGTH, 0):
            ways[mask] = tuple(out.clone() for out in outputs)
            cpu_bfloat16(x, ways[mask], storage, *args, tile_lengths=mask)
        assert not all(torch.equal(a, b) for a, b in zip(ways[-1], ways[0], strict=True)), "the ways agree bitwise"
        bounds = args[2]
        for start, end, _, _ in bounds.tolist():
            num = end - start
            tiles = num > 2 and (mixed >> sum(num > b for b in cpu.lora_tile_length_bounds())) & 1
            expected = ways[cpu.EVERY_TILE_LENGTH if tiles else 0]
            for got, want in zip(ways[mixed], expected, strict=True):
                assert torch.equal(got[start:end], want[start:end]), f"segment of {num} tokens (tiles: {bool(tiles)})"
            checked.append(num)
        for out, result in zip(outputs, ways[mixed], strict=True):
            out.copy_(result)

    # Long segments off the tiles run one ATen GEMM pair each: MKL's grouped GEMM may sum a segment
    # in another order when the group around it differs, which would hide nothing but break the
    # bit-for-bit comparison.
    cpu.lora_grouped_gemm(enable=False)
    try:
        run_segments(three_ways, indices, seed=7, scattered=scattered, layer=1, hidden=576, outs=(192, 17, 1536),
                     atol=BF16_RTOL, dtype=torch.bfloat16)  # fmt: skip
    finally:
        cpu.lora_grouped_gemm(enable=True)
    assert checked == lengths


# bfloat16: the kernel sums in float32 and rounds each output once, so it is held to half a
# bfloat16 step of the output (2^-8 relative), not to a bfloat16 GEMM's looser error.
BF16_RTOL = 2**-8


@pytest.mark.parametrize("scattered", [False, True], ids=["consecutive-pages", "scattered-pages"])
@pytest.mark.parametrize("pattern", list(POPULARITY))
def test_lora_segments_bfloat16_pool_match_the_float32_reference(
    pattern: str, scattered: bool, segment_kernel: SegmentsKernel
) -> None:
    """A bfloat16 pool under Punica's popularity patterns: grouped by adapter (segments of the tiled
    loops) and interleaved (mostly 1-2 token row loops)."""
    indices = POPULARITY[pattern](random.Random(pattern))
    run_segments(segment_kernel, sorted(indices), seed=len(pattern), scattered=scattered, layer=1, atol=BF16_RTOL,
                 dtype=torch.bfloat16)  # fmt: skip
    run_segments(segment_kernel, indices, seed=3, scattered=scattered, layer=0, atol=BF16_RTOL, dtype=torch.bfloat16)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("scattered", [False, True], ids=["consecutive-pages", "scattered-pages"])
@pytest.mark.parametrize(
    "hidden, outs", [(37, (29, 5, 70)), (38, (29, 5, 70)), (576, (192, 17, 1536))], ids=["odd", "even", "wide"]
)
def test_lora_segments_bfloat16_on_every_path(
    hidden: int, outs: tuple[int, ...], scattered: bool, threads: int, segment_kernel: SegmentsKernel
) -> None:
    """Every segment length class (1-9, 13, 32 tokens tiled, 33 and 40 on MKL or the AMX tiles) on
    widths with scalar tails (odd: float loops; even: 19 pairs, the pair dots' tail) and wide ones,
    with and without MKL's grouped GEMM: bfloat16 weights widened in the row loops, the tiles and the
    copies for MKL. The first batch's 9 tiled segments
    (10 on AMX) run whole per thread on 1 or 2 threads (at least 4 per thread); the second's 3 (5 on
    AMX) run as split phases on 2 threads. On AMX: 1 to 5 blocks of 16 tokens, full and partial;
    segments of 32 or more tokens take the long-segment tiles (x read in place) at the wide hidden
    size and the packed-token tiles at the odd one (37 terms are not whole tile rows)."""
    many = [0, 1, 1, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 4, -1, 5] + [6] * 32 + [7] * 33
    many += [8] * 6 + [9] * 7 + [10] * 8 + [11] * 9 + [1] * 13
    few = [6] * 5 + [7] * 8 + [-1] * 2 + [8] * 13 + [9] * 40 + [10] * 70
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for grouped in (True, False):
            cpu.lora_grouped_gemm(enable=grouped)
            for indices in (many, few):
                run_segments(segment_kernel, indices, seed=5, scattered=scattered, layer=1, hidden=hidden, outs=outs,
                             atol=BF16_RTOL, dtype=torch.bfloat16)  # fmt: skip
    finally:
        cpu.lora_grouped_gemm(enable=True)
        torch.set_num_threads(previous)


@pytest.mark.parametrize("threads", [1, 2])
def test_lora_segments_bfloat16_long_rows_and_long_segments(threads: int, segment_kernel: SegmentsKernel) -> None:
    """A hidden size of 4096 (long float32 sums in the shrink) and a 300-token segment (on AMX: the
    long-segment tiles, items of 64 tokens and a partial last block), beside short segments,
    against the float32 reference."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        indices = [0] * 5 + [1] * 300 + [2] * 20 + [-1] * 3 + [3] * 9
        run_segments(segment_kernel, indices, seed=11, scattered=False, layer=0, hidden=4096, outs=(96, 40, 8),
                     atol=BF16_RTOL, dtype=torch.bfloat16)  # fmt: skip
    finally:
        torch.set_num_threads(previous)


def test_lora_segments_bfloat16_outputs_round_to_nearest_even(segment_kernel: SegmentsKernel) -> None:
    """Each output is the bfloat16 nearest to its float32 sum, ties to even, as torch rounds: with
    weights of ones the LoRA term is exactly x's first element v, so the results are fixed bit for
    bit, on the row loops (1 token), the tiles (5) and MKL (40), in vectors and scalar tails."""
    width = 36  # vectors of 8 or 16 lanes, then a tail
    storage = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    storage[0, 0, 0] = 1.0  # A: rank 1 over 4 inputs, v = x[:, 0]
    storage[0, 0, 4 : 4 + width] = 1.0  # B^T [1, width]: every output gets v
    meta = torch.zeros(1, 1, 1, 14, dtype=torch.long)
    meta[0, 0, 0, :6] = torch.tensor([0, 1, 0, 1, 4, width])
    inf, nan = float("inf"), float("nan")
    base = [1.0, 1.0, -1.0, 256.0, 3.0, inf, nan, 0.0, -0.0]
    # 1 + 2^-8 is a tie of 1 and 1 + 2^-7: 1 (even); 1 + 3 * 2^-8 a tie of 1 + 2^-7 and 1 + 2^-6: the latter.
    cases = {
        2**-8: [1.0, 1.0, -1.0 + 2**-8, 256.0, 3.0, inf, nan, 2**-8, 2**-8],
        3 * 2**-8: [1.0 + 2**-6, 1.0 + 2**-6, -1.0 + 3 * 2**-8, 256.0, 3.0 + 2**-6, inf, nan, 3 * 2**-8, 3 * 2**-8],
    }
    for num in (1, 5, 40):
        for v, expected in cases.items():
            out = torch.tensor([base * 4] * num, dtype=torch.bfloat16)  # [num, 36]
            x = torch.zeros(num, 4, dtype=torch.bfloat16)
            x[:, 0] = v
            segment_kernel(x, (out,), storage, 0, 0, torch.tensor([[0, num, 0, 0]]), torch.tensor([[0]]), meta,
                           torch.ones(1, 1, 1, 3))  # fmt: skip
            expected_rows = torch.tensor([expected * 4] * num)
            torch.testing.assert_close(out.float(), expected_rows, rtol=0, atol=0, equal_nan=True, msg=f"{num}, {v}")


def test_a_bfloat16_engine_applies_adapters_with_the_compiled_kernel(
    tiny_model_dir: Path, tiny_hf_model: Any, tmp_path: Path
) -> None:
    """kernels="cpu" in bfloat16 reads adapters with this kernel (no torch hook), and the prompt
    logprobs under an adapter follow the float32 torch reference far closer than the base model's do."""
    from loraserve import LLM, SamplingParams
    from loraserve.lora.apply_cpu import CompiledLoRAApplier

    every_projection = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapter = make_peft_adapter(tiny_hf_model, tmp_path / "r8", rank=8, seed=4, target_modules=every_projection)
    prompt = "The weather today is sunny and warm, and the children play outside in the park"
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)

    def prompt_logprobs(kernels: str, dtype: str, name: str | None) -> torch.Tensor:
        llm = LLM(str(tiny_model_dir), num_pages=64, kernels=kernels, dtype=dtype)
        if kernels == "cpu":
            assert isinstance(llm.engine.runner.lora_hook, CompiledLoRAApplier)
        llm.add_adapter("r8", adapter)
        out = llm.generate([prompt], params, use_tqdm=False, adapters=name)[0]
        assert out.prompt_logprobs is not None
        ids = out.prompt_token_ids
        return torch.tensor([entry[ids[i]][0] for i, entry in enumerate(out.prompt_logprobs) if entry is not None])

    reference = prompt_logprobs("torch", "float32", "r8")
    with_adapter = (prompt_logprobs("cpu", "bfloat16", "r8") - reference).abs().max()
    base = (prompt_logprobs("cpu", "bfloat16", None) - reference).abs().max()
    assert with_adapter < 0.25 * base, (float(with_adapter), float(base))
