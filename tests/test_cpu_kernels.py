"""The compiled CPU kernels (``kernels/cpu.py``) against the torch references (the decode
attention's are in ``test_cpu_decode_attention.py``, the fused elementwise ops' in
``test_cpu_elementwise.py``).

Segmented LoRA: adapters of mixed ranks laid out in pool pages as ``lora/layout.py`` does
(stacked A rows, then B^T per module, modules absent in some adapters), on consecutive
pages (read in place) or scattered ones (followed through page tables), under Punica's
adapter popularity patterns.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from typing import Any

import pytest
import torch
from kernel_cases import ATTENTION_CASES, ATTENTION_IDS, BS, HIDDEN, POPULARITY, make_paged, run_segments
from loraserve.kernels import cpu, cpu_features
from loraserve.kernels.paged_attention import write_kv

pytestmark = pytest.mark.skipif(cpu.load_extension() is None, reason="the C++ CPU kernels could not be built")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    kv = torch.randn(7, 2, 4, 3, 8, generator=gen).to(dtype)
    key, value = (torch.randn(10, 3, 8, generator=gen).to(dtype) for _ in range(2))
    slots = torch.randperm(28, generator=gen)[:10]  # distinct slots over every page
    expected = kv.clone()
    write_kv(expected, key, value, slots)
    cpu.write_kv_(kv, key, value, slots)
    assert torch.equal(kv, expected)
    with pytest.raises(RuntimeError, match="outside the pages"):
        cpu.write_kv_(kv, key[:1], value[:1], torch.tensor([28]))


@pytest.mark.parametrize("scattered", [False, True], ids=["consecutive-pages", "scattered-pages"])
@pytest.mark.parametrize("pattern", list(POPULARITY))
def test_lora_segments_match_reference(pattern: str, scattered: bool) -> None:
    """Grouped by adapter (segments long enough for MKL) and interleaved (1-2 token GEMV loops)."""
    indices = POPULARITY[pattern](random.Random(pattern))
    run_segments(cpu.lora_segments, sorted(indices), seed=len(pattern), scattered=scattered, layer=1)
    run_segments(cpu.lora_segments, indices, seed=3, scattered=scattered, layer=0)


@pytest.mark.parametrize(
    "indices", [[5] + [11] * (BS - 1), [11] * (BS - 1) + [0], [-1] * 4, [3]], ids=["1+bs-1", "bs-1+1", "base", "one"]
)
def test_lora_segments_skewed_sizes(indices: list[int]) -> None:
    run_segments(cpu.lora_segments, indices, seed=9, scattered=False, layer=0)
    run_segments(cpu.lora_segments, indices, seed=9, scattered=True, layer=1)


@pytest.mark.parametrize("scattered", [False, True], ids=["consecutive-pages", "scattered-pages"])
@pytest.mark.parametrize("hidden, outs", [(37, (29, 5, 70)), (576, (192, 17, 1536))], ids=["odd", "wide"])
def test_lora_segments_tiled_and_mkl_paths_on_any_width(hidden: int, outs: tuple[int, ...], scattered: bool) -> None:
    """Segments of 1-9 and 13 tokens (every remainder of the 4- and 8-token blocks: AVX-512 builds
    tile 8 tokens, AVX2 builds 4), 32 (the largest tiled one) and 33 (MKL), on widths that are not
    multiples of the vector width (scalar tails) and wide ones (several expand work items per module)."""
    indices = [0, 1, 1, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 4, -1, 5] + [6] * 32 + [7] * 33
    indices += [8] * 6 + [9] * 7 + [10] * 8 + [11] * 9 + [1] * 13
    run_segments(cpu.lora_segments, indices, seed=5, scattered=scattered, layer=1, hidden=hidden, outs=outs)


@pytest.mark.parametrize("scattered", [False, True], ids=["consecutive-pages", "scattered-pages"])
@pytest.mark.parametrize("num_segments", [3, 12], ids=["few-segments", "many-segments"])
@pytest.mark.parametrize("threads", [1, 2])
def test_lora_segments_tiled_whole_segments_and_split_phases(threads: int, num_segments: int, scattered: bool) -> None:
    """Short segments run whole per thread when there are at least 4 per thread (12 segments on 2
    threads, any number on 1), else each phase is split across threads (3 on 2): both give the
    reference, with segments of 8 tokens (one full block) and 5 (a partial one), on a wide input
    (dots summed in chunks) and on narrow and wide outputs (B summed in registers, or by rank blocks)."""
    indices = [i for i in range(num_segments) for _ in range(8 if i % 2 else 5)]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        run_segments(cpu.lora_segments, indices, seed=11, scattered=scattered, layer=1, hidden=200, outs=(64, 16, 640))
    finally:
        torch.set_num_threads(previous)


needs_pair_dots = pytest.mark.skipif(
    cpu.load_extension() is None or not cpu.lora_pair_dots(), reason="no pair dots in this build (no avx512_bf16)"
)


@pytest.mark.parametrize(
    "dtype, pairs",
    [(torch.float32, False), (torch.bfloat16, False), pytest.param(torch.bfloat16, True, marks=needs_pair_dots)],
    ids=["float32", "bfloat16", "bfloat16-pair-dots"],
)
def test_the_expand_rank_block_changes_the_speed_only(dtype: torch.dtype, pairs: bool) -> None:
    """The tiled loops' expand streams B's rows in blocks of ``expand_rank_block`` (0: the whole rank;
    the engine times which is faster): for segments of 3-32 tokens (one token block, several, and
    long ones in pieces; whole segments per thread, and few segments split across threads) over
    ranks 1-64 on narrow and wide outputs, every block gives the same bits as the default's, and they
    match the reference; a negative block is refused by name. By pair dots (``expand_pairs``) v is
    rounded to bfloat16 first: they match the reference that rounds it so, to half a bfloat16 step
    of the output as the float expand matches the unrounded one, and differ from the float expand."""
    many = [i % 12 for i, num in enumerate([3, 5, 8, 9, 13, 16, 17, 24, 32, 40, 7, 8]) for _ in range(num)]
    few = [2] * 9 + [5] * 40 + [7] * 5
    blocks = (cpu.EXPAND_RANK_BLOCK, 0, 1, 3, 16)
    compared: list[int] = []

    def every_block(x: torch.Tensor, outputs: tuple[torch.Tensor, ...], storage: torch.Tensor, *args: Any) -> None:
        results = {}
        for block in blocks:
            results[block] = tuple(out.to(dtype, copy=True) for out in outputs)
            cpu.lora_segments(x.to(dtype), results[block], storage.to(dtype), *args, tile_lengths=0,
                              loop_lengths=cpu.EVERY_LOOP_LENGTH, expand_rank_block=block,
                              expand_pairs=pairs)  # fmt: skip
        for block in blocks[1:]:
            for got, want in zip(results[block], results[blocks[0]], strict=True):
                assert torch.equal(got, want), f"expand_rank_block={block}"
            compared.append(block)
        if pairs:  # v is rounded: the results differ from the float expand's
            floats = tuple(out.to(dtype, copy=True) for out in outputs)
            cpu.lora_segments(x.to(dtype), floats, storage.to(dtype), *args, tile_lengths=0,
                              loop_lengths=cpu.EVERY_LOOP_LENGTH)  # fmt: skip
            assert not all(torch.equal(a, b) for a, b in zip(floats, results[blocks[0]], strict=True))
        for out, result in zip(outputs, results[blocks[0]], strict=True):
            out.copy_(result.float())

    atol = 2**-8 if dtype == torch.bfloat16 else 1e-5
    v_dtype = torch.bfloat16 if pairs else torch.float32
    for indices in (many, few):
        run_segments(every_block, indices, seed=13, scattered=True, layer=1, hidden=200, outs=(64, 16, 640),
                     atol=atol, dtype=dtype, v_dtype=v_dtype)  # fmt: skip
    assert compared == list(blocks[1:]) * 2
    x = torch.zeros(4, 8, dtype=dtype)
    storage = torch.zeros(1, 1, 64, dtype=dtype)
    no_segments = (torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, 1, dtype=torch.long))
    meta, scales = torch.zeros(1, 1, 0, 14, dtype=torch.long), torch.zeros(1, 1, 0, 3)
    with pytest.raises(RuntimeError, match="expand_rank_block must be 0 \\(the whole rank\\) or positive, got -1"):
        cpu.lora_segments(x, (), storage, 0, 0, *no_segments, meta, scales, expand_rank_block=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_pair_dot_expand_is_refused_where_it_cannot_run(dtype: torch.dtype) -> None:
    """``expand_pairs`` over a float32 pool, or on a build without avx512_bf16, is refused by name."""
    x = torch.zeros(4, 8, dtype=dtype)
    storage = torch.zeros(1, 1, 64, dtype=dtype)
    no_segments = (torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, 1, dtype=torch.long))
    meta, scales = torch.zeros(1, 1, 0, 14, dtype=torch.long), torch.zeros(1, 1, 0, 3)
    if dtype == torch.bfloat16 and cpu.lora_pair_dots():
        cpu.lora_segments(x, (), storage, 0, 0, *no_segments, meta, scales, expand_pairs=True)
        return
    with pytest.raises(RuntimeError, match="expand_pairs takes a bfloat16 pool on a build with avx512_bf16"):
        cpu.lora_segments(x, (), storage, 0, 0, *no_segments, meta, scales, expand_pairs=True)


LONG_LENGTHS = [33, 40, 64, 65, 100, 129, 200, 257, 300, 513, 600]  # every class above 32 tokens, twice


@pytest.mark.parametrize("scattered", [False, True], ids=["consecutive-pages", "scattered-pages"])
@pytest.mark.parametrize("hidden, outs", [(37, (29, 5, 70)), (576, (192, 17, 1536))], ids=["odd", "wide"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_segments_take_the_loops_or_the_gemm_as_loop_lengths_say(
    dtype: torch.dtype, hidden: int, outs: tuple[int, ...], scattered: bool
) -> None:
    """Segments of 33-600 tokens (every class above 32; lengths that split into equal and unequal
    pieces) run on the tiled loops in pieces where their class's bit of ``loop_lengths`` is set, else
    as GEMMs: each segment's outputs are bit for bit those of the same segment in a call with every
    class on the loops, or none, as its bit says (the two ways round differently), and all match
    the float32 reference."""
    mixed = 0b10101000  # classes 33-64, 129-256 and 513+ on the loops
    class_bounds = cpu.lora_tile_length_bounds()
    indices = [i % 12 for i, num in enumerate(LONG_LENGTHS) for _ in range(num)]
    checked: list[int] = []

    def three_ways(x: torch.Tensor, outputs: tuple[torch.Tensor, ...], storage: torch.Tensor, *args: Any) -> None:
        ways = {}
        for mask in (mixed, cpu.EVERY_LOOP_LENGTH, 0):
            ways[mask] = tuple(out.to(dtype, copy=True) for out in outputs)
            cpu.lora_segments(x.to(dtype), ways[mask], storage.to(dtype), *args, tile_lengths=0, loop_lengths=mask)
        assert not all(torch.equal(a, b) for a, b in zip(ways[-1], ways[0], strict=True)), "the ways agree bitwise"
        for start, end, _, _ in args[2].tolist():
            num = end - start
            loops = (mixed >> sum(num > b for b in class_bounds)) & 1
            expected = ways[cpu.EVERY_LOOP_LENGTH if loops else 0]
            for got, want in zip(ways[mixed], expected, strict=True):
                assert torch.equal(got[start:end], want[start:end]), f"segment of {num} tokens (loops: {bool(loops)})"
            checked.append(num)
        for out, result in zip(outputs, ways[mixed], strict=True):
            out.copy_(result.float())

    # Off the loops, one ATen GEMM pair per segment: MKL's grouped GEMM may sum a segment in another
    # order when the group around it differs, which would hide nothing but break the comparison.
    cpu.lora_grouped_gemm(enable=False)
    try:
        atol = 2**-8 if dtype == torch.bfloat16 else 1e-5
        run_segments(three_ways, indices, seed=7, scattered=scattered, layer=1, hidden=hidden, outs=outs, atol=atol,
                     dtype=dtype)  # fmt: skip
    finally:
        cpu.lora_grouped_gemm(enable=True)
    assert checked == LONG_LENGTHS


def test_lora_segments_without_mkl_grouped_gemm_give_the_same_results() -> None:
    """The per-kernel fallback of a torch without MKL (one ATen GEMM pair per long segment),
    forced here: the MKL path's cases, against the same reference."""
    assert cpu.lora_grouped_gemm(enable=False) is False
    try:
        assert cpu.fallbacks() == () or cpu.fallbacks() == ("lora_grouped_gemm",)
        indices = [0, 1, 1, 2] + [6] * 33 + [7] * 40 + [-1, 5]
        for scattered in (False, True):
            run_segments(cpu.lora_segments, indices, seed=5, scattered=scattered, layer=1, hidden=576,
                         outs=(192, 17, 1536))  # fmt: skip
            run_segments(cpu.lora_segments, indices, seed=6, scattered=scattered, layer=0)
    finally:
        cpu.lora_grouped_gemm(enable=True)


