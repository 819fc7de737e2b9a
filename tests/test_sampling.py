"""Sampling parameters end to end on a tiny model: seeds, top-k/top-p, stops, n, limits."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from loraserve import LLM, SamplingParams
from loraserve.config import ConfigError
from loraserve.input_processor import RequestError
from loraserve.outputs import RequestOutput
from loraserve.sampling_params import SamplingParamsError

PROMPTS = ["The weather today is", "In a galaxy far away", "Numbers: 1 2 3"]
_REQUEST_IDS = itertools.count()


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), num_pages=256)


def _tokens(llm: LLM, prompts: list[str], params: SamplingParams) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    alone = _tokens(llm, [PROMPTS[0]], params)[0]
    batched = _tokens(llm, PROMPTS, params)[0]
    assert alone == batched
    other_seed = _tokens(llm, [PROMPTS[0]], SamplingParams(temperature=1.0, seed=8, max_tokens=12, ignore_eos=True))
    assert other_seed[0] != alone


def test_top_k_one_is_greedy(llm: LLM) -> None:
    greedy = _tokens(llm, PROMPTS, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    top1 = _tokens(llm, PROMPTS, SamplingParams(temperature=1.5, top_k=1, seed=3, max_tokens=10, ignore_eos=True))
    assert greedy == top1
    tiny_p = _tokens(llm, PROMPTS, SamplingParams(temperature=1.5, top_p=1e-6, seed=3, max_tokens=10, ignore_eos=True))
    assert greedy == tiny_p


def _run_engine(llm: LLM, prompt: str, params: SamplingParams) -> RequestOutput:
    """One request through the engine's own steps (``LLM.generate`` would make it ``final_only``)."""
    engine = llm.engine
    request_id = f"direct-{next(_REQUEST_IDS)}"
    engine.add_request(request_id, prompt, params)
    last: RequestOutput | None = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id:
                last = output
    assert last is not None and last.finished
    return last


def test_max_tokens_stop_token_ids_and_stop_strings(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    full = llm.generate([PROMPTS[1]], greedy, use_tqdm=False)[0]
    assert len(full.token_ids) == 12 and full.finish_reason == "length"
    stop_id = full.token_ids[4]
    first = full.token_ids.index(stop_id)
    by_id = llm.generate(
        [PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(stop_id,)), use_tqdm=False
    )[0]
    assert by_id.token_ids == full.token_ids[: first + 1]
    assert by_id.finish_reason == "stop" and by_id.outputs[0].stop_reason == stop_id
    without_stop = llm.tokenizer.decode(full.token_ids[:first], skip_special_tokens=True)
    assert by_id.text == without_stop  # the stop token's text is left out, as vLLM's v1 engine does
    with_stop = llm.tokenizer.decode(full.token_ids[: first + 1], skip_special_tokens=True)
    for kind in ("cumulative", "final_only"):  # detokenized token by token, or once at the end
        for keep, expected in ((False, without_stop), (True, with_stop)):
            params = SamplingParams(
                temperature=0.0,
                max_tokens=12,
                stop_token_ids=(stop_id,),
                include_stop_str_in_output=keep,
                output_kind=kind,
            )
            assert _run_engine(llm, PROMPTS[1], params).text == expected, (kind, keep)
    text = full.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip()
    by_text = llm.generate(
        [PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=(stop,)), use_tqdm=False
    )[0]
    assert by_text.finish_reason == "stop" and by_text.outputs[0].stop_reason == stop
    assert by_text.text == text[: text.index(stop)]
    kept = SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, stop=(stop,), include_stop_str_in_output=True
    )
    assert llm.generate([PROMPTS[1]], kept, use_tqdm=False)[0].text == text[: text.index(stop) + len(stop)]


