"""Linear layers on the CPU GEMM kernel chosen for their shape and row count.

Five kernels compute ``y = x @ W^T + b`` (``GemmKernel``):

* ``panels``: loraserve's register-tiled GEMM on weights packed once into 16-column panels:
  float32 (``kernels/cpu.py: linear_panels``), and bfloat16 where the CPU has avx512_bf16, its
  panels holding k pairs for dot products (``kernels/cpu_linear.py: linear_pair_panels``).
* ``onednn``: oneDNN on weights reordered once into its blocked layout
  (``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``); float32, and bfloat16
  on AMX or AVX-512-BF16 where the CPU has them.
* ``torch``: ``F.linear`` on the plain weights (MKL's sgemm for float32, oneDNN for bfloat16).
* ``dot``: loraserve's bfloat16 kernel of AVX512-BF16 dot products on the plain weights
  (``kernels/cpu_linear.py: linear_dot``), which reads them once, front to back: made for the few
  rows of a small decode step, which is bound by reading the weights from memory.
* ``amx``: loraserve's bfloat16 kernel on AMX tiles that load the plain weights in place
  (``kernels/cpu_linear.py: linear_amx``), also reading them once for all rows: made for decode
  steps of up to some tens of rows.

Which one is fastest depends on the CPU (an AVX2 EPYC and an AVX-512 Xeon disagree) and on the
number of rows, so a group holds one kernel per row bucket (``ROW_BUCKETS``), chosen by timing
on the machine (``models/gemm_choice.py``). A group keeps the packed copy of only the kernels it
uses; ``torch``, ``dot`` and ``amx`` need none. Results differ from ``F.linear`` only by the order of float additions.

Projections that read the same input (Llama's q/k/v, gate/up) run as one ``PackedLinearGroup``:
each output written contiguous (the LoRA kernels add into them in place); the panel kernel
makes one call over the panels of all of them. A model names its groups in ``fused_groups``.

A group of two whose outputs the model combines as ``silu(y_1) * y_2`` (a gated MLP, named in
``gated_groups``) can compute that in the GEMM's epilogue instead (``silu_and_mul``): the bfloat16
panels' tiles or oneDNN's post-ops, in the row buckets where ``models/silu_epilogue.py`` timed it faster.
"""

from __future__ import annotations

import bisect
import enum
import itertools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from loraserve.kernels import cpu, cpu_features, cpu_linear

# A call with r rows uses the bucket nearest r on a log scale; 1,024 and 2,048 are the default prefill
# chunks on a CPU in float32 and in bfloat16 (EngineConfig.step_token_budget), where the best kernel can differ.
ROW_BUCKETS = (1, 4, 16, 64, 256, 1024, 2048)
ONEDNN_ROWS_HINT = 64  # the batch-size hint of oneDNN's weight reorder (the layout serves any row count)


class GemmKernel(str, enum.Enum):
    PANELS = "panels"
    ONEDNN = "onednn"
    TORCH = "torch"
    DOT = "dot"
    AMX = "amx"


UNPACKED = (GemmKernel.TORCH, GemmKernel.DOT, GemmKernel.AMX)  # the kernels that read the weights as stored (no copy)

# Geometric midpoints between neighbouring buckets: a row count up to an edge (inclusive) belongs below it.
_BUCKET_EDGES = tuple(math.sqrt(low * high) for low, high in itertools.pairwise(ROW_BUCKETS))


def bucket_index(rows: int, num_buckets: int = len(ROW_BUCKETS)) -> int:
    """Index of the bucket nearest ``rows`` on a log scale (ties to the lower), among the first
    ``num_buckets``; a bisection over precomputed edges, since every linear call asks."""
    return min(bisect.bisect_left(_BUCKET_EDGES, rows), num_buckets - 1)


def kernels_for(dtype: torch.dtype) -> tuple[GemmKernel, ...]:
    """The kernels that can run weights of ``dtype`` on this build (panels need the C++ extension)."""
    available: list[GemmKernel] = []
    if dtype == torch.float32 and cpu.load_extension() is not None:
        available.append(GemmKernel.PANELS)
    if dtype == torch.bfloat16 and cpu_linear.linear_pair_panels_available():
        available.append(GemmKernel.PANELS)
    onednn_dtype = dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_features.cpu_info().onednn_bfloat16)
    if onednn_dtype and torch.backends.mkldnn.is_available():
        available.append(GemmKernel.ONEDNN)
    available.append(GemmKernel.TORCH)
    if dtype == torch.bfloat16 and cpu_linear.linear_dot_available():
        available.append(GemmKernel.DOT)
    if dtype == torch.bfloat16 and cpu_linear.linear_amx_available():
        available.append(GemmKernel.AMX)
    return tuple(available)


