"""The torch references' step path (the ``torch`` backend): RoPE in place on one q/k/v output, the
KV write and the decode attention over a step's precomputed index, each against the per-tensor
reference it replaces."""

from __future__ import annotations

import pytest
import torch
from loraserve.kernels.paged_attention import (
    StepIndex,
    paged_decode_attention,
    paged_decode_attention_indexed,
    write_kv,
    write_kv_indexed,
)

from loraserve.models.rope import RotaryEmbedding, apply_rope


def rope_config(num_heads: int, num_kv_heads: int, head_dim: int) -> object:
    fields = {"head_dim": head_dim, "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads}
    return type("Config", (), {**fields, "hidden_size": num_heads * head_dim, "rope_theta": 1e4})()


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 16), (8, 1, 32)])
def test_rope_on_the_qkv_output_equals_apply_rope_bit_for_bit(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(11)
    positions = torch.randint(0, 5000, (19,), generator=gen)
    tables = RotaryEmbedding(rope_config(num_heads, num_kv_heads, head_dim))(
        positions, torch.float32, qkv_heads=(num_heads, num_kv_heads)
    )
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(19, width, generator=gen) * 4  # one GEMM's output: q | k | v
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    q = qkv[:, :q_end].reshape(19, num_heads, head_dim)
    k = qkv[:, q_end:k_end].reshape(19, num_kv_heads, head_dim)
    expected_q, expected_k = apply_rope(q, tables.cos, tables.sin), apply_rope(k, tables.cos, tables.sin)
    expected_v = qkv[:, k_end:].clone()
    tables.apply_to_qkv_(qkv.view(19, -1, 1, head_dim))
    assert torch.equal(qkv[:, :q_end].reshape(19, num_heads, head_dim), expected_q)
    assert torch.equal(qkv[:, q_end:k_end].reshape(19, num_kv_heads, head_dim), expected_k)
    assert torch.equal(qkv[:, k_end:], expected_v)  # v heads: times 1 plus 0


def test_tables_without_qkv_heads_refuse_the_joint_rotation() -> None:
    tables = RotaryEmbedding(rope_config(2, 1, 8))(torch.arange(3), torch.float32)
    assert tables.qkv_cos is None
    with pytest.raises(AssertionError, match="without qkv_heads"):
        tables.apply_to_qkv_(torch.zeros(3, 4, 1, 8))


def paged_case(block_size: int, num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pool of random pages, four sequences' block tables (scattered pages, zero padded) and lengths."""
    gen = torch.Generator().manual_seed(block_size)
    kv = torch.randn(40, 2, block_size, num_kv_heads, head_dim, generator=gen)
    lengths = torch.tensor([1, block_size, 2 * block_size + 3, 5 * block_size - 1])
    max_blocks = int((lengths.max() + block_size - 1) // block_size)
    pages = torch.randperm(39, generator=gen)[: 4 * max_blocks].view(4, max_blocks) + 1
    for s, length in enumerate(lengths.tolist()):
        pages[s, -(-length // block_size) :] = 0  # padding entries
    return kv, pages, lengths


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (6, 1)])
def test_indexed_decode_attention_equals_the_reference(block_size: int, num_heads: int, num_kv_heads: int) -> None:
    kv, tables, lengths = paged_case(block_size, num_kv_heads, 16)
    query = torch.randn(4, num_heads, 16, generator=torch.Generator().manual_seed(3))
    index = StepIndex.build(torch.zeros(4, dtype=torch.long), block_size, tables, lengths)
    expected = paged_decode_attention(query, kv, tables, lengths, 0.25)  # [4, num_heads, 16]
    out = paged_decode_attention_indexed(query.unsqueeze(2), kv, index, 0.25)  # [4, num_heads, 1, 16]
    torch.testing.assert_close(out.squeeze(2), expected, rtol=1e-6, atol=1e-6)


def test_indexed_kv_write_equals_the_reference_and_touches_only_its_slots() -> None:
    block_size, num_kv_heads, head_dim = 4, 2, 8
    kv = torch.randn(10, 2, block_size, num_kv_heads, head_dim, generator=torch.Generator().manual_seed(1))
    expected = kv.clone()
    slots = torch.tensor([37, 3, 12, 13, 22])  # pages 9, 0, 3, 3, 5
    new_kv = torch.randn(5, 2, num_kv_heads, head_dim, generator=torch.Generator().manual_seed(2))
    write_kv(expected, new_kv[:, 0], new_kv[:, 1], slots)
    write_kv_indexed(kv, new_kv, StepIndex.build(slots, block_size))
    assert torch.equal(kv, expected)


def test_an_index_without_decode_tables_has_no_gather() -> None:
    index = StepIndex.build(torch.tensor([0, 5]), 4)
    assert index.decode_rows is None and index.decode_mask is None
    with pytest.raises(AssertionError, match="no decode tables"):
        paged_decode_attention_indexed(torch.zeros(2, 1, 1, 8), torch.zeros(3, 2, 4, 1, 8), index, 1.0)
