"""Graph-capturable decode steps (``decode_graphs.py``, ``lora/slots.py``), checked on the CPU:
the padded forward over static buffers is what a CUDA graph captures and replays, so it must
(a) run the same ops whatever the step's content at one padded size, with no host copy and no
scalar read inside, (b) leave real rows' logits and every page the padding could touch unchanged,
(c) give the same tokens as eager steps and as the torch references, adapters included; and the
adapter slot tables change only when an adapter takes a slot."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
import torch
from adapter_factory import make_peft_adapter
from engine_steps import step_until_decoding
from torch.utils._python_dispatch import TorchDispatchMode

from loraserve import LLM, SamplingParams
from loraserve.decode_graphs import capture_sizes
from loraserve.llm_engine import LLMEngine
from loraserve.lora.batch import AdapterPages
from loraserve.lora.layout import AdapterLayout
from loraserve.lora.slots import AdapterSlots

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on CUDA the graphs are really captured
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class OpTrace(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def adapter_dirs(tiny_hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("graph-adapters")
    return {
        "r4-qv": make_peft_adapter(tiny_hf_model, root / "a", rank=4, target_modules=["q_proj", "v_proj"], seed=1),
        "r24-all": make_peft_adapter(tiny_hf_model, root / "b", rank=24, target_modules=ALL, seed=2),
    }


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]


def _generate(model_dir: Path, adapters: dict[str, Path], kernels: str, **options: Any) -> tuple[list, LLM]:
    llm = LLM(str(model_dir), kernels=kernels, device=DEVICE, block_size=4, num_pages=300, max_num_seqs=8, **options)
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    return _run_prompts(llm), llm


def _run_prompts(llm: LLM) -> list[list[int]]:
    system = "You are a terse assistant. Answer in one line. "  # a shared prefix: prefix-cache hits
    prompts = [system + p for p in ("Hi", "Name a color", "Count to three", "Why?", "Hi")]
    names: list[str | None] = [None, "r4-qv", "r24-all", "r24-all", "r4-qv", None, "r4-qv"]
    prompts += ["A much longer prompt that the small token budget splits into chunks " * 2, "Bye"]
    # The shared prefix cached before: hits do not hang on which requests' adapters loaded first.
    llm.generate([system], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    outputs = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), adapters=names, use_tqdm=False
    )
    return [o.token_ids for o in outputs]


def test_graph_path_equals_eager_and_torch(
    tiny_model_dir: Path, adapter_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mixed adapters, prefix hits and chunked prefill: the padded decode path (adapters by slot),
    the eager Triton path (adapters by segment) and the torch references give the same tokens;
    the Triton runs call no per-sequence attention (SDPA) at all."""
    chunked = dict(max_num_batched_tokens=24)
    expected, torch_llm = _generate(tiny_model_dir, adapter_dirs, "torch", **chunked)
    assert torch_llm.engine.stats().prefix_cache_matched_tokens > 0

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("per-sequence SDPA called under the triton kernels")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", refuse)
    graphed, llm = _generate(tiny_model_dir, adapter_dirs, "triton", adapter_decode_path="graph", **chunked)
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None and graphs.num_steps >= 9  # decode steps took the padded path
    assert graphed == expected
    eager, eager_llm = _generate(tiny_model_dir, adapter_dirs, "triton", enforce_eager=True, **chunked)
    assert eager_llm.engine.runner.decode_graphs is None
    assert eager == expected
    assert len({tuple(tokens) for tokens in expected}) > 4  # adapters and prompts change the outputs


def test_graph_path_with_async_scheduling(tiny_model_dir: Path, adapter_dirs: dict[str, Path]) -> None:
    """Steps launched before the last one's tokens are on the host: the padded decode path reads
    those tokens on the device (into its static input buffer) and gives the same tokens."""
    chunked = dict(max_num_batched_tokens=24)
    expected, _ = _generate(tiny_model_dir, adapter_dirs, "torch", **chunked)
    options = dict(adapter_decode_path="graph", async_scheduling=True, **chunked)
    overlapped, llm = _generate(tiny_model_dir, adapter_dirs, "triton", **options)  # type: ignore[arg-type]
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None and graphs.num_steps >= 9
    assert overlapped == expected


def _decoding(model_dir: Path, adapters: dict[str, Path], count: int, offset: int) -> LLMEngine:
    llm = LLM(str(model_dir), kernels="triton", device=DEVICE, block_size=4, num_pages=300, max_num_seqs=8,
              adapter_decode_path="graph")  # fmt: skip
    for name, path in adapters.items():
        llm.add_adapter(name, path)
    names: list[str | None] = [None, "r4-qv", "r24-all"]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i in range(count):
        tokens = list(range(40 + offset + i, 47 + 2 * offset + 2 * i))
        llm.engine.add_request(str(i), tokens, params, names[(i + offset) % 3])
    step_until_decoding(llm.engine, min_steps=3)
    return llm.engine