def can_pack(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can run on a packed kernel (a CPU float32 or bfloat16 matrix)."""
    return weight.device.type == "cpu" and weight.dim() == 2 and len(kernels_for(weight.dtype)) > 1


class PackedLinearGroup(nn.Module):
    """Linear layers that share an input, ``(x @ W_1^T + b_1, ..., x @ W_n^T + b_n)``; for 2-D
    inputs ``[num_rows, in_features]`` on ``kernels[bucket_index(num_rows, len(kernels))]``, each
    output contiguous; other inputs ``F.linear`` each.

    Holds no state of its own: it reads the members' weights, and the packed copies are plain
    attributes, so the wrapped layers stay where they are (state dict, LoRA, PEFT comparisons).
    """

    def __init__(
        self, linears: Sequence[nn.Linear], kernels: Sequence[GemmKernel], silu_epilogue: Sequence[bool] = ()
    ) -> None:
        super().__init__()
        if len({linear.in_features for linear in linears}) != 1:
            raise ValueError("a PackedLinearGroup's layers must share in_features")
        if not kernels:
            raise ValueError("a PackedLinearGroup needs a kernel for at least one row bucket")
        self.weights = [linear.weight for linear in linears]  # each [out_i, in_features]
        self.biases = [linear.bias for linear in linears]  # each [out_i] or None
        self.out_sizes = [linear.out_features for linear in linears]
        self.kernels = tuple(GemmKernel(k) for k in kernels)
        dtype = self.weights[0].dtype
        missing = set(self.kernels) - set(kernels_for(dtype))
        if missing:
            raise ValueError(f"kernels {sorted(k.value for k in missing)} cannot run {dtype} weights here")
        # per row bucket: whether silu_and_mul runs in the GEMMs' epilogues (() for none)
        self.silu_epilogue = tuple(bool(on) for on in silu_epilogue) or (False,) * len(self.kernels)
        if len(self.silu_epilogue) != len(self.kernels):
            raise ValueError("a PackedLinearGroup's silu_epilogue needs one entry per row bucket of its kernels")
        if any(self.silu_epilogue) and not can_run_silu_epilogue(self.out_sizes, dtype):
            raise ValueError("only a group of two outputs of one width can run SiLU-and-mul in an epilogue")
        fusing = silu_epilogue_kernels(dtype)
        if any(on and k not in fusing for on, k in zip(self.silu_epilogue, self.kernels, strict=True)):
            raise ValueError(f"SiLU-and-mul runs in the epilogue only in buckets of {[k.value for k in fusing]}")
        # float32 [num_panels, in_features, 16]; bfloat16 [num_panels, ceil(in_features / 2), 32] (k pairs)
        self.panels: torch.Tensor | None = None
        self.panel_bias: torch.Tensor | None = None  # [num_panels * 16] float32
        self.onednn_weights: list[torch.Tensor] = []  # each oneDNN's blocked copy of W_i
        with torch.no_grad():
            weights = [w.detach() for w in self.weights]
            biases = [b.detach() if b is not None else None for b in self.biases]
            if GemmKernel.PANELS in self.kernels and dtype == torch.bfloat16:
                self.panels, self.panel_bias = cpu_linear.pack_pair_panels(weights, biases)
            elif GemmKernel.PANELS in self.kernels:
                self.panels, self.panel_bias = cpu.pack_panels(weights, biases)
            if GemmKernel.ONEDNN in self.kernels:
                reorder = torch.ops.mkldnn._reorder_linear_weight
                self.onednn_weights = [reorder(w, ONEDNN_ROWS_HINT) for w in weights]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # [num_rows, in] -> each [num_rows, out_i]
        if x.dim() != 2:
            return tuple(F.linear(x, w, b) for w, b in zip(self.weights, self.biases, strict=True))
        return self.run(self.kernels[bucket_index(x.shape[0], len(self.kernels))], x)

    def run(self, kernel: GemmKernel, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The group's outputs for ``x`` ``[num_rows, in_features]`` on ``kernel`` (one this group packed)."""
        if kernel is GemmKernel.PANELS:
            assert self.panels is not None, "this group has no panels"
            if self.panels.dtype == torch.bfloat16:
                return tuple(cpu_linear.linear_pair_panels(x, self.panels, self.panel_bias, self.out_sizes))
            return tuple(cpu.linear_panels(x, self.panels, self.panel_bias, self.out_sizes))
        if kernel is GemmKernel.ONEDNN and x.shape[0] > 0:
            assert self.onednn_weights, "this group has no oneDNN weights"
            linear = torch.ops.mkldnn._linear_pointwise
            x = x.contiguous()
            return tuple(linear(x, w, b, "none", [], "") for w, b in zip(self.onednn_weights, self.biases, strict=True))
        if kernel is GemmKernel.DOT:
            return tuple(cpu_linear.linear_dot(x, self.weights, self.biases))
        if kernel is GemmKernel.AMX:
            return tuple(cpu_linear.linear_amx(x, self.weights, self.biases))
        return tuple(F.linear(x, w, b) for w, b in zip(self.weights, self.biases, strict=True))

    def runs_silu_epilogue(self, x: torch.Tensor) -> bool:
        """Whether ``silu_and_mul(x)`` runs in the GEMMs' epilogues (``x``'s row bucket chose them)."""
        return x.dim() == 2 and self.silu_epilogue[bucket_index(x.shape[0], len(self.kernels))]

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:  # [num_rows, in] -> [num_rows, out_1]
        """``silu(y_1) * y_2`` in the GEMMs' epilogues, for an ``x`` whose row bucket chose them
        (``runs_silu_epilogue``)."""
        if not self.runs_silu_epilogue(x):
            raise ValueError(f"the row bucket of {x.shape[0]} rows does not run SiLU-and-mul in the epilogue")
        return self.run_silu_and_mul(self.kernels[bucket_index(x.shape[0], len(self.kernels))], x)

    def run_silu_and_mul(self, kernel: GemmKernel, x: torch.Tensor) -> torch.Tensor:
        """``silu(x @ W_1^T + b_1) * (x @ W_2^T + b_2)`` ``[num_rows, out_1]``: for ``panels`` (bfloat16)
        in the tiles' epilogue, each tile holding a panel of both (``linear_pair_panels_silu``, the
        same bits as the two outputs and ``silu_and_mul_``); for ``onednn`` and ``torch`` in two
        oneDNN calls, the first applying SiLU to its sums before writing them, the second multiplying
        its sums by that result (post-ops), on the packed weights for ``onednn`` and the plain ones
        for ``torch``."""
        assert len(self.weights) == 2, "a gated pair has two outputs"
        if kernel is GemmKernel.PANELS:
            assert self.panels is not None, "this group has no panels"
            return cpu_linear.linear_pair_panels_silu(x, self.panels, self.panel_bias, self.out_sizes[0])
        weights = self.onednn_weights if kernel is GemmKernel.ONEDNN else [w.detach() for w in self.weights]
        assert len(weights) == 2, "this group has no oneDNN weights"
        linear = torch.ops.mkldnn._linear_pointwise
        x = x.contiguous()
        gate = linear(x, weights[0], self.biases[0], "swish", [], "")  # [num_rows, out_1]
        return linear.binary(x, gate, weights[1], self.biases[1], "mul")  # [num_rows, out_1]

    def packed_bytes(self) -> int:
        """Bytes of the packed copies this group keeps beside its members' weights."""
        tensors = [t for t in (self.panels, self.panel_bias, *self.onednn_weights) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def extra_repr(self) -> str:
        epilogue = f", SiLU-and-mul in the epilogue {list(self.silu_epilogue)}" if any(self.silu_epilogue) else ""
        return f"out_sizes={self.out_sizes}, kernels by row bucket {[k.value for k in self.kernels]}{epilogue}"


def silu_epilogue_kernels(dtype: torch.dtype) -> tuple[GemmKernel, ...]:
    """The kernels that can run a gated pair's SiLU-and-mul in their epilogue for ``dtype`` weights
    on this build: ``onednn`` and ``torch`` (oneDNN's post-ops) where oneDNN runs ``dtype``, and the
    bfloat16 ``panels``."""
    available = kernels_for(dtype)
    on_onednn = (GemmKernel.ONEDNN, GemmKernel.TORCH) if GemmKernel.ONEDNN in available else ()
    on_panels = (GemmKernel.PANELS,) if dtype == torch.bfloat16 and GemmKernel.PANELS in available else ()
    return on_onednn + on_panels


def can_run_silu_epilogue(out_sizes: Sequence[int], dtype: torch.dtype) -> bool:
    """Whether a group of these outputs can run SiLU-and-mul in an epilogue: two outputs of one
    width, and a kernel for ``dtype`` that has one on this build."""
    return len(out_sizes) == 2 and out_sizes[0] == out_sizes[1] and bool(silu_epilogue_kernels(dtype))


class PackedLinear(nn.Module):
    """``nn.Linear`` semantics (``y = x @ W^T + b``), on the chosen kernels for 2-D inputs.

    Shares ``weight`` and ``bias`` with the layer it wraps (so a tied LM head stays tied); its
    packed copies belong to ``group``, a ``PackedLinearGroup`` of ``linear`` alone (built from
    ``kernels`` when not given), which is not part of the state dict.
    """

    def __init__(
        self, linear: nn.Linear, kernels: Sequence[GemmKernel] = (), group: PackedLinearGroup | None = None
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # [out_features, in_features]
        self.bias = linear.bias  # [out_features] or None
        self.group = group if group is not None else PackedLinearGroup([linear], kernels)
        if len(self.group.weights) != 1 or self.group.weights[0] is not linear.weight:
            raise ValueError("a PackedLinear's group must be the layer it wraps alone")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_rows, in_features] -> [num_rows, out_features]
        return self.group.forward(x)[0]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"
