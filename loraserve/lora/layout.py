"""Where an adapter's weights sit inside its pages.

An adapter owns ``num_pages`` page ids; in every layer those pages, concatenated,
form one flat buffer of ``num_pages * page_elems`` elements holding that layer's
weights, rank rows back to back (a row may cross a page boundary)::

    [ A_q | A_k | A_v | A_o | A_gate | A_up | A_down | B_q^T | B_k^T | ... | B_down^T ]

``A_m`` is ``[r_m, in_m]`` and ``B_m^T`` is ``[r_m, out_m]``, both row-major. The A
blocks of projections that share an input (q/k/v and gate/up) are adjacent, so one
view gives their stacked shrink matrix. A block (a group's stacked A, a module's B^T) whose
rows are a multiple of ``WEIGHT_ALIGN`` (64) elements long starts at a multiple of 64, which
lets the GPU kernels load aligned tiles (``kernels/lora.py``); in real models, every
projection's sizes being multiples of 64, that adds nothing. A layer takes
``sum_m r_m * (in_m + out_m)`` elements plus less than 64 per block: memory grows linearly
with rank, with no padding to a maximum rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraserve.adapters import LoRAAdapter
from loraserve.kernels.lora import WEIGHT_ALIGN

# Projections grouped by the input they read, in the order the model applies them.
LORA_GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


@dataclass(frozen=True)
class ModuleSlot:
    module: str
    rank: int
    in_features: int
    out_features: int
    a_offset: int  # element offset of A_m in the layer buffer
    b_offset: int  # element offset of B_m^T
    column: int  # first column of this module in its group's shrink output
    scale: float


@dataclass(frozen=True)
class GroupSlot:
    """The stacked A of one input group in one layer, and each module's expand."""

    a_offset: int
    num_rows: int
    in_features: int
    modules: tuple[ModuleSlot | None, ...]  # aligned with LORA_GROUPS[group]


@dataclass(frozen=True)
class AdapterLayout:
    layers: tuple[dict[str, GroupSlot], ...]  # per layer: group name -> slot
    layer_elems: tuple[int, ...]  # elements used in each layer

    @property
    def max_layer_elems(self) -> int:
        return max(self.layer_elems, default=0)

    def num_pages(self, page_elems: int) -> int:
        return max(1, -(-self.max_layer_elems // page_elems))

    @classmethod
    def for_adapter(cls, adapter: LoRAAdapter, num_layers: int) -> AdapterLayout:
        layers: list[dict[str, GroupSlot]] = []
        layer_elems: list[int] = []
        for layer in range(num_layers):
            a_slots: dict[str, tuple[int, int, int]] = {}  # module -> (a_offset, rank, in)
            offset = 0
            for modules in LORA_GROUPS.values():
                group_start = True  # the group's A blocks are adjacent: one stacked matrix
                for module in modules:
                    weights = adapter.weights.get((layer, module))
                    if weights is not None:
                        rank, in_features = weights.lora_a.shape
                        offset = aligned(offset, in_features) if group_start else offset
                        group_start = False
                        a_slots[module] = (offset, rank, in_features)
                        offset += rank * in_features
            groups: dict[str, GroupSlot] = {}
            for group, modules in LORA_GROUPS.items():
                slots: list[ModuleSlot | None] = []
                column = 0
                group_offset, group_in = -1, 0
                for module in modules:
                    weights = adapter.weights.get((layer, module))
                    if weights is None:
                        slots.append(None)
                        continue
                    a_offset, rank, in_features = a_slots[module]
                    if group_offset < 0:
                        group_offset, group_in = a_offset, in_features
                    out_features = weights.lora_b.shape[0]
                    offset = aligned(offset, out_features)
                    slots.append(
                        ModuleSlot(module, rank, in_features, out_features, a_offset, offset, column, weights.scale)
                    )
                    offset += rank * out_features
                    column += rank
                if group_offset >= 0:
                    groups[group] = GroupSlot(group_offset, column, group_in, tuple(slots))
            layers.append(groups)
            layer_elems.append(offset)
        return cls(tuple(layers), tuple(layer_elems))

    def write(self, adapter: LoRAAdapter, layer: int, buffer: torch.Tensor) -> None:
        """Copy one layer's weights into its flat buffer (``[>= layer_elems]``)."""
        for group in self.layers[layer].values():
            for slot in group.modules:
                if slot is None:
                    continue
                weights = adapter.weights[(layer, slot.module)]
                a_size = slot.rank * slot.in_features
                b_size = slot.rank * slot.out_features
                buffer[slot.a_offset : slot.a_offset + a_size].copy_(weights.lora_a.reshape(-1))
                buffer[slot.b_offset : slot.b_offset + b_size].copy_(weights.lora_b.T.reshape(-1))


def aligned(offset: int, row_length: int) -> int:
    """Where a block of rows ``row_length`` long starts at ``offset`` or after: rounded up to a
    multiple of ``WEIGHT_ALIGN`` if its rows are a multiple of it long (else ``offset``)."""
    if row_length % WEIGHT_ALIGN:
        return offset
    return -(-offset // WEIGHT_ALIGN) * WEIGHT_ALIGN


def max_rank_pages(module_shapes: dict[str, tuple[int, int]], rank: int, page_elems: int) -> int:
    """Pages of an adapter of every projection (``(in, out)`` each) at ``rank``: the size of one
    slot of a fixed adapter region (``adapter_region="fixed"``)."""
    present = [[module for module in modules if module in module_shapes] for modules in LORA_GROUPS.values()]
    offset = 0
    for modules in present:  # placed as for_adapter places them
        if modules:
            offset = aligned(offset, module_shapes[modules[0]][0])
            offset += sum(rank * module_shapes[module][0] for module in modules)
    for module in (module for modules in present for module in modules):
        offset = aligned(offset, module_shapes[module][1]) + rank * module_shapes[module][1]
    return max(1, -(-offset // page_elems))
