"""vLLM's Prometheus names of the engine's state (``api/vllm_metrics.py``), as LoRA-aware routers
read them: requests running and waiting, the pool's share in use, and the adapters of the running
requests in ``vllm:lora_requests_info``; and vLLM's request counters and histograms."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from adapter_factory import make_peft_adapter
from loraserve.api import ServerSettings, ServerThread, create_app
from prometheus_client.parser import text_string_to_metric_families

from loraserve.config import EngineConfig
from loraserve.llm_engine import LLMEngine

pytestmark = pytest.mark.slow


def _vllm_samples(http: httpx.Client) -> dict[str, Any]:
    found = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name.startswith("vllm:"):
                found[sample.name + "".join(f",{v}" for k, v in sample.labels.items() if k == "finished_reason")] = (
                    sample
                )
    return found


def test_vllm_names_show_the_running_adapters(tiny_model_dir: Path, tiny_hf_model: Any, tmp_path: Path) -> None:
    config = EngineConfig(model=str(tiny_model_dir), num_pages=64, kernels="torch", registry=f"dir:{tmp_path / 'r'}")
    engine = LLMEngine(config)
    engine.add_adapter("mine", make_peft_adapter(tiny_hf_model, tmp_path / "mine", rank=4, target_modules=["q_proj"]))
    app = create_app(engine, ServerSettings(model_id="tiny"))
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        idle = _vllm_samples(http)
        assert idle["vllm:num_requests_running"].value == 0
        assert idle["vllm:num_requests_running"].labels == {"model_name": "tiny", "engine": "0"}
        no_adapters = {"max_lora": str(config.max_num_seqs), "running_lora_adapters": "", "waiting_lora_adapters": ""}
        assert idle["vllm:lora_requests_info"].labels == no_adapters
        body = {"model": "mine", "prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as streamed:
            lines = streamed.iter_lines()
            next(line for line in lines if line.startswith("data: {"))  # running now
            busy = _vllm_samples(http)
        assert busy["vllm:num_requests_running"].value == 1
        assert busy["vllm:lora_requests_info"].labels["running_lora_adapters"] == "mine"
        assert 0 < busy["vllm:kv_cache_usage_perc"].value <= 1
        done = http.post(
            "/v1/completions", json={"model": "tiny", "prompt": "x y", "max_tokens": 3, "ignore_eos": True}
        )
        assert done.status_code == 200, done.text
        after = _vllm_samples(http)
        assert after["vllm:request_success_total,length"].value == 1
        assert after["vllm:request_generation_tokens_sum"].value == 3
        assert after["vllm:e2e_request_latency_seconds_count"].value == 1
        assert after["vllm:prompt_tokens_total"].labels == {"model_name": "tiny", "engine": "0"}
        prompt_tokens = done.json()["usage"]["prompt_tokens"]
        assert after["vllm:request_prompt_tokens_sum"].value == prompt_tokens
        assert after["vllm:prefix_cache_queries_total"].value >= prompt_tokens  # both requests looked up
        assert after["vllm:num_preemptions_total"].value == 0
    engine.close()
