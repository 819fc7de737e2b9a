"""S-LoRA's synthetic workload: arrivals in time, a power-law adapter draw, and latency summaries.

Shared by ``benchmarks.many_adapters`` (in-process engines and PEFT) and ``benchmarks.serving``
(any OpenAI-compatible URL), so both see the same request stream for the same options.

One seeded ``numpy`` generator draws, in this order: the arrival gaps, the prompt lengths, the
output lengths, every prompt's token ids, and one ``u`` per request from ``power(alpha)``
(density ``alpha * u**(alpha-1)`` on [0, 1)); with ``N`` adapters request ``i`` uses adapter
``int(u_i * N)`` (S-LoRA's ``int(rng.power(alpha) * N)``), so every N serves the same prompts,
lengths and arrival times, and alpha < 1 makes low adapter indices the popular ones (alpha = 1 is
uniform). Arrivals: gaps exponential with mean ``1/rate`` (Poisson), or gamma of shape
``1/cv**2`` and the same mean (coefficient of variation ``cv``; cv = 1 is Poisson), or all at
t = 0 (``rate = inf``).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

FIRST_PLAIN_TOKEN = 32  # skip the special tokens at the start of the vocabulary


@dataclass(frozen=True)
class Stream:
    """The requests: arrival time (seconds from the start), prompt token ids, output length, draw."""

    arrivals: list[float]
    prompts: list[list[int]]
    output_lens: list[int]
    draws: list[float]  # in [0, 1): request i uses adapter int(draws[i] * N)

    def __len__(self) -> int:
        return len(self.prompts)

    def adapter_of(self, i: int, num_adapters: int) -> int:
        return min(num_adapters - 1, int(self.draws[i] * num_adapters))

    def adapters(self, num_adapters: int) -> list[int]:
        return [self.adapter_of(i, num_adapters) for i in range(len(self))]


def arrival_times(num: int, rate: float, cv: float, rng: np.random.Generator) -> list[float]:
    """Cumulative arrival times of ``num`` requests (the first gap included: the first may come late)."""
    if math.isinf(rate):
        return [0.0] * num
    if cv == 1.0:
        gaps = rng.exponential(1.0 / rate, num)
    else:
        shape = 1.0 / (cv * cv)
        gaps = rng.gamma(shape, 1.0 / (rate * shape), num)
    return [float(t) for t in np.cumsum(gaps)]


def make_stream(num: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int], vocab: int, *, rate: float,
                cv: float, alpha: float, seed: int) -> Stream:  # fmt: skip
    """``num`` requests; lengths uniform in the half-open ranges ``[lo, hi)``."""
    rng = np.random.default_rng(seed)
    arrivals = arrival_times(num, rate, cv, rng)
    p_lens = rng.integers(prompt_lens[0], prompt_lens[1], num)
    o_lens = rng.integers(output_lens[0], output_lens[1], num)
    prompts = [rng.integers(FIRST_PLAIN_TOKEN, vocab, int(n)).tolist() for n in p_lens]
    draws = rng.power(alpha, num)
    return Stream(arrivals, prompts, [int(n) for n in o_lens], [float(u) for u in draws])


def add_arrival_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup, rate: float | None) -> None:
    """``--rate``, ``--cv``, ``--alpha`` and ``--slo-ttft`` (``rate=None``: no arrival process by default)."""
    add = parser.add_argument
    add("--rate", type=float, default=rate,
        help=f"arrivals per second, Poisson (inf: all at once; default {rate})")  # fmt: skip
    add("--cv", type=float, default=1.0, help="coefficient of variation of the gaps: gamma arrivals (1: Poisson)")
    add("--alpha", type=float, default=1.0, help="power-law exponent of the adapter draw (1: uniform; <1: skewed)")
    add("--slo-ttft", type=float, default=6.0, help="TTFT target in seconds for SLO attainment (default 6)")


def check_arrival_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.rate is not None and not args.rate > 0:
        parser.error("--rate must be positive (inf: all at once)")
    if not args.cv > 0 or not args.alpha > 0 or not args.slo_ttft > 0:
        parser.error("--cv, --alpha and --slo-ttft must be positive")


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (``q`` in [0, 100]) interpolated linearly between the closest ranks,
    as ``numpy.percentile`` (and so ``vllm bench serve``) computes it; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = q / 100 * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


@dataclass
class Timing:
    """One request's times in seconds from the run's start; ``first``/``finish`` None until they happen."""

    arrival: float
    first: float | None = None
    finish: float | None = None
    tokens: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.arrival

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (finish - first) / (tokens - 1)."""
        if self.first is None or self.finish is None or self.tokens < 2:
            return None
        return (self.finish - self.first) / (self.tokens - 1)


def latency_summary(timings: Sequence[Timing], slo_ttft: float) -> dict[str, float | None]:
    """TTFT and TPOT p50/p99 and the share of ALL requests whose TTFT is under ``slo_ttft``
    (a request that never got a first token misses it)."""
    ttfts = [t for t in (x.ttft for x in timings) if t is not None]
    tpots = [t for t in (x.tpot for x in timings) if t is not None]
    return {
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "tpot_p50_s": percentile(tpots, 50),
        "tpot_p99_s": percentile(tpots, 99),
        "slo_attainment": sum(t < slo_ttft for t in ttfts) / len(timings) if timings else None,
    }
