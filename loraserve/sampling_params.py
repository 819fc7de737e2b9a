"""Per-request sampling parameters (the vLLM shape)."""

from __future__ import annotations

from dataclasses import dataclass, field

OUTPUT_KINDS = ("cumulative", "final_only")


class SamplingParamsError(ValueError):
    """A sampling parameter is invalid; the message names it."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.

    ``temperature == 0`` is greedy. ``seed`` makes sampling reproducible per
    request, independent of what else shares the batch; with ``n > 1`` sample
    ``i`` uses seed ``seed + i``. Stop strings are not included in the output
    text; stop token ids and EOS end generation and are included in
    ``token_ids`` (not in ``text``). ``output_kind`` is vLLM's: ``cumulative`` reports the
    request at every step that changes it; ``final_only`` only when it finishes, which also lets
    the engine detokenize it once at the end when it has no stop strings (``LLM.generate``
    uses it).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    output_kind: str = "cumulative"
    extra: dict[str, object] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        _require(self.n >= 1, f"n must be at least 1, got {self.n}")
        _require(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        _require(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _require(self.top_k == -1 or self.top_k >= 1, f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        _require(self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}")
        _require(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        _require(
            self.logprobs is None or 0 <= self.logprobs <= 20,
            f"logprobs must be in [0, 20], got {self.logprobs}",
        )
        _require(
            self.output_kind in OUTPUT_KINDS, f"output_kind must be one of {OUTPUT_KINDS}, got {self.output_kind!r}"
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def sample_seed(self, sample_index: int) -> int | None:
        """Seed of the ``sample_index``-th of the ``n`` samples."""
        return None if self.seed is None else self.seed + sample_index


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise SamplingParamsError(message)
