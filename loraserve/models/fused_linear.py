"""Projections that share an input as one GEMM: ``[y_1 | ... | y_n] = x @ [W_1; ...; W_n]^T + b``.

The member layers (``q_proj``, ``k_proj``, ``v_proj``; ``gate_proj``, ``up_proj``) stay where a
Hugging Face checkpoint puts them; their weights become row blocks of one concatenated matrix
(views, so no second copy), built from the members the first time the module runs or when the
loader calls :meth:`ConcatLinear.refresh`, and again whenever the members' tensors were replaced
(a new checkpoint, a move to another device). The outputs are column views of one result.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ConcatLinear(nn.Module):
    def __init__(self, owner: nn.Module, names: tuple[str, ...]) -> None:
        super().__init__()
        # Not registered as a submodule: the owner holds this module (no cycle in modules()).
        object.__setattr__(self, "_owner", owner)
        self.names = names
        self._weight: torch.Tensor | None = None  # [sum(out_i), in_features]
        self._bias: torch.Tensor | None = None  # [sum(out_i)] or None
        self._key: tuple[int, ...] = ()
        self.out_sizes: list[int] = []

    def _members(self) -> list[nn.Linear]:
        owner: nn.Module = object.__getattribute__(self, "_owner")
        return [getattr(owner, name) for name in self.names]

    @staticmethod
    def _key_of(members: list[nn.Linear]) -> tuple[int, ...]:
        return tuple(t.data_ptr() for m in members for t in (m.weight, m.bias) if t is not None)

    def refresh(self) -> None:
        """Concatenate the members' weights and make theirs views of it (if they changed)."""
        members = self._members()
        if self._weight is not None and self._key_of(members) == self._key:
            return
        with torch.inference_mode(False), torch.no_grad():
            self._weight = torch.cat([m.weight for m in members])
            biases = [m.bias for m in members]
            self._bias = torch.cat([b for b in biases if b is not None]) if all(b is not None for b in biases) else None
            if self._bias is None and any(b is not None for b in biases):
                raise ValueError(f"{self.names}: either all or none of the fused layers have a bias")
            self.out_sizes = [m.out_features for m in members]
            for member, rows in zip(members, self._weight.split(self.out_sizes), strict=True):
                member.weight.data = rows
            if self._bias is not None:
                for member, part in zip(members, self._bias.split(self.out_sizes), strict=True):
                    assert member.bias is not None
                    member.bias.data = part
        self._key = self._key_of(members)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # [rows, in] -> each [rows, out_i], views
        return self.split(self.fused(x))

    def fused(self, x: torch.Tensor) -> torch.Tensor:  # [rows, in] -> [rows, sum(out_i)]
        """The one GEMM's output, all members' columns side by side."""
        self.refresh()
        assert self._weight is not None
        return F.linear(x, self._weight, self._bias)

    def split(self, fused: torch.Tensor) -> tuple[torch.Tensor, ...]:  # [rows, sum(out_i)] -> each [rows, out_i]
        """Each member's columns of ``fused`` (views)."""
        return fused.split(self.out_sizes, dim=-1)

    def extra_repr(self) -> str:
        return f"fuses {', '.join(self.names)}"
