"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs."""

from __future__ import annotations

import torch

from loraserve.sequence import Sequence

_SEED_MIX = 0x9E3779B97F4A7C15


def _sample_generator(seed: int, output_index: int) -> torch.Generator:
    """A generator that depends only on the request's seed and the token's index.

    So a seeded request draws the same noise whatever shares its batch, and again
    after preemption and recomputation.
    """
    generator = torch.Generator()
    generator.manual_seed((seed * _SEED_MIX + output_index) % (2**63))
    return generator


def _filter_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p nucleus to -inf."""
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)  # [rows, vocab]
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]  # [1, vocab]
    remove = ranks >= top_ks[:, None]  # [rows, vocab]
    probs = sorted_logits.softmax(dim=-1)
    cumulative = probs.cumsum(dim=-1) - probs  # mass strictly before each token
    remove |= cumulative >= top_ps[:, None]
    remove[:, 0] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_ids, sorted_logits)


class Sampler:
    """Turns the last-position logits of each sampling sequence into one token each."""

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits: [num_seqs, vocab] float32, row i for ``seqs[i]``."""
        logits = logits.float()
        token_ids = logits.argmax(dim=-1)  # [num_seqs]
        random_rows = [i for i, seq in enumerate(seqs) if not seq.params.is_greedy]
        if random_rows:
            rows = torch.tensor(random_rows)
            params = [seqs[i].params for i in random_rows]
            vocab = logits.shape[-1]
            temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
            top_ks = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params])
            top_ps = torch.tensor([p.top_p for p in params], dtype=torch.float32)
            # Sampled on the CPU whatever the device: the per-request generators are CPU ones, so a
            # seed gives the same tokens on any device (up to the logits' rounding).
            scaled = logits[rows.to(logits.device)].cpu() / temps[:, None]  # [num_random, vocab]
            if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
                scaled = _filter_top_k_top_p(scaled, top_ks, top_ps)
            probs = scaled.softmax(dim=-1)
            noise = torch.empty_like(probs)  # exponential race: argmax(p / E) samples from p
            for row, i in enumerate(random_rows):
                seed = seqs[i].seed
                generator = self.generator if seed is None else _sample_generator(seed, seqs[i].num_output_tokens)
                noise[row].exponential_(generator=generator)
            token_ids[rows.to(token_ids.device)] = (probs / noise).argmax(dim=-1).to(token_ids.device)
        sampled = token_ids.tolist()
        self._record_logprobs(logits, seqs, sampled)
        return sampled

    @staticmethod
    def _record_logprobs(logits: torch.Tensor, seqs: list[Sequence], sampled: list[int]) -> None:
        wanted = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
        if not wanted:
            return
        logprobs = logits[wanted].log_softmax(dim=-1)  # [num_wanted, vocab]
        for row, i in enumerate(wanted):
            num_top = seqs[i].params.logprobs or 0
            entry = {sampled[i]: float(logprobs[row, sampled[i]])}
            if num_top:
                top_values, top_ids = logprobs[row].topk(num_top)
                for value, token in zip(top_values.tolist(), top_ids.tolist(), strict=True):
                    entry.setdefault(token, value)
            seqs[i].output_logprobs.append(entry)