def _trace_padded_forward(engine: LLMEngine) -> tuple[list[str], int]:
    """Ops of the padded forward (what a graph captures) in the next step, and that step's padded size."""
    graphs = engine.runner.decode_graphs
    assert graphs is not None
    traces: list[tuple[list[str], int]] = []
    forward = graphs.forward

    def traced(size: int, with_lora: bool) -> torch.Tensor:
        with OpTrace() as trace:
            out = forward(size, with_lora)
        traces.append((trace.ops, size))
        return out

    graphs.forward = traced  # type: ignore[method-assign]
    engine.step()
    assert len(traces) == 1, "the step did not take the padded decode path"
    return traces[0]


def test_the_padded_forward_records_no_autograd_graph(tiny_model_dir: Path, adapter_dirs: dict[str, Path]) -> None:
    """The start-up capture runs outside inference mode: with weights that need no gradient, the
    forward keeps no autograd state alive in the graphs' memory pool."""
    graphs = _decoding(tiny_model_dir, adapter_dirs, 3, 0).runner.decode_graphs
    assert graphs is not None and not torch.is_inference_mode_enabled()
    logits = graphs.forward(4, True)
    assert not logits.requires_grad and logits.grad_fn is None


@pytest.mark.skipif(DEVICE == "cuda", reason="on CUDA the decode forward is replayed, not run (the capture proves it)")
def test_same_ops_whatever_the_content_and_no_host_traffic(tiny_model_dir: Path, adapter_dirs: dict[str, Path]) -> None:
    """Two decode steps of different sequences, adapters, lengths and batch sizes (3 and 4) at the
    same padded size (4) run the same op sequence; nothing inside reads a scalar or makes a tensor
    from host data (a captured graph could do neither)."""
    first, size_a = _trace_padded_forward(_decoding(tiny_model_dir, adapter_dirs, 3, 0))
    second, size_b = _trace_padded_forward(_decoding(tiny_model_dir, adapter_dirs, 4, 5))
    assert size_a == size_b == 4
    assert first == second
    counts = collections.Counter(first)
    assert counts["aten._local_scalar_dense.default"] == 0
    assert counts["aten.lift_fresh.default"] == 0  # no tensor made from host data
    assert not any("scaled_dot_product" in op for op in counts)  # one attention kernel, no per-sequence SDPA


def test_padded_rows_change_no_real_row_and_no_page(tiny_model_dir: Path, adapter_dirs: dict[str, Path]) -> None:
    """The logits of a step padded from 3 to 4 rows equal the unpadded eager forward's, and the
    padded forward writes exactly the KV slots of the real rows."""
    engine = _decoding(tiny_model_dir, adapter_dirs, 3, 1)
    runner = engine.runner
    graphs = runner.decode_graphs
    assert graphs is not None
    batch = engine.scheduler.schedule()
    runner.input_batch.release(batch.released_seq_ids)
    runner.pool.copy_pages(batch)
    with torch.inference_mode():
        forward_batch = runner.prepare(batch).forward
        assert forward_batch.num_decode_tokens == 3 and forward_batch.lora is not None
        before = runner.pool.storage.clone()
        eager = runner.model(forward_batch, runner.pool.kv_caches, runner.lora_hook)  # [3, vocab]
        written = runner.pool.storage.clone()
        runner.pool.storage.copy_(before)
        padded = graphs.run(forward_batch)
        assert padded is not None and graphs.padded_size(3) == 4
        # (a leak of padded rows would differ by O(1); F.linear's kernels for 3 and 4 rows may sum in
        # different orders: 1.1e-5 seen on an AVX2 EPYC)
        torch.testing.assert_close(padded, eager, rtol=0, atol=1e-4)
        assert torch.equal(runner.pool.storage != before, written != before)  # padding wrote no other slot
        torch.testing.assert_close(runner.pool.storage, written, rtol=0, atol=1e-4)  # real rows wrote the same
        assert not torch.equal(written, before)


def _pages(adapter_id: str, page_ids: tuple[int, ...], layout: AdapterLayout) -> AdapterPages:
    return AdapterPages(adapter_id, page_ids, layout)


