"""``benchmarks.cpu_perf``'s rounds: (a) and (b) swap places every other round (neither always
runs first on a drifting VM), each round reported in the order (a), (b), (c)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks import cpu_perf
from benchmarks.cpu_perf import Run


def test_rounds_alternate_which_loraserve_run_goes_first(monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []

    def fake_run(llm: Any, work: Any, with_adapters: bool) -> Run:
        order.append("b" if with_adapters else "a")
        return Run("loraserve LoRA" if with_adapters else "loraserve base", 4, 8, 1.0, 1.0)

    class Peft:
        def run(self, work: Any, share: range) -> Run:
            order.append("c")
            return Run(f"peft {share.start}-{share.stop}", len(share), 8, 1.0, 1.0)

    monkeypatch.setattr(cpu_perf, "run_loraserve", fake_run)
    llm = SimpleNamespace(reset_prefix_cache=lambda: True)
    work = SimpleNamespace(prompts=[[1]] * 8)
    rounds = cpu_perf.run_rounds(llm, work, Peft(), 4)  # type: ignore[arg-type]
    assert order == ["a", "b", "c", "b", "a", "c", "a", "b", "c", "b", "a", "c"]
    assert [[r.system for r in runs] for runs in rounds] == [
        ["loraserve base", "loraserve LoRA", f"peft {2 * i}-{2 * i + 2}"] for i in range(4)
    ]
