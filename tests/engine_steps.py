"""Stepping a test's engine until its requests decode."""

from __future__ import annotations

from loraserve.llm_engine import LLMEngine


def step_until_decoding(engine: LLMEngine, min_steps: int = 1, max_steps: int = 200) -> None:
    """Run at least ``min_steps`` steps, then more until every unfinished request's sequences are
    past their prompts and have run one decode step (two tokens sampled). An adapter's files are
    read on the loader thread, so how many steps pass before its requests start depends on the
    machine: a fixed count of steps is a race."""
    for step in range(max_steps):
        seqs = [seq for request in engine.requests.values() for seq in request.seqs]
        if step >= min_steps and not engine.scheduler.num_waiting and all(seq.num_output_tokens >= 2 for seq in seqs):
            return
        engine.step()
    raise AssertionError(f"requests still waiting or in their prompts after {max_steps} steps")