def test_stop_strings_count_once_the_output_is_longer_than_min_tokens(llm: LLM) -> None:
    """As vLLM's v1 engine: a stop string is looked for only in text that arrives after the first
    ``min_tokens`` output tokens (``len(output) > min_tokens``), while EOS and stop token ids end it
    from ``min_tokens`` tokens on."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    full = llm.generate([PROMPTS[0]], greedy, use_tqdm=False)[0]
    first, rest = llm.tokenizer.decode(full.token_ids[:1]).strip(), llm.tokenizer.decode(full.token_ids[1:])
    pieces = [first[i:j] for i in range(len(first)) for j in range(i + 1, len(first) + 1)]
    stop = next(piece for piece in pieces if piece not in rest)  # in the first token's text only
    at_once = dataclasses.replace(greedy, stop=(stop,))
    assert len(llm.generate([PROMPTS[0]], at_once, use_tqdm=False)[0].token_ids) == 1
    after_one = dataclasses.replace(at_once, min_tokens=1)
    late = llm.generate([PROMPTS[0]], after_one, use_tqdm=False)[0]
    assert late.token_ids == full.token_ids and late.finish_reason == "length"


def test_eos_ends_generation_unless_ignored(llm: LLM) -> None:
    eos = llm.tokenizer.eos_token_id
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    full = llm.generate([PROMPTS[2]], params, use_tqdm=False)[0]
    engine = llm.engine
    engine.scheduler.stop_checker.eos_token_ids = frozenset({full.token_ids[2]})
    try:
        stopped = llm.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
        assert stopped.token_ids == full.token_ids[: full.token_ids.index(full.token_ids[2]) + 1]
        assert stopped.finish_reason == "stop"
        assert len(llm.generate([PROMPTS[2]], params, use_tqdm=False)[0].token_ids) == 8
    finally:
        engine.scheduler.stop_checker.eos_token_ids = frozenset({eos})


def test_n_samples_and_logprobs(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=5, ignore_eos=True, logprobs=2)
    output = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    assert [o.index for o in output.outputs] == [0, 1, 2]
    for sample in output.outputs:
        assert len(sample.token_ids) == 5 and sample.logprobs is not None and len(sample.logprobs) == 5
        for token, entry in zip(sample.token_ids, sample.logprobs, strict=True):
            assert token in entry and len(entry) >= 2 and all(v <= 0.0 for v in entry.values())


def test_extreme_seeds_and_top_k_run_beside_other_requests(llm: LLM) -> None:
    """Any 64-bit signed seed is valid (vLLM's range): ``seed + i`` of sample ``i`` wraps as int64
    does, and a top_k above the vocabulary keeps every token. Before, ``seed = 2**63 - 1`` with
    ``n = 2`` or ``top_k = 2**63`` overflowed the runner's int64 rows inside the step, which failed
    every request of that step."""
    assert SamplingParams(seed=2**63 - 1, n=2).sample_seed(1) == -(2**63)
    with pytest.raises(SamplingParamsError, match="seed"):
        SamplingParams(seed=2**63)
    edge = SamplingParams(n=2, seed=2**63 - 1, max_tokens=4, ignore_eos=True)
    huge_k = SamplingParams(top_k=2**63, seed=5, max_tokens=4, ignore_eos=True)
    everything = SamplingParams(seed=5, max_tokens=4, ignore_eos=True)
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outputs = llm.generate(PROMPTS, [edge, huge_k, plain], use_tqdm=False)
    assert [len(o.outputs) for o in outputs] == [2, 1, 1]
    assert outputs[1].outputs[0].token_ids == _tokens(llm, PROMPTS[1:2], everything)[0]  # k > vocab: no filter
    negative = SamplingParams(seed=-(2**63), max_tokens=4, ignore_eos=True)
    assert _tokens(llm, PROMPTS[:1], negative) == _tokens(llm, PROMPTS[:1], negative)


def test_final_only_requests_are_reported_once_with_the_same_text(llm: LLM) -> None:
    """``output_kind="final_only"`` (what LLM.generate uses): no per-step outputs, and the text
    decoded once at the end equals the token-by-token text of a cumulative request."""
    engine = llm.engine
    base = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    kinds = {"cumulative": base, "final": dataclasses.replace(base, output_kind="final_only")}
    for request_id, params in kinds.items():
        engine.add_request(request_id, PROMPTS[0], params)
    reports: dict[str, list[RequestOutput]] = {request_id: [] for request_id in kinds}
    while engine.has_unfinished_requests():
        for output in engine.step():
            reports[output.request_id].append(output)
    assert len(reports["cumulative"]) == 10
    (final,) = reports["final"]
    assert final.finished and final.token_ids == reports["cumulative"][-1].token_ids
    assert final.text == reports["cumulative"][-1].text != ""
    with pytest.raises(SamplingParamsError, match="output_kind"):
        SamplingParams(output_kind="delta")


def test_a_request_finished_early_carries_the_text_generated_so_far(llm: LLM) -> None:
    """``finish_request`` (a drain out of time) ends requests with finish reason ``abort`` and their
    output so far: a ``final_only`` one's text, decoded only at the end, is decoded there too (it
    came back empty before), the same text as a cumulative request's."""
    engine = llm.engine
    base = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    kinds = {"early-cumulative": base, "early-final": dataclasses.replace(base, output_kind="final_only")}
    for request_id, params in kinds.items():
        engine.add_request(request_id, PROMPTS[2], params)
    for _ in range(8):
        engine.step()
    outputs = {request_id: engine.finish_request(request_id) for request_id in kinds}
    cumulative, final = outputs["early-cumulative"], outputs["early-final"]
    assert cumulative is not None and final is not None and not engine.has_unfinished_requests()
    assert final.finish_reason == "abort" and final.finished and 0 < len(final.token_ids) < 50
    assert final.token_ids == cumulative.token_ids and final.text == cumulative.text != ""
    assert engine.finish_request("early-final") is None  # ended already


