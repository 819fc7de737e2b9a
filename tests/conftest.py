"""Shared fixtures: the default model (converted once) and its Hugging Face twin."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from loraserve.models.loader import default_model_dir as resolve

    return resolve()


@pytest.fixture(scope="session")
def hf_model(default_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(default_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)