def test_lora_segments_check_page_ids() -> None:
    """A page id outside the pool, in a segment's table or past its consecutive pages, is refused."""
    x = torch.zeros(40, HIDDEN)
    outputs = (torch.zeros(40, 8),)
    storage = torch.zeros(2, 4, 256)  # [layers, 4 pages, 256 elements]
    meta = torch.zeros(2, 1, 1, 14, dtype=torch.long)
    meta[:, :, 0, :6] = torch.tensor([0, 4, 0, 4, 4 * HIDDEN, 8])  # rank 4: A then B^T, 4 * (48 + 8) elements
    scales = torch.ones(2, 1, 1, 3)
    for num in (1, 8, 40):  # the row loops, the tiled loops, the grouped GEMMs
        scattered = torch.tensor([[0, num, 1, 0]])
        with pytest.raises(RuntimeError, match="page id 9 is outside the pool of 4 pages"):
            cpu.lora_segments(x, outputs, storage, 0, 0, scattered, torch.tensor([[9, 0]]), meta, scales)
        consecutive = torch.tensor([[0, num, 0, 3 * 256 + 100]])  # starts late in the last page: runs past it
        with pytest.raises(RuntimeError, match="consecutive pages run past the pool"):
            cpu.lora_segments(x, outputs, storage, 0, 0, consecutive, torch.tensor([[3, 4]]), meta, scales)