def test_bad_input_is_named(llm: LLM) -> None:
    with pytest.raises(SamplingParamsError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(SamplingParamsError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(RequestError, match="empty"):
        llm.generate([""], use_tqdm=False)
    with pytest.raises(RequestError, match="vocabulary"):
        llm.generate([[10**9]], use_tqdm=False)
    with pytest.raises(RequestError, match="context length"):
        llm.generate(["hi"], SamplingParams(max_tokens=10**6), use_tqdm=False)
    with pytest.raises(KeyError, match="not registered"):
        llm.generate(["hi"], adapters="nope", use_tqdm=False)
    with pytest.raises(ConfigError, match="block_size"):
        LLM(block_size=3)
    with pytest.raises(ConfigError, match="unknown engine option"):
        LLM(bogus=1)
    with pytest.raises(ConfigError, match="kernels must be one of"):
        LLM(kernels="gpu")
    assert llm.engine.pool.num_free_pages + llm.engine.pool.num_evictable_pages == llm.engine.pool.num_pages


def test_sampling_parameters_change_the_output_as_vllm_defines_them(llm: LLM) -> None:
    prompt = ["The capital of France is"]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = _tokens(llm, prompt, greedy)[0]
    assert len(set(plain)) < len(plain)  # the tiny model repeats a token: something to penalize
    for penalty in ({"repetition_penalty": 1.8}, {"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        penalized = _tokens(llm, prompt, dataclasses.replace(greedy, **penalty))[0]  # type: ignore[arg-type]
        assert penalized != plain and len(set(penalized)) > len(set(plain)), penalty
    forced = _tokens(llm, prompt, dataclasses.replace(greedy, logit_bias={77: 100.0}))[0]
    assert forced == [77] * 24
    # min_p 0.99 at temperature 1 keeps only the top token: the greedy output.
    assert _tokens(llm, prompt, SamplingParams(temperature=1.0, min_p=0.99, max_tokens=24, ignore_eos=True))[0] == plain
    eos = llm.engine.scheduler.stop_checker.eos_token_ids
    early = SamplingParams(temperature=0.0, max_tokens=12, logit_bias={min(eos): 100.0})
    assert _tokens(llm, prompt, early)[0] == [min(eos)]  # EOS at once
    late = dataclasses.replace(early, min_tokens=5)
    tokens = _tokens(llm, prompt, late)[0]
    assert len(tokens) == 6 and tokens[-1] == min(eos) and min(eos) not in tokens[:5]


def test_allowed_token_ids_and_bad_words_change_the_output(llm: LLM) -> None:
    prompt = ["The capital of France is"]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = _tokens(llm, prompt, greedy)[0]
    allowed = (plain[1], 44, 1000)
    limited = _tokens(llm, prompt, dataclasses.replace(greedy, allowed_token_ids=allowed))[0]
    assert set(limited) <= set(allowed) and limited != plain
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True, allowed_token_ids=(44, 1000))
    assert set(_tokens(llm, prompt, seeded)[0]) <= {44, 1000}
    # a word of the greedy output whose token, as the model emits it, the rule bans
    words = {token: llm.engine.tokenizer.decode([token]).strip() for token in plain}
    token, word = next((t, w) for t, w in words.items() if w and (t,) in llm.engine.inputs.bad_words_token_ids((w,)))
    cleaned = _tokens(llm, prompt, dataclasses.replace(greedy, bad_words=(word,)))[0]
    assert token not in cleaned and cleaned != plain
    with pytest.raises(RequestError, match="allowed_token_ids"):
        llm.generate(prompt, dataclasses.replace(greedy, allowed_token_ids=(10**7,)), use_tqdm=False)
    with pytest.raises(SamplingParamsError, match="allowed_token_ids must not be empty"):
        SamplingParams(allowed_token_ids=())


def test_allowed_token_ids_that_leave_nothing_to_sample_are_refused(llm: LLM) -> None:
    """Only EOS or stop ids allowed while min_tokens bans them, or only bad words: every logit
    would be masked, so the request is refused by name instead of sampling outside the set."""
    prompt = ["The capital of France is"]
    eos = min(llm.engine.inputs.eos_token_ids)
    only_eos = SamplingParams(temperature=0.7, max_tokens=8, min_tokens=3, allowed_token_ids=(eos,))
    with pytest.raises(RequestError, match=r"only EOS or stop token ids, which min_tokens \(3\)"):
        llm.generate(prompt, only_eos, use_tqdm=False)
    only_stop = SamplingParams(
        max_tokens=8, min_tokens=1, ignore_eos=True, stop_token_ids=[44], allowed_token_ids=(44,)
    )
    with pytest.raises(RequestError, match="only EOS or stop token ids"):
        llm.generate(prompt, only_stop, use_tqdm=False)
    word = next(w for w in ("the", "cat", "dog") if len(llm.engine.inputs.bad_words_token_ids((w,))[0]) == 1)
    banned = tuple(ids[0] for ids in llm.engine.inputs.bad_words_token_ids((word,)) if len(ids) == 1)
    with pytest.raises(RequestError, match="every token of allowed_token_ids is a bad word"):
        llm.generate(prompt, SamplingParams(max_tokens=4, allowed_token_ids=banned, bad_words=(word,)), use_tqdm=False)
    # The same sets are served where something is left: EOS once min_tokens is past, ids beside the bad word.
    (ended,) = _tokens(llm, prompt, SamplingParams(temperature=0.0, max_tokens=8, allowed_token_ids=(eos,)))
    assert ended == [eos]
    (padded,) = _tokens(
        llm, prompt, SamplingParams(temperature=0.0, max_tokens=3, min_tokens=2, allowed_token_ids=(eos, 44))
    )
    assert padded[:2] == [44, 44] and set(padded) <= {44, eos}
    (kept,) = _tokens(
        llm, prompt, SamplingParams(max_tokens=4, ignore_eos=True, allowed_token_ids=(*banned, 1000), bad_words=(word,))
    )
    assert set(kept) == {1000}


def test_prompt_logprobs_match_the_model(tiny_model_dir: Path, tiny_hf_model: Any) -> None:
    """Each prompt token's logprob and rank, and the top ones, from Hugging Face's logits of the
    same prompt; with the prompt split into chunks, again when its blocks are cached (a request
    for prompt logprobs computes its whole prompt), and in chunks of one token beside decoding
    requests (such a chunk is sorted with the decodes, and once lost its position's entry)."""
    llm = LLM(str(tiny_model_dir), num_pages=256, block_size=4, max_num_batched_tokens=8, kernels="torch")
    prompt = list(range(40, 63))  # 23 tokens: 3 chunks of at most 8
    with torch.inference_mode():
        reference = tiny_hf_model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)  # [23, vocab]
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)

    def check(output: RequestOutput) -> None:
        entries = output.prompt_logprobs
        assert entries is not None and len(entries) == len(prompt) and entries[0] is None
        for position in range(1, len(prompt)):
            row = reference[position - 1]
            entry = entries[position]
            assert entry is not None
            value, rank = entry[prompt[position]]
            assert value == pytest.approx(row[prompt[position]].item(), abs=1e-4)
            assert rank == int((row > row[prompt[position]]).sum()) + 1
            top = row.topk(2)
            for place, (top_value, token) in enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True)):
                assert entry[token][0] == pytest.approx(top_value, abs=1e-4) and entry[token][1] in (place + 1, rank)
        assert output.num_cached_tokens == 0

    for _ in range(2):  # the second run finds the prompt's blocks cached, and recomputes them
        check(llm.generate([prompt], params, use_tqdm=False)[0])
    # 7 requests of 2-token prompts take the first 3 steps' budget, then decode 7 of its 8 tokens
    # a step for 40 steps: the prompt runs one token a step.
    decoding = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    check(llm.generate([*[[5, 6]] * 7, prompt], [decoding] * 7 + [params], use_tqdm=False)[-1])
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0  # others still hit the cache
