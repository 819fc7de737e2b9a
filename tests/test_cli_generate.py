"""``loraserve generate``: prompts in, completions out; mistakes in its options end with one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from adapter_factory import make_peft_adapter

from loraserve import LLM, SamplingParams
from loraserve.entrypoints.cli import main

PROMPT = "The weather today is"


def generate(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["generate", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_prints_what_the_engine_generates_with_and_without_an_adapter(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tiny_hf_model: Any, tmp_path: Path
) -> None:
    adapter = make_peft_adapter(tiny_hf_model, tmp_path / "a", rank=4, target_modules=["q_proj", "v_proj"], seed=5)
    model = ["--model", str(tiny_model_dir), "--num-pages", "64", "--max-tokens", "5", "--ignore-eos"]
    code, out, _ = generate(capsys, PROMPT, PROMPT, *model, "--adapter", f"mine={adapter}", "--use", "base",
                            "--use", "mine")  # fmt: skip
    assert code == 0
    llm = LLM(str(tiny_model_dir), num_pages=64)
    llm.add_adapter("mine", adapter)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    expected = llm.generate([PROMPT] * 2, params, adapters=[None, "mine"], use_tqdm=False)
    assert expected[0].text != expected[1].text
    assert out == (f"--- {PROMPT!r} (sample 0, length)\n{expected[0].text}\n"
                   f"--- {PROMPT!r} [mine] (sample 0, length)\n{expected[1].text}\n")  # fmt: skip


def test_adapters_that_no_prompt_uses_or_uses_that_name_none_are_refused_before_the_model_loads(
    tmp_path: Path,
) -> None:
    nowhere = ["--model", str(tmp_path / "no-model")]  # never reached: it would fail to load
    with pytest.raises(SystemExit, match=r"--adapter registers \['mine'\] but no --use names one"):
        main(["generate", PROMPT, *nowhere, "--adapter", f"mine={tmp_path}"])
    with pytest.raises(SystemExit, match="--use 'other' is not registered"):
        main(["generate", PROMPT, *nowhere, "--adapter", f"mine={tmp_path}", "--use", "other"])
    with pytest.raises(SystemExit, match="--adapter expects NAME=PATH"):
        main(["generate", PROMPT, *nowhere, "--adapter", str(tmp_path), "--use", "base"])
    with pytest.raises(SystemExit, match="--adapter 'mine' is given twice"):
        main(["generate", PROMPT, *nowhere, "--adapter", f"mine={tmp_path}", "--adapter", "mine=x", "--use", "mine"])
    with pytest.raises(SystemExit, match="--use given 2 times for 1 prompts"):
        main(["generate", PROMPT, *nowhere, "--use", "base", "--use", "base"])


def test_a_model_or_adapter_that_cannot_be_read_ends_with_one_line(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    code, _, err = generate(capsys, PROMPT, "--model", str(tmp_path / "no-model"))
    assert code == 2 and err.startswith("error: ") and "no-model" in err and "Traceback" not in err
    model = ["--model", str(tiny_model_dir), "--num-pages", "64"]
    code, _, err = generate(capsys, PROMPT, *model, "--adapter", f"mine={tmp_path / 'gone'}", "--use", "mine")
    assert code == 2 and err.startswith("error: ") and "gone" in err and "Traceback" not in err
    damaged = tmp_path / "damaged"  # its weights file is a directory: an OSError (IsADirectoryError)
    damaged.mkdir()
    for path in tiny_model_dir.iterdir():
        target = damaged / path.name
        target.mkdir() if path.name.endswith(".safetensors") else target.write_bytes(path.read_bytes())
    code, _, err = generate(capsys, PROMPT, "--model", str(damaged), "--num-pages", "64")
    assert code == 2 and err.startswith("error: ") and "model.safetensors" in err and "Traceback" not in err, err
