"""The engine: requests in, one scheduled step at a time, outputs back."""

from __future__ import annotations

import logging
import os
import random
import weakref
from collections.abc import Mapping

import torch

from loraserve.adapters import (
    AdapterError,
    AdapterInfo,
    AdapterNotFoundError,
    BaseModelShapes,
    RegistryUnavailableError,
)
from loraserve.config import ConfigError, EngineConfig
from loraserve.decode_path import DecodePathChoice
from loraserve.detokenizer import Detokenizer
from loraserve.engine_kernels import EngineKernels
from loraserve.engine_memory import EngineMemory, close_adapters
from loraserve.host_memory import keep_freed_blocks
from loraserve.input_processor import InputProcessor, RequestError
from loraserve.launched_step import LaunchedStep
from loraserve.lora.layout import max_rank_pages
from loraserve.lora.tile_choice import LoRAKernelPolicy, lora_hook_factory
from loraserve.model_runner import ModelRunner
from loraserve.models.loader import cache_root, load_hf_config, load_model, resolve_model_dir
from loraserve.outputs import RequestOutput
from loraserve.page_layout import PageLayout
from loraserve.page_pool import PagePool
from loraserve.request import Request, make_output
from loraserve.sampling_params import SamplingParams
from loraserve.scheduler import Scheduler
from loraserve.sequence import FinishReason, Sequence
from loraserve.stats import EngineStats, engine_stats
from loraserve.stop_checker import StopChecker, decodes_at_end, model_eos_token_ids
from loraserve.structured_outputs import GrammarCompiler, StructuredOutputsError

