"""The engine: requests in, one scheduled step at a time, outputs back."""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Mapping
from typing import Any

import torch

from loraserve.adapters import (
    AdapterError,
    AdapterInfo,
    AdapterNotFoundError,
    AdapterRegistry,
    BaseModelShapes,
    make_store,
)
from loraserve.config import ConfigError, EngineConfig
from loraserve.detokenizer import Detokenizer
from loraserve.kernel_backend import select_backend
from loraserve.kv_cache_manager import KVCacheManager
from loraserve.lora.residency import AdapterManager
from loraserve.model_runner import ModelRunner, PageLayout
from loraserve.models.gemm_choice import GemmPlan, GemmPolicy, pack_linears
from loraserve.models.loader import cache_root, load_hf_config, load_model, resolve_model_dir
from loraserve.output_processor import OutputProcessor, Request
from loraserve.outputs import RequestOutput
from loraserve.page_pool import PagePool
from loraserve.sampling_params import SamplingParams
from loraserve.scheduler import Scheduler
from loraserve.sequence import FinishReason, Sequence, SequenceStatus

logger = logging.getLogger(__name__)
LOAD_WAIT_S = 0.05  # how long an idle step waits for an adapter load before returning


class RequestError(ValueError):
    """A request cannot be served as asked; the message says why."""


