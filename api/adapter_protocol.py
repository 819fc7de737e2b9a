"""Pydantic models of the adapter API's bodies (``/v1/adapters`` and vLLM's ``/v1/load_lora_adapter``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from .openai_protocol import RequestBody


class AdapterCard(BaseModel):
    id: str = Field(description="The adapter's name; pass it as `model` to use the adapter")
    object: Literal["adapter"] = "adapter"
    rank: int
    ranks: Any = Field(None, description="Per-module ranks when they differ")
    target_modules: list[str]
    digest: str = Field(description="Content digest of the adapter's weights and config")
    num_bytes: int
    num_parameters: int


class AdapterList(BaseModel):
    object: Literal["list"] = "list"
    data: list[AdapterCard]


class AdapterDeleted(BaseModel):
    id: str
    object: Literal["adapter"] = "adapter"
    deleted: bool = True


class LoadLoRAAdapterRequest(RequestBody):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1, description="A directory under one of the server's --allowed-lora-dir")
    load_inplace: bool = Field(False, description="Replace an adapter of that name (running requests keep the old)")
    is_3d_lora_weight: bool = Field(False, description="vLLM's flag for MoE adapters' 3D weights: refused if true")


class UnloadLoRAAdapterRequest(RequestBody):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None
