"""A linear layer whose small-batch calls run oneDNN on a weight pre-packed for that batch size.

On these CPUs (AVX2, 2 cores) oneDNN's fp32 GEMM on a weight reordered once into its blocked
layout beats MKL's on the plain weight when few rows are multiplied, which is every decode
step. Measured at 64 rows on SmolLM2-135M's shapes, weights cold in cache: the 49,152-word LM
head 26 ms instead of 42 ms; a decoder layer's seven projections 3.66 ms instead of 4.01 ms.
From a few thousand rows on (long prefill chunks) MKL is faster again, so calls with more than
``max_rows`` rows keep ``F.linear`` on the plain weight. The price is a second copy of each
weight (the packed one); results differ from ``F.linear`` only by float rounding.

Projections that read the same input (Llama's q/k/v, gate/up) run as one ``PackedLinearGroup``:
one GEMM on their concatenated packed weights, split into contiguous outputs. Fewer, wider
GEMMs: measured on SmolLM2's 30 layers, weights cold, 32 rows: 61-67 ms a step instead of
67-78 (64 rows: 111-116 instead of 116-122). A model names its groups in ``fused_groups``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

DEFAULT_MAX_ROWS = 512  # measured crossover on SmolLM2 shapes: oneDNN ahead at 512 rows, MKL at 2048


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


class PackedLinear(nn.Module):
    """``nn.Linear`` semantics (``y = x @ W^T + b``) for 2-D inputs ``[num_rows, in_features]``.

    Shares ``weight`` and ``bias`` with the layer it wraps (so a tied LM head stays tied); the
    packed copy is a plain attribute, not part of the state dict.
    """

    def __init__(self, linear: nn.Linear, batch_hint: int, max_rows: int = DEFAULT_MAX_ROWS) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # [out_features, in_features]
        self.bias = linear.bias  # [out_features] or None
        self.max_rows = max_rows
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_rows, in_features] -> [num_rows, out_features]
        if x.dim() != 2 or x.shape[0] > self.max_rows:
            return F.linear(x, self.weight, self.bias)
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for <= {self.max_rows} rows"


class PackedLinearGroup(nn.Module):
    """Linear layers that share an input, ``(x @ W_1^T + b_1, ..., x @ W_n^T + b_n)``, for 2-D
    inputs ``[num_rows, in_features]``: up to ``max_rows`` rows one oneDNN GEMM on the packed
    concatenation ``[W_1; ...; W_n]`` split into contiguous outputs, above that ``F.linear`` each.

    Holds no state of its own: it reads the members' weights, and the packed copy is a plain
    attribute, so the wrapped layers stay where they are (state dict, LoRA, PEFT comparisons).
    """

    def __init__(self, linears: Sequence[nn.Linear], batch_hint: int, max_rows: int = DEFAULT_MAX_ROWS) -> None:
        super().__init__()
        if len({linear.in_features for linear in linears}) != 1:
            raise ValueError("a PackedLinearGroup's layers must share in_features")
        self.weights = [linear.weight for linear in linears]  # each [out_i, in_features]
        self.biases = [linear.bias for linear in linears]  # each [out_i] or None
        self.out_sizes = [linear.out_features for linear in linears]
        self.max_rows = max_rows
        with torch.no_grad():
            weight = torch.cat([w.detach() for w in self.weights])  # [sum out_i, in_features]
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
            sized = zip(self.biases, self.out_sizes, strict=True)
            parts = [b.detach() if b is not None else weight.new_zeros(n) for b, n in sized]
            self.bias = None if all(b is None for b in self.biases) else torch.cat(parts)  # [sum out_i]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # [num_rows, in] -> each [num_rows, out_i]
        if x.dim() != 2 or x.shape[0] > self.max_rows:
            return tuple(F.linear(x, w, b) for w, b in zip(self.weights, self.biases, strict=True))
        fused = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        # [num_rows, sum out_i] into contiguous pieces; torch's stub types the out= form's None
        pieces: list[torch.Tensor] = torch.split_with_sizes_copy(fused, self.out_sizes, dim=1)  # type: ignore[func-returns-value,assignment]
        return tuple(pieces)

    def extra_repr(self) -> str:
        return f"out_sizes={self.out_sizes}, packed for <= {self.max_rows} rows"


def pack_linears(model: nn.Module, batch_hint: int, max_rows: int = DEFAULT_MAX_ROWS) -> int:
    """Pack ``model``'s linear layers for oneDNN; returns how many layers were packed.

    Every module with a ``fused_groups`` mapping (attribute name -> names of linear children that
    share an input) gets a ``PackedLinearGroup`` of those children under that attribute; every
    other ``nn.Linear`` child is replaced by a ``PackedLinear``. Leaves the model as it is
    (returns 0) when this torch build cannot pack its weights; packing twice packs nothing more.
    """
    grouped: set[int] = set()
    num_grouped = 0
    for module in model.modules():
        for attr, names in getattr(module, "fused_groups", {}).items():
            members = [getattr(module, name) for name in names]
            existing = getattr(module, attr, None)
            if existing is not None:
                grouped.update(id(member) for member in members)
            elif all(type(m) is nn.Linear and can_pack(m.weight) for m in members):
                setattr(module, attr, PackedLinearGroup(members, batch_hint, max_rows))
                grouped.update(id(member) for member in members)
                num_grouped += len(members)
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and can_pack(child.weight) and id(child) not in grouped
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, batch_hint, max_rows))
    if targets or num_grouped:
        num_bytes = sum(child.weight.numel() * child.weight.element_size() for _, _, child in targets)
        logger.info(
            "packed %d linear weights for oneDNN, %d of them in groups (%.0f MiB more memory)",
            len(targets) + num_grouped,
            num_grouped,
            num_bytes / 2**20,
        )
    return len(targets) + num_grouped
