"""What ``benchmarks.gpu`` prints and keeps: every figure logged and written to
``--out DIR/results.json`` as soon as it is measured, so a run stopped at its time limit keeps
what it measured; and the CUDA helpers its parts share."""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RESULTS: dict[str, Any] = {}
OUT: list[Path] = []  # where results.json goes (--out), rewritten after every figure


def log(message: str) -> None:
    print(message, flush=True)


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_gpu_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def record(key: str, value: Any) -> None:
    RESULTS[key] = value
    if OUT:
        OUT[0].mkdir(parents=True, exist_ok=True)
        (OUT[0] / "results.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def guarded(what: str, run: Callable[[], None]) -> None:
    """Run one part of the benchmark; a failure is logged and recorded as ``{what}_error`` and the
    benchmark goes on (what failed leaves the other figures measured)."""
    try:
        run()
    except Exception:
        log(f"{what} FAILED:\n{traceback.format_exc()}")
        record(f"{what}_error", traceback.format_exc()[-2000:])
        free_gpu_cache()
