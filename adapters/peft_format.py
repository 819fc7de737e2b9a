"""Loading a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``).

Only safetensors is read: pickle-based checkpoints (``.bin``/``.pt``) are refused, and nothing
here ever calls ``torch.load`` or ``pickle``, because unpickling an uploaded file executes code.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from .errors import AdapterError
from .lora_weights import (
    PROJECTION_NAMES,
    PROJECTION_PARENTS,
    BaseModelShapes,
    LoRAAdapter,
    LoRAModuleWeights,
    module_key,
)
from .peft_config import CONFIG_FILE, LoraConfigView, parse_lora_config

__all__ = [
    "CONFIG_FILE",
    "PICKLE_SUFFIXES",
    "WEIGHTS_FILE",
    "BaseModelShapes",
    "LoRAAdapter",
    "LoRAModuleWeights",
    "load_adapter",
    "parse_adapter_files",
    "read_adapter_dir",
]

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Key layouts peft writes: "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight" for a
# CausalLM, without "base_model.model." from get_peft_model_state_dict, without "model." when the
# base was a bare LlamaModel, and with the adapter name ("lora_A.default.weight") in older files.
_TENSOR_KEY = re.compile(
    r"(?:base_model\.model\.)?(?:model\.)?layers\.(?P<layer>\d+)\.(?P<parent>\w+)\.(?P<module>\w+)"
    r"\.lora_(?P<factor>[AB])(?:\.[\w-]+)?\.weight"
)

# Diagnoses for keys that are not A/B matrices of a projection: (substring, explanation).
_KEY_DIAGNOSES: tuple[tuple[str, str], ...] = (
    ("lora_magnitude_vector", "DoRA magnitude vectors are not supported"),
    ("lora_embedding_", "LoRA on embeddings (embed_tokens) is not supported"),
    ("embed_tokens", "adapting embed_tokens is not supported"),
    ("lm_head", "adapting lm_head is not supported"),
    ("modules_to_save", "modules_to_save weights are not supported"),
    ("trainable_tokens", "trainable token weights are not supported"),
    (".bias", "LoRA bias tensors are not supported"),
)


def read_adapter_dir(path: str | os.PathLike[str]) -> dict[str, bytes]:
    """Read the two adapter files of a PEFT directory; refuse pickle-only checkpoints."""
    directory = Path(path)
    if not directory.is_dir():
        raise AdapterError(f"{directory}: not a directory")
    files: dict[str, bytes] = {}
    for file_name in (CONFIG_FILE, WEIGHTS_FILE):
        file_path = directory / file_name
        if file_path.is_file():
            files[file_name] = file_path.read_bytes()
    if WEIGHTS_FILE not in files:
        pickled = sorted(p.name for p in directory.glob("adapter_model.*") if p.suffix in PICKLE_SUFFIXES)
        if pickled:
            raise AdapterError(
                f"{directory / pickled[0]}: pickle checkpoints are refused (they can run code when loaded); "
                f"save the adapter with safetensors ({WEIGHTS_FILE})"
            )
        raise AdapterError(f"{directory}: missing {WEIGHTS_FILE}")
    if CONFIG_FILE not in files:
        raise AdapterError(f"{directory}: missing {CONFIG_FILE}")
    return files


def load_adapter(path: str | os.PathLike[str], shapes: BaseModelShapes, name: str) -> LoRAAdapter:
    """Load and validate the PEFT adapter directory at ``path`` for a base model with ``shapes``."""
    return parse_adapter_files(read_adapter_dir(path), shapes, name)


def parse_adapter_files(files: Mapping[str, bytes], shapes: BaseModelShapes, name: str) -> LoRAAdapter:
    """Validate and parse in-memory adapter files (keys are file names, e.g. from an upload).

    Raises :class:`AdapterError` naming the problem and the file or tensor key. Weights come back
    as float32 on CPU; the scale of each module is PEFT's ``lora_alpha / r`` (``/ sqrt(r)`` with
    rsLoRA) after ``rank_pattern``/``alpha_pattern``.
    """
    pickled = sorted(file_name for file_name in files if file_name.lower().endswith(PICKLE_SUFFIXES))
    if pickled:
        raise AdapterError(f"{pickled[0]}: pickle files are refused (they can run code when loaded); use safetensors")
    for required in (CONFIG_FILE, WEIGHTS_FILE):
        if required not in files:
            raise AdapterError(f"missing {required} (got files {sorted(files)})")
    config = parse_lora_config(bytes(files[CONFIG_FILE]))
    targets = config.resolve_targets(shapes.num_layers)
    factors = _group_factors(_read_tensors(bytes(files[WEIGHTS_FILE])), shapes.num_layers)
    for layer, module in sorted(factors.keys() - targets):
        raise AdapterError(
            f"{WEIGHTS_FILE}: has weights for layer {layer} {module}, which {CONFIG_FILE} does not target"
        )
    for layer, module in sorted(targets - factors.keys()):
        raise AdapterError(
            f"{WEIGHTS_FILE}: missing lora_A/lora_B for layer {layer} {module} targeted by {CONFIG_FILE}"
        )
    # Layer-major, projections in decoder order: errors name the first problem a reader would meet.
    ordered = sorted(factors.items(), key=lambda item: (item[0][0], PROJECTION_NAMES.index(item[0][1])))
    weights = {
        (layer, module): _module_weights(layer, module, pair, shapes, config) for (layer, module), pair in ordered
    }
    _check_finite(weights, factors)
    digest = _content_digest(weights, factors)
    logger.debug("parsed adapter %s: %d modules, digest %s", name, len(weights), digest)
    return LoRAAdapter(name=name, digest=digest, weights=weights)


def _read_tensors(data: bytes) -> dict[str, torch.Tensor]:
    try:
        return load_safetensors(data)
    except Exception as exc:  # safetensors raises its own error types for every malformation
        raise AdapterError(f"{WEIGHTS_FILE}: not a valid safetensors file: {exc}") from exc


def _diagnose_key(key: str) -> str:
    for needle, explanation in _KEY_DIAGNOSES:
        if needle in key:
            return explanation
    return "not a LoRA A/B weight of a decoder-layer projection"


def _group_factors(
    tensors: Mapping[str, torch.Tensor], num_layers: int
) -> dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]]:
    """Map (layer, module) -> {"A"|"B": (original key, tensor)}; reject every other tensor."""
    factors: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
    for key, tensor in tensors.items():
        match = _TENSOR_KEY.fullmatch(key)
        if match is None:
            raise AdapterError(f"{WEIGHTS_FILE}: tensor {key!r}: {_diagnose_key(key)}")
        layer, module = int(match["layer"]), match["module"]
        if module not in PROJECTION_NAMES or PROJECTION_PARENTS[module] != match["parent"]:
            raise AdapterError(
                f"{WEIGHTS_FILE}: tensor {key!r}: target module {match['parent']}.{module} is not supported; "
                f"only {', '.join(PROJECTION_NAMES)} can be adapted"
            )
        if layer >= num_layers:
            raise AdapterError(
                f"{WEIGHTS_FILE}: tensor {key!r}: layer {layer} does not exist (base model has {num_layers})"
            )
        pair = factors.setdefault((layer, module), {})
        factor = match["factor"]
        if factor in pair:
            raise AdapterError(f"{WEIGHTS_FILE}: tensors {pair[factor][0]!r} and {key!r} are the same weight")
        pair[factor] = (key, tensor)
    return factors


def _module_weights(
    layer: int,
    module: str,
    pair: Mapping[str, tuple[str, torch.Tensor]],
    shapes: BaseModelShapes,
    config: LoraConfigView,
) -> LoRAModuleWeights:
    where = f"{WEIGHTS_FILE}: layer {layer} {module}"
    for factor in ("A", "B"):
        if factor not in pair:
            raise AdapterError(f"{where}: missing lora_{factor} weight")
    (key_a, lora_a), (key_b, lora_b) = pair["A"], pair["B"]
    for key, tensor in ((key_a, lora_a), (key_b, lora_b)):
        if tensor.dtype not in _FLOAT_DTYPES:
            raise AdapterError(f"{WEIGHTS_FILE}: tensor {key!r}: dtype {tensor.dtype} is not a float type")
        if tensor.dim() != 2:
            raise AdapterError(f"{WEIGHTS_FILE}: tensor {key!r}: expected 2 dims, got shape {list(tensor.shape)}")
    in_features, out_features = shapes.module_shapes[module]
    rank = int(lora_a.shape[0])
    if int(lora_b.shape[1]) != rank:
        raise AdapterError(
            f"{where}: rank mismatch between lora_A {list(lora_a.shape)} (rank {rank}) and lora_B "
            f"{list(lora_b.shape)} (rank {lora_b.shape[1]})"
        )
    if int(lora_a.shape[1]) != in_features or int(lora_b.shape[0]) != out_features:
        raise AdapterError(
            f"{where}: shape mismatch with the base model: expected lora_A [r, {in_features}] and lora_B "
            f"[{out_features}, r], got lora_A {list(lora_a.shape)} and lora_B {list(lora_b.shape)}"
        )
    key = module_key(layer, module)
    expected_rank = config.rank_for(key)
    if rank != expected_rank:
        raise AdapterError(f"{where}: rank {rank} does not match {CONFIG_FILE} (r={expected_rank} for {key})")
    return LoRAModuleWeights(
        lora_a=lora_a.to(torch.float32).contiguous(),
        lora_b=lora_b.to(torch.float32).contiguous(),
        scale=config.scale_for(key),
    )


def _check_finite(
    weights: Mapping[tuple[int, str], LoRAModuleWeights],
    factors: Mapping[tuple[int, str], Mapping[str, tuple[str, torch.Tensor]]],
) -> None:
    """Reject NaN/inf anywhere, naming the first bad tensor in layer-major order.

    A finite sum of the tensors' sums proves every value finite (a NaN or an infinity survives
    any sum): one vectorised reduction per tensor, ~10x cheaper than ``isfinite`` over all of
    them. Only when the sum is not finite (a bad value, or an overflow) are the tensors checked
    one by one, to name the culprit.
    """
    sums = [t.sum() for w in weights.values() for t in (w.lora_a, w.lora_b)]
    if not sums or math.isfinite(float(torch.stack(sums).sum())):
        return
    for (layer, module), module_weights in weights.items():
        for factor, tensor in (("A", module_weights.lora_a), ("B", module_weights.lora_b)):
            if not bool(torch.isfinite(tensor).all()):  # the float32 copy: float64 values past its range too
                key = factors[(layer, module)][factor][0]
                raise AdapterError(
                    f"{WEIGHTS_FILE}: tensor {key!r} contains NaN or infinite values (or values past float32's range)"
                )


def _content_digest(
    weights: Mapping[tuple[int, str], LoRAModuleWeights],
    factors: Mapping[tuple[int, str], Mapping[str, tuple[str, torch.Tensor]]],
) -> str:
    """sha256 over the resolved scales and every tensor's canonical name, dtype, shape and bytes.

    Canonical names ("layers.3.q_proj.lora_A") make the digest independent of the key prefix
    variant and of tensor order in the file; the original dtype and bytes are hashed, so any weight
    change changes the digest. The scales stand for the config fields that matter (r, lora_alpha,
    use_rslora, rank/alpha patterns); the adapter's name is deliberately not included.
    """
    hasher = hashlib.sha256()
    scales = {f"layers.{layer}.{module}": w.scale for (layer, module), w in sorted(weights.items())}
    _update_framed(hasher, json.dumps({"format": "loraserve-lora/1", "scales": scales}, sort_keys=True).encode())
    for (layer, module), pair in sorted(factors.items()):
        for factor in ("A", "B"):
            tensor = pair[factor][1].contiguous()
            name = f"layers.{layer}.{module}.lora_{factor}"
            meta = {"name": name, "dtype": str(tensor.dtype), "shape": list(tensor.shape)}
            _update_framed(hasher, json.dumps(meta, sort_keys=True).encode())
            _update_framed(hasher, tensor.view(torch.uint8).numpy().data)
    return hasher.hexdigest()


def _update_framed(hasher: hashlib._Hash, data: bytes | memoryview) -> None:
    """Length-prefix each field so that no two different sequences hash the same byte stream."""
    view = memoryview(data)
    hasher.update(view.nbytes.to_bytes(8, "little"))
    hasher.update(view)
