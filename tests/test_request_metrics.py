"""Per-request latency histograms of ``/metrics`` (``api/metrics.py``), fed outputs as the engine
loop feeds them: time to first token and inter-token latency come from the engine's token times
(``RequestOutput.metrics``), so a request that is not streamed, reported once at its end, is
measured as a streamed one is; and those times as the engine records them."""

from __future__ import annotations

from pathlib import Path

import pytest
from loraserve.api.metrics import ServerMetrics
from loraserve.api.vllm_metrics import token_buckets

from loraserve import LLM, SamplingParams
from loraserve.outputs import CompletionOutput, RequestOutput

MODEL = "base"


def _output(num_tokens: int, finished: bool, first: float, last: float) -> RequestOutput:
    completion = CompletionOutput(0, "", list(range(num_tokens)), "length" if finished else None)
    times = {"arrival_time": 0.0, "first_token_time": first, "last_token_time": last}
    return RequestOutput("r", None, [1, 2, 3], [completion], finished, metrics=times)


def _histogram(metrics: ServerMetrics, name: str) -> tuple[float, float]:
    """(count, sum) of a histogram's series for MODEL."""
    values = [metrics.registry.get_sample_value(f"{name}_{part}", {"model": MODEL}) for part in ("count", "sum")]
    return values[0] or 0.0, values[1] or 0.0


def test_a_request_reported_once_at_its_end_is_timed_by_its_tokens() -> None:
    metrics = ServerMetrics(MODEL, 2048)
    metrics.request_started("r", None, 100.0)
    metrics.request_output(_output(5, True, first=100.5, last=101.3), now=102.0)  # final_only: one report
    assert _histogram(metrics, "loraserve_time_to_first_token_seconds") == (1, pytest.approx(0.5))
    assert _histogram(metrics, "loraserve_inter_token_latency_seconds") == (4, pytest.approx(0.8))
    assert _histogram(metrics, "loraserve_e2e_request_latency_seconds") == (1, pytest.approx(2.0))


def test_a_streamed_request_is_timed_by_its_tokens_too() -> None:
    metrics = ServerMetrics(MODEL, 2048)
    metrics.request_started("r", None, 10.0)
    metrics.request_output(_output(1, False, first=10.2, last=10.2), now=10.25)
    metrics.request_output(_output(2, False, first=10.2, last=10.3), now=10.5)  # delivered late: not counted
    metrics.request_output(_output(4, True, first=10.2, last=10.6), now=10.7)  # two tokens in one report
    assert _histogram(metrics, "loraserve_time_to_first_token_seconds") == (1, pytest.approx(0.2))
    assert _histogram(metrics, "loraserve_inter_token_latency_seconds") == (3, pytest.approx(0.4))


def test_the_engine_reports_its_token_times(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), kernels="torch", block_size=4)
    (output,) = llm.generate(["a prompt"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    times = output.metrics
    assert times["arrival_time"] <= times["first_token_time"] < times["last_token_time"]


def test_vllm_names_record_the_same_requests() -> None:
    """vLLM's series (labels ``model_name``, ``engine``) get what ``loraserve_*`` get, adapters'
    requests in the one series, plus each request's token counts and time per output token."""
    metrics = ServerMetrics(MODEL, 2048)
    metrics.request_started("r", "an-adapter", 100.0)
    metrics.request_output(_output(5, True, first=100.5, last=101.3), now=102.0)
    labels = {"model_name": MODEL, "engine": "0"}

    def value(name: str, **extra: str) -> float | None:
        return metrics.registry.get_sample_value(name, {**labels, **extra})

    assert value("vllm:time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert value("vllm:inter_token_latency_seconds_count") == 4
    assert value("vllm:request_time_per_output_token_seconds_sum") == pytest.approx(0.8 / 4)
    assert value("vllm:e2e_request_latency_seconds_sum") == pytest.approx(2.0)
    assert value("vllm:request_prompt_tokens_sum") == 3 and value("vllm:request_generation_tokens_sum") == 5
    assert value("vllm:prompt_tokens_total") == 3 and value("vllm:generation_tokens_total") == 5
    assert value("vllm:request_success_total", finished_reason="length") == 1
    assert value("vllm:request_success_total", finished_reason="stop") == 0  # every reason from the start
    assert token_buckets(2048) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    # n = 2: each sample counted as a request (vLLM's), the time per output token from the first
    samples = [CompletionOutput(0, "", [1, 2, 3], "stop"), CompletionOutput(1, "", [4], "length")]
    times = {"arrival_time": 0.0, "first_token_time": 10.2, "last_token_time": 10.6}
    metrics.request_started("s", None, 10.0)
    metrics.request_output(RequestOutput("s", None, [1, 2], samples, True, metrics=times), now=11.0)
    assert value("vllm:request_success_total", finished_reason="stop") == 1
    assert value("vllm:request_success_total", finished_reason="length") == 2
    assert value("vllm:request_generation_tokens_count") == 3 and value("vllm:e2e_request_latency_seconds_count") == 3
    assert value("vllm:request_time_per_output_token_seconds_count") == 2
    assert value("vllm:request_time_per_output_token_seconds_sum") == pytest.approx(0.8 / 4 + 0.4 / 2)
