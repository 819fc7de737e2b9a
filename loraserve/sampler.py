"""Token sampling on the model's device: greedy, temperature, top-k, top-p, per-request seeds.

Every sampled row draws one uniform number from a counter-based generator keyed by (the
sequence's seed, the index of the token in its output) and inverts the row's distribution
with it. So a sequence's tokens depend only on its seed and its logits, never on what shares
its batch, and a preempted and recomputed sequence draws the same numbers again. Sequences
without a seed get a random one from the engine at arrival. No per-row Python loop, no
generator objects, no host round trip: the runner reads the sampled ids back in one copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from loraserve.logits_adjustments import LogitsAdjustments
from loraserve.sequence import Sequence

_GOLDEN = 0x9E3779B97F4A7C15 - 2**64  # the splitmix64 constants as signed int64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:  # int64, wrapping arithmetic
    z = x + _GOLDEN
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def uniform_from_keys(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:  # [rows] float64 in [0, 1)
    """One uniform number per (seed, counter) pair (both int64 ``[rows]``), on their device."""
    bits = _splitmix64(_splitmix64(seeds) + counters)
    return _shift_right(bits, 11).double() * 2.0**-53


# Tokens per block of the two-level inversion: divides the usual vocabularies (32,000, 49,152,
# 128,256, 151,936), so that only an odd one pays for a padded copy of the probabilities.
CDF_BLOCK = 128


def invert_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:  # [rows] int64
    """The first token of each row whose cumulative mass exceeds ``uniform * total``: never one of
    zero probability. probs: ``[rows, vocab]`` float32, non-negative, any total; uniform:
    ``[rows]`` float64 in [0, 1). A row whose mass is not finite gets some token in the vocabulary.

    Two levels: float32 block masses, their float64 cumulative sum, then the chosen block's
    float64 running sum (cheaper than one running sum over the row, which is sequential).
    A float32 running sum over the whole vocabulary rounds at every token, so a change of one
    unit in the last place of any logit moved every later boundary and, on a flat distribution,
    often the sampled token: logits that differ only by the order of a GEMM's sums (another
    batch, another CPU) then gave other tokens. The result is a float64 running sum's up to the
    rounding of the float32 block masses (~1e-9 of the total)."""
    rows, vocab = probs.shape
    if vocab % CDF_BLOCK:
        probs = torch.nn.functional.pad(probs, (0, CDF_BLOCK - vocab % CDF_BLOCK))
    blocks = probs.view(rows, -1, CDF_BLOCK)  # [rows, blocks, CDF_BLOCK]
    upper = blocks.sum(dim=-1).double().cumsum(dim=-1)  # [rows, blocks] mass up to each block's end
    total = upper[:, -1:]  # [rows, 1]
    # Below the total (u * total may round up to it), so that the block found has mass.
    target = torch.minimum(uniform[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))  # [rows, 1]
    block = torch.searchsorted(upper, target, right=True)  # [rows, 1] upper[b - 1] <= target < upper[b]
    block.clamp_(max=upper.shape[1] - 1)  # (past the end only where the mass is not finite)
    lower = torch.where(block > 0, upper.gather(1, (block - 1).clamp_(min=0)), 0.0)  # [rows, 1]
    chosen = blocks.gather(1, block[:, :, None].expand(-1, -1, CDF_BLOCK)).squeeze(1)  # [rows, CDF_BLOCK]
    running = chosen.cumsum(dim=-1, dtype=torch.float64)  # [rows, CDF_BLOCK]
    last = running[:, -1:]  # [rows, 1] the block's mass as its running sum rounds it
    rest = torch.minimum(target - lower, torch.nextafter(last, torch.zeros_like(last)))  # [rows, 1]
    position = torch.searchsorted(running, rest, right=True)  # [rows, 1]
    return (block * CDF_BLOCK + position).squeeze(1).clamp_(max=vocab - 1)


# How many most likely tokens a top-k/top-p filter takes per row on the CPU, in turn: a row whose
# filter keeps all of them goes on to the next count, and last to a sort of the whole row (as on
# other devices, where sorting is cheap; on the CPU sorting rows of a large vocabulary is what
# costs, ~2 ms per row of 49k tokens).
CPU_FILTER_CANDIDATES = (64, 1024)


def _filter_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p nucleus to -inf.

    The nucleus is the smallest run of most likely tokens whose mass reaches top_p (1: off); a
    token tied with the last one kept may fall either side. The most likely token is always kept."""
    vocab = logits.shape[-1]
    if logits.device.type != "cpu":
        return _filter_sorted(logits, top_ks, top_ps)
    filtering = (top_ks < vocab) | (top_ps < 1)  # [rows]
    filtered = torch.full_like(logits, float("-inf"))  # [rows, vocab]
    if not bool(filtering.all()):
        filtered[~filtering] = logits[~filtering]  # rows without a filter stay as they are
    pending = filtering.nonzero().squeeze(1)  # [rows filtered]
    rows_of = _rows(logits, pending)  # [len(pending), vocab]
    probs = rows_of.softmax(dim=-1)  # [len(pending), vocab]
    at = torch.arange(pending.numel())  # each pending row's row in rows_of and probs
    for count in CPU_FILTER_CANDIDATES:
        if not pending.numel() or count >= vocab:
            break
        values, ids = _rows(rows_of, at).topk(count, dim=-1)  # [len(at), count], most likely first
        remove = _outside(probs[at[:, None], ids], top_ks[pending], top_ps[pending])  # [len(pending), count]
        done = remove[:, -1]  # rows whose filter keeps fewer than `count` tokens
        filtered[pending[done][:, None], ids[done]] = values[done].masked_fill(remove[done], float("-inf"))
        pending, at = pending[~done], at[~done]
    if pending.numel():
        filtered[pending] = _filter_sorted(logits[pending], top_ks[pending], top_ps[pending])
    return filtered


