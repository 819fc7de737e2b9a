"""``benchmarks/many_adapters.py`` and the arrival mode of ``benchmarks/serving.py``: the shared
workload's distributions, and a smoke run of each script on the tiny model whose results must hold
(every request served with its exact output length by every system; TTFTs for every request)."""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from pathlib import Path

import pytest
import torch
from adapter_factory import make_peft_adapter_for_config

from benchmarks import many_adapters, serving
from benchmarks._arrivals import Timing, latency_summary, make_stream, percentile

VOCAB = 1000


def test_power_law_draw_favours_low_indices() -> None:
    stream = make_stream(20_000, (1, 2), (1, 2), VOCAB, rate=1.0, cv=1.0, alpha=0.5, seed=1)
    counts = Counter(stream.adapters(10))
    assert [counts[i] for i in range(10)] == sorted(counts.values(), reverse=True)
    assert counts[0] / 20_000 == pytest.approx(0.1**0.5, abs=0.02)  # P(u < 0.1) for u ~ power(0.5)
    uniform = Counter(make_stream(20_000, (1, 2), (1, 2), VOCAB, rate=1.0, cv=1.0, alpha=1.0, seed=1).adapters(10))
    assert max(uniform.values()) / min(uniform.values()) < 1.15
    assert stream.adapters(1) == [0] * 20_000  # N=1: every request on adapter 0, same stream


def test_arrivals_poisson_gamma_and_all_at_once() -> None:
    gaps = lambda s: [b - a for a, b in zip([0.0, *s.arrivals], s.arrivals, strict=False)]  # noqa: E731
    poisson = gaps(make_stream(20_000, (1, 2), (1, 2), VOCAB, rate=4.0, cv=1.0, alpha=1.0, seed=2))
    assert statistics.fmean(poisson) == pytest.approx(0.25, rel=0.03)
    assert statistics.stdev(poisson) == pytest.approx(0.25, rel=0.05)  # exponential: std = mean
    bursty = gaps(make_stream(20_000, (1, 2), (1, 2), VOCAB, rate=4.0, cv=3.0, alpha=1.0, seed=2))
    assert statistics.fmean(bursty) == pytest.approx(0.25, rel=0.06)
    assert statistics.stdev(bursty) / statistics.fmean(bursty) == pytest.approx(3.0, rel=0.1)
    assert make_stream(5, (1, 2), (1, 2), VOCAB, rate=math.inf, cv=1.0, alpha=1.0, seed=2).arrivals == [0.0] * 5
    lens = make_stream(2_000, (8, 512), (8, 512), VOCAB, rate=1.0, cv=1.0, alpha=1.0, seed=3)
    assert min(map(len, lens.prompts)) >= 8 and max(map(len, lens.prompts)) < 512
    assert min(lens.output_lens) >= 8 and max(lens.output_lens) < 512
    assert all(32 <= t < VOCAB for p in lens.prompts for t in p)


def test_latency_summary() -> None:
    # Interpolated between the closest ranks, as numpy.percentile (and vllm bench serve).
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5 and percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert percentile([5.0], 99) == 5.0 and percentile([], 50) is None
    values = [float(v) for v in range(37, 0, -3)]
    assert [percentile(values, q) for q in (0, 10, 50, 99, 100)] == pytest.approx(
        [float(x) for x in __import__("numpy").percentile(values, [0, 10, 50, 99, 100])]
    )
    timings = [Timing(0.0, 1.0, 3.0, 3), Timing(1.0, 9.0, 10.0, 2), Timing(2.0)]  # the last never started
    s = latency_summary(timings, slo_ttft=5.0)
    assert s["ttft_p50_s"] == 4.5 and s["ttft_p99_s"] == pytest.approx(7.93) and s["tpot_p50_s"] == 1.0
    assert s["slo_attainment"] == pytest.approx(1 / 3)


def test_run_summary_over_every_request_of_a_run_cut_by_its_cap() -> None:
    """A PEFT run cut by its time cap: SLO over ALL requests (one never served misses it), TTFT
    of every request that started, and the tokens the cut batch made before the cap count."""
    from benchmarks._many_report import RunResult

    timings = [Timing(0.0, 1.0, 3.0, 3), Timing(0.0, 1.0, None, 2), Timing(0.0, 7.0, None, 1), Timing(0.0)]
    result = RunResult("peft-one", 1, [3, 5, 4, 4], timings, wall_s=10.0, timed_out=True)
    s = result.summary(slo_ttft=5.0)
    assert s["done"] == 1 and s["output_tokens"] == 6 and s["tok_s"] == pytest.approx(0.6)
    assert s["slo_attainment"] == pytest.approx(2 / 4) and s["ttft_p50_s"] == 1.0 and s["ttft_p99_s"] > 6.8


