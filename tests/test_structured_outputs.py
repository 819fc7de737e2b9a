"""Structured outputs (``loraserve/structured_outputs.py``) on a tiny random Llama: its tokens are
noise, so every well-formed output is the grammar's doing. JSON schemas, regexes, choices and
EBNF grammars, sampled and greedy, several samples, beside unconstrained requests that must not
change, with async scheduling; the bitmask op against a per-token reference."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from loraserve.kernels import cpu

from loraserve import LLM, SamplingParams, StructuredOutputsParams
from loraserve.structured_outputs import (
    StructuredOutputsError,
    TokenMask,
    apply_bitmasks,
    choice_grammar,
    fill_bitmasks,
    is_lark,
)

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "digit": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "digit"],
    "additionalProperties": False,
}
PROMPTS = ["The weather today is", "In a galaxy far away"]


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), num_pages=256, kernels="torch")


def _texts(llm: LLM, params: SamplingParams, prompts: list[str] = PROMPTS) -> list[tuple[str, str | None]]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [(c.text, c.finish_reason) for o in outputs for c in o.outputs]


def test_json_schema_regex_choice_and_grammar_hold(llm: LLM) -> None:
    sampled = {"temperature": 1.0, "seed": 5, "max_tokens": 40, "n": 2}
    constraints = {
        "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
        "regex": StructuredOutputsParams(regex=r"[a-c]{3}-\d{2}"),
        "choice": StructuredOutputsParams(choice=("red", 'say "hi"', "naïve")),
        "grammar": StructuredOutputsParams(grammar='root ::= "<" [0-9]+ ">"'),
        "lark": StructuredOutputsParams(grammar='start: "<" DIGITS ">"  // Lark\nDIGITS: /[0-9]+/'),
        "json_object": StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
    }
    for name, constraint in constraints.items():
        for params in (SamplingParams(**sampled), SamplingParams(temperature=0.0, max_tokens=40)):
            for text, reason in _texts(llm, SamplingParams(**{**params.__dict__, "structured_outputs": constraint})):
                if name == "json":
                    assert " " not in text, text  # compact separators, as vLLM's
                    value = json.loads(text)
                    assert set(value) == {"ok", "digit"} and isinstance(value["ok"], bool) and 0 <= value["digit"] <= 9
                elif name == "regex":
                    assert re.fullmatch(r"[a-c]{3}-\d{2}", text), text
                elif name == "choice":
                    assert text in ("red", 'say "hi"', "naïve"), text
                elif name in ("grammar", "lark"):  # a length cap may cut it: only the start is sure
                    assert re.fullmatch(r"<\d+>" if reason == "stop" else r"<\d*", text), (text, reason)
                elif reason == "stop":
                    assert isinstance(json.loads(text), dict), text
                assert reason == "stop" or name in ("grammar", "lark", "json_object"), (name, text, reason)


def test_unconstrained_requests_beside_constrained_ones_are_unchanged(llm: LLM) -> None:
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = _texts(llm, plain)
    constrained = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputsParams(
        regex=r"\d+"))  # fmt: skip
    requests = [(prompt, params) for prompt in PROMPTS for params in (plain, constrained)]
    outputs = llm.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    assert [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs[::2]] == alone
    assert all(re.fullmatch(r"\d+", o.outputs[0].text) for o in outputs[1::2])


def test_a_complete_grammar_ends_the_output_even_with_ignore_eos(llm: LLM) -> None:
    params = SamplingParams(max_tokens=30, ignore_eos=True, structured_outputs=StructuredOutputsParams(choice=("no",)))
    (output,) = llm.generate(["x"], params, use_tqdm=False)
    completion = output.outputs[0]
    assert completion.text == "no" and completion.finish_reason == "stop"
    assert completion.token_ids[-1] in llm.engine.inputs.eos_token_ids  # the grammar's end, as EOS


def test_async_scheduling_waits_for_each_token_of_a_constrained_request(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), num_pages=128, kernels="torch", async_scheduling=True)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=20,
                            structured_outputs=StructuredOutputsParams(regex=r"(ab|cd){2,4}"))  # fmt: skip
    for text, reason in _texts(llm, params, PROMPTS * 2):
        assert re.fullmatch(r"(ab|cd){2,4}", text) and reason == "stop", text


def test_constraints_are_checked_when_made() -> None:
    with pytest.raises(StructuredOutputsError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=("b",))
    with pytest.raises(StructuredOutputsError, match="exactly one"):
        StructuredOutputsParams()
    for bad in ((), "abc", ("a", 1)):
        with pytest.raises(StructuredOutputsError, match="choice"):
            StructuredOutputsParams(choice=bad)  # type: ignore[arg-type]
    with pytest.raises(StructuredOutputsError, match="boolean"):
        StructuredOutputsParams(json_object="yes")  # type: ignore[arg-type]
    assert list(json.loads(str(StructuredOutputsParams(json={"b": 1, "a": 2}).json))) == ["b", "a"]  # order kept
    with pytest.raises(ValueError, match="cannot be combined"):
        SamplingParams(min_tokens=1, structured_outputs=StructuredOutputsParams(regex="a"))
    assert choice_grammar(('a"b', "c\\d")) == 'root ::= "a\\"b" | "c\\\\d"'
    assert is_lark('start: "a"\n// root ::= "b" is a comment here') and not is_lark('# Lark?\nroot ::= "a"')
    assert not is_lark("")  # vLLM's test: an empty grammar is EBNF's


def test_bad_constraints_are_refused_by_name(llm: LLM) -> None:
    from loraserve.input_processor import RequestError

    for constraint, field in (
        (StructuredOutputsParams(regex="("), "regex"),
        (StructuredOutputsParams(json="{not json"), "json"),
        (StructuredOutputsParams(grammar="root ::= missing"), "grammar: EBNF parser error"),
        (StructuredOutputsParams(grammar="start: missing  # Lark: no ::= anywhere"), "grammar: Lark error"),
    ):
        with pytest.raises(RequestError, match=f"structured_outputs.{field}"):
            llm.generate(["x"], SamplingParams(structured_outputs=constraint), use_tqdm=False)


def _masks() -> list[tuple[str, TokenMask]]:
    masks: list[tuple[str, TokenMask]] = [("torch", apply_bitmasks)]
    if cpu.load_extension() is not None:
        masks.append(("compiled", cpu.mask_by_bitmask_))
    return masks


@pytest.mark.parametrize(("name", "mask"), _masks(), ids=[name for name, _ in _masks()])
def test_bitmask_op_matches_a_per_token_reference(name: str, mask: TokenMask) -> None:
    """``apply_bitmasks`` and the ``cpu`` backend's twin (``kernels.cpu.mask_by_bitmask_``, run
    where the extension builds) against setting -inf token by token from the bits, over
    vocabularies that do and do not fill their last word; random words (the sign bit set in
    some), all-banned words (filled whole except past the vocabulary) and all-allowed ones;
    rows left alone."""
    generator = torch.Generator().manual_seed(0)
    for vocab in (1, 32, 64, 70, 95):
        logits = torch.randn(5, vocab, generator=generator)  # [rows, vocab] float32
        rows = torch.tensor([3, 0, 4])
        words = -(-vocab // 32)
        random_words = torch.randint(-(2**31), 2**31, (3, words), generator=generator, dtype=torch.int64)
        whole_words = torch.where(torch.rand(3, words, generator=generator) < 0.5, 0, -1)  # all banned / allowed
        for bitmask in (random_words, whole_words, torch.zeros(3, words, dtype=torch.int64)):  # int32 values
            expected = logits.clone()
            for i, row in enumerate(rows.tolist()):
                for token in range(vocab):
                    if not (int(bitmask[i, token // 32]) >> (token % 32)) & 1:
                        expected[row, token] = float("-inf")
            got = logits.clone()
            mask(got, rows, bitmask)
            assert torch.equal(got, expected), (name, vocab)
    assert fill_bitmasks([], 100).shape == (0, 4) and fill_bitmasks([], 100).dtype == np.int64


@pytest.mark.skipif(cpu.load_extension() is None, reason="the C++ CPU kernels could not be built")
def test_compiled_mask_refuses_what_it_cannot_mask() -> None:
    """The compiled mask names the argument it refuses instead of writing out of bounds."""
    logits = torch.zeros(2, 40)
    with pytest.raises(RuntimeError, match="outside"):
        cpu.mask_by_bitmask_(logits, torch.tensor([2]), torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="cannot cover"):
        cpu.mask_by_bitmask_(logits, torch.tensor([0]), torch.zeros(1, 1, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="float32"):
        cpu.mask_by_bitmask_(logits.bfloat16(), torch.tensor([0]), torch.zeros(1, 2, dtype=torch.int64))


@pytest.mark.skipif(cpu.load_extension() is None, reason="the C++ CPU kernels could not be built")
def test_cpu_backend_masks_with_the_compiled_kernel(tiny_model_dir: Path) -> None:
    """On the ``cpu`` kernel backend the runner masks with the compiled twin, and a schema still
    holds the tiny model's noise to well-formed JSON, greedy and sampled, next to a free request."""
    engine = LLM(str(tiny_model_dir), num_pages=256, kernels="cpu")
    assert engine.engine.runner.mask_tokens is cpu.mask_by_bitmask_
    constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    for params in (
        SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=constraint),
        SamplingParams(max_tokens=40, temperature=1.0, seed=3, n=2, structured_outputs=constraint),
    ):
        outputs = engine.generate(PROMPTS, params, use_tqdm=False)
        for completion in (c for o in outputs for c in o.outputs):
            assert completion.finish_reason == "stop", completion.text
            value = json.loads(completion.text)
            assert set(value) == {"ok", "digit"} and 0 <= value["digit"] <= 9
    (free,) = engine.generate(["x"], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(free.outputs[0].token_ids) == 5


def test_logprobs_see_the_grammar_and_request_stop_ids_end_it(llm: LLM) -> None:
    """vLLM's: the mask is in the logits logprobs come from (only allowed tokens are likely), and a
    request's stop token ids may end a complete output as EOS does."""
    choices = ("yes", "no")
    params = SamplingParams(max_tokens=8, logprobs=5, structured_outputs=StructuredOutputsParams(choice=choices))
    (output,) = llm.generate(["x"], params, use_tqdm=False)
    completion = output.outputs[0]
    assert completion.logprobs is not None and completion.text in choices
    first = {llm.tokenizer.decode([token]) for token, logprob in completion.logprobs[0].items() if logprob > -1e30}
    assert first and all(any(choice.startswith(text) for choice in choices) for text in first), first
    stop_id = 1234  # made likeliest by its bias: once the choice is complete, only it or EOS may come
    stopped = SamplingParams(max_tokens=8, stop_token_ids=(stop_id,), logit_bias={stop_id: 100.0},
                             structured_outputs=StructuredOutputsParams(choice=("no",)))  # fmt: skip
    (output,) = llm.generate(["x"], stopped, use_tqdm=False)
    assert output.outputs[0].text == "no" and output.outputs[0].stop_reason == stop_id


def test_a_token_the_grammar_rejects_ends_the_sample(tiny_model_dir: Path) -> None:
    """Only a broken bitmask lets one through; the sample then ends (``abort``), as vLLM ends it."""
    from loraserve.detokenizer import Detokenizer
    from loraserve.sequence import Sequence
    from loraserve.stop_checker import StopChecker

    class Refusing:  # an xgrammar matcher's two methods the engine calls after a step
        def is_terminated(self) -> bool:
            return False

        def accept_token(self, token: int) -> bool:
            return False

    llm = LLM(str(tiny_model_dir), num_pages=32, kernels="torch")
    seq = Sequence("r", [1, 2], SamplingParams(max_tokens=5), grammar=Refusing())
    checker = StopChecker(Detokenizer(llm.tokenizer), frozenset({0}), 100)
    seq.append_token(7)
    assert seq.grammar_rejected and checker(seq, 7) == ("abort", None)