def test_lora_segments_refuse_other_dtypes() -> None:
    """float16, or x, pool and outputs of different dtypes, are refused by name."""
    meta = torch.zeros(1, 1, 1, 14, dtype=torch.long)
    rest = (torch.tensor([[0, 2, 0, 0]]), torch.zeros(1, 0, dtype=torch.long), meta, torch.zeros(1, 1, 1, 3))
    for x_dtype, pool_dtype, out_dtype in [
        (torch.float16, torch.float16, torch.float16),
        (torch.bfloat16, torch.float32, torch.float32),
        (torch.float32, torch.bfloat16, torch.bfloat16),
    ]:
        with pytest.raises(RuntimeError, match="float32 or bfloat16: x and storage of one dtype"):
            x = torch.zeros(2, HIDDEN, dtype=x_dtype)
            cpu.lora_segments(x, (torch.zeros(2, 4, dtype=out_dtype),), torch.zeros(1, 1, 8, dtype=pool_dtype), 0, 0,
                              *rest)  # fmt: skip
    with pytest.raises(RuntimeError, match=r"outputs must be contiguous .* of x's dtype"):
        x = torch.zeros(2, HIDDEN, dtype=torch.bfloat16)
        cpu.lora_segments(x, (torch.zeros(2, 4),), torch.zeros(1, 1, 8, dtype=torch.bfloat16), 0, 0, *rest)