logger = logging.getLogger(__name__)
LOAD_WAIT_S = 0.05  # how long an idle step waits for an adapter load before returning


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
        if self.device.type == "cuda" and not (self.device.index or 0) < torch.cuda.device_count():
            built = "has" if torch.backends.cuda.is_built() else "has no"
            raise ConfigError(
                f"device {config.device!r}: no such CUDA device here (this torch build {built} CUDA; "
                f"{torch.cuda.device_count()} GPUs visible)"
            )
        if self.device.type == "cpu":
            keep_freed_blocks()  # a step's activations reuse the last step's memory, not fresh pages
        self.model_dir = resolve_model_dir(config.model)
        self.hf_config = load_hf_config(self.model_dir)
        positions = int(self.hf_config.max_position_embeddings)
        if config.max_model_len is not None and config.max_model_len > positions:  # as vLLM refuses it
            raise ConfigError(
                f"max_model_len={config.max_model_len} is above the model's context of {positions} tokens "
                f"(max_position_embeddings in {self.model_dir / 'config.json'})"
            )
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        chosen = EngineKernels.choose(config, self.hf_config, self.device)
        self.kernels = chosen.backend
        self.kernel_fallbacks = chosen.fallbacks
        self.attention_plan = chosen.attention_plan
        self.decode_attention_plan = chosen.decode_attention_plan
        self.max_model_len = config.max_model_len or positions
        # The CPU GEMM kernel of each linear layer shape and row bucket (empty off the cpu backend).
        self.model, self.gemm_plan = load_model(
            self.model_dir,
            self.hf_config,
            config.torch_dtype,
            self.device,
            chosen.model,
            chosen.gemm_policy,
            max_positions=self.max_model_len,
        )
        eos_token_ids = model_eos_token_ids(self.model_dir, self.tokenizer)
        self.inputs = InputProcessor(self.tokenizer, int(self.hf_config.vocab_size), self.max_model_len, eos_token_ids)
        self.grammars = GrammarCompiler(self.tokenizer, int(self.hf_config.vocab_size), eos_token_ids)
        self.layout = PageLayout.for_model(self.hf_config, config.block_size)
        shapes = BaseModelShapes.from_hf_config(self.hf_config)
        memory = EngineMemory.build(config, self.layout, shapes)
        self.pools, self.kv_manager = memory.pools, memory.kv_manager
        self.adapter_registry, self.adapters = memory.adapter_registry, memory.adapters
        self.private_registry_dir = memory.private_registry_dir  # None when config.registry names one
        # One finalizer for close() and for an engine dropped or alive at exit: the registry's
        # threads stop before a private registry directory is removed, so they never see it vanish.
        self._finalizer = weakref.finalize(self, close_adapters, self.adapters, self.private_registry_dir)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.scheduler = Scheduler(
            self.kv_manager,
            config.max_num_seqs,
            config.step_token_budget,
            config.preemption_mode,
            self.adapters,
            StopChecker(self.detokenizer, eos_token_ids, self.max_model_len),
        )
        # Where the compiled LoRA kernel can use AMX tiles: the segment lengths that do, timed or cached.
        lora_policy = LoRAKernelPolicy(config.cpu_lora, cache_root() / "cpu_lora")
        make_lora_hook, self.lora_plan = lora_hook_factory(
            self.kernels, shapes.module_shapes, config.torch_dtype, self.layout.page_elems, lora_policy
        )
        self.runner = ModelRunner(
            self.model,
            self.layout,
            memory.num_pages,
            config.num_swap_pages,
            config.torch_dtype,
            self.device,
            make_lora_hook,
            config.max_num_seqs,
            self.max_model_len,
            eos_token_ids,
            decode_graphs=chosen.decode_graphs,
            # Slot rows wide enough for rank 64 on every module: common adapters never regrow them.
            adapter_slot_pages=max_rank_pages(shapes.module_shapes, 64, self.layout.page_elems),
            adapter_decode=DecodePathChoice(config.adapter_decode_path),
            mask_tokens=self.kernels.mask_tokens,
        )
        if self.runner.decode_graphs is not None:
            self.runner.decode_graphs.warm_up()  # CUDA: every padded decode size captured now
        self.requests: dict[str, Request] = {}
        self._in_flight: LaunchedStep | None = None  # async scheduling: the step whose tokens are on their way
        self._host_bound: set[str] = set()  # requests whose steps may not overlap (``needs_host_tokens``)
        self._seed_rng = random.Random(config.seed)  # sampling seeds of requests that give none
        logger.info(
            "engine ready: %s, %d pages of %d tokens (%.1f MiB)",
            self.model_dir,
            memory.num_pages,
            config.block_size,
            memory.num_pages * memory.page_bytes / 2**20,
        )

    @property
    def pool(self) -> PagePool:
        """The pool KV blocks take pages from (adapters too, when unified)."""
        return self.pools.kv

    @property
    def max_seq_tokens(self) -> int:
        """The most tokens (prompt and output) one sequence's KV can take in the pool, alone (less
        its adapter's pages in a unified pool): a request past it is refused at arrival."""
        return self.scheduler.admission.max_seq_tokens

    @property
    def adapter_pool(self) -> PagePool:
        """The pool adapters take pages from: ``pool`` itself unless the adapter region is fixed."""
        return self.pools.adapters

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
        token_ids = self.inputs.encode(prompt)
        self.inputs.check(len(token_ids), params)
        bad_words = self.inputs.bad_words_token_ids(params.bad_words)
        self.inputs.check_samplable(params, bad_words)
        adapter_id = self._resolve_adapter(adapter_name)
        params, error = self.scheduler.admission.fitted(params, len(token_ids), adapter_id)  # with its adapter
        if error is not None:
            raise RequestError(error)
        constraint = params.structured_outputs
        try:
            stops = params.stop_token_ids
            grammars = [self.grammars.matcher(constraint, stops) if constraint else None for _ in range(params.n)]
        except StructuredOutputsError as bad:
            raise RequestError(str(bad)) from None
        seqs = [
            Sequence(
                request_id,
                list(token_ids),
                params,
                sample_index=i,
                adapter_name=adapter_name,
                adapter_id=adapter_id,
                cache_salt=cache_salt,
                random_seed=self._seed_rng.getrandbits(63),
                bad_words_token_ids=bad_words,
                grammar=grammars[i],
            )
            for i in range(params.n)
        ]
        request = Request(request_id, prompt if isinstance(prompt, str) else None, seqs, adapter_name)
        self.requests[request_id] = request
        if params.needs_host_tokens:
            self._host_bound.add(request_id)
        for seq in seqs:
            self.detokenizer.start(seq)
        self.scheduler.add(seqs[0], forks=seqs[1:])  # waits for the adapter's files if they are on their way
        return request

    def _resolve_adapter(self, adapter_name: str | None) -> str | None:
        if adapter_name is None:
            return None
        try:
            return self.adapters.resolve_nowait(adapter_name)
        except AdapterNotFoundError:
            raise UnknownAdapterError(f"adapter {adapter_name!r} is not registered") from None
        except RegistryUnavailableError:
            raise
        except AdapterError:  # its read or parse failed: the request waits with those that did, and
            return None  # ends as they do at the next step (the resolver remembers the failure)

    # ---- adapters -------------------------------------------------------------------
    def add_adapter(self, name: str, path: str | os.PathLike[str], overwrite: bool = False) -> AdapterInfo:
        """Register the PEFT directory at ``path`` under ``name`` (validated first)."""
        return self.adapters.resolver.register_from_path(name, str(path), overwrite=overwrite)

    def register_adapter(self, name: str, files: Mapping[str, bytes], overwrite: bool = False) -> AdapterInfo:
        """Register PEFT files given as bytes (``adapter_config.json``, ``adapter_model.safetensors``)."""
        return self.adapters.resolver.register(name, files, overwrite=overwrite)

    def remove_adapter(self, name: str) -> None:
        """Unregister ``name``: new requests cannot use it; requests in flight finish on it."""
        self.adapters.resolver.remove(name)

    def adapter_info(self, name: str) -> AdapterInfo:
        """``name``'s summary (parsed once per stored content); ``AdapterNotFoundError`` if not registered."""
        return self.adapters.resolver.info(name)

    def list_adapters(self) -> list[AdapterInfo]:
        """Every registered adapter that can be served: one deleted while the list is read is left
        out, as is one whose stored files no longer parse (logged once; its requests get that error).
        ``RegistryUnavailableError`` when the registry cannot be read."""
        infos = []
        for name in self.adapter_registry.names():
            try:
                infos.append(self.adapters.resolver.info(name))
            except RegistryUnavailableError:
                raise
            except AdapterNotFoundError:
                continue
            except AdapterError:
                continue  # logged where it was parsed
        return infos

    def abort_request(self, request_id: str) -> None:
        request = self._forget(request_id)
        if request is not None:
            for seq in request.seqs:  # the first sample also ends the others not forked yet
                self.scheduler.finish(seq, FinishReason.ABORT)

    def finish_request(self, request_id: str) -> RequestOutput | None:
        """End a request now, as ``abort_request`` does, and return its output so far (None if it
        is unknown): the end of a drain that ran out of time. Text decoded only at the end
        (``final_only``) is decoded here, so the output carries what was generated."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.is_finished and decodes_at_end(seq.params):
                self.detokenizer.update(seq, at_once=True)
        self.abort_request(request_id)
        return make_output(request)

    def close(self) -> None:
        """Stop following the registry and reading adapters (the background threads) and remove a
        private registry directory; the engine serves nothing after this."""
        self._finalizer()

    def reset_prefix_cache(self) -> bool:
        """Drop the cached prefix blocks (vLLM's name); False, changing nothing, while requests hold KV."""
        return self.kv_manager.reset_prefix_cache()

    def stats(self) -> EngineStats:
        """A snapshot of pages, queues and counters (call on the engine's thread)."""
        return engine_stats(self)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the step -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; return the state of every request that changed.

        With ``async_scheduling`` it launches the step and then collects the one launched before
        (whose GPU work ran while this step was scheduled and prepared); a request that needs
        each step's tokens on the host first (``needs_host_tokens``) turns the overlap off while
        it runs. With nothing to run while adapters load, it waits for the oldest load (at most
        ``LOAD_WAIT_S``) and returns.
        """
        outputs: list[RequestOutput] = []
        if self._in_flight is not None and self._host_bound:
            outputs += self._collect_in_flight()
        batch = self.scheduler.schedule()
        outputs += [self._aborted_output(seq, error, code) for seq, error, code in batch.aborted]
        if batch.is_empty:
            if self._in_flight is not None:
                outputs += self._collect_in_flight()
            elif self.scheduler.loading:
                self.scheduler.wait_for_adapter(LOAD_WAIT_S)
            elif self.scheduler.num_unfinished:
                raise RuntimeError("scheduler made no progress although requests are waiting")
            return outputs
        try:
            launched = self.runner.launch(batch, self._in_flight)
        except BaseException:
            self.adapters.unwritten(batch.adapter_loads)  # never served from pages it may not have filled
            raise
        if not self.config.async_scheduling:
            return outputs + self._outputs(launched, in_flight=False)
        self.scheduler.launched(batch)
        previous, self._in_flight = self._in_flight, launched
        if previous is not None:
            outputs += self._outputs(previous, in_flight=True)
        if not self.scheduler.num_unfinished:  # its sequences all ended: nothing waits on its tokens
            outputs += self._collect_in_flight()
        return outputs

    def _collect_in_flight(self) -> list[RequestOutput]:
        assert self._in_flight is not None
        launched, self._in_flight = self._in_flight, None
        return self._outputs(launched, in_flight=True)

    def _outputs(self, launched: LaunchedStep, in_flight: bool) -> list[RequestOutput]:
        """Hand a step's tokens to the scheduler; the outputs of the requests that changed."""
        sampled = self.runner.collect(launched)
        touched: dict[str, Request] = {}
        for seq in self.scheduler.update_from_output(launched.batch, sampled, launched=in_flight):
            cumulative = seq.params.output_kind == "cumulative"
            if not (cumulative or seq.is_finished):
                continue  # final_only and still running: nothing to report (the common case)
            request = self.requests.get(seq.request_id)
            if request is not None and (cumulative or request.is_finished):
                touched[seq.request_id] = request
        outputs = []
        for request in touched.values():
            output = make_output(request)
            outputs.append(output)
            if output.finished:
                self._forget(request.request_id)
        return outputs

    def _forget(self, request_id: str) -> Request | None:
        self._host_bound.discard(request_id)
        return self.requests.pop(request_id, None)

    def _aborted_output(self, seq: Sequence, error: str, code: str | None) -> RequestOutput:
        request = self._forget(seq.request_id)
        assert request is not None
        output = make_output(request)
        output.error = error
        # "registry_unavailable": retry later
        output.error_code = code or self.adapters.resolver.error_code(seq.adapter_name)
        return output
