"""The CPU GEMM kernels (panels, oneDNN, torch) and the layers on them, against ``F.linear``
(the bfloat16 ``dot`` and ``amx`` kernels: tests/test_linear_bf16.py).

Row counts cover a partial register tile (1, 5, 7 rows), whole tiles and a whole row block (6,
64, 144), and several row blocks with a ragged end (301); output widths that are not multiples of the
16-column panel check the padded last panel; groups check that each output gets exactly its
own panels. The reference is ``F.linear`` in float64, and the kernel is held to the error
that ``F.linear`` in float32 makes against it (times 2, plus a little absolute slack): a
different order of float additions, nothing more.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from loraserve.kernels import cpu, cpu_features, cpu_linear
from torch import nn

from loraserve.models.gemm_choice import GemmPolicy, pack_linears
from loraserve.models.packed_linear import (
    ROW_BUCKETS,
    GemmKernel,
    PackedLinear,
    PackedLinearGroup,
    bucket_index,
    can_pack,
    kernels_for,
)

pytestmark = pytest.mark.skipif(cpu.load_extension() is None, reason="the C++ CPU kernels could not be built")
KERNELS = [k for k in GemmKernel if k not in (GemmKernel.DOT, GemmKernel.AMX)]  # the float32 ones (dot, amx: bfloat16)
FORCED = GemmPolicy("panels")

ROWS = [0, 1, 5, 6, 7, 64, 144, 301]


def assert_float_close(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """``out`` is as close to the float64 result as float32 ``F.linear`` is (x2, + 1e-5)."""
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert out.dtype == torch.float32 and out.shape == exact.shape
    if out.numel():
        float_error = (F.linear(x, weight, bias).double() - exact).abs().max()
        assert (out.double() - exact).abs().max() <= 2 * float_error + 1e-5


VARIANTS = ["avx512", "vec8"]  # the panel tilings (kernels/csrc/linear_panels.cpp); this CPU's build has some


def _variant(name: str) -> str:
    if name not in cpu.linear_panels_variants():
        pytest.skip(f"the {name} panel tiling is not in this CPU's build (it has {cpu.linear_panels_variants()})")
    return name


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [*ROWS, 12, 13, 25])
def test_linear_panels_matches_f_linear(rows: int, bias: bool, variant: str) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(200, 96, generator=gen)  # 200 = 12 panels + 8 columns
    b = torch.randn(200, generator=gen) if bias else None
    panels, panel_bias = cpu.pack_panels([weight], [b])
    assert panels.shape == (13, 96, 16) and (panel_bias is None) == (not bias)
    x = torch.randn(rows, 96, generator=gen)
    (out,) = cpu.linear_panels(x, panels, panel_bias, [200], _variant(variant))
    assert out.is_contiguous()
    assert_float_close(out, x, weight, b)


def test_linear_panels_checks_its_arguments() -> None:
    panels, _ = cpu.pack_panels([torch.randn(32, 8)])
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="need 3 panels, got 2"):
        cpu.linear_panels(x, panels, None, [40])
    with pytest.raises(RuntimeError, match="matching x"):
        cpu.linear_panels(torch.randn(3, 9), panels, None, [32])
    with pytest.raises(RuntimeError, match="float32 only"):
        cpu.linear_panels(x.double(), panels, None, [32])
    with pytest.raises(RuntimeError, match="variant 'neon' is not compiled"):
        cpu.linear_panels(x, panels, None, [32], "neon")
    assert cpu.linear_panels_variants()[-1] == "vec8"  # every build has the 8-lane tiling
    if cpu_features.cpu_info().has("avx512f"):
        assert cpu.linear_panels_variants() == ["avx512", "vec8"]


def test_work_lists_hand_a_stalled_threads_units_to_the_other() -> None:
    """The panel GEMM's scheduler (kernels/csrc/work_lists.h): a thread that stalls in its first
    unit keeps only that one; the other runs its own list and then the rest of the stalled one's,
    from the back; every unit runs once."""
    module = cpu.load_extension()
    for stalled in (0, 1):
        *ran_by, runs = module.trace_work_lists([6, 5], 2, stalled, 300)
        own = ran_by[:6] if stalled == 0 else ran_by[6:]  # the stalled thread's list
        other = ran_by[6:] if stalled == 0 else ran_by[:6]
        assert runs == 11 and other == [1 - stalled] * len(other)
        # it ran at most its first unit (the other thread may have started on its list first)
        assert own[1:] == [1 - stalled] * (len(own) - 1) and own[0] in (0, 1)
    *ran_by, runs = module.trace_work_lists([4, 0, 3, 1], 3, -1, 0)  # more lists than threads: taken from the back
    assert runs == 8 and all(t in (0, 1, 2) for t in ran_by)


@pytest.mark.parametrize("variant", VARIANTS)
def test_linear_panels_same_bits_on_any_number_of_threads(variant: str) -> None:
    """Each output tile is computed by one unit whoever runs it (more threads than cores: units
    change hands), so the result does not depend on the threads."""
    gen = torch.Generator().manual_seed(7)
    weights = [torch.randn(n, 64, generator=gen) for n in (200, 48, 8)]
    panels, bias = cpu.pack_panels(weights, [torch.randn(n, generator=gen) for n in (200, 48, 8)])
    x = torch.randn(301, 64, generator=gen)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3, 5):
            torch.set_num_threads(n)
            results.append(cpu.linear_panels(x, panels, bias, [200, 48, 8], _variant(variant)))
    finally:
        torch.set_num_threads(threads)
    for outs in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], outs, strict=True))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows", [1, 12, 30, 130])
def test_linear_panels_pairs_panels_of_different_outputs(rows: int, variant: str) -> None:
    """The AVX-512 tiling takes two panels at a time: pairs that straddle two outputs, odd ends."""
    gen = torch.Generator().manual_seed(rows)
    weights = [torch.randn(n, 40, generator=gen) for n in (40, 8, 16, 33, 16)]  # 3, 1, 1, 3, 1 panels
    biases = [torch.randn(n, generator=gen) for n in (40, 8, 16, 33, 16)]
    panels, bias = cpu.pack_panels(weights, biases)
    x = torch.randn(rows, 40, generator=gen)
    outs = cpu.linear_panels(x, panels, bias, [40, 8, 16, 33, 16], _variant(variant))
    for out, weight, b in zip(outs, weights, biases, strict=True):
        assert out.is_contiguous()
        assert_float_close(out, x, weight, b)


def test_packed_linear_keeps_nn_linear_semantics() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(48, 40)
    for kernel in KERNELS:
        packed = PackedLinear(linear, (kernel,))
        x = torch.randn(9, 48)
        assert_float_close(packed(x), x, linear.weight, linear.bias)
    batched = torch.randn(2, 3, 48)  # not 2-D: plain F.linear, bit for bit
    assert torch.equal(packed(batched), F.linear(batched, linear.weight, linear.bias))


def test_pack_linears_replaces_every_linear_and_keeps_tied_weights_shared() -> None:
    embed = nn.Embedding(50, 16)
    model = nn.ModuleDict({"embed": embed, "proj": nn.Linear(16, 16), "head": nn.Linear(16, 50, bias=False)})
    model["head"].weight = embed.weight
    state_keys = set(model.state_dict())
    assert pack_linears(model, FORCED).num_layers == 2
    assert isinstance(model["proj"], PackedLinear) and isinstance(model["head"], PackedLinear)
    assert model["head"].weight is embed.weight  # still tied
    assert set(model.state_dict()) == state_keys  # the panels are not state
    assert pack_linears(model, FORCED).num_layers == 0  # idempotent: nothing left to pack
    assert not can_pack(torch.zeros(4, 4, dtype=torch.float16))  # no packed kernel takes float16
    onednn_bf16 = (GemmKernel.ONEDNN,) if cpu_features.cpu_info().onednn_bfloat16 else ()  # (needs AVX-512/NE)
    dot = (GemmKernel.DOT,) if cpu_linear.linear_dot_available() else ()  # (needs avx512_bf16)
    amx = (GemmKernel.AMX,) if cpu_linear.linear_amx_available() else ()  # (needs amx_bf16 and the OS's grant)
    pairs = (GemmKernel.PANELS,) if cpu_linear.linear_pair_panels_available() else ()  # (bfloat16 panels: avx512_bf16)
    assert kernels_for(torch.bfloat16) == (*pairs, *onednn_bf16, GemmKernel.TORCH, *dot, *amx)


class _SharedInput(nn.Module):
    """Three projections of one input (one with a bias) declared as a group, and one that is not."""

    fused_groups: ClassVar[dict[str, tuple[str, ...]]] = {"abc_packed": ("a", "b", "c")}

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(24, 40, bias=False), nn.Linear(24, 8, bias=True)
        self.c = nn.Linear(24, 16, bias=False)
        self.out = nn.Linear(40, 24)
        self.abc_packed: PackedLinearGroup | None = None


@pytest.mark.parametrize("kernel", KERNELS, ids=[k.value for k in KERNELS])
@pytest.mark.parametrize("rows", ROWS)
def test_packed_linear_group_matches_its_layers(rows: int, kernel: GemmKernel) -> None:
    torch.manual_seed(rows)
    module = _SharedInput()
    group = PackedLinearGroup([module.a, module.b, module.c], (kernel,))
    if kernel is GemmKernel.PANELS:
        assert group.panels is not None and group.panels.shape == (3 + 1 + 1, 24, 16)  # 40 -> 3, 8 -> 1, 16 -> 1
    assert (group.packed_bytes() == 0) == (kernel is GemmKernel.TORCH)  # torch runs on the weights as they are
    x = torch.randn(rows, 24)
    outs = group(x)
    assert [o.shape for o in outs] == [(rows, 40), (rows, 8), (rows, 16)]
    assert all(o.is_contiguous() for o in outs)  # the LoRA kernels add into them in place
    for out, linear in zip(outs, (module.a, module.b, module.c), strict=True):
        assert_float_close(out, x, linear.weight, linear.bias)


def test_a_group_runs_each_row_bucket_on_its_kernel_and_packs_only_those(monkeypatch: pytest.MonkeyPatch) -> None:
    module = _SharedInput()
    kernels = (GemmKernel.PANELS, GemmKernel.TORCH, GemmKernel.TORCH, GemmKernel.PANELS)
    group = PackedLinearGroup([module.a, module.b, module.c], kernels)
    assert group.panels is not None and group.onednn_weights == []  # no copy for a kernel it never runs
    ran: list[GemmKernel] = []
    run = group.run
    monkeypatch.setattr(group, "run", lambda kernel, x: ran.append(kernel) or run(kernel, x))
    for rows in (1, 3, 5, 16, 30, 200, 5000):  # buckets 1, 4, 4, 16, 16 (log-nearest), 64 (the last), 64
        group(torch.randn(rows, 24))
    assert ran == [kernels[i] for i in (0, 1, 1, 2, 2, 3, 3)]
    assert [bucket_index(r) for r in (1, 2, 3, 7, 9, 100, 180, 1448, 1449, 4096)] == [0, 0, 1, 1, 2, 3, 4, 5, 6, 6]
    assert ROW_BUCKETS[bucket_index(64)] == 64  # (the edges are log midpoints: 1,448 ~ sqrt(1,024 * 2,048))
    with pytest.raises(ValueError, match=r"cannot run torch\.float16"):
        PackedLinearGroup([nn.Linear(8, 8).half()], (GemmKernel.PANELS,))


def test_pack_linears_builds_declared_groups_and_packs_the_rest() -> None:
    module = _SharedInput()
    state_keys = set(module.state_dict())
    plan = pack_linears(module, FORCED)
    assert plan.num_layers == 4 and plan.source == "forced"  # a, b, c in the group, out alone
    assert plan.choices == {
        "float32 24->40+8+16 +bias": (GemmKernel.PANELS,),
        "float32 40->24 +bias": (GemmKernel.PANELS,),
    }
    assert isinstance(module.abc_packed, PackedLinearGroup)
    assert all(type(getattr(module, name)) is nn.Linear for name in "abc")  # members stay as they are
    assert isinstance(module.out, PackedLinear)
    assert set(module.state_dict()) == state_keys  # neither the group nor the panels are state
    assert pack_linears(module, FORCED).num_layers == 0
    with pytest.raises(ValueError, match="share in_features"):
        PackedLinearGroup([module.a, nn.Linear(8, 8)], (GemmKernel.TORCH,))
