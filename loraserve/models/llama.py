"""A Llama-family decoder (RMSNorm, RoPE with scaling, GQA, SwiGLU) over paged KV.

Parameter names follow Hugging Face's ``LlamaForCausalLM`` so checkpoints load
as they are, and the arithmetic follows it step by step so fp32 outputs match.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from loraserve.forward_batch import ForwardBatch
from loraserve.kernels.paged_attention import StepIndex, paged_decode_attention_indexed, write_kv_indexed
from loraserve.models.fused_linear import ConcatLinear
from loraserve.models.model_kernels import FusedRMSNorm, ModelKernels
from loraserve.models.packed_linear import PackedLinearGroup
from loraserve.models.rope import RopeTables, RotaryEmbedding, head_dim

# (input, layer_index, group, outputs, batch): adds the LoRA deltas of one input group
# ("qkv", "o", "gate_up", "down") to its projections' outputs in place.
LoRAHook = Callable[[torch.Tensor, int, str, tuple[torch.Tensor, ...], ForwardBatch], None]


@dataclass(frozen=True)
class StepTables:
    """What every layer reads in one step, computed once before the first: the rotary tables and,
    on the reference kernels, the step's KV index."""

    rope: RopeTables
    index: StepIndex | None = None


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, fused: FusedRMSNorm | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.fused = fused

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Norm of ``hidden``; with ``residual``, first ``residual += hidden`` (in place) and norm of that."""
        if self.fused is not None:
            return self.fused(hidden, self.weight, self.eps, residual)
        if residual is not None:
            hidden = residual.add_(hidden)
        dtype = hidden.dtype
        if dtype != torch.float32:  # the casts are no-ops (but still ops) in float32
            hidden = hidden.to(torch.float32)
        variance = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + self.eps)
        return self.weight * (hidden if dtype == torch.float32 else hidden.to(dtype))


class LlamaAttention(nn.Module):
    fused_groups: ClassVar[dict[str, tuple[str, ...]]] = {"qkv_packed": ("q_proj", "k_proj", "v_proj")}

    def __init__(self, config: Any, layer_index: int, kernels: ModelKernels) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim(config)
        self.scale = self.head_dim**-0.5
        bias = bool(getattr(config, "attention_bias", False))
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        # One GEMM for q, k and v: over their concatenated weights, or the CPU kernels' packed copies.
        self.qkv_packed: ConcatLinear | PackedLinearGroup = ConcatLinear(self, self.fused_groups["qkv_packed"])
        self.decode_attention = kernels.decode_attention
        self.prefill_attention = kernels.prefill_attention
        self.write_kv = kernels.write_kv
        self.fused_rope = kernels.rope
        self.unified_attention = kernels.attention
        self.rope_write_kv = kernels.rope_write_kv

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]
        tables: StepTables,
        kv: torch.Tensor,  # [num_pages, 2, block_size, num_kv_heads, head_dim]
        batch: ForwardBatch,
        lora: LoRAHook | None,
    ) -> torch.Tensor:
        if tables.index is not None and isinstance(self.qkv_packed, ConcatLinear):
            return self._forward_reference(hidden, tables, kv, batch, lora)
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_packed.forward(hidden)
        if lora is not None:
            lora(hidden, self.layer_index, "qkv", (q, k, v), batch)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.rope_write_kv is not None:
            self.rope_write_kv(q, k, v, tables.rope.cos, tables.rope.sin, kv, batch.slot_mapping)
        else:
            if self.fused_rope is not None:
                self.fused_rope(q, tables.rope.cos, tables.rope.sin)
                self.fused_rope(k, tables.rope.cos, tables.rope.sin)
            else:
                q, k = tables.rope.apply(q), tables.rope.apply(k)
            self.write_kv(kv, k, v, batch.slot_mapping)
        return self._project(self._attend(q, k, v, kv, batch), batch, lora)

    def _forward_reference(
        self, hidden: torch.Tensor, tables: StepTables, kv: torch.Tensor, batch: ForwardBatch, lora: LoRAHook | None
    ) -> torch.Tensor:
        """The torch references' path: q, k and v stay head views of their one GEMM output, rotated
        there together; K and V are written in one op, and a decode-only step's attention is one
        gather and one SDPA over the step's index."""
        assert isinstance(self.qkv_packed, ConcatLinear) and tables.index is not None
        num_tokens = hidden.shape[0]
        qkv = self.qkv_packed.fused(hidden)  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
        if lora is not None:
            lora(hidden, self.layer_index, "qkv", self.qkv_packed.split(qkv), batch)
        heads = qkv.view(num_tokens, -1, 1, self.head_dim)  # [num_tokens, num_heads + 2 * num_kv_heads, 1, head_dim]
        tables.rope.apply_to_qkv_(heads)
        # q: [num_tokens, num_heads, 1, head_dim]; kv_heads: [num_tokens, 2 * num_kv_heads, 1, head_dim]
        q, kv_heads = heads.split([self.num_heads, 2 * self.num_kv_heads], dim=1)
        new_kv = kv_heads.view(num_tokens, 2, self.num_kv_heads, self.head_dim)  # [num_tokens, 2, kv_heads, head_dim]
        write_kv_indexed(kv, new_kv, tables.index)
        if tables.index.decode_rows is not None:  # a decode-only step
            out = paged_decode_attention_indexed(q, kv, tables.index, self.scale)  # [num_tokens, heads, 1, head_dim]
        else:
            k, v = new_kv.unbind(1)  # each [num_tokens, num_kv_heads, head_dim]
            out = self._attend(q.view(num_tokens, self.num_heads, self.head_dim), k, v, kv, batch)
        return self._project(out.view(num_tokens, self.num_heads * self.head_dim), batch, lora)

    def _attend(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated (already written to kv)
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv: torch.Tensor,  # [num_pages, 2, block_size, num_kv_heads, head_dim]
        batch: ForwardBatch,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        num_tokens = q.shape[0]
        decode = (kv, batch.decode_block_tables, batch.decode_context_lens, self.scale)
        prefill = batch.prefill
        num_decode = batch.num_decode_tokens
        if self.unified_attention is not None:  # the whole step, decode and prefill, in one call
            tables = (batch.query_starts, batch.seq_lens, batch.block_tables)
            splits = batch.attention_splits
            out = self.unified_attention(q, kv, *tables, self.scale, None, splits)  # [num_tokens, num_heads, head_dim]
        elif prefill is None:  # a decode-only step: the kernel's output is the whole result
            out = self.decode_attention(q, *decode)  # [num_tokens, num_heads, head_dim]
        else:
            tables = (prefill.query_starts, prefill.cached_lens, prefill.block_tables)
            rows = slice(num_decode, num_tokens)  # the prefill chunks, one call for all of them
            prefill_out = self.prefill_attention(q[rows], kv, *tables, self.scale, k[rows], v[rows])
            if num_decode:
                out = torch.empty_like(q)
                out[:num_decode] = self.decode_attention(q[:num_decode], *decode)
                out[rows] = prefill_out
            else:
                out = prefill_out  # [num_tokens, num_heads, head_dim]
        return out.view(num_tokens, self.num_heads * self.head_dim)

    def _project(self, attn: torch.Tensor, batch: ForwardBatch, lora: LoRAHook | None) -> torch.Tensor:
        """o_proj (and its LoRA) of ``attn`` ``[num_tokens, num_heads * head_dim]``."""
        result = self.o_proj.forward(attn)
        if lora is not None:
            lora(attn, self.layer_index, "o", (result,), batch)
        return result


class LlamaMLP(nn.Module):
    fused_groups: ClassVar[dict[str, tuple[str, ...]]] = {"gate_up_packed": ("gate_proj", "up_proj")}
    gated_groups: ClassVar[tuple[str, ...]] = ("gate_up_packed",)  # its outputs feed silu(gate) * up

    def __init__(self, config: Any, layer_index: int, kernels: ModelKernels) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.silu_and_mul = kernels.silu_and_mul
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.gate_up_packed: ConcatLinear | PackedLinearGroup = ConcatLinear(self, self.fused_groups["gate_up_packed"])

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, lora: LoRAHook | None) -> torch.Tensor:
        act = self._activation(hidden, batch, lora)  # [num_tokens, intermediate]
        out = self.down_proj.forward(act)  # [num_tokens, hidden]
        if lora is not None:
            lora(act, self.layer_index, "down", (out,), batch)
        return out

    def _activation(self, hidden: torch.Tensor, batch: ForwardBatch, lora: LoRAHook | None) -> torch.Tensor:
        """``silu(gate) * up`` ``[num_tokens, intermediate]``, with the step's LoRA on gate and up."""
        packed = self.gate_up_packed
        epilogue = isinstance(packed, PackedLinearGroup) and packed.runs_silu_epilogue(hidden)
        if epilogue and not (batch.lora is not None and batch.lora.touches(self.layer_index, "gate_up")):
            return cast(PackedLinearGroup, packed).silu_and_mul(hidden)  # in the epilogues: no pass over both
        gate, up = packed.forward(hidden)  # [num_tokens, intermediate] each
        if lora is not None:
            lora(hidden, self.layer_index, "gate_up", (gate, up), batch)
        if self.silu_and_mul is not None:
            self.silu_and_mul(gate, up)
            act = gate  # [num_tokens, intermediate]
        else:
            act = F.silu(gate, inplace=True).mul_(up)  # [num_tokens, intermediate], in place: no temporaries
        return act


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_index: int, kernels: ModelKernels) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_index, kernels)
        self.mlp = LlamaMLP(config, layer_index, kernels)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels.rms_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels.rms_norm)

    def forward(
        self,
        residual: torch.Tensor,
        pending: torch.Tensor | None,
        tables: StepTables,
        kv: torch.Tensor,
        batch: ForwardBatch,
        lora: LoRAHook | None,
    ) -> torch.Tensor:
        """``residual`` is the stream, updated in place; ``pending`` the previous layer's MLP output,
        not yet added (None before the first layer). Returns this layer's MLP output, pending in
        turn: each add is fused into the norm that follows it."""
        input_norm = self.input_layernorm.forward
        normed = input_norm(residual) if pending is None else input_norm(pending, residual=residual)
        attn = self.self_attn.forward(normed, tables, kv, batch, lora)
        normed = self.post_attention_layernorm.forward(attn, residual=residual)  # residual += attn
        return self.mlp.forward(normed, batch, lora)


