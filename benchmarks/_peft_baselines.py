"""The PEFT baselines of ``benchmarks.many_adapters``, served against the same arrival clock.

A loop on the real clock takes the requests that have arrived (in arrival order) and serves them
in static batches of at most ``batch`` with Hugging Face ``generate`` (greedy):

* ``peft-one`` (S-LoRA's "PEFT" baseline): the adapter of the oldest waiting request is made
  active with ``set_adapter``, and the batch is the waiting requests of that adapter only;
* ``peft-mixed`` (PEFT's best mode): the oldest waiting requests whatever their adapters, one
  ``generate(..., adapter_names=[...])`` call.

Different lengths in one batch: prompts are left-padded to the longest (attention mask), and the
batch generates the LONGEST output length of its requests (``min_new_tokens = max_new_tokens``, so
EOS cannot end it early); a stopping criterion records the time of every generated token, request
``i`` gets its first token at the batch's first and finishes at the time of its own
``output_len``-th token (its later tokens are computed and thrown away; only its own count). A
request's TTFT thus includes its wait for the batches before it. Adapters are loaded with
``load_adapter`` the first time they are needed, inside the clock (loraserve reads its adapters
inside the clock too) and kept (with ``max_loaded`` set, at most that many: least recently used
deleted). The first adapter of the stream is loaded with the model, before the clock. The time cap
is checked at every token: the requests of a batch cut by it are not finished, but the tokens each
got before the cap count in the run's tokens (as loraserve's would).
"""

from __future__ import annotations

import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from benchmarks._arrivals import Stream, Timing
from benchmarks._many_report import RunResult


class _Clock:
    """A stopping criterion: the time of every generated token; stops everything past the deadline."""

    def __init__(self, deadline: float) -> None:
        self.deadline, self.times = deadline, list[float]()

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        now = time.perf_counter()
        self.times.append(now)
        return torch.full((input_ids.shape[0],), now > self.deadline, dtype=torch.bool)


class PeftBaseline:
    """One base model and a ``PeftModel`` over it, rebuilt for every run (adapters start cold)."""

    def __init__(self, model_dir: Path, adapter_dir: Callable[[int], Path], adapter_name: Callable[[int], str],
                 batch: int, dtype: torch.dtype = torch.float32, max_loaded: int | None = None) -> None:  # fmt: skip
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        warnings.filterwarnings("ignore", module="transformers|peft")
        self.model_dir, self.adapter_dir, self.adapter_name = model_dir, adapter_dir, adapter_name
        self.batch, self.dtype = batch, dtype
        self.max_loaded = None if max_loaded is None else max(max_loaded, batch)
        self.model: Any = None
        self.loaded: OrderedDict[str, None] = OrderedDict()
        self.loads = 0

    def _reset(self, first: int) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        self.model = None
        base = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype).eval()
        self.pad = int(base.config.pad_token_id if base.config.pad_token_id is not None else 0)
        name = self.adapter_name(first)
        # PEFT keeps an adapter's float32 weights in float32 over a bfloat16 base: .to() casts them (each load too).
        self.model = PeftModel.from_pretrained(base, str(self.adapter_dir(first)), adapter_name=name).to(self.dtype)
        self.model.eval()
        self.loaded, self.loads = OrderedDict({name: None}), 0
        self._generate([[self.pad + 1] * 4], [name], 2, None, float("inf"))  # warm-up

    def _ensure(self, index: int) -> str:
        name = self.adapter_name(index)
        if name in self.loaded:
            self.loaded.move_to_end(name)
            return name
        self.model.load_adapter(str(self.adapter_dir(index)), adapter_name=name)
        self.model.to(self.dtype)
        self.loads += 1
        self.loaded[name] = None
        while self.max_loaded is not None and len(self.loaded) > self.max_loaded:
            old, _ = self.loaded.popitem(last=False)
            if old == self.model.active_adapter:  # never delete the active one: make the newest active first
                self.model.set_adapter(name)
            self.model.delete_adapter(old)
        return name

    @torch.inference_mode()
    def _generate(self, prompts: list[list[int]], names: list[str], new: int, one: str | None,
                  deadline: float) -> list[float]:  # fmt: skip
        """Left-padded batch generating ``new`` tokens; the time of each token (fewer if cut)."""
        from transformers import StoppingCriteriaList

        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :], mask[row, width - len(prompt) :] = torch.tensor(prompt), 1
        clock = _Clock(deadline)
        kwargs: dict[str, Any] = {"adapter_names": names} if one is None else {}
        if one is not None:
            self.model.set_adapter(one)
        self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                            do_sample=False, pad_token_id=self.pad, stopping_criteria=StoppingCriteriaList([clock]),
                            **kwargs)  # fmt: skip
        return clock.times

    def serve(self, stream: Stream, num_adapters: int, system: str, timeout: float) -> RunResult:
        """Serve the stream as ``system`` (``peft-one`` or ``peft-mixed``) with the time cap ``timeout``."""
        adapters = stream.adapters(num_adapters)
        self._reset(adapters[0])
        result = RunResult(system, num_adapters, stream.output_lens, [Timing(a) for a in stream.arrivals])
        waiting: list[int] = []
        arrived = finished = 0
        progress = tqdm(total=len(stream), desc=f"{system} N={num_adapters}", unit="req", leave=False)
        start = time.perf_counter()
        while finished < len(stream):
            now = time.perf_counter() - start
            if now > timeout:
                result.timed_out = True
                break
            while arrived < len(stream) and stream.arrivals[arrived] <= now:
                waiting.append(arrived)
                arrived += 1
            if not waiting:
                time.sleep(min(stream.arrivals[arrived] - now, timeout - now) + 1e-4)
                continue
            if system == "peft-one":
                batch = [i for i in waiting if adapters[i] == adapters[waiting[0]]][: self.batch]
            else:
                batch = waiting[: self.batch]
            taken = set(batch)
            waiting = [i for i in waiting if i not in taken]
            names = [self._ensure(adapters[i]) for i in batch]
            new = max(stream.output_lens[i] for i in batch)
            times = self._generate([stream.prompts[i] for i in batch], names, new,
                                   names[0] if system == "peft-one" else None, start + timeout)  # fmt: skip
            for i in batch:
                n = stream.output_lens[i]
                timing = result.timings[i]
                if times:
                    timing.first = times[0] - start
                if len(times) >= n and times[n - 1] - start <= timeout:
                    timing.finish, timing.tokens = times[n - 1] - start, n
                    finished += 1
                    progress.update(1)
                else:  # cut by the cap: the tokens it got in time
                    timing.tokens = sum(1 for at in times[:n] if at - start <= timeout)
        progress.close()
        finishes = [t.finish for t in result.timings if t.finish is not None]
        result.wall_s = timeout if result.timed_out else max(finishes, default=0.0)
        result.stats = {"adapter_loads": self.loads, "adapters_used": len(set(adapters)), "peft_batch": self.batch}
        self.model = None
        return result
