"""Linear layers that run loraserve's CPU GEMM (``kernels/cpu.py: linear_panels``) on weights
packed once into 16-column panels.

On this machine kind (AVX2, 2 cores) the register-tiled kernel beats the BLAS libraries torch
calls at every batch size a step has. Measured on SmolLM2-135M's decoder projections, 30
layers, weights cold in cache, medians of alternating runs (ms, this kernel / oneDNN on weights
reordered for the batch size / MKL on the plain weight): 1 row 19.7 / 29.4; 8 rows 23.5 / 31.8;
64 rows 97.7 / 121.2; 512 rows 763 / 790 / 824; 2048 rows 2574 / 2912 / 2715. The price is a
second copy of each weight (the panels); results differ from ``F.linear`` only by the order of
float additions.

Projections that read the same input (Llama's q/k/v, gate/up) run as one ``PackedLinearGroup``:
one kernel call over the panels of all of them, each output written contiguous in place (no
split copies; the LoRA kernels add into them). A model names its groups in ``fused_groups``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from loraserve.kernels import cpu

logger = logging.getLogger(__name__)


def can_pack(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can run on the panel kernel (a CPU float32 matrix, the kernels built)."""
    return (
        weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.dtype == torch.float32
        and cpu.load_extension() is not None
    )


class PackedLinearGroup(nn.Module):
    """Linear layers that share an input, ``(x @ W_1^T + b_1, ..., x @ W_n^T + b_n)``: for 2-D
    inputs ``[num_rows, in_features]`` one ``linear_panels`` call, each output contiguous; other
    inputs ``F.linear`` each.

    Holds no state of its own: it reads the members' weights, and the panels are a plain
    attribute, so the wrapped layers stay where they are (state dict, LoRA, PEFT comparisons).
    """

    def __init__(self, linears: Sequence[nn.Linear]) -> None:
        super().__init__()
        if len({linear.in_features for linear in linears}) != 1:
            raise ValueError("a PackedLinearGroup's layers must share in_features")
        self.weights = [linear.weight for linear in linears]  # each [out_i, in_features]
        self.biases = [linear.bias for linear in linears]  # each [out_i] or None
        self.out_sizes = [linear.out_features for linear in linears]
        with torch.no_grad():
            biases = [b.detach() if b is not None else None for b in self.biases]
            # [num_panels, in_features, 16], [num_panels * 16] or None
            self.panels, self.panel_bias = cpu.pack_panels([w.detach() for w in self.weights], biases)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # [num_rows, in] -> each [num_rows, out_i]
        if x.dim() != 2:
            return tuple(F.linear(x, w, b) for w, b in zip(self.weights, self.biases, strict=True))
        return tuple(cpu.linear_panels(x, self.panels, self.panel_bias, self.out_sizes))

    def extra_repr(self) -> str:
        return f"out_sizes={self.out_sizes}, on 16-column panels"


class PackedLinear(nn.Module):
    """``nn.Linear`` semantics (``y = x @ W^T + b``), on the panel kernel for 2-D inputs.

    Shares ``weight`` and ``bias`` with the layer it wraps (so a tied LM head stays tied); its
    panels are a group of one, which is not part of the state dict.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # [out_features, in_features]
        self.bias = linear.bias  # [out_features] or None
        self.group = PackedLinearGroup([linear])  # the panels (a group of one)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_rows, in_features] -> [num_rows, out_features]
        return self.group(x)[0]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, on 16-column panels"


def pack_linears(model: nn.Module) -> int:
    """Run ``model``'s float32 linear layers on the panel kernel; returns how many layers were packed.

    Every module with a ``fused_groups`` mapping (attribute name -> names of linear children that
    share an input) gets a ``PackedLinearGroup`` of those children under that attribute; every
    other ``nn.Linear`` child is replaced by a ``PackedLinear``. Leaves the model as it is
    (returns 0) when its weights cannot be packed; packing twice packs nothing more.
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
                setattr(module, attr, PackedLinearGroup(members))
                grouped.update(id(member) for member in members)
                num_grouped += len(members)
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and can_pack(child.weight) and id(child) not in grouped
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    num_packed = len(targets) + num_grouped
    if num_packed:
        groups = [m for m in model.modules() if isinstance(m, PackedLinearGroup)]
        num_bytes = sum(g.panels.numel() * g.panels.element_size() for g in groups)
        logger.info(
            "packed %d linear weights into panels, %d of them in groups (%.0f MiB)",
            num_packed,
            num_grouped,
            num_bytes / 2**20,
        )
    return num_packed
