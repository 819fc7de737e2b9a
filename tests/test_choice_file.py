"""The per-CPU choice file: processes that start together keep each other's timings."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from loraserve.choice_file import ChoiceFile


def test_a_put_keeps_what_another_process_wrote_since_this_one_read(tmp_path: Path) -> None:
    first, second = ChoiceFile(tmp_path, "test"), ChoiceFile(tmp_path, "test")  # both read an empty file
    first.put("gemm 64 rows", {"kernel": "amx"})
    second.put("gemm 512 rows", {"kernel": "onednn"})
    assert ChoiceFile(tmp_path, "test").entries == {
        "gemm 64 rows": {"kernel": "amx"},
        "gemm 512 rows": {"kernel": "onednn"},
    }
    assert second.get("gemm 64 rows") == {"kernel": "amx"}  # merged in memory too
    assert first.get("gemm 512 rows") is None  # first has not read the file since


def _put_many(directory: Path, name: str, start: multiprocessing.synchronize.Barrier) -> None:
    choices = ChoiceFile(directory, "test")
    start.wait()
    for i in range(25):
        choices.put(f"{name} {i}", i)


def test_processes_putting_at_the_same_time_lose_no_entry(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(2)
    workers = [context.Process(target=_put_many, args=(tmp_path, name, start)) for name in ("a", "b")]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
        assert worker.exitcode == 0
    entries = ChoiceFile(tmp_path, "test").entries
    assert entries == {f"{name} {i}": i for name in ("a", "b") for i in range(25)}
