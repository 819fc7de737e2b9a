"""``benchmarks/paging_sim.py`` (the PagedAttention memory study on the real scheduler): its
``--quick`` runs, and the invariants each policy must keep whatever the numbers."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import paging_sim
from loraserve.page_pool import PagePool
from loraserve.sampling_params import SamplingParams
from loraserve.scheduler import Scheduler
from loraserve.sequence import Sequence

ROOT = Path(__file__).resolve().parents[1]
QUICK_WORK = paging_sim.draw_workload(200, 0, 4096)
_runs: dict[tuple[str, ...], dict[str, Any]] = {}


def quick(*argv: str) -> dict[str, Any]:
    """The single result of ``--quick`` with these options (each run once per session)."""
    if argv not in _runs:
        (_runs[argv],) = paging_sim.main(["--quick", *argv])
    return _runs[argv]


@pytest.mark.parametrize("policy", paging_sim.POLICIES)
def test_quick_run_keeps_the_invariants(policy: str) -> None:
    result = quick("--policy", policy)
    assert result["requests"] == 200 and result["cache_gb"] == 6.0
    assert result["tokens"] == sum(o for _, o in QUICK_WORK)  # every request ended at its drawn length
    assert 0 < result["utilization"] <= 1 and 0 < result["pool_used"] <= 1
    assert 1 <= result["avg_batch"] <= result["max_batch"]
    assert result["tokens_per_s"] > 0 and result["sim_s"] > 0
    assert (result["preemptions"] == 0) == (result["recompute_tokens"] == 0)
    if policy != "paged":  # every slot a request gets is held from admission: nothing to preempt for
        assert result["preemptions"] == 0 and result["block_size"] == 1


def test_reserve_holds_the_maximum_length() -> None:
    result = quick("--policy", "reserve")
    assert result["max_batch"] <= result["kv_slots"] // 4096
    expected_waste = sum(4096 - (p + o - 1) for p, o in QUICK_WORK) / len(QUICK_WORK)
    assert result["mean_waste_tokens"] == pytest.approx(expected_waste)


def test_oracle_holds_exactly_what_it_will_use() -> None:
    result = quick("--policy", "oracle")
    assert result["mean_waste_tokens"] == 0
    assert result["utilization"] < 1  # it holds its future tokens' slots from the start


def test_paged_wastes_less_than_a_block_and_batches_more() -> None:
    paged, reserve = quick("--policy", "paged"), quick("--policy", "reserve")
    assert 0 <= paged["mean_waste_tokens"] < paged["block_size"] == 16
    assert reserve["utilization"] < paged["utilization"]
    assert reserve["avg_batch"] < paged["avg_batch"] and reserve["tokens_per_s"] < paged["tokens_per_s"]


def test_paged_without_watermark_preempts_and_recomputes() -> None:
    result = quick("--policy", "paged", "--watermark", "0")
    assert result["preemptions"] > 0 and result["recompute_tokens"] > 0
    assert result["tokens"] == sum(o for _, o in QUICK_WORK)  # recompute samples no token twice


def test_larger_blocks_waste_more() -> None:
    small, large = quick("--policy", "paged", "--block-size", "16"), quick("--policy", "paged", "--block-size", "512")
    assert small["mean_waste_tokens"] < large["mean_waste_tokens"] < 512
    assert large["utilization"] < small["utilization"]


def test_reserving_manager_allocates_the_reservation_at_admission() -> None:
    manager = paging_sim.ReservingKVCacheManager(PagePool(20), 4, lambda seq: 30)  # 8 pages a request
    sched = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64)
    seqs = [Sequence(str(i), [0] * 5, SamplingParams(max_tokens=3)) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    for _ in range(3):  # the prompts, then two decodes: no page is added after admission
        batch = sched.schedule()
        assert batch.seqs == seqs[:2] and manager.pool.num_free_pages == 4
        assert all(len(seq.block_ids) == 8 for seq in batch.seqs)
        sched.update_from_output(batch, [0] * len(batch.seqs))
    assert seqs[0].is_finished and seqs[1].is_finished
    assert sched.schedule().seqs == [seqs[2]] and manager.pool.num_free_pages == 12


def test_workload_distributions() -> None:
    mu, sigma = paging_sim.lognormal_from_mean(374, 1118)
    assert math.exp(mu + sigma * sigma / 2) == pytest.approx(374)
    assert math.exp(mu + paging_sim.Z95 * sigma) == pytest.approx(1118)
    work = paging_sim.draw_workload(2000, 0, 4096)
    assert max(p + o for p, o in work) <= 4096 and min(min(p, o) for p, o in work) >= 1
    prompts = sorted(p for p, _ in work)
    assert 500 < prompts[1000] < 680 and 1800 < prompts[1900] < 2500  # median 584, p95 2155


def test_cli_writes_json_and_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    command = [sys.executable, "-m", "benchmarks.paging_sim", "--quick", "--json", str(out), "--plot", str(png)]
    printed = subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True, timeout=300).stdout
    assert "| cache GB | policy |" in printed
    results = json.loads(out.read_text())["results"]
    assert [r["policy"] for r in results] == list(paging_sim.POLICIES)
    for key in ("avg_batch", "utilization", "tokens_per_s", "preemptions", "recompute_tokens", "mean_waste_tokens"):
        assert all(key in r for r in results)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_runs_every_configuration() -> None:
    results = paging_sim.main(["--quick", "--sweep", "--requests", "40", "--cache-gb", "1"])
    assert len(results) == 2 + 4 * 3 and len({paging_sim.label(r) for r in results}) == len(results)
    assert all(r["tokens"] == results[0]["tokens"] for r in results)