class LlamaModel(nn.Module):
    def __init__(self, config: Any, kernels: ModelKernels) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, kernels) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels.rms_norm)
        self.rotary_emb = RotaryEmbedding(config)


class LlamaForCausalLM(nn.Module):
    """Forward over a flattened batch; ``kv_caches[i]`` is layer i's page view."""

    def __init__(self, config: Any, kernels: ModelKernels | None = None) -> None:
        super().__init__()
        self.config = config
        self.kernels = kernels or ModelKernels()
        self.model = LlamaModel(config, self.kernels)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, batch: ForwardBatch, kv_caches: list[torch.Tensor], lora: LoRAHook | None = None
    ) -> torch.Tensor:  # [num_sampled, vocab]
        residual = self.model.embed_tokens(batch.input_ids)  # [num_tokens, hidden]
        tables = self._step_tables(batch, residual.dtype, block_size=kv_caches[0].shape[2])
        pending: torch.Tensor | None = None  # [num_tokens, hidden]
        # Inside the model, submodules are called through forward, skipping nn.Module.__call__'s hook
        # checks (about 11 calls a layer in every step; the model registers no hooks).
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            pending = layer.forward(residual, pending, tables, kv, batch, lora)
        # The last add only for the rows that are sampled.
        residual = residual.index_select(0, batch.logits_indices)  # [num_sampled, hidden]
        if pending is None:
            hidden = self.model.norm(residual)
        else:
            hidden = self.model.norm(pending.index_select(0, batch.logits_indices), residual=residual)
        return self.lm_head(hidden).float()

    def _step_tables(self, batch: ForwardBatch, dtype: torch.dtype, block_size: int) -> StepTables:
        if not self.kernels.is_reference:
            return StepTables(self.model.rotary_emb(batch.positions, dtype))
        heads = (self.config.num_attention_heads, self.config.num_key_value_heads)
        rope = self.model.rotary_emb(batch.positions, dtype, qkv_heads=heads)
        decode = (batch.decode_block_tables, batch.decode_context_lens) if batch.prefill is None else (None, None)
        return StepTables(rope, StepIndex.build(batch.slot_mapping, block_size, *decode))
