"""The fused elementwise Triton kernels (``kernels/triton_fused.py``, ``kernels/triton_rope_kv.py``)
against the torch references.

Compiled on a CUDA machine, interpreted elsewhere (``conftest.py``), on tiny shapes: residual add +
RMSNorm (one tile and two passes, widths that are not powers of two), SiLU-and-mul on the two
column halves of one projection, and RoPE + paged KV write for GQA/MHA/MQA over shuffled slots with
padded rows (slot -1), with q/k/v as head views of one qkv output and kv as one layer of a pool
storage, as the engine passes them. Float32 is compared tightly; float16 loosely, against a float32
reference computed from the same float16 inputs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from loraserve.kernels.paged_attention import write_kv

from loraserve.models.llama import RMSNorm
from loraserve.models.rope import apply_rope

triton_fused = pytest.importorskip("loraserve.kernels.triton_fused")
triton_rope_kv = pytest.importorskip("loraserve.kernels.triton_rope_kv")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS = 1e-6


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _torch_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    residual: torch.Tensor | None,  # [num_tokens, hidden], updated in place
) -> torch.Tensor:
    """The model's torch RMSNorm (the reference)."""
    norm = RMSNorm(weight.shape[0], EPS)
    norm.weight.data = weight.clone()
    with torch.no_grad():
        return norm(x, residual)


