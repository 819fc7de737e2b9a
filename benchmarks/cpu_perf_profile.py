"""``benchmarks.cpu_perf``'s decode profile: one full-batch decode step's time split into attention,
the base model's matmuls, LoRA, sampling, other ops and Python overhead, with ``torch.profiler``
and ``record_function`` scopes around the engine's parts."""

from __future__ import annotations

import contextlib
import inspect
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks._workload import Workload, adapter_name

SCOPE = "cpu_perf::"
MATMULS = frozenset(  # the base model's GEMM ops, including oneDNN's on prepacked weights (its bfloat16 path)
    {"aten::linear", "aten::addmm", "aten::mm", "aten::matmul", "aten::bmm", "cpu_kernels.linear_panels",
     "cpu_kernels.linear_pair_panels", "cpu_kernels.linear_dot", "cpu_kernels.linear_amx", "mkldnn::_linear_pointwise",
     "mkldnn::_linear_pointwise.binary"}
)  # fmt: skip
PARTS = ("attention", "base matmuls", "lora", "sampling", "other ops", "python overhead")


@contextlib.contextmanager
def profiler_scopes(engine: Any) -> Iterator[None]:
    """Wrap engine parts in ``record_function`` scopes (monkeypatching this engine; undone on exit).

    attention: every function the model imports from ``kernels/paged_attention.py`` and each
    layer's decode-attention kernel; lora: the LoRA hook's ``prepare`` and ``apply`` and every function imported
    from ``kernels/lora.py``; sampling: the sampler; schedule and prepare: the scheduler's and
    the batch builder's Python. Calls into the compiled CPU kernels are recorded as ops of
    their own (``cpu_kernels.*``), so their time counts as kernel time, not Python overhead.
    """
    from loraserve.kernels import cpu

    import loraserve.lora.apply_torch
    import loraserve.models.llama

    patched: list[tuple[Any, str, Any, bool]] = []

    def wrap(owner: Any, attr: str, scope: str) -> None:
        original: Callable[..., Any] = getattr(owner, attr)

        def scoped(*a: Any, **k: Any) -> Any:
            with record_function(SCOPE + scope):
                return original(*a, **k)

        patched.append((owner, attr, original, attr in vars(owner)))
        setattr(owner, attr, scoped)

    kernels = {"loraserve.kernels.paged_attention": "attention", "loraserve.kernels.lora": "lora"}
    for module in (loraserve.models.llama, loraserve.lora.apply_torch):
        for name, value in list(vars(module).items()):
            if inspect.isfunction(value) and value.__module__ in kernels:  # functions, not classes
                wrap(module, name, kernels[value.__module__])
    for layer in engine.model.model.layers:
        wrap(layer.self_attn, "decode_attention", "attention")
    extension = cpu.load_extension()
    if extension is not None:
        names = ("paged_decode_attention", "lora_segments", "linear_panels", "linear_pair_panels", "linear_dot",
                 "linear_amx", "rms_norm", "rope_", "write_kv_", "silu_and_mul_")  # fmt: skip
        for name in names:
            if not hasattr(extension, name):
                continue
            original = getattr(extension, name)
            patched.append((extension, name, original, True))
            setattr(extension, name, _recorded(f"cpu_kernels.{name}", original))
    runner = engine.runner
    if runner.lora_hook is not None:  # the hook object stays (the runner also asks it for upload_parts)
        wrap(runner.lora_hook, "prepare", "lora")
        wrap(runner.lora_hook, "apply", "lora")
    wrap(runner, "sampler", "sampling")
    wrap(runner, "prepare", "prepare")
    wrap(engine.scheduler, "schedule", "schedule")
    try:
        yield
    finally:
        for owner, attr, original, own in reversed(patched):
            if own:
                setattr(owner, attr, original)
            else:
                delattr(owner, attr)


def _recorded(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    def recorded(*a: Any, **k: Any) -> Any:
        with record_function(name):
            return function(*a, **k)

    return recorded


def _ancestors(event: Any) -> list[str]:
    """Names of ``event`` and of every event enclosing it."""
    chain: list[str] = []
    while event is not None:
        chain.append(event.name)
        event = event.cpu_parent
    return chain


def _bucket(event: Any) -> str:
    chain = _ancestors(event)
    for scope in ("attention", "lora", "sampling"):
        if SCOPE + scope in chain:
            return scope
    return "base matmuls" if MATMULS.intersection(chain) else "other ops"


def profile_decode(llm: Any, work: Workload, with_adapters: bool, steps: int) -> dict[str, Any]:
    """Fill the batch, run until every sequence decodes, time ``steps`` steps, then profile ``steps`` more."""
    from loraserve import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=work.max_tokens, ignore_eos=True)
    count = min(len(work.prompts), engine.config.max_num_seqs)
    ids = [f"profile-{with_adapters}-{i}" for i in range(count)]
    for i, request_id in enumerate(ids):
        engine.add_request(
            request_id, work.prompts[i], params, adapter_name(work.adapter_of[i]) if with_adapters else None
        )
    seqs = [seq for request_id in ids for seq in engine.requests[request_id].seqs]
    while not all(seq.num_output_tokens >= 1 for seq in seqs):  # prefill (chunked) until all decode
        engine.step()
    engine.step()  # warm
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    plain_ms = (time.perf_counter() - start) * 1e3 / steps
    walls: list[float] = []
    with profiler_scopes(engine), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t0)
    for request_id in ids:
        engine.abort_request(request_id)
    ops: dict[str, float] = defaultdict(float)
    scopes: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.name.startswith(SCOPE):
            if event.name not in _ancestors(event.cpu_parent):  # nested scopes of one name count once
                scopes[event.name[len(SCOPE) :]] += event.cpu_time_total / 1e3 / steps
        else:
            ops[_bucket(event)] += event.self_cpu_time_total / 1e3 / steps
    step_ms = sum(walls) * 1e3 / steps
    ops["python overhead"] = step_ms - sum(ops.values())
    return {"batch": count, "steps": steps, "step_ms": step_ms, "unprofiled_step_ms": plain_ms,
            "parts_ms": {part: ops.get(part, 0.0) for part in PARTS}, "scopes_ms": dict(scopes)}  # fmt: skip
