"""The server's sampling defaults from the model's ``generation_config.json``, as vLLM takes them
(its ``--generation-config auto``, the default): a request field left out (or sent as null) takes
the model's value, else OpenAI's default. ``max_new_tokens`` becomes the default ``max_tokens`` of a
chat completion that names none. ``--generation-config vllm`` ignores the file (OpenAI's defaults
only); a directory reads that directory's file instead; ``--override-generation-config`` (JSON)
sets values over either."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from loraserve.sampling_params import SamplingParams, SamplingParamsError

logger = logging.getLogger(__name__)

# The fields vLLM takes from a generation config, by its names (HF's ``max_new_tokens``: max_tokens).
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
INT_FIELDS = ("top_k", "max_tokens")


def load_sampling_defaults(model_dir: Path, source: str, overrides: str | None) -> dict[str, float | int]:
    """The defaults for ``model_dir``'s model: ``source`` ``"auto"`` (its own
    ``generation_config.json``), ``"vllm"`` (none) or a directory holding a
    ``generation_config.json``; ``overrides`` a JSON object of generation-config fields set over
    them. A ValueError naming the problem for a bad source, file or override."""
    if source == "vllm":
        found: dict[str, Any] = {}
    else:
        folder = Path(model_dir) if source == "auto" else Path(source).expanduser()
        if source != "auto" and not (folder / "generation_config.json").is_file():
            raise ValueError(f"--generation-config {source!r}: no generation_config.json there (or give auto or vllm)")
        found = _model_generation_config(folder)
    if overrides:
        try:
            extra = json.loads(overrides)
        except json.JSONDecodeError as error:
            raise ValueError(f"--override-generation-config is not JSON: {error}") from None
        if not isinstance(extra, dict):
            raise ValueError("--override-generation-config must be a JSON object, e.g. '{\"temperature\": 0.5}'")
        found.update(extra)
    defaults = sampling_defaults(found)
    if defaults:
        logger.info("sampling defaults from the generation config (request fields override them): %s", defaults)
    return defaults


def _model_generation_config(folder: Path) -> dict[str, Any]:
    """The fields of ``folder/generation_config.json`` that differ from Hugging Face's defaults
    (``GenerationConfig.to_diff_dict``, vLLM's reading); {} without one."""
    if not (folder / "generation_config.json").is_file():
        return {}
    from transformers import GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(folder)
    except (OSError, ValueError) as error:
        raise ValueError(f"{folder / 'generation_config.json'} cannot be read: {error}") from None
    diff: dict[str, Any] = config.to_diff_dict()
    return diff


def sampling_defaults(config: dict[str, Any]) -> dict[str, float | int]:
    """The sampling defaults in a generation config's fields (other fields ignored, as vLLM does);
    a ValueError naming a field whose value is not a number of the right kind."""
    config = dict(config)
    if "max_new_tokens" in config:
        config["max_tokens"] = config.pop("max_new_tokens")
    defaults: dict[str, float | int] = {}
    for name in (*FLOAT_FIELDS, *INT_FIELDS):
        value = config.get(name)
        if value is None:
            continue
        integral = name in INT_FIELDS
        if isinstance(value, bool) or not isinstance(value, int | float) or (integral and value != int(value)):
            kind = "an integer" if integral else "a number"
            raise ValueError(f"generation config {name!r} must be {kind}, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"generation config {name!r} must be finite, got {value!r}")
        defaults[name] = int(value) if integral else float(value)
    try:  # the ranges a request's values are held to
        checked: dict[str, Any] = {**defaults, "top_k": -1 if defaults.get("top_k", 0) == 0 else defaults["top_k"]}
        SamplingParams(**checked)
    except SamplingParamsError as error:
        raise ValueError(f"generation config: {error}") from None
    return defaults
