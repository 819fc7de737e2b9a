"""How decode-only steps with adapters run under decode graphs (``decode_path.py``): by default
both paths are timed on the first such steps of each padded size (each path's first step not
counted) and the faster kept; ``graph`` or ``eager`` fixes it. The engine tests make one path look
slower through the choice's clock and check which path later steps take, the tokens (equal to
the torch references either way) and ``stats()`` (what ``/health`` shows); options are validated."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from adapter_factory import make_peft_adapter

from loraserve import LLM, SamplingParams
from loraserve.config import ConfigError, EngineConfig
from loraserve.decode_path import DecodePath, DecodePathChoice

GRAPH, EAGER = DecodePath.GRAPH, DecodePath.EAGER
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on CUDA the graphs are really captured


class ManualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_steps(choice: DecodePathChoice, clock: ManualClock, size: int, seconds: dict[DecodePath, float], steps: int,
              num_seqs: int = 4, first: dict[DecodePath, float] | None = None) -> list[DecodePath]:  # fmt: skip
    """``steps`` steps at ``size``, each taking ``seconds[path]`` (``first[path]`` more for a path's first)."""
    paths = []
    for _ in range(steps):
        path = choice.path(size)
        started = clock()
        clock.now += seconds[path] + ((first or {}).get(path, 0.0) if path not in paths else 0.0)
        choice.record(size, path, started, num_seqs)
        paths.append(path)
    return paths


def test_auto_alternates_then_keeps_the_faster_per_size() -> None:
    clock = ManualClock()
    choice = DecodePathChoice("auto", trials=2, clock=clock)
    paths = run_steps(choice, clock, 8, {GRAPH: 3.0, EAGER: 1.0}, steps=8)
    assert paths == [GRAPH, EAGER] * 3 + [EAGER, EAGER]  # a warm step and two timed steps of each, then eager
    assert choice.chosen == {8: EAGER} and choice.measured_us == {8: (3e6 / 4, 1e6 / 4)}  # per sequence
    assert choice.path(16) is GRAPH  # another size is measured on its own
    run_steps(choice, clock, 16, {GRAPH: 1.0, EAGER: 2.0}, steps=6)
    assert choice.chosen == {8: EAGER, 16: GRAPH}


def test_first_step_of_a_path_is_not_counted() -> None:
    """A path's first step compiles kernels or captures graphs: were it counted, the graphs would lose."""
    clock = ManualClock()
    choice = DecodePathChoice("auto", trials=1, clock=clock)
    run_steps(choice, clock, 4, {GRAPH: 1.0, EAGER: 2.0}, steps=4, first={GRAPH: 100.0})
    assert choice.chosen == {4: GRAPH}


def test_a_slow_timed_step_does_not_decide() -> None:
    """A graph step that captures every graph again (the slot tables grew) is slow once; the
    path's fastest step is its cost."""
    clock = ManualClock()
    choice = DecodePathChoice("auto", trials=2, clock=clock)
    for path, seconds in [(GRAPH, 9.0), (EAGER, 9.0), (GRAPH, 1.0), (EAGER, 2.0), (GRAPH, 50.0), (EAGER, 2.0)]:
        started = clock()
        clock.now += seconds
        choice.record(8, path, started, 1)
    assert choice.chosen == {8: GRAPH}


def test_time_is_compared_per_sequence() -> None:
    clock = ManualClock()
    choice = DecodePathChoice("auto", trials=1, clock=clock)
    for path, seconds, num_seqs in [(GRAPH, 9, 1), (EAGER, 9, 1), (GRAPH, 4.0, 2), (EAGER, 3.0, 1)]:
        started = clock()
        clock.now += seconds
        choice.record(8, path, started, num_seqs)
    assert choice.chosen == {8: GRAPH}  # 2 s per sequence against 3


def test_fixed_paths_and_bad_options() -> None:
    for mode, path in (("graph", GRAPH), ("eager", EAGER)):
        choice = DecodePathChoice(mode)
        assert choice.path(8) is path
        choice.record(8, path, 0.0, 1)
        assert choice.chosen == {}  # nothing measured
    with pytest.raises(ValueError, match="adapter decode path"):
        DecodePathChoice("fastest")
    with pytest.raises(ConfigError, match="adapter_decode_path must be one of"):
        EngineConfig(adapter_decode_path="fastest")
    for mode in ("graph", "eager"):
        with pytest.raises(ConfigError, match="enforce_eager"):
            EngineConfig(adapter_decode_path=mode, enforce_eager=True)


def test_a_fixed_path_needs_decode_graphs(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="needs kernels 'triton'"):  # refused before the model loads
        LLM(str(tiny_model_dir), kernels="torch", num_pages=50, adapter_decode_path="eager")


@pytest.fixture(scope="module")
def adapter_dirs(tiny_hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("decode-path-adapters")
    return {
        "r4": make_peft_adapter(tiny_hf_model, root / "a", rank=4, target_modules=["q_proj", "v_proj"], seed=1),
        "r8": make_peft_adapter(tiny_hf_model, root / "b", rank=8, target_modules=["o_proj", "down_proj"], seed=2),
    }


def generate(llm: LLM, adapter_dirs: dict[str, Path]) -> list[list[int]]:
    for name, path in adapter_dirs.items():
        llm.add_adapter(name, path)
    prompts = ["Hi", "Name a color", "Count to three", "Why?"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(prompts, params, adapters=[None, "r4", "r8", "r4"], use_tqdm=False)
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize("slower", [GRAPH, EAGER])
def test_engine_keeps_the_path_measured_faster(
    tiny_model_dir: Path, adapter_dirs: dict[str, Path], slower: DecodePath
) -> None:
    pytest.importorskip("triton")
    torch_llm = LLM(str(tiny_model_dir), kernels="torch", device=DEVICE, block_size=4, num_pages=300)
    expected = generate(torch_llm, adapter_dirs)
    llm = LLM(str(tiny_model_dir), kernels="triton", device=DEVICE, block_size=4, num_pages=300, max_num_seqs=4)
    runner = llm.engine.runner
    graphs = runner.decode_graphs
    assert graphs is not None
    clock = ManualClock()
    runner.adapter_decode = DecodePathChoice("auto", trials=2, clock=clock)
    taken: list[DecodePath] = []  # the decode steps with adapters at padded size 4
    run = graphs.run

    def timed_run(batch: Any) -> Any:  # the graph path runs here; a decode step with adapters it declines is eager
        logits = run(batch)
        if batch.lora is not None and batch.prefill is None:
            # Adapters load on a background thread, so under load a sequence may start a step late and
            # the last steps run at a smaller padded size, which is timed on its own.
            if graphs.padded_size(batch.input_ids.shape[0]) == 4:
                taken.append(GRAPH if logits is not None else EAGER)
            clock.now += 1.0 if (logits is not None) == (slower is GRAPH) else 0.0
        return logits

    graphs.run = timed_run  # type: ignore[method-assign]
    assert generate(llm, adapter_dirs) == expected
    faster = EAGER if slower is GRAPH else GRAPH
    assert llm.engine.stats().adapter_decode_paths[4] == faster.value
    assert taken[:6] == [GRAPH, EAGER] * 3 and set(taken[6:]) == {faster} and len(taken) > 8
