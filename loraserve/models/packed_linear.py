"""Linear layers whose small-batch calls run oneDNN on weights pre-packed for that batch size.

On these CPUs (AVX2, 2 cores) oneDNN's fp32 GEMM on a weight reordered once into its blocked
layout beats MKL's on the plain weight when few rows are multiplied, which is every decode
step. Measured at 64 rows on SmolLM2-135M's shapes, weights cold in cache: the 49,152-word LM
head 26 ms instead of 42 ms; a decoder layer's seven projections 3.66 ms instead of 4.01 ms, and
q/k/v (gate/up) as one GEMM on their concatenated weights saves another ~8 % (~5 %) of theirs.
Around a few thousand rows (long prefill chunks) the two libraries are even, so calls with more
than ``max_rows`` rows keep ``F.linear`` on the plain weights. The price is a second copy of
each weight (the packed one); results differ from ``F.linear`` only by float rounding.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

DEFAULT_MAX_ROWS = 512  # oneDNN measured ahead up to 512 rows, even with MKL at 2048


def can_pack(weight: torch.Tensor) -> bool:
    """Whether this torch build can pack ``weight`` for oneDNN (a CPU float32/bfloat16 matrix)."""
    return (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedGroup(nn.Module):
    """Linear layers of one input as one GEMM: ``x @ [W_1; ...; W_n]^T (+ b)``, split per layer.

    Takes a 2-D input ``[num_rows, in_features]`` and returns each layer's output
    ``[num_rows, out_features_m]`` (contiguous). The plain layers stay where they are (their
    parameters, and ``F.linear`` on them for batches above ``max_rows``); the concatenated packed
    weight is a plain attribute, not part of any state dict.
    """

    def __init__(self, linears: list[nn.Linear], batch_hint: int, max_rows: int = DEFAULT_MAX_ROWS) -> None:
        super().__init__()
        self.linears = tuple(linears)  # not submodules: their owners keep them
        self.split_sizes = [linear.out_features for linear in linears]
        self.max_rows = max_rows
        with torch.no_grad():
            weight = torch.cat([linear.weight.detach() for linear in linears])  # [sum out_m, in_features]
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
            biases = [linear.bias for linear in linears]
            self.bias = (
                None
                if all(b is None for b in biases)
                else torch.cat(
                    [
                        b.detach() if b is not None else torch.zeros(n)
                        for b, n in zip(biases, self.split_sizes, strict=True)
                    ]
                )
            )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if x.dim() != 2 or x.shape[0] > self.max_rows:
            return tuple(F.linear(x, linear.weight, linear.bias) for linear in self.linears)
        out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        if len(self.split_sizes) == 1:
            return (out,)
        return tuple(part.contiguous() for part in out.split(self.split_sizes, dim=1))

    def extra_repr(self) -> str:
        return f"out_features={self.split_sizes}, packed for <= {self.max_rows} rows"


class PackedLinear(PackedGroup):
    """``nn.Linear`` semantics (``y = x @ W^T + b``) on a packed weight; shares ``weight``/``bias``."""

    def __init__(self, linear: nn.Linear, batch_hint: int, max_rows: int = DEFAULT_MAX_ROWS) -> None:
        super().__init__([linear], batch_hint, max_rows)
        self.weight = linear.weight  # [out_features, in_features]; a tied LM head stays tied
        if linear.bias is not None:
            self.bias = linear.bias  # the parameter itself, so the state dict keeps its key

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x)[0]


def pack_llama_linears(model: nn.Module, batch_hint: int, max_rows: int = DEFAULT_MAX_ROWS) -> int:
    """Run a ``LlamaForCausalLM``'s projections on packed weights: q/k/v and gate/up as one GEMM
    each, o, down and the LM head alone. Returns the number of weights packed (0 when this torch
    build cannot pack them: the model is left as it is)."""
    from loraserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM

    assert isinstance(model, LlamaForCausalLM)
    if isinstance(model.lm_head, PackedGroup) or not can_pack(_plain(model.lm_head).weight):
        return 0
    packed: list[nn.Linear] = [_plain(model.lm_head)]
    for layer in model.model.layers:
        assert isinstance(layer, LlamaDecoderLayer)
        attn, mlp = layer.self_attn, layer.mlp
        q, k, v, o = _plain(attn.q_proj), _plain(attn.k_proj), _plain(attn.v_proj), _plain(attn.o_proj)
        gate, up, down = _plain(mlp.gate_proj), _plain(mlp.up_proj), _plain(mlp.down_proj)
        packed += [q, k, v, o, gate, up, down]
        attn.project_qkv = PackedGroup([q, k, v], batch_hint, max_rows)
        attn.o_proj = PackedLinear(o, batch_hint, max_rows)
        mlp.project_gate_up = PackedGroup([gate, up], batch_hint, max_rows)
        mlp.down_proj = PackedLinear(down, batch_hint, max_rows)
    model.lm_head = PackedLinear(_plain(model.lm_head), batch_hint, max_rows)
    num_bytes = sum(linear.weight.numel() * linear.weight.element_size() for linear in packed)
    logger.info("packed %d linear weights for oneDNN (%.0f MiB more memory)", len(packed), num_bytes / 2**20)
    return len(packed)


def _plain(module: nn.Module) -> nn.Linear:
    assert type(module) is nn.Linear, f"expected a plain nn.Linear, got {type(module).__name__}"
    return module
