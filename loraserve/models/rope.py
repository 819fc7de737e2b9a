"""Rotary position embedding (RoPE) with Hugging Face's inverse-frequency rules, its reference, and
the per-step tables the torch path applies in place.

For a token at position ``p`` and a head vector ``x = [x1 | x2]`` (two halves of ``head_dim / 2``):

    rope(x) = x * cos(p * f) + rotate_half(x) * sin(p * f),   rotate_half(x) = [-x2 | x1]

with ``f`` the inverse frequencies repeated over both halves (times the rope type's attention
scaling). ``apply_rope`` is the reference; ``RopeTables`` holds one step's tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

DEFAULT_MAX_POSITIONS = 8192  # a config without max_position_embeddings


def head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class RotaryEmbedding(nn.Module):
    """RoPE with Hugging Face's inverse-frequency rules (default, linear, llama3, yarn, ...).

    The tables of every position below ``max_positions`` (default: the config's
    ``max_position_embeddings``) are computed once, at construction, exactly as a step would
    compute them; a step gathers its positions' rows (three gathers instead of a dozen ops).
    Memory: three ``[max_positions, head_dim]`` tables in the model's dtype.
    """

    def __init__(self, config: Any, max_positions: int | None = None) -> None:
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type in ("dynamic", "longrope"):
            raise ValueError(f"rope_type {rope_type!r} depends on the sequence length and is not supported")
        if rope_type == "default":
            base = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            dim = head_dim(config)
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            self.attention_scaling = 1.0
        else:
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        self.max_positions = max_positions or int(getattr(config, "max_position_embeddings", DEFAULT_MAX_POSITIONS))
        if self.max_positions <= 0:
            raise ValueError(f"max_positions must be positive, got {self.max_positions}")
        positions = torch.arange(self.max_positions)  # [max_positions]
        freqs = positions.float()[:, None] * inv_freq.float()[None, :]  # [max_positions, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        cos = emb.cos() * self.attention_scaling  # [max_positions, head_dim] float32
        sin = emb.sin() * self.attention_scaling
        half = sin.shape[-1] // 2
        sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # rotate_half's sign folded in
        # Buffers, so they follow the model's device and dtype (a float32 value rounded once, as
        # a per-step ``.to(dtype)`` would round it).
        self.cos_table: torch.Tensor
        self.sin_table: torch.Tensor
        self.sin_signed_table: torch.Tensor
        self.register_buffer("cos_table", cos, persistent=False)
        self.register_buffer("sin_table", sin, persistent=False)
        self.register_buffer("sin_signed_table", sin_signed, persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype, qkv_heads: tuple[int, int] | None = None
    ) -> RopeTables:
        """The step's tables (``positions`` below ``max_positions``); with ``qkv_heads``
        ``(num_heads, num_kv_heads)`` also those of ``RopeTables.apply_to_qkv_`` (one rotation over
        q, k and v heads side by side)."""
        cos = self.cos_table.index_select(0, positions).to(dtype)  # [num_tokens, head_dim]
        sin = self.sin_table.index_select(0, positions).to(dtype)  # [num_tokens, head_dim]
        sin_signed = self.sin_signed_table.index_select(0, positions).to(dtype)  # [num_tokens, head_dim]
        qkv_cos = qkv_sin = None
        if qkv_heads is not None:
            rotated, kept = qkv_heads[0] + qkv_heads[1], qkv_heads[1]  # q and k heads rotate; v heads keep
            shape = (cos.shape[0], kept, 1, cos.shape[1])
            # [num_tokens, heads + 2 * kv_heads, 1, head_dim]: v heads times 1 plus 0
            qkv_cos = torch.cat((cos[:, None, None, :].expand(-1, rotated, 1, -1), cos.new_ones(shape)), 1)
            qkv_sin = torch.cat((sin_signed[:, None, None, :].expand(-1, rotated, 1, -1), sin.new_zeros(shape)), 1)
        return RopeTables(cos, sin, cos[:, None, :], sin_signed[:, None, :], qkv_cos, qkv_sin)


@dataclass(frozen=True)
class RopeTables:
    """One step's rotary tables, computed once for every layer."""

    cos: torch.Tensor  # [num_tokens, head_dim]
    sin: torch.Tensor  # [num_tokens, head_dim]
    cos_heads: torch.Tensor  # [num_tokens, 1, head_dim]
    sin_signed_heads: torch.Tensor  # [num_tokens, 1, head_dim], first half negated
    qkv_cos: torch.Tensor | None = None  # [num_tokens, heads + 2 * kv_heads, 1, head_dim]
    qkv_sin: torch.Tensor | None = None  # [num_tokens, heads + 2 * kv_heads, 1, head_dim], signed

    def apply(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, heads, head_dim]
        """``apply_rope(x, cos, sin)`` with the per-step parts precomputed: the halves swapped by one
        flip, the sign of rotate-half taken from the table (bit for bit the same products and sum)."""
        num_tokens, heads, dim = x.shape
        swapped = x.view(num_tokens, heads, 2, dim // 2).flip(2).view(num_tokens, heads, dim)
        return x * self.cos_heads + swapped * self.sin_signed_heads

    def apply_to_qkv_(self, heads: torch.Tensor) -> None:
        """RoPE on the q and k heads of one q/k/v output ``[num_tokens, heads + 2 * kv_heads, 1,
        head_dim]`` (a view; rotated in place), v heads unchanged (times 1, plus 0): four ops for
        all of them, the same products and sum as ``apply_rope`` (``addcmul_`` would save one, but
        it fuses the multiply-add and rounds differently)."""
        assert self.qkv_cos is not None and self.qkv_sin is not None, "tables built without qkv_heads"
        swapped = heads.roll(heads.shape[-1] // 2, dims=-1).mul_(self.qkv_sin)  # [x2 | x1] * signed sin
        heads.mul_(self.qkv_cos).add_(swapped)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The reference: x: [num_tokens, heads, head_dim]; cos/sin: [num_tokens, head_dim]."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]