def test_adapter_slots_are_written_only_when_an_adapter_takes_one(
    tiny_model_dir: Path, adapter_dirs: dict[str, Path]
) -> None:
    engine = _decoding(tiny_model_dir, adapter_dirs, 3, 0)
    slots = engine.runner.adapter_slots
    assert slots is not None
    writes = slots.num_writes
    assert writes == 2  # r4-qv and r24-all, once each
    for _ in range(4):  # steady state: adapters keep their slots
        engine.step()
    assert slots.num_writes == writes

    some = next(iter(engine.adapters.resident.values())).pages  # a real adapter's pages and layout
    table = AdapterSlots(num_slots=2, num_layers=engine.layout.num_layers, device=torch.device("cpu"), max_pages=2)
    a, b, c = (_pages(name, some.page_ids, some.layout) for name in "abc")
    assert table.assign({"a": a, "b": b}) == {"a": 0, "b": 1} and table.num_writes == 2
    assert table.assign({"b": b}) == {"b": 1} and table.num_writes == 2  # kept
    assert table.assign({"b": b, "c": c}) == {"b": 1, "c": 0}  # a was least recently used
    moved = _pages("b", tuple(p + 1 for p in some.page_ids), some.layout)
    assert table.assign({"b": moved}) == {"b": 1} and table.num_writes == 4  # pages moved: rewritten
    assert table.tables.page_tables[1, : len(some.page_ids)].tolist() == list(moved.page_ids)
    generation = table.generation
    wide = _pages("d", tuple(range(10, 10 + 3 * max(2, len(some.page_ids)))), some.layout)
    assert table.assign({"d": wide}) == {"d": 0}
    assert table.generation == generation + 1  # the tables grew: captured graphs must be redone
    assert table.tables.page_tables[1, : len(some.page_ids)].tolist() == list(moved.page_ids)  # rows kept
    with pytest.raises(RuntimeError, match="3 adapters in one step"):
        table.assign({"a": a, "b": b, "c": c})


def test_row_bound_doubles_past_the_stacked_rows(tiny_model_dir: Path, adapter_dirs: dict[str, Path]) -> None:
    """The slot kernels' shrink spans ``row_bound`` stacked rows: an adapter with more in some layer
    group doubles it (a power of two) and changes the generation, so graphs are captured again."""
    from loraserve.lora.apply_cpu import layout_meta

    engine = _decoding(tiny_model_dir, adapter_dirs, 3, 0)

    def stacked_rows(pages: AdapterPages) -> int:
        return int(layout_meta(pages.layout)[0][:, :, 1].max())

    small, large = sorted((r.pages for r in engine.adapters.resident.values()), key=stacked_rows)
    assert stacked_rows(small) == 8 and stacked_rows(large) == 72  # r4 on q and v; r24 on q, k and v
    table = AdapterSlots(2, engine.layout.num_layers, torch.device("cpu"), max_pages=len(large.page_ids))
    table.assign({"small": small})
    assert (table.tables.row_bound, table.generation) == (64, 0)
    table.assign({"large": large})
    assert (table.tables.row_bound, table.generation) == (128, 1)
    table.assign({"small": small, "large": large})
    assert (table.tables.row_bound, table.generation) == (128, 1)
    runner_slots = engine.runner.adapter_slots
    assert runner_slots is not None and runner_slots.tables.row_bound == 128


def test_attention_splits_rule() -> None:
    from loraserve.forward_batch import attention_splits

    assert attention_splits(num_programs=8, max_context=8192, num_sms=132) == 16  # few sequences, long contexts
    assert attention_splits(num_programs=8, max_context=2048, num_sms=132) == 4  # shares of >= 512 tokens
    assert attention_splits(num_programs=8, max_context=1500, num_sms=132) == 2
    assert attention_splits(num_programs=8, max_context=600, num_sms=132) == 1  # short contexts
    assert attention_splits(num_programs=256 * 8, max_context=8192, num_sms=132) == 1  # the GPU is already full
    assert attention_splits(num_programs=8, max_context=8192, num_sms=0) == 1  # off a GPU


def test_split_kv_decode_graphs_equal_torch(tiny_model_dir: Path, adapter_dirs: dict[str, Path]) -> None:
    """Decode steps whose attention is split into 4 shares per context (what a GPU with more
    multiprocessors than programs gets) give the torch references' tokens."""
    expected, _ = _generate(tiny_model_dir, adapter_dirs, "torch")
    llm = LLM(str(tiny_model_dir), kernels="triton", device=DEVICE, block_size=4, num_pages=300, max_num_seqs=8,
              adapter_decode_path="graph")  # fmt: skip
    runner = llm.engine.runner
    graphs = runner.decode_graphs
    assert graphs is not None
    runner.num_sms = 64  # as if on a GPU of 64 multiprocessors: every padded size splits contexts
    graphs.splits = {size: runner.attention_splits(size, llm.engine.max_model_len) for size in graphs.sizes}
    assert graphs.splits[8] == graphs.splits[1] == 4  # shares of 512 of the 2,048-token limit
    for name, path in adapter_dirs.items():
        llm.add_adapter(name, path)
    assert _run_prompts(llm) == expected
