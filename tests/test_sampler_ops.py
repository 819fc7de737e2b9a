"""The sampler's and the logits adjustments' operations against references, without an engine:
argmax, top-k/top-p filters, seeded draws, penalties, bias, min_tokens, allowed tokens and bad words."""

from __future__ import annotations

import pytest
import torch

from loraserve import SamplingParams
from loraserve.sampler import (
    CPU_FILTER_CANDIDATES,
    Sampler,
    SamplingBatch,
    _filter_sorted,
    _filter_top_k_top_p,
    argmax_rows,
    invert_cdf,
    uniform_from_keys,
)
from loraserve.sequence import Sequence


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


def _invert_in_float64(probs: torch.Tensor, uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference twin of ``invert_cdf``, one float64 running sum over each row: the tokens
    ``[rows]`` and how far each row's target is from the nearest boundary (a share of the mass)."""
    cdf = probs.double().cumsum(dim=-1)  # [rows, vocab]
    target = uniform[:, None] * cdf[:, -1:]  # [rows, 1]
    tokens = torch.searchsorted(cdf, target, right=True)  # [rows, 1]
    above = cdf.gather(1, tokens.clamp(max=probs.shape[-1] - 1)) - target
    below = target - torch.where(tokens > 0, cdf.gather(1, (tokens - 1).clamp(min=0)), 0.0)
    return tokens.squeeze(1), (torch.minimum(above, below) / cdf[:, -1:]).squeeze(1)


@pytest.mark.parametrize("vocab", [49_152, 32_001, 130, 5])
def test_inversion_equals_a_float64_running_sum(vocab: int) -> None:
    """Equal tokens in every row whose target is more than 1e-8 of the mass from a boundary (the
    float32 block masses round by ~1e-9; a float32 running sum differs by up to ~1e-5 in a flat
    49,152-token row, where a change of one unit in the last place of the logits then flips the
    token); never a zero-probability token, also with masked tokens, whole masked blocks, one
    token left and uniform numbers next to 1."""
    generator = torch.Generator().manual_seed(vocab)
    for chunk in range(4):
        logits = torch.randn(1024, vocab, generator=generator)  # [rows, vocab]
        logits[::3, :: max(vocab // 50, 2)] = float("-inf")
        logits[1::5, vocab // 2 :] = float("-inf")  # the row's last blocks masked
        logits[2::7, :] = float("-inf")
        logits[2::7, vocab // 3] = 0.0  # only one token left
        probs = logits.softmax(dim=-1)
        uniform = uniform_from_keys(torch.arange(1024) + chunk * 1024, torch.zeros(1024, dtype=torch.long))
        uniform[::11] = 1 - 2.0**-53  # (next to the last boundary: only the zero-probability check)
        tokens = invert_cdf(probs, uniform)  # [rows]
        expected, margin = _invert_in_float64(probs, uniform)
        clear = margin > 1e-8  # [rows]
        assert int(clear.sum()) > 900 and torch.equal(tokens[clear], expected[clear])
        assert bool((probs.gather(1, tokens[:, None]) > 0).all())


def test_inversion_of_rows_without_a_finite_mass_stays_in_the_vocabulary() -> None:
    """NaN or infinite probabilities (logits overflowed by a penalty) draw some token, not an error."""
    probs = torch.rand(4, 300)  # [rows, vocab]
    probs[0, 5] = float("nan")
    probs[1, 299] = float("inf")
    probs[2, :] = float("nan")
    tokens = invert_cdf(probs, torch.tensor([0.0, 0.5, 0.99, 1 - 2.0**-53], dtype=torch.float64))
    assert bool(((tokens >= 0) & (tokens < 300)).all())


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
    parts = LogitsAdjustments.host_parts(seqs, frozenset({0}), 64)
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
    parts = LogitsAdjustments.host_parts([seq], frozenset({3}), 64)
    views = [torch.from_numpy(p.reshape(-1)) for p in parts]
    banned = LogitsAdjustments.from_views(views, [p.shape for p in parts], any_penalty=False).apply(logits)
    assert banned[0, 3] == banned[0, 4] == float("-inf") and banned.argmax().item() not in (3, 4)
    seq.append_token(6)
    seq.append_token(6)  # min_tokens reached: nothing banned any more
    parts = LogitsAdjustments.host_parts([seq], frozenset({3}), 64)
    assert parts[8].size == 0


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
    parts = LogitsAdjustments.host_parts([limited, worded, other], frozenset(), 64)
    views = [torch.from_numpy(p.reshape(-1)) for p in parts]
    got = LogitsAdjustments.from_views(views, [p.shape for p in parts], any_penalty=False).apply(logits)
    expected = logits.clone()
    expected[0] = float("-inf")
    expected[0, [3, 7, 19]] = logits[0, [3, 7, 19]]
    expected[1, [5, 9]] = float("-inf")
    expected[2, 5] = logits[2, 5]  # the row without the one-token word keeps token 5 and 9
    torch.testing.assert_close(got, expected)
