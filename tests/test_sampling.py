"""Sampling parameters end to end on a tiny model: seeds, top-k/top-p, stops, n, limits."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from loraserve import LLM, SamplingParams
from loraserve.config import ConfigError
from loraserve.input_processor import RequestError
from loraserve.outputs import RequestOutput
from loraserve.sampler import (
    CPU_FILTER_CANDIDATES,
    Sampler,
    SamplingBatch,
    _filter_sorted,
    _filter_top_k_top_p,
    argmax_rows,
    uniform_from_keys,
)
from loraserve.sampling_params import SamplingParamsError
from loraserve.sequence import Sequence

PROMPTS = ["The weather today is", "In a galaxy far away", "Numbers: 1 2 3"]


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


def test_argmax_rows_equals_torch_argmax_with_ties_and_nans() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(37, 1000, generator=gen)
    logits[1, [5, 9, 700]] = 50.0  # ties: the first wins
    logits[2, :] = 0.0  # all equal
    logits[3, [4, 8]] = float("nan")  # a NaN is the maximum
    logits[4, 10] = float("inf")
    wide = torch.randn(5, 3000, generator=gen)[:, ::3]  # a strided view
    for case in (logits, wide, logits[:0]):
        got = argmax_rows(case)
        assert got.dtype == torch.int64 and torch.equal(got, case.argmax(dim=-1))
    assert argmax_rows(logits)[1:4].tolist() == [5, 0, 4]


def test_filter_keeps_exactly_top_k_and_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    kept = _filter_top_k_top_p(logits, torch.tensor([3]), torch.tensor([1.0])).isfinite()
    assert kept.tolist() == [[True, True, True, False, False]]
    kept = _filter_top_k_top_p(logits, torch.tensor([5]), torch.tensor([0.7])).isfinite()
    assert kept.tolist() == [[True, True, False, False, False]]  # 0.5 + 0.2 reaches 0.7


def test_cpu_filter_over_candidates_equals_sorting_whole_rows() -> None:
    """On the CPU the filter takes the 64, then the 1024 most likely tokens before sorting a row
    whole: rows settled at each count, rows that need the sort and rows without a filter, in one
    batch, keep what sorting every row keeps."""
    assert CPU_FILTER_CANDIDATES == (64, 1024)
    vocab = 5000
    gen = torch.Generator().manual_seed(0)
    scales = torch.tensor([40.0, 40.0, 6.0, 6.0, 1.0, 1.0, 40.0, 1.0, 6.0])[:, None]  # peaked .. flat rows
    logits = torch.randn(9, vocab, generator=gen) * scales  # [9, vocab], no ties
    top_ks = torch.tensor([50, vocab, vocab, 300, vocab, 20, 1, vocab, 100])
    top_ps = torch.tensor([1.0, 0.9, 0.95, 1.0, 0.9, 0.5, 0.3, 1.0, 0.99])
    filtered = _filter_top_k_top_p(logits, top_ks, top_ps)
    reference = _filter_sorted(logits, top_ks, top_ps)
    kept = filtered.isfinite()
    assert torch.equal(kept, reference.isfinite()) and torch.equal(filtered[kept], reference[kept])
    assert torch.equal(filtered[kept], logits[kept])  # kept logits unchanged
    counts = kept.sum(dim=-1).tolist()
    assert counts[0] == 50 and counts[3] == 300 and counts[5] == 20 and counts[6] == 1  # top_p 1: no nucleus
    assert counts[7] == vocab  # no filter on this row
    assert min(counts) < 64 and any(64 <= c < 1024 for c in counts) and any(1024 <= c < vocab for c in counts)
    every = torch.tensor([0, 1, 2, 3, 4, 5, 6, 8])  # every row filtered: the rows are not copied first
    assert torch.equal(_filter_top_k_top_p(logits[every], top_ks[every], top_ps[every]), filtered[every])


def test_cpu_filter_over_candidates_with_masked_logits() -> None:
    """Rows that earlier adjustments left mostly -inf (allowed_token_ids, bans) filter as sorting does."""
    vocab = 3000
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, vocab, generator=gen) * 5
    logits[:3] = float("-inf")
    logits[0, [5, 70, 900]] = torch.tensor([1.0, 2.0, 0.5])  # three allowed tokens
    logits[1, 42] = 3.0  # one
    logits[2, :200] = torch.randn(200, generator=gen)  # 200
    top_ks = torch.tensor([50, vocab, 100, vocab, 10, 64])
    top_ps = torch.tensor([0.95, 0.5, 1.0, 0.9, 1.0, 0.999])
    filtered = _filter_top_k_top_p(logits, top_ks, top_ps)
    assert torch.equal(filtered, _filter_sorted(logits, top_ks, top_ps))
    assert filtered.isfinite().sum(dim=-1).tolist()[:3] == [3, 1, 100]


def test_sampler_follows_the_distribution() -> None:
    """3000 rows at once, each its own seed: the counts follow the distribution."""
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0])
    seqs = [Sequence("r", [1], SamplingParams(temperature=1.0, seed=seed)) for seed in range(3000)]
    tokens = Sampler()(probs.log().expand(3000, 4), SamplingBatch.from_seqs(seqs, 4, torch.device("cpu")))
    counts = torch.bincount(tokens, minlength=4).float()
    assert torch.allclose(counts / counts.sum(), probs, atol=0.03) and counts[3] == 0


def test_sampled_token_depends_only_on_seed_and_output_index() -> None:
    """A row's token is the same whatever the other rows are (and differs across seeds)."""
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    seqs = [Sequence("r", [1], SamplingParams(temperature=1.0, seed=seed)) for seed in range(64)]
    cpu = torch.device("cpu")
    together = Sampler()(logits.expand(64, 50), SamplingBatch.from_seqs(seqs, 50, cpu)).tolist()
    alone = [Sampler()(logits, SamplingBatch.from_seqs([seq], 50, cpu)).item() for seq in seqs]
    assert together == alone and len(set(together)) > 10
    uniform = uniform_from_keys(torch.arange(10_000), torch.zeros(10_000, dtype=torch.long))
    assert float(uniform.min()) >= 0 and float(uniform.max()) < 1 and abs(float(uniform.mean()) - 0.5) < 0.01


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


