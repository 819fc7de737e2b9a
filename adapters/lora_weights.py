"""In-memory representation of a parsed LoRA adapter and of the base model shapes it must fit."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

# The seven Llama projections an adapter may target, in the order they appear in a decoder layer.
PROJECTION_NAMES: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)

# Parent submodule of each projection inside a Llama decoder layer (as named by transformers).
PROJECTION_PARENTS: dict[str, str] = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


def module_key(layer: int, module: str) -> str:
    """Full module name in a transformers ``LlamaForCausalLM``, as PEFT matches its patterns against."""
    return f"model.layers.{layer}.{PROJECTION_PARENTS[module]}.{module}"


@dataclass(frozen=True)
class BaseModelShapes:
    """Shapes of the base model's adaptable projections.

    ``module_shapes`` maps each of the seven projection names to ``(in_features, out_features)``;
    the shapes are the same in every layer.
    """

    num_layers: int
    module_shapes: dict[str, tuple[int, int]]
    base_model_id: str | None = None

    def __post_init__(self) -> None:
        if self.num_layers <= 0:
            raise ValueError(f"num_layers must be positive, got {self.num_layers}")
        if set(self.module_shapes) != set(PROJECTION_NAMES):
            raise ValueError(
                f"module_shapes must have exactly the keys {list(PROJECTION_NAMES)}, got {sorted(self.module_shapes)}"
            )
        for module, shape in self.module_shapes.items():
            if len(shape) != 2 or any(int(d) <= 0 for d in shape):
                raise ValueError(f"module_shapes[{module!r}] must be two positive ints, got {shape!r}")
        # Normalise (e.g. lists from JSON) so equality and hashing see plain int tuples.
        normalised = {module: (int(shape[0]), int(shape[1])) for module, shape in self.module_shapes.items()}
        object.__setattr__(self, "module_shapes", normalised)

    def __hash__(self) -> int:
        # Explicit because the dict field defeats the generated hash; shapes are used as cache keys.
        return hash((self.num_layers, tuple(sorted(self.module_shapes.items())), self.base_model_id))

    @classmethod
    def from_hf_config(cls, config: Any) -> BaseModelShapes:
        """Build from a transformers ``LlamaConfig``-like object.

        ``head_dim`` may be missing or ``None`` (then ``hidden_size // num_attention_heads``), and
        ``num_key_value_heads`` likewise (then equal to ``num_attention_heads``, i.e. no GQA).
        """
        hidden = int(config.hidden_size)
        intermediate = int(config.intermediate_size)
        num_heads = int(config.num_attention_heads)
        num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
        head_dim = int(getattr(config, "head_dim", None) or hidden // num_heads)
        q_out = num_heads * head_dim
        kv_out = num_kv_heads * head_dim
        shapes = {
            "q_proj": (hidden, q_out),
            "k_proj": (hidden, kv_out),
            "v_proj": (hidden, kv_out),
            "o_proj": (q_out, hidden),
            "gate_proj": (hidden, intermediate),
            "up_proj": (hidden, intermediate),
            "down_proj": (intermediate, hidden),
        }
        base_model_id = getattr(config, "_name_or_path", None) or None
        return cls(
            num_layers=int(config.num_hidden_layers),
            module_shapes=shapes,
            base_model_id=str(base_model_id) if base_model_id else None,
        )


# eq=False: tensors do not support value equality in a dataclass-generated __eq__; an adapter's
# identity is its digest.
@dataclass(frozen=True, eq=False)
class LoRAModuleWeights:
    """One adapted projection: ``y += scale * (x @ lora_a.T) @ lora_b.T``."""

    lora_a: torch.Tensor  # [rank, in_features] float32, CPU, contiguous
    lora_b: torch.Tensor  # [out_features, rank] float32, CPU, contiguous
    scale: float

    @property
    def rank(self) -> int:
        return int(self.lora_a.shape[0])

    @property
    def num_parameters(self) -> int:
        return self.lora_a.numel() + self.lora_b.numel()


@dataclass(frozen=True, eq=False)
class LoRAAdapter:
    """A validated LoRA adapter, float32 on CPU, keyed by ``(layer_index, module_name)``.

    ``digest`` is a sha256 hex of the adapter's content (resolved per-module scales and every
    tensor's canonical name, dtype, shape and bytes), independent of ``name``: use it, not the
    name, wherever cached state derived from the adapter must be keyed (e.g. prefix-cache hashes).
    The ``weights`` mapping must not be mutated.
    """

    name: str
    digest: str
    weights: dict[tuple[int, str], LoRAModuleWeights] = field(repr=False)

    @property
    def target_modules(self) -> tuple[str, ...]:
        """Sorted names of the projections adapted in at least one layer."""
        return tuple(sorted({module for _, module in self.weights}))

    @property
    def ranks(self) -> dict[str, int]:
        """Rank per projection name (the largest over layers, since ``rank_pattern`` may vary it)."""
        ranks: dict[str, int] = {}
        for (_, module), weights in self.weights.items():
            ranks[module] = max(ranks.get(module, 0), weights.rank)
        return dict(sorted(ranks.items()))

    @property
    def max_rank(self) -> int:
        return max((w.rank for w in self.weights.values()), default=0)

    @functools.cached_property
    def num_parameters(self) -> int:
        """Memoised: the host cache sums it over every adapter it holds whenever a request comes."""
        return sum(w.num_parameters for w in self.weights.values())

    @property
    def num_bytes(self) -> int:
        """Size of all A and B matrices in float32."""
        return 4 * self.num_parameters

    def rank_of(self, layer: int, module: str) -> int:
        """Rank of ``module`` in ``layer``; 0 where the adapter leaves that projection unchanged."""
        weights = self.weights.get((layer, module))
        return 0 if weights is None else weights.rank