class UnknownAdapterError(RequestError, KeyError):
    """The request names an adapter that is not registered."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoTokenizer

        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device(config.device)
        self.model_dir = resolve_model_dir(config.model)
        self.hf_config = load_hf_config(self.model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.kernels = select_backend(config.kernels, self.device, config.torch_dtype)
        self.model = load_model(self.model_dir, self.hf_config, config.torch_dtype, self.device, self.kernels.model)
        self.layout = PageLayout.for_model(self.hf_config, config.block_size)
        page_bytes = self.layout.page_bytes(config.torch_dtype)
        num_pages = config.num_pages or max(2, config.memory_budget_mb * 2**20 // page_bytes)
        self.pool = PagePool(num_pages)
        host_pool = PagePool(config.num_swap_pages) if config.num_swap_pages else None
        num_watermark_pages = int(config.watermark * num_pages)
        self.kv_manager = KVCacheManager(
            self.pool, config.block_size, num_watermark_pages, host_pool, config.enable_prefix_caching
        )
        self._registry_dir: tempfile.TemporaryDirectory[str] | None = None
        if config.registry is None:
            self._registry_dir = tempfile.TemporaryDirectory(prefix="loraserve-adapters-")
            registry_spec = self._registry_dir.name
        else:
            registry_spec = config.registry
        self.adapter_registry = AdapterRegistry(
            make_store(registry_spec), BaseModelShapes.from_hf_config(self.hf_config)
        )
        self.adapters = AdapterManager(
            self.adapter_registry,
            self.pool,
            self.layout.num_layers,
            self.layout.page_elems,
            config.host_adapter_cache_mb * 2**20,
            num_watermark_pages,
        )
        self.scheduler = Scheduler(
            self.kv_manager, config.max_num_seqs, config.max_num_batched_tokens, config.preemption_mode, self.adapters
        )
        self.runner = ModelRunner(
            self.model,
            self.layout,
            num_pages,
            config.num_swap_pages,
            config.torch_dtype,
            self.device,
            self.kernels.make_lora_hook,
            config.seed,
        )
        self.gemm_plan = GemmPlan()  # the CPU GEMM kernel of each linear layer shape and row bucket
        if self.kernels.pack_linears:
            policy = GemmPolicy(
                config.cpu_gemm,
                max_rows=config.max_num_batched_tokens,
                row_limits=(("lm_head", config.max_num_seqs),),  # one row per sampled sequence
                cache_dir=cache_root() / "cpu_gemm",
            )
            self.gemm_plan = pack_linears(self.model, policy)
        elif config.cpu_gemm != "auto":
            raise ConfigError(f"cpu_gemm={config.cpu_gemm!r} needs the compiled CPU kernels (kernels 'cpu')")
        self.detokenizer = Detokenizer(self.tokenizer)
        self.max_model_len = config.max_model_len or int(self.hf_config.max_position_embeddings)
        self.max_seq_tokens = (num_pages - num_watermark_pages) * config.block_size
        self.output_processor = OutputProcessor(
            self.detokenizer, self.scheduler, _eos_token_ids(self.model_dir, self.tokenizer), self.max_model_len
        )
        self.requests: dict[str, Request] = {}
        # Requests whose adapter is being read and parsed (arrival order): not scheduled yet.
        self.loading: dict[str, Request] = {}
        logger.info(
            "engine ready: %s, %d pages of %d tokens (%.1f MiB)",
            self.model_dir,
            num_pages,
            config.block_size,
            num_pages * page_bytes / 2**20,
        )

    # ---- requests -------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        adapter_name: str | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """Queue a request; ``cache_salt`` keeps its prefix cache apart from other salts'."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        token_ids = self.encode(prompt)
        if len(token_ids) + params.max_tokens > self.max_model_len:
            raise RequestError(
                f"prompt ({len(token_ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                f"model's context length of {self.max_model_len} tokens"
            )
        adapter_id = self._resolve_adapter(adapter_name)
        if adapter_id is not None:
            self._check_fits(len(token_ids), params, adapter_id)
        seqs = [
            Sequence(
                request_id,
                list(token_ids),
                params,
                sample_index=i,
                adapter_name=adapter_name,
                adapter_id=adapter_id,
                cache_salt=cache_salt,
            )
            for i in range(params.n)
        ]
        request = Request(request_id, prompt if isinstance(prompt, str) else None, seqs, adapter_name, seqs[1:])
        self.requests[request_id] = request
        for seq in seqs:
            self.detokenizer.start(seq)
        if adapter_name is not None and adapter_id is None:
            self.loading[request_id] = request  # scheduled once the adapter is loaded (see step)
        else:
            self._schedule(request)
        return request

    def _check_fits(self, num_prompt_tokens: int, params: SamplingParams, adapter_id: str) -> None:
        adapter_pages = self.adapters.num_pages(adapter_id)
        if num_prompt_tokens + params.max_tokens + adapter_pages * self.config.block_size > self.max_seq_tokens:
            raise RequestError(
                f"prompt ({num_prompt_tokens} tokens) plus max_tokens ({params.max_tokens}) plus the adapter's "
                f"{adapter_pages} pages needs more pages than the pool holds ({self.max_seq_tokens} tokens); "
                "raise num_pages"
            )

    def _schedule(self, request: Request) -> None:
        adapter_id = request.seqs[0].adapter_id
        if adapter_id is not None:
            for _ in request.seqs:
                self.adapters.add_live_seq(adapter_id)
        self.scheduler.add(request.seqs[0])

    def _schedule_loaded(self) -> list[RequestOutput]:
        """Schedule the loading requests whose adapter is now in host memory; end those whose
        adapter could not be loaded (or does not fit the pool) with ``abort``, and report them."""
        failed: list[RequestOutput] = []
        for request_id, request in list(self.loading.items()):
            first = request.seqs[0]
            assert first.adapter_name is not None
            try:
                adapter_id = self.adapters.resolve_nowait(first.adapter_name)
                if adapter_id is None:
                    continue
                self._check_fits(first.num_prompt_tokens, first.params, adapter_id)
            except (AdapterError, RequestError) as error:  # AdapterNotFoundError: removed meanwhile
                logger.error("request %s: adapter %r: %s", request_id, first.adapter_name, error)
                del self.loading[request_id], self.requests[request_id]
                for seq in request.seqs:
                    seq.status, seq.finish_reason = SequenceStatus.FINISHED, FinishReason.ABORT
                output = self.output_processor.make_output(request)
                output.error = f"adapter {first.adapter_name!r} could not be loaded: {error}"
                failed.append(output)
                continue
            del self.loading[request_id]
            for seq in request.seqs:
                seq.adapter_id = adapter_id
            self._schedule(request)
        return failed

    def _resolve_adapter(self, adapter_name: str | None) -> str | None:
        if adapter_name is None:
            return None
        try:
            return self.adapters.resolve_nowait(adapter_name)
        except AdapterNotFoundError:
            raise UnknownAdapterError(f"adapter {adapter_name!r} is not registered") from None

    # ---- adapters -------------------------------------------------------------------
    def add_adapter(self, name: str, path: str | os.PathLike[str], overwrite: bool = False) -> AdapterInfo:
        """Register the PEFT directory at ``path`` under ``name`` (validated first)."""
        return self.adapters.register_from_path(name, str(path), overwrite=overwrite)

    def register_adapter(self, name: str, files: Mapping[str, bytes], overwrite: bool = False) -> AdapterInfo:
        """Register PEFT files given as bytes (``adapter_config.json``, ``adapter_model.safetensors``)."""
        return self.adapters.register(name, files, overwrite=overwrite)

    def remove_adapter(self, name: str) -> None:
        """Unregister ``name``: new requests cannot use it; requests in flight finish on it."""
        self.adapters.remove(name)

    def list_adapters(self) -> list[AdapterInfo]:
        return [self.adapters.info(name) for name in self.adapter_registry.names()]

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            token_ids = list(self.tokenizer.encode(prompt))
        else:
            token_ids = [int(t) for t in prompt]
            vocab = int(self.hf_config.vocab_size)
            bad = [t for t in token_ids if not 0 <= t < vocab]
            if bad:
                raise RequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if not token_ids:
            raise RequestError("the prompt is empty")
        return token_ids

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        if self.loading.pop(request_id, None) is not None:  # never scheduled, holds nothing
            for seq in request.seqs:
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, FinishReason.ABORT
            return
        for seq in request.pending_forks:
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = FinishReason.ABORT
            if seq.adapter_id is not None:
                self.adapters.drop_live_seq(seq.adapter_id)
        request.pending_forks = []
        for seq in request.seqs:
            self.scheduler.finish(seq, FinishReason.ABORT)

    def reset_prefix_cache(self) -> bool:
        """Drop the cached prefix blocks (vLLM's name); False, changing nothing, while requests hold KV."""
        return self.kv_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self.loading)

    # ---- the step -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return the state of every request that changed.

        With nothing to run while adapters load, it waits for the oldest load (at most
        ``LOAD_WAIT_S``) and returns.
        """
        failed = self._schedule_loaded() if self.loading else []
        batch = self.scheduler.schedule()
        if batch.is_empty:
            if self.loading:
                first = next(iter(self.loading.values())).seqs[0]
                assert first.adapter_name is not None
                self.adapters.wait_for_load(first.adapter_name, timeout=LOAD_WAIT_S)
            elif self.scheduler.num_unfinished:
                raise RuntimeError("scheduler made no progress although requests are waiting")
            return failed
        sampled = self.runner.execute(batch)
        self.scheduler.update(batch)
        touched: dict[str, Request] = {}
        for seq, token in zip(batch.seqs, sampled, strict=True):
            if token is None or seq.is_finished:
                continue
            seq.append_token(token)
            request = self.requests[seq.request_id]
            if request.pending_forks and seq is request.seqs[0]:
                for child in reversed(request.pending_forks):
                    self.scheduler.add_fork(seq, child)
                request.pending_forks = []
            self.output_processor.check_stop(seq, token)
            if seq.params.output_kind == "cumulative" or request.is_finished:
                touched[seq.request_id] = request
        outputs = [self.output_processor.make_output(request) for request in touched.values()]
        for output in outputs:
            if output.finished:
                del self.requests[output.request_id]
        return failed + outputs


def _eos_token_ids(model_dir: Any, tokenizer: Any) -> frozenset[int]:
    from transformers import GenerationConfig

    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    try:
        generation = GenerationConfig.from_pretrained(model_dir)
    except OSError:
        return frozenset(ids)
    eos = generation.eos_token_id
    ids.update([eos] if isinstance(eos, int) else list(eos or []))
    return frozenset(ids)
