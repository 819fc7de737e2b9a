"""The offline Python API: ``LLM(...).generate(prompts, params)``."""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Sequence as Seq
from typing import Any

from tqdm.auto import tqdm

from loraserve.adapters import AdapterInfo
from loraserve.config import EngineConfig
from loraserve.llm_engine import LLMEngine
from loraserve.outputs import RequestOutput
from loraserve.sampling_params import SamplingParams


class LLM:
    """One base model with its engine.

    ``LLM(model=None, **options)``: ``model`` is a local Hugging Face Llama-style
    directory, or ``None`` for the default model (SmolLM2-135M-Instruct). Options
    are the fields of :class:`loraserve.config.EngineConfig` (``block_size``,
    ``num_pages``, ``memory_budget_mb``, ``max_num_seqs``, ``device``, ``dtype``, ...).
    """

    def __init__(self, model: str | None = None, **options: Any) -> None:
        self.config = EngineConfig.from_options(model, **options)
        self.engine = LLMEngine(self.config)
        self._request_counter = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def add_adapter(self, name: str, path: str | os.PathLike[str], overwrite: bool = False) -> AdapterInfo:
        """Register a PEFT LoRA directory under ``name`` (validated; safetensors only)."""
        return self.engine.add_adapter(name, path, overwrite=overwrite)

    def remove_adapter(self, name: str) -> None:
        self.engine.remove_adapter(name)

    def list_adapters(self) -> list[AdapterInfo]:
        return self.engine.list_adapters()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False (nothing dropped) while requests are running."""
        return self.engine.reset_prefix_cache()

    def generate(
        self,
        prompts: str | Seq[str] | Seq[list[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        adapters: str | Seq[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order.

        ``adapters`` is one adapter name for all prompts or one per prompt (``None``
        is the base model).
        """
        prompt_list: list[str | list[int]] = [prompts] if isinstance(prompts, str) else list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompt_list)} prompts")
        # Only finished requests are returned: no per-step outputs, text decoded once at the end.
        final_only = {id(p): dataclasses.replace(p, output_kind="final_only") for p in params_list}
        params_list = [final_only[id(p)] for p in params_list]
        if adapters is None or isinstance(adapters, str):
            adapter_list: list[str | None] = [adapters] * len(prompt_list)
        else:
            adapter_list = list(adapters)
            if len(adapter_list) != len(prompt_list):
                raise ValueError(f"got {len(adapter_list)} adapters for {len(prompt_list)} prompts")
        request_ids = [str(next(self._request_counter)) for _ in prompt_list]
        try:
            for request_id, prompt, sampling, adapter in zip(
                request_ids, prompt_list, params_list, adapter_list, strict=True
            ):
                self.engine.add_request(request_id, prompt, sampling, adapter)
        except Exception:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(prompt_list), desc="generate", disable=not use_tqdm, unit="req") as progress:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        progress.update(1)
        return [finished[request_id] for request_id in request_ids]