def _rows(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``tensor[index]`` for ascending row ids, without the copy torch's indexing makes when they
    are all the rows."""
    return tensor if index.numel() == tensor.shape[0] else tensor[index]


def _filter_sorted(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """``_filter_top_k_top_p`` by sorting whole rows: other devices' path, and the reference the
    CPU's candidates are tested against."""
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # [rows, vocab]
    remove = _outside(sorted_logits.softmax(dim=-1), top_ks, top_ps)  # [rows, vocab]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_ids, sorted_logits)


def _outside(
    probs: torch.Tensor,  # [rows, n] the n most likely tokens' probabilities, most likely first
    top_ks: torch.Tensor,  # [rows]
    top_ps: torch.Tensor,  # [rows]
) -> torch.Tensor:  # [rows, n] bool: outside the top-k or the nucleus (never the first)
    ranks = torch.arange(probs.shape[-1], device=probs.device)[None, :]  # [1, n]
    remove = ranks >= top_ks[:, None]  # [rows, n]
    cumulative = probs.cumsum(dim=-1) - probs  # mass strictly before each token
    remove |= (cumulative >= top_ps[:, None]) & (top_ps[:, None] < 1)
    remove[:, 0] = False  # always keep the most likely token
    return remove


@dataclass(frozen=True)
class SamplingBatch:
    """How to sample each row of a step's logits (tensors on the logits' device, ``[rows]``)."""

    temperatures: torch.Tensor  # float32, 0 for greedy rows
    top_ks: torch.Tensor  # int64, the vocabulary size when off
    top_ps: torch.Tensor  # float32
    seeds: torch.Tensor  # int64
    counters: torch.Tensor  # int64, the index of the token being sampled in the sequence's output
    all_greedy: bool  # host-side flags, so that no branch reads a device value
    any_filter: bool
    min_ps: torch.Tensor | None = None  # [rows] float64, None when no row sets min_p
    adjustments: LogitsAdjustments | None = None  # bias, min_tokens, penalties; None when no row asks
    # Logits rows after the sampled ones, for prompt logprobs: (sequence, first prompt position, rows)
    prompt_spans: tuple[tuple[Sequence, int, int], ...] = ()

    @classmethod
    def from_seqs(cls, seqs: list[Sequence], vocab_size: int, device: torch.device) -> SamplingBatch:
        """The rows of ``seqs`` (the runner packs the same values into its one upload instead)."""
        params = [seq.params for seq in seqs]
        return cls(
            temperatures=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_ks=torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in params], device=device),
            top_ps=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            seeds=torch.tensor([seq.seed for seq in seqs], dtype=torch.long, device=device),
            counters=torch.tensor([seq.num_output_tokens for seq in seqs], dtype=torch.long, device=device),
            all_greedy=all(p.is_greedy for p in params),
            any_filter=any(p.top_k > 0 or p.top_p < 1.0 for p in params),
            min_ps=torch.tensor([p.min_p for p in params], dtype=torch.float64, device=device)
            if any(p.min_p > 0 for p in params)
            else None,
        )


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:  # [rows] int64
    """``logits.argmax(dim=-1)`` (the first maximum; a NaN counts as the maximum); on the CPU
    NumPy's, which a test checks equal and which is several times faster than torch's."""
    if logits.device.type != "cpu":
        return logits.argmax(dim=-1)
    ids = torch.empty(logits.shape[0], dtype=torch.int64)  # [rows], written by NumPy in place
    np.argmax(logits.contiguous().numpy(), axis=-1, out=ids.numpy())
    return ids