def test_lora_segments_check_their_arguments() -> None:
    """Segments past x's rows, overlapping or out of order, a layer or group outside meta, and
    meta rows that are not one per segment: each refused by name (threads would race or read
    outside the tensors)."""
    x, outputs, storage = torch.zeros(4, HIDDEN), (torch.zeros(4, 4),), torch.zeros(1, 1, 8)
    meta, scales, tables = torch.zeros(1, 1, 2, 14, dtype=torch.long), torch.zeros(1, 1, 2, 3), torch.zeros(2, 1)
    tables = tables.long()
    for bounds, message in [
        (
            [[0, 2, 0, 0], [2, 5, 0, 0]],
            r"segment 1: tokens \[2, 5\) must follow the previous segment's and lie within x's 4",
        ),
        ([[0, 2, 0, 0], [1, 3, 0, 0]], r"segment 1: tokens \[1, 3\) must follow"),
        ([[2, 3, 0, 0], [0, 1, 0, 0]], r"segment 1: tokens \[0, 1\) must follow"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            cpu.lora_segments(x, outputs, storage, 0, 0, torch.tensor(bounds), tables, meta, scales)
    ok = torch.tensor([[0, 2, 0, 0], [2, 4, 0, 0]])
    with pytest.raises(RuntimeError, match="layer 1 is outside meta, scales or storage"):
        cpu.lora_segments(x, outputs, storage, 1, 0, ok, tables, meta, scales)
    with pytest.raises(RuntimeError, match="group 1 is outside meta or scales"):
        cpu.lora_segments(x, outputs, storage, 0, 1, ok, tables, meta, scales)
    with pytest.raises(RuntimeError, match="meta and scales need one row per segment"):
        cpu.lora_segments(x, outputs, storage, 0, 0, ok[:1], tables[:1], meta, scales[:, :, :1])


# (cached, new) per chunk: prompts from scratch, prompts over cached prefixes, single tokens and
# lengths at the 16-row query block and 16-position chunk boundaries
PREFILL_CHUNKS = [(0, 1), (0, 15), (0, 16), (0, 17), (5, 1), (16, 16), (31, 40), (0, 33), (48, 3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"), ATTENTION_CASES, ids=ATTENTION_IDS)
def test_prefill_attention_of_a_whole_step_matches_the_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> None:
    from loraserve.kernels.paged_attention import paged_prefill_attention_varlen

    cached = [c for c, _ in PREFILL_CHUNKS]
    new = [n for _, n in PREFILL_CHUNKS]
    kv, tables = make_paged([c + n for c, n in PREFILL_CHUNKS], num_kv_heads, head_dim, block_size, dtype, seed=3)
    starts = torch.tensor([0, *itertools.accumulate(new)])
    gen = torch.Generator().manual_seed(4)
    query = torch.randn(int(starts[-1]), num_heads, head_dim, generator=gen).to(dtype)
    cached_lens = torch.tensor(cached)
    out = cpu.paged_prefill_attention(query, kv, starts, cached_lens, tables, head_dim**-0.5)
    # the reference in float32 (the kernel's scores and sums are float32 whatever the dtype)
    expected = paged_prefill_attention_varlen(query.float(), kv.float(), starts, cached_lens, tables, head_dim**-0.5)
    assert out.dtype == dtype and out.shape == query.shape
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)


def test_prefill_attention_checks_page_ids_and_offsets() -> None:
    kv, tables = make_paged([20, 7], 2, 16, 8, torch.float32, seed=0)
    query = torch.randn(27, 4, 16)
    starts, cached = torch.tensor([0, 20, 27]), torch.tensor([0, 0])
    bad = tables.clone()
    bad[1, 0] = kv.shape[0]  # one past the pool
    with pytest.raises(RuntimeError, match=r"page \d+ is outside the pool"):
        cpu.paged_prefill_attention(query, kv, starts, cached, bad, 0.25)
    with pytest.raises(RuntimeError, match="needs 4 blocks, its table has 3"):
        cpu.paged_prefill_attention(query, kv, starts, torch.tensor([0, 20]), tables, 0.25)
    with pytest.raises(RuntimeError, match="from 0 to the number of query rows"):
        cpu.paged_prefill_attention(query, kv, torch.tensor([0, 20, 26]), cached, tables, 0.25)


def cpuinfo_text(model: int) -> str:
    first = "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: {}\nmodel name\t: Some CPU\n"
    first += "stepping\t: 2\ncache size\t: 307200 KB\nflags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512vl amx_tile\n\n"
    return first.format(model) + "processor\t: 1\nmodel\t\t: 1\nmodel name\t: Some CPU\nflags\t\t: fpu\n"


def test_cpu_features_are_read_from_cpuinfo() -> None:
    model, identity, flags, count = cpu_features._parse_cpuinfo(cpuinfo_text(207))
    assert (model, count) == ("Some CPU", 2) and {"avx2", "avx512f", "amx_tile"} <= flags
    assert identity == "GenuineIntel family 6 model 207 stepping 2 cache 307200 KB"  # the first processor's
    features = tuple(f for f in cpu_features.ISA_FEATURES if f in flags)
    info = cpu_features.CpuInfo(model, identity, "x86_64", features, count)
    assert info.vector_isa == "avx512" and info.has("fma") and not info.has("avx512bw")
    assert dataclasses.replace(info, features=("avx2", "fma")).vector_isa == "avx2"
    # Virtual machines name different CPUs alike with the same flags: the model tells them apart.
    _, other, _, _ = cpu_features._parse_cpuinfo(cpuinfo_text(167))
    assert cpu_features.signature(info) != cpu_features.signature(dataclasses.replace(info, identity=other))
    here = cpu_features.cpu_info()
    assert here.model_name in cpu_features.summary() and here.vector_isa in cpu_features.summary()
    assert here.identity in cpu_features.summary()
    assert len(cpu_features.signature()) == 12 and cpu_features.signature() == cpu_features.signature(here)
