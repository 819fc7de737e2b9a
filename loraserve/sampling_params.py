"""Per-request sampling parameters (the vLLM shape)."""

from __future__ import annotations

from dataclasses import dataclass, field

from loraserve.structured_outputs import StructuredOutputsParams

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
    ``token_ids``, their text not in ``text`` (both unless ``include_stop_str_in_output``, as
    vLLM's v1 engine). ``min_tokens``: no EOS or stop token id ends the output before that many
    tokens, nor a stop string before more than that many. ``output_kind`` is vLLM's: ``cumulative`` reports the
    request at every step that changes it; ``final_only`` only when it finishes, which also lets
    the engine detokenize it once at the end when it has no stop strings (``LLM.generate``
    uses it). ``lower_max_tokens_to_pool``: where the prompt, ``max_tokens`` and the adapter's pages
    cannot fit in the KV pool even alone, run with ``max_tokens`` lowered to what fits (the HTTP
    server's rule) instead of refusing the request; the adapter's size counts once it is known.
    ``structured_outputs``: the output follows a JSON schema, a regex, a choice or a grammar
    (``structured_outputs.py``); not with ``allowed_token_ids``, ``bad_words`` or ``min_tokens``,
    whose masks could leave a step no token the grammar allows.
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
    prompt_logprobs: int | None = None  # logprobs of every prompt token (and the top ones) after the first
    output_kind: str = "cumulative"
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); a dict is accepted
    min_tokens: int = 0
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text in it
    skip_special_tokens: bool = True  # leave special tokens' text out of the output text
    spaces_between_special_tokens: bool = True  # the tokenizer's decode option (fast tokenizers: no effect)
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be sampled
    bad_words: tuple[str, ...] = ()  # never generated (vLLM's rule: see InputProcessor.bad_words_token_ids)
    lower_max_tokens_to_pool: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    extra: dict[str, object] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(int(t) for t in self.allowed_token_ids))
            _require(len(self.allowed_token_ids) > 0, "allowed_token_ids must not be empty")
            _require(all(t >= 0 for t in self.allowed_token_ids), "allowed_token_ids must be >= 0")
        words = (self.bad_words,) if isinstance(self.bad_words, str) else tuple(self.bad_words)
        object.__setattr__(self, "bad_words", words)
        _require(all(isinstance(w, str) and w.strip() for w in self.bad_words), "bad_words must be non-empty strings")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        _require(
            -2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"
        )
        _require(
            -2.0 <= self.frequency_penalty <= 2.0,
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
        )
        _require(self.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _require(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _require(
            all(-100.0 <= b <= 100.0 for _, b in self.logit_bias),
            "logit_bias values must be in [-100, 100]",
        )
        _require(all(t >= 0 for t, _ in self.logit_bias), "logit_bias token ids must be >= 0")
        _require(
            0 <= self.min_tokens <= self.max_tokens,
            f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
        )
        _require(self.n >= 1, f"n must be at least 1, got {self.n}")
        _require(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        _require(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _require(self.top_k == -1 or self.top_k >= 1, f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        _require(
            self.seed is None or -(2**63) <= self.seed < 2**63, f"seed must be a 64-bit signed integer, got {self.seed}"
        )
        _require(self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}")
        _require(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        _require(
            self.logprobs is None or 0 <= self.logprobs <= 20,
            f"logprobs must be in [0, 20], got {self.logprobs}",
        )
        _require(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
            f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}",
        )
        _require(
            self.structured_outputs is None
            or (self.allowed_token_ids is None and not self.bad_words and self.min_tokens == 0),
            "structured_outputs cannot be combined with allowed_token_ids, bad_words or min_tokens",
        )
        _require(
            self.output_kind in OUTPUT_KINDS, f"output_kind must be one of {OUTPUT_KINDS}, got {self.output_kind!r}"
        )

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def restricts_tokens(self) -> bool:
        """Whether some tokens are masked out (``allowed_token_ids``, ``bad_words``, a grammar)."""
        return self.allowed_token_ids is not None or bool(self.bad_words) or self.structured_outputs is not None

    @property
    def adjusts_logits(self) -> bool:
        """Whether sampling changes this request's logits before drawing (penalties, bias, ...)."""
        return (
            self.has_penalties
            or bool(self.logit_bias)
            or self.min_tokens > 0
            or self.min_p > 0.0
            or self.restricts_tokens
        )

    @property
    def needs_host_tokens(self) -> bool:
        """Whether each step of this request needs the one before's tokens on the host (penalties,
        bias, ``min_tokens``, masks, logprobs, forks): async scheduling does not overlap its steps."""
        return self.adjusts_logits or self.logprobs is not None or self.prompt_logprobs is not None or self.n > 1

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def sample_seed(self, sample_index: int) -> int | None:
        """Seed of the ``sample_index``-th of the ``n`` samples: ``seed + sample_index``, wrapped to 64-bit
        signed as int64 arithmetic wraps (so ``seed = 2**63 - 1`` with ``n > 1`` stays a valid seed)."""
        if self.seed is None:
            return None
        return (self.seed + sample_index + 2**63) % 2**64 - 2**63


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise SamplingParamsError(message)
