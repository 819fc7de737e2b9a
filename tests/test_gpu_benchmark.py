"""``python -m benchmarks.gpu`` (the script a GPU slot runs once) keeps working between GPU slots:
its ``kernels`` and ``exact`` parts with ``--smoke`` (tiny shapes, Triton's interpreter on the
CPU), their figures in ``results.json``. The ``throughput`` part's smoke takes minutes here and
runs by hand (``TRITON_INTERPRET=1 python -m benchmarks.gpu --smoke --device cpu``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_kernels_and_exact_parts_run_and_record(tmp_path: Path, default_model_dir: Path) -> None:
    from benchmarks import gpu

    gpu.main(["--smoke", "--device", "cpu", "--parts", "kernels,exact", "--out", str(tmp_path / "out"),
              "--work", str(tmp_path / "work"), "--tokenizer", str(default_model_dir)])  # fmt: skip
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert "kernels_error" not in results and "exact_error" not in results, results
    assert {"decode seqs=4 ctx=40 splits=1", "mixed step", "lora slots"} <= set(results["kernels"])
    lora_keys = {"slots_ms", "segments_ms", "dense_same_rank_ms", "grouping_ms"}
    lora_keys |= {"slots_gathered_ms", "segments_gathered_ms", "slots_tile_sweep_ms"}  # comparisons
    assert lora_keys <= set(results["kernels"]["lora slots"])
    for kernels in ("triton", "torch"):  # the tiny model's greedy tokens equal HF + PEFT's
        assert results[f"exact_{kernels}"]["equal"] == results[f"exact_{kernels}"]["requests"] == 3


@pytest.mark.parametrize(
    "argv, message",
    [(["--baseline-tokens", "0"], "--baseline-tokens must be at least 1"), (["--parts", "tests,nope"], "unknown parts"),
     (["--min-prompt", "9", "--max-prompt", "3"], "--min-prompt <= --max-prompt")],
)  # fmt: skip
def test_bad_options_are_refused(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import gpu

    with pytest.raises(SystemExit) as exit_info:
        gpu.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
