"""What sampling does to a step's logits before drawing: allowed tokens, bad words, logit bias,
``min_tokens``, structured outputs' grammars, penalties.

Only steps with such a request pay for it. The runner packs the host side (``host_parts``: every
sampled row's output token ids, and prompt token ids when a repetition penalty asks for them,
padded with -1; the allowed tokens, the biases and the banned tokens as (row, token) lists) into
its one upload; the sampler applies them on the device (``apply``): a row with ``allowed_token_ids``
keeps only those, then the bias, then the banned tokens (``min_tokens``' EOS and stop ids; each
bad word's last token once the output ends with the word's other tokens, vLLM's rule), then
repetition, frequency and presence penalties. The tokens each row's grammar does not allow next
(its matcher's bitmask, filled on the host) are masked first, in the model's logits themselves
(``mask_grammars``, called by the runner), so logprobs see the grammar as vLLM's do. ``min_p``
is applied by the sampler after the temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from loraserve.sampling_params import SamplingParams
from loraserve.sequence import Sequence
from loraserve.structured_outputs import TokenMask, fill_bitmasks


def _padded(rows: list[list[int]]) -> np.ndarray:  # [len(rows), longest] int64, -1 padded
    width = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), width), -1, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


@dataclass(frozen=True)
class LogitsAdjustments:
    """Per sampled row, on the logits' device."""

    presence: torch.Tensor  # [rows] float64
    frequency: torch.Tensor  # [rows] float64
    repetition: torch.Tensor  # [rows] float64, 1 = off
    output_ids: torch.Tensor  # [rows, longest output] int64, -1 padded
    prompt_ids: torch.Tensor  # [rows, longest prompt] int64, -1 padded; [rows, 0] when no row asks
    bias_rows: torch.Tensor  # [k] int64
    bias_tokens: torch.Tensor  # [k] int64
    bias_values: torch.Tensor  # [k] float64
    banned_rows: torch.Tensor  # [m] int64
    banned_tokens: torch.Tensor  # [m] int64
    allowed_rows: torch.Tensor  # [a] int64, rows limited to their allowed tokens
    allowed_tokens: torch.Tensor  # [a] int64
    grammar_rows: torch.Tensor  # [g] int64, rows with a structured output
    grammar_bitmask: torch.Tensor  # [g, ceil(vocab / 32)] int64 (int32 words; [0, 0] when g = 0)
    any_penalty: bool

    @staticmethod
    def host_parts(seqs: list[Sequence], eos_token_ids: frozenset[int], vocab_size: int) -> list[np.ndarray]:
        """The arrays to upload for the sampled sequences ``seqs`` (row i is ``seqs[i]``)."""
        params = [seq.params for seq in seqs]
        repetition = any(p.repetition_penalty != 1.0 for p in params)
        bias = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
        banned = [
            (i, t)
            for i, (seq, p) in enumerate(zip(seqs, params, strict=True))
            if seq.num_output_tokens < p.min_tokens
            for t in min_tokens_bans(p, eos_token_ids)
        ]
        for i, seq in enumerate(seqs):
            if seq.bad_words_token_ids:
                banned += [(i, t) for t in bad_word_bans(seq.bad_words_token_ids, seq.output_token_ids)]
        allowed = [(i, t) for i, p in enumerate(params) for t in p.allowed_token_ids or ()]
        penalized = [seq.params.has_penalties for seq in seqs]
        constrained = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
        bitmask = fill_bitmasks([seqs[i].grammar for i in constrained], vocab_size) if constrained else None
        return [
            np.array([p.presence_penalty for p in params], np.float64),
            np.array([p.frequency_penalty for p in params], np.float64),
            np.array([p.repetition_penalty for p in params], np.float64),
            _padded([seq.output_token_ids if on else [] for seq, on in zip(seqs, penalized, strict=True)]),
            _padded(
                [seq.prompt_token_ids if repetition and on else [] for seq, on in zip(seqs, penalized, strict=True)]
            ),
            np.array([i for i, _, _ in bias], np.int64),
            np.array([t for _, t, _ in bias], np.int64),
            np.array([b for _, _, b in bias], np.float64),
            np.array([i for i, _ in banned], np.int64),
            np.array([t for _, t in banned], np.int64),
            np.array([i for i, _ in allowed], np.int64),
            np.array([t for _, t in allowed], np.int64),
            np.array(constrained, np.int64),
            np.zeros((0, 0), np.int64) if bitmask is None else bitmask,
        ]

    @classmethod
    def from_views(
        cls, views: list[torch.Tensor], shapes: list[tuple[int, ...]], any_penalty: bool
    ) -> LogitsAdjustments:
        """The uploaded ``host_parts`` (1-D views of the device buffer) in their shapes."""
        p = [view.view(shape) for view, shape in zip(views, shapes, strict=True)]
        return cls(p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], p[8], p[9], p[10], p[11], p[12], p[13], any_penalty)

    def mask_grammars(self, logits: torch.Tensor, mask_tokens: TokenMask) -> None:  # [rows, vocab], in place
        """-inf for the tokens each constrained row's grammar does not allow next, in the model's
        logits themselves (before ``apply``), so logprobs see the grammar too, as vLLM's;
        ``mask_tokens``: the kernel backend's (``structured_outputs.apply_bitmasks`` or its twin)."""
        if self.grammar_rows.numel():
            mask_tokens(logits, self.grammar_rows, self.grammar_bitmask)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:  # [rows, vocab] float32 -> a new tensor
        logits = logits.clone()
        rows, vocab = logits.shape
        if self.allowed_rows.numel():
            keep = torch.zeros(rows, vocab, dtype=torch.bool, device=logits.device)
            keep[self.allowed_rows, self.allowed_tokens] = True
            limited = torch.zeros(rows, 1, dtype=torch.bool, device=logits.device)
            limited[self.allowed_rows] = True
            logits.masked_fill_(limited & ~keep, float("-inf"))
        if self.bias_rows.numel():
            logits.index_put_((self.bias_rows, self.bias_tokens), self.bias_values.float(), accumulate=True)
        if self.banned_rows.numel():
            logits[self.banned_rows, self.banned_tokens] = float("-inf")
        if not self.any_penalty:
            return logits
        # Counts of each token in the output (a spare column vocab takes the padding).
        out_ids = torch.where(self.output_ids >= 0, self.output_ids, vocab)  # [rows, longest output]
        counts = torch.zeros(rows, vocab + 1, device=logits.device)
        counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=counts.dtype))
        counts = counts[:, :vocab]  # [rows, vocab]
        in_output = counts > 0
        seen = in_output.clone()
        if self.prompt_ids.shape[1]:
            prompt_ids = torch.where(self.prompt_ids >= 0, self.prompt_ids, vocab)
            in_prompt = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=logits.device)
            seen |= in_prompt.scatter_(1, prompt_ids, True)[:, :vocab]
        repetition = self.repetition.float()[:, None]  # [rows, 1]
        penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalized, logits)
        logits -= self.frequency.float()[:, None] * counts + self.presence.float()[:, None] * in_output
        return logits


def min_tokens_bans(params: SamplingParams, eos_token_ids: frozenset[int]) -> tuple[int, ...]:
    """Tokens banned while the output is shorter than ``min_tokens``: EOS (unless ignored) and the
    stop token ids."""
    return (*(() if params.ignore_eos else sorted(eos_token_ids)), *params.stop_token_ids)


def bad_word_bans(words: tuple[tuple[int, ...], ...], output: list[int]) -> list[int]:
    """Tokens an output must not continue with: a one-token bad word always, a longer one's last
    token when the output so far ends with its other tokens."""
    bans = []
    for word in words:
        prefix = word[:-1]
        if not prefix or (len(output) >= len(prefix) and tuple(output[len(output) - len(prefix) :]) == prefix):
            bans.append(word[-1])
    return bans