class Sampler:
    """Turns the last-position logits of each sampling sequence into one token each."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:  # [rows] int64
        """logits: ``[rows, vocab]``; returns the sampled ids on the logits' device."""
        logits = logits.float()
        if batch.adjustments is not None:
            logits = batch.adjustments.apply(logits)  # a new tensor: logprobs stay the model's
        greedy = argmax_rows(logits)  # [rows]
        if batch.all_greedy:
            return greedy
        is_greedy = batch.temperatures == 0
        scaled = logits / torch.where(is_greedy, 1.0, batch.temperatures)[:, None]  # [rows, vocab]
        if batch.min_ps is not None:  # p < min_p * p_max  <=>  logit < max logit + log(min_p)
            floor = scaled.amax(dim=-1, keepdim=True) + batch.min_ps.float().log()[:, None]
            scaled = scaled.masked_fill(scaled < floor, float("-inf"))
        if batch.any_filter:
            scaled = _filter_top_k_top_p(scaled, batch.top_ks, batch.top_ps)
        sampled = invert_cdf(scaled.softmax(dim=-1), uniform_from_keys(batch.seeds, batch.counters))
        return torch.where(is_greedy, greedy, sampled)


def record_logprobs(logits: torch.Tensor, seqs: list[Sequence], sampled: list[int]) -> None:
    """Append each sequence's requested logprobs (the sampled token and the top ones)."""
    wanted = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
    if not wanted:
        return
    logprobs = logits[wanted].float().log_softmax(dim=-1)  # [num_wanted, vocab]
    num_top = max(seqs[i].params.logprobs or 0 for i in wanted)
    rows = torch.arange(len(wanted), device=logits.device)
    chosen = logprobs[rows, torch.tensor([sampled[i] for i in wanted], device=logits.device)].tolist()
    top_values, top_ids = logprobs.topk(num_top) if num_top else (logprobs[:, :0], logprobs[:, :0].long())
    for i, value, values, ids in zip(wanted, chosen, top_values.tolist(), top_ids.tolist(), strict=True):
        entry = {sampled[i]: value}
        for token, top_value in zip(ids[: seqs[i].params.logprobs or 0], values, strict=False):
            entry.setdefault(token, top_value)
        seqs[i].output_logprobs.append(entry)


def record_prompt_logprobs(logits: torch.Tensor, spans: tuple[tuple[Sequence, int, int], ...]) -> None:
    """Append prompt logprobs: ``logits`` ``[rows, vocab]`` are the rows of prompt positions
    ``first .. first + count - 1`` of each span's sequence, in order; the row at position ``p``
    gives prompt token ``p + 1`` its logprob and rank (1 = the likeliest), with the
    ``prompt_logprobs`` likeliest tokens and their ranks (vLLM's entries)."""
    logprobs = logits.float().log_softmax(dim=-1)  # [rows, vocab]
    targets = [t for seq, first, count in spans for t in seq.token_ids[first + 1 : first + 1 + count]]
    target_ids = torch.tensor(targets, device=logits.device)
    chosen = logprobs.gather(1, target_ids[:, None])  # [rows, 1]
    ranks = (logprobs > chosen).sum(dim=1) + 1  # [rows]
    num_top = max(seq.params.prompt_logprobs or 0 for seq, _, _ in spans)
    top_values, top_ids = logprobs.topk(num_top) if num_top else (logprobs[:, :0], logprobs[:, :0].long())
    rows = zip(targets, chosen[:, 0].tolist(), ranks.tolist(), top_values.tolist(), top_ids.tolist(), strict=True)
    for seq, _, count in spans:
        wanted = seq.params.prompt_logprobs or 0
        for _ in range(count):
            target, value, rank, values, ids = next(rows)
            entry = {target: (value, rank)}
            for position, (token, top_value) in enumerate(zip(ids[:wanted], values, strict=False)):
                entry.setdefault(token, (top_value, position + 1))
            seq.prompt_logprobs.append(entry)