def _rms_norm_case(
    num_tokens: int, hidden: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x as a column slice of a wider tensor (row stride != hidden), a residual and a weight."""
    gen = _generator(seed)
    wide = (torch.randn(num_tokens, hidden + 8, generator=gen) * 2).to(dtype)  # [num_tokens, hidden + 8]
    x = wide[:, 3 : 3 + hidden]  # [num_tokens, hidden], row stride hidden + 8
    residual = torch.randn(num_tokens, hidden, generator=gen).to(dtype)  # [num_tokens, hidden]
    weight = (1 + 0.5 * torch.randn(hidden, generator=gen)).to(dtype)  # [hidden]
    return x, residual, weight


@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add-norm"])
@pytest.mark.parametrize("hidden", [64, 96])
def test_rms_norm_matches_reference(hidden: int, with_residual: bool) -> None:
    x, residual, weight = _rms_norm_case(5, hidden, torch.float32, seed=hidden)
    expected_residual = residual.clone() if with_residual else None
    expected = _torch_rms_norm(x, weight, expected_residual)
    x_dev, weight_dev = x.to(DEVICE), weight.to(DEVICE)
    residual_dev = residual.to(DEVICE) if with_residual else None
    out = triton_fused.fused_add_rms_norm(x_dev, weight_dev, EPS, residual_dev)
    assert out.dtype == torch.float32 and out.is_contiguous()
    torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(x_dev.cpu(), x, rtol=0, atol=0)  # the input is left alone
    if with_residual:
        assert residual_dev is not None and expected_residual is not None
        torch.testing.assert_close(residual_dev.cpu(), expected_residual, rtol=0, atol=0)


def test_rms_norm_two_passes_when_wider_than_a_tile(monkeypatch: pytest.MonkeyPatch) -> None:
    """96 columns in tiles of 32: sum of squares, then scale, with and without a residual."""
    monkeypatch.setattr(triton_fused, "RMS_NORM_MAX_BLOCK", 32)
    x, residual, weight = _rms_norm_case(3, 96, torch.float32, seed=4)
    expected_plain = _torch_rms_norm(x, weight, None)
    expected_residual = residual.clone()
    expected = _torch_rms_norm(x, weight, expected_residual)
    plain = triton_fused.fused_add_rms_norm(x.to(DEVICE), weight.to(DEVICE), EPS, None)
    torch.testing.assert_close(plain.cpu(), expected_plain, rtol=0, atol=1e-5)
    residual_dev = residual.to(DEVICE)
    out = triton_fused.fused_add_rms_norm(x.to(DEVICE), weight.to(DEVICE), EPS, residual_dev)
    torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(residual_dev.cpu(), expected_residual, rtol=0, atol=0)


@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add-norm"])
def test_rms_norm_float16_close_to_float32_reference(with_residual: bool) -> None:
    x, residual, weight = _rms_norm_case(4, 96, torch.float16, seed=11)
    summed = (residual + x) if with_residual else x  # the residual sum, rounded to float16 as stored
    expected = _torch_rms_norm(summed.float(), weight.float(), None)
    residual_dev = residual.to(DEVICE) if with_residual else None
    out = triton_fused.fused_add_rms_norm(x.to(DEVICE), weight.to(DEVICE), EPS, residual_dev)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float().cpu(), expected, rtol=0, atol=2e-2)
    if residual_dev is not None:
        torch.testing.assert_close(residual_dev.cpu(), summed, rtol=0, atol=1e-3)


def _gate_up(num_tokens: int, intermediate: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """One ``[num_tokens, 2 * intermediate]`` gate_up projection output."""
    return (torch.randn(num_tokens, 2 * intermediate, generator=_generator(seed)) * 3).to(dtype)


@pytest.mark.parametrize("intermediate", [48, 128])
def test_silu_and_mul_matches_reference(intermediate: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """In place on the gate half of one projection; 48 columns also run as two tiles of 32."""
    fused = _gate_up(3, intermediate, torch.float32, seed=intermediate)
    gate, up = fused.split(intermediate, dim=1)
    expected = F.silu(gate.clone()) * up  # [3, intermediate]
    if intermediate == 48:
        monkeypatch.setattr(triton_fused, "SILU_BLOCK", 32)
    fused_dev = fused.to(DEVICE)
    gate_dev, up_dev = fused_dev.split(intermediate, dim=1)
    triton_fused.silu_and_mul(gate_dev, up_dev)
    torch.testing.assert_close(gate_dev.cpu(), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(up_dev.cpu(), up, rtol=0, atol=0)  # up is left alone


def test_silu_and_mul_float16_close_to_float32_reference() -> None:
    fused = _gate_up(4, 48, torch.float16, seed=5)
    gate, up = fused.split(48, dim=1)
    expected = F.silu(gate.float()) * up.float()
    fused_dev = fused.to(DEVICE)
    gate_dev, up_dev = fused_dev.split(48, dim=1)
    triton_fused.silu_and_mul(gate_dev, up_dev)
    assert gate_dev.dtype == torch.float16
    torch.testing.assert_close(gate_dev.float().cpu(), expected, rtol=1e-2, atol=1e-2)


NUM_LAYERS, NUM_PAGES, NUM_TOKENS = 2, 5, 7
PADDED_ROWS = (2, 5)  # rows with slot -1


def _rope_tables(positions: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's cos/sin ``[num_tokens, head_dim]``: emb = cat(freqs, freqs)."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))  # [head_dim // 2]
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [num_tokens, head_dim // 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [num_tokens, head_dim]
    return emb.cos(), emb.sin()


def _rope_case(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv ``[T, (H + 2 Hkv) D]``, cos/sin, a pool storage ``[L, P, 2 B Hkv D]`` and shuffled slots."""
    gen = _generator(seed)
    qkv = torch.randn(NUM_TOKENS, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 500, (NUM_TOKENS,), generator=gen)  # [T]
    cos, sin = _rope_tables(positions, head_dim)
    page_elems = 2 * block_size * num_kv_heads * head_dim
    storage = torch.randn(NUM_LAYERS, NUM_PAGES, page_elems, generator=gen).to(dtype)  # [L, P, E]
    # Never the pool's last slot: a stray write of slot -1 through Python indexing would land there.
    slots = torch.randperm(NUM_PAGES * block_size - 1, generator=gen)[:NUM_TOKENS]  # [T] int64
    slots[list(PADDED_ROWS)] = -1
    return qkv, cos.to(dtype), sin.to(dtype), storage, slots


def _split_qkv(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Head views of one qkv output, as the model makes them."""
    num_tokens = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    return (
        q.view(num_tokens, num_heads, head_dim),  # [T, H, D]
        k.view(num_tokens, num_kv_heads, head_dim),  # [T, Hkv, D]
        v.view(num_tokens, num_kv_heads, head_dim),  # [T, Hkv, D]
    )


def _layer_kv(storage: torch.Tensor, layer: int, block_size: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    return storage[layer].view(NUM_PAGES, 2, block_size, num_kv_heads, head_dim)  # [P, 2, B, Hkv, D]


def _run_rope_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    storage: torch.Tensor,
    slots: torch.Tensor,
    shape: tuple[int, int, int, int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on ``DEVICE`` copies, on layer 1 of the storage; returns qkv and storage, on the CPU."""
    num_heads, num_kv_heads, head_dim, block_size = shape
    qkv_dev, storage_dev = qkv.to(DEVICE), storage.to(DEVICE)
    q, k, v = _split_qkv(qkv_dev, num_heads, num_kv_heads, head_dim)
    kv = _layer_kv(storage_dev, 1, block_size, num_kv_heads, head_dim)
    triton_rope_kv.rope_write_kv(q, k, v, cos.to(DEVICE), sin.to(DEVICE), kv, slots.to(DEVICE))
    return qkv_dev.cpu(), storage_dev.cpu()


ROPE_CASES = [
    (4, 2, 16, 8),
    (4, 2, 32, 16),
    (4, 1, 16, 16),
    (4, 1, 32, 8),
    (4, 4, 16, 8),
    (4, 4, 32, 16),
    (6, 3, 24, 8),  # heads and half head_dim not powers of two: masked tiles
]


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    ROPE_CASES,
    ids=[f"h{h}-kv{g}-d{d}-b{b}" for h, g, d, b in ROPE_CASES],
)
def test_rope_write_kv_matches_reference(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
    shape = (num_heads, num_kv_heads, head_dim, block_size)
    qkv, cos, sin, storage, slots = _rope_case(*shape, torch.float32, seed=head_dim + block_size + num_kv_heads)
    q, k, v = _split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    expected_q, expected_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    expected_storage = storage.clone()
    valid = slots >= 0
    write_kv(
        _layer_kv(expected_storage, 1, block_size, num_kv_heads, head_dim), expected_k[valid], v[valid], slots[valid]
    )

    qkv_out, storage_out = _run_rope_write_kv(qkv, cos, sin, storage, slots, shape)

    q_out, k_out, v_out = _split_qkv(qkv_out, num_heads, num_kv_heads, head_dim)
    torch.testing.assert_close(q_out, expected_q, rtol=0, atol=1e-5)  # padded rows rotated too
    torch.testing.assert_close(k_out, expected_k, rtol=0, atol=1e-5)
    torch.testing.assert_close(v_out, v, rtol=0, atol=0)
    torch.testing.assert_close(storage_out, expected_storage, rtol=0, atol=1e-5)
    # Every slot no valid row maps to (the other layer, the padded rows' nowhere) is bit-identical.
    written = torch.zeros(NUM_LAYERS, NUM_PAGES, block_size, dtype=torch.bool)
    written[1, slots[valid] // block_size, slots[valid] % block_size] = True
    by_slot = (NUM_LAYERS, NUM_PAGES, 2, block_size, num_kv_heads * head_dim)
    untouched = ~written[:, :, None, :].expand(NUM_LAYERS, NUM_PAGES, 2, block_size)
    assert torch.equal(storage_out.view(by_slot)[untouched], storage.view(by_slot)[untouched])


def test_rope_write_kv_float16_close_to_float32_reference() -> None:
    shape = num_heads, num_kv_heads, head_dim, block_size = (4, 2, 32, 8)
    qkv, cos, sin, storage, slots = _rope_case(*shape, torch.float16, seed=3)
    q, k, _ = _split_qkv(qkv, num_heads, num_kv_heads, head_dim)
    expected_q = apply_rope(q.float(), cos.float(), sin.float())
    expected_k = apply_rope(k.float(), cos.float(), sin.float())

    qkv_out, storage_out = _run_rope_write_kv(qkv, cos, sin, storage, slots, shape)

    q_out, k_out, v_out = _split_qkv(qkv_out, num_heads, num_kv_heads, head_dim)
    assert q_out.dtype == torch.float16
    torch.testing.assert_close(q_out.float(), expected_q, rtol=0, atol=1e-2)
    torch.testing.assert_close(k_out.float(), expected_k, rtol=0, atol=1e-2)
    # The cache holds exactly the rotated keys (as rounded in key) and the values.
    valid = slots >= 0
    kv_out = _layer_kv(storage_out, 1, block_size, num_kv_heads, head_dim)
    pages, offsets = slots[valid] // block_size, slots[valid] % block_size
    assert torch.equal(kv_out[pages, 0, offsets], k_out[valid])
    assert torch.equal(kv_out[pages, 1, offsets], v_out[valid])
    assert torch.equal(storage_out[0], storage[0])


def test_empty_batches_are_no_ops() -> None:
    empty = torch.empty(0, 64, device=DEVICE)
    weight = torch.ones(64, device=DEVICE)
    assert triton_fused.fused_add_rms_norm(empty, weight, EPS, empty.clone()).shape == (0, 64)
    gate, up = torch.empty(0, 96, device=DEVICE).split(48, dim=1)
    triton_fused.silu_and_mul(gate, up)
    heads = torch.empty(0, 2, 16, device=DEVICE)
    kv = torch.zeros(2, 2, 8, 2, 16, device=DEVICE)
    tables = torch.empty(0, 16, device=DEVICE)
    triton_rope_kv.rope_write_kv(
        heads, heads, heads, tables, tables, kv, torch.empty(0, dtype=torch.int64, device=DEVICE)
    )
    assert not kv.any()