def _reference_penalties(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """vLLM's definitions, one row, plain loops (the reference twin of LogitsAdjustments.apply)."""
    out = logits.clone()
    for token, bias in p.logit_bias:
        out[token] += bias
    for token in set(prompt) | set(output):
        out[token] = out[token] / p.repetition_penalty if out[token] > 0 else out[token] * p.repetition_penalty
    for token in set(output):
        out[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    return out


def test_penalties_and_bias_match_the_reference() -> None:
    from loraserve.logits_adjustments import LogitsAdjustments

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 40, generator=gen) * 3
    cases = [
        SamplingParams(repetition_penalty=1.7, presence_penalty=0.5, frequency_penalty=0.3, logit_bias={7: 5.0}),
        SamplingParams(),  # a row without any: unchanged
        SamplingParams(repetition_penalty=0.6, frequency_penalty=-1.0, logit_bias={0: -100.0, 39: 2.5}),
    ]
    seqs = []
    for i, params in enumerate(cases):
        seq = Sequence(str(i), [1, 2, 3, 9 + i], params)
        for token in (2, 5, 5, 11, 30 + i):
            seq.append_token(token)
        seqs.append(seq)
    parts = LogitsAdjustments.host_parts(seqs, frozenset({0}))
    views = [torch.from_numpy(p.reshape(-1)) for p in parts]
    adjustments = LogitsAdjustments.from_views(views, [p.shape for p in parts], any_penalty=True)
    got = adjustments.apply(logits)
    for row, seq in enumerate(seqs):
        expected = _reference_penalties(logits[row], seq.prompt_token_ids, seq.output_token_ids, seq.params)
        torch.testing.assert_close(got[row], expected, rtol=1e-6, atol=1e-6)


def test_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    from loraserve.logits_adjustments import LogitsAdjustments

    params = SamplingParams(min_tokens=2, stop_token_ids=(4,), max_tokens=5)
    seq = Sequence("r", [1, 2], params)
    logits = torch.zeros(1, 8)
    logits[0, 3], logits[0, 4] = 10.0, 9.0  # EOS (3) and a stop id (4) are the likeliest
    parts = LogitsAdjustments.host_parts([seq], frozenset({3}))
    views = [torch.from_numpy(p.reshape(-1)) for p in parts]
    banned = LogitsAdjustments.from_views(views, [p.shape for p in parts], any_penalty=False).apply(logits)
    assert banned[0, 3] == banned[0, 4] == float("-inf") and banned.argmax().item() not in (3, 4)
    seq.append_token(6)
    seq.append_token(6)  # min_tokens reached: nothing banned any more
    parts = LogitsAdjustments.host_parts([seq], frozenset({3}))
    assert parts[8].size == 0


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


def test_allowed_token_ids_and_bad_words_match_the_reference() -> None:
    """Rows limited to their allowed ids; a one-token bad word always banned, a two-token one's
    last token banned only right after its first (vLLM's rule), as plain loops would do."""
    from loraserve.logits_adjustments import LogitsAdjustments

    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(4))
    limited = Sequence("a", [1, 2], SamplingParams(allowed_token_ids=(3, 7, 19)))
    worded = Sequence("b", [1, 2], SamplingParams(bad_words=("x",)), bad_words_token_ids=((5,), (8, 9)))
    other = Sequence("c", [1, 2], SamplingParams(bad_words=("x",)), bad_words_token_ids=((8, 9),))
    worded.append_token(8)  # ends with the two-token word's first token: its last is banned
    other.append_token(9)
    parts = LogitsAdjustments.host_parts([limited, worded, other], frozenset())
    views = [torch.from_numpy(p.reshape(-1)) for p in parts]
    got = LogitsAdjustments.from_views(views, [p.shape for p in parts], any_penalty=False).apply(logits)
    expected = logits.clone()
    expected[0] = float("-inf")
    expected[0, [3, 7, 19]] = logits[0, [3, 7, 19]]
    expected[1, [5, 9]] = float("-inf")
    expected[2, 5] = logits[2, 5]  # the row without the one-token word keeps token 5 and 9
    torch.testing.assert_close(got, expected)


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


def test_prompt_logprobs_match_the_model(tiny_model_dir: Path, tiny_hf_model: Any) -> None:
    """Each prompt token's logprob and rank, and the top ones, from Hugging Face's logits of the
    same prompt; with the prompt split into chunks, and again when its blocks are cached (a
    request for prompt logprobs computes its whole prompt)."""
    llm = LLM(str(tiny_model_dir), num_pages=256, block_size=4, max_num_batched_tokens=8, kernels="torch")
    prompt = list(range(40, 63))  # 23 tokens: 3 chunks of at most 8
    with torch.inference_mode():
        reference = tiny_hf_model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)  # [23, vocab]
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    for _ in range(2):  # the second run finds the prompt's blocks cached, and recomputes them
        output = llm.generate([prompt], params, use_tqdm=False)[0]
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
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0  # others still hit the cache