def test_many_adapters_smoke(tiny_model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out, plots = tmp_path / "many.json", tmp_path / "plots"
    argv = ["--model", str(tiny_model_dir), "--cache-dir", str(tmp_path / "adapters"), "--adapters", "1,3",
            "--requests", "16", "--min-len", "4", "--max-len", "12", "--rate", "40", "--alpha", "0.3",
            "--memory-budget-mb", "4", "--max-loras", "2", "--peft-batch", "4", "--peft-timeout", "60",
            "--threads", "1", "--json", str(out), "--plot-dir", str(plots)]  # fmt: skip
    threads = torch.get_num_threads()  # one thread: steady next to other work, and plenty for the tiny model
    try:
        many_adapters.main(argv)
    finally:
        torch.set_num_threads(threads)
    payload = json.loads(out.read_text())
    assert payload["machine"]["dtype"] == "float32"
    expected = payload["stream"]["output_lens"]
    assert len(expected) == 16 and all(4 <= n < 12 for n in expected)
    results = payload["results"]
    assert [(r["system"], r["num_adapters"]) for r in results] == [
        (s, n) for n in (1, 3) for s in ("loraserve", "fixed", "reserve", "peft-one", "peft-mixed")
    ]
    for r in results:
        assert r["done"] == 16 and not r["timed_out"] and r["skipped"] is None, r["label"]
        assert r["per_request"]["tokens"] == expected, r["label"]
        assert all(t is not None and t >= 0 for t in r["per_request"]["ttft_s"]), r["label"]
        ttfts = r["per_request"]["ttft_s"]
        assert r["req_s"] > 0 and r["ttft_p50_s"] == pytest.approx(statistics.median(ttfts)), r["label"]
        assert r["slo_attainment"] == sum(t < payload["args"]["slo_ttft"] for t in ttfts) / 16, r["label"]
    engines = [r for r in results if not r["system"].startswith("peft")]
    for r in engines:
        assert r["timeline"] and r["peak_kv_pages"] > 0 and r["peak_adapter_pages"] > 0, r["label"]
        assert 0 < r["kv_util_mean"] <= 1 and r["adapter_loads"] >= 1, r["label"]
        assert all(sum(row[1:6]) == r["pool_pages"] for row in r["timeline"]), r["label"]
    counts = Counter(min(2, int(u * 3)) for u in payload["stream"]["draws"])
    assert counts[0] > counts[1] >= counts[2]  # alpha < 1: the popular adapters first
    assert {r["adapters_used"] for r in results if r["num_adapters"] == 3} == {len(counts)}
    arrivals = payload["stream"]["arrivals_s"]
    gaps = [b - a for a, b in zip([0.0, *arrivals], arrivals, strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(1 / 40, rel=0.6)  # 16 gaps: a loose check; see above
    for name in ("throughput", "latency_cdf", "pool"):
        assert (plots / f"many_adapters_{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_many_adapters_dtype_reaches_loraserve_and_peft(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig

    from benchmarks._peft_baselines import PeftBaseline

    argv = ["--model", str(tiny_model_dir), "--cache-dir", str(tmp_path), "--adapters", "2", "--dtype", "bfloat16"]
    args = many_adapters.parse_args(argv)
    store = many_adapters.prepare_adapters(args, tiny_model_dir, AutoConfig.from_pretrained(tiny_model_dir), 2)
    assert all(many_adapters.engine_options(args, s, store)["dtype"] == "bfloat16" for s in ("loraserve", "fixed"))
    name = lambda i: many_adapters.adapter_name(i, args.ranks)  # noqa: E731
    peft = PeftBaseline(tiny_model_dir, lambda i: store / name(i), name, 2, torch.bfloat16)
    peft._reset(0)
    peft._ensure(1)  # a second adapter, loaded later: cast too (PEFT keeps float32 files in float32)
    assert {p.dtype for p in peft.model.parameters()} == {torch.bfloat16}
    assert len(peft.loaded) == 2


def test_serving_arrivals_against_loraserve(tiny_model_dir: Path, tmp_path: Path) -> None:
    from loraserve.api import ServerSettings, ServerThread, create_app
    from transformers import AutoConfig

    from loraserve.config import EngineConfig
    from loraserve.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_pages=256, max_num_seqs=16))
    config = AutoConfig.from_pretrained(tiny_model_dir)
    for i, rank in enumerate((8, 16)):
        path = make_peft_adapter_for_config(config, tmp_path / f"a{i}", rank=rank, target_modules=["q_proj"], seed=i)
        engine.add_adapter(f"a{i}", path)
    out = tmp_path / "serving.json"
    try:
        with ServerThread(create_app(engine, ServerSettings(model_id="tiny"))) as server:
            payload = serving.main(["--url", server.url, "--rate", "30", "--requests", "12", "--min-prompt", "4",
                                    "--max-prompt", "16", "--min-output", "2", "--max-tokens", "10", "--alpha", "0.5",
                                    "--json", str(out)])  # fmt: skip
            closed = serving.main(["--url", server.url, "--quick", "--phases", "lora"])  # the closed loop still works
    finally:
        engine.close()
    assert payload is not None and payload == json.loads(out.read_text())
    assert payload["model_ids"] == ["tiny", "a0", "a1"]
    for phase in payload["phases"]:
        assert phase["ok"] == 12 and phase["failed"] == 0 and phase["short"] == 0, phase
        assert len(phase["ttfts_s"]) == 12 and all(t is not None and t > 0 for t in phase["ttfts_s"]), phase
        assert phase["ttft_p99_s"] >= phase["ttft_p50_s"] > 0 and phase["tpot_p50_s"] > 0
        slo = payload["args"]["slo_ttft"]
        assert phase["slo_attainment"] == sum(t < slo for t in phase["ttfts_s"]) / 12, phase
    assert closed is not None and closed["phases"][0]["ok"] == 8 and closed["phases"][0]["short"] == 0
