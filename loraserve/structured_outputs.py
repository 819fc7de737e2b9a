"""Structured outputs (vLLM's ``structured_outputs``): the output is held to a JSON schema, any
JSON object, a regular expression, one of a list of strings, or a grammar (EBNF or Lark), by masking at
each step every token the grammar does not allow next (xgrammar, vLLM's default backend).

The parts, in the order of a step:

* :class:`StructuredOutputsParams` (in ``SamplingParams``): the constraint, vLLM's fields;
* :class:`GrammarCompiler` (one per engine): compiles a constraint for the engine's tokenizer
  (cached, thread-safe) and starts a matcher per sample; the matcher lives on the ``Sequence``
  and accepts each token as the scheduler appends it (``Sequence.append_token``);
* :func:`fill_bitmasks`: the host side of a step, each constrained row's allowed tokens as bits
  (``LogitsAdjustments.host_parts`` uploads them with the step's other arrays);
* :func:`apply_bitmasks`: the device side, ``-inf`` for every token whose bit is 0 (the torch
  reference; the ``cpu`` kernel backend runs ``kernels.cpu.mask_by_bitmask_`` in its place).

A sample ends (finish reason ``stop``) when its grammar is complete: EOS (or one of the request's
stop token ids) is then all that is allowed, and accepting it ends the matcher.
"""

from __future__ import annotations

import enum
import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

BITS = 32  # tokens per bitmask word (xgrammar's int32 words)
CACHE_LIMIT_BYTES = 512 * 2**20  # compiled grammars kept (vLLM's default VLLM_XGRAMMAR_CACHE_MB)

# (logits [num_rows, vocab] float32, rows [g] int64, bitmask [g, words] int64) -> None: the grammar
# mask in place, as :func:`apply_bitmasks` (a kernel backend's ``mask_tokens``).
TokenMask = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


class StructuredOutputsError(ValueError):
    """A constraint is malformed or cannot be compiled; the message names the field."""


class ConstraintKind(enum.Enum):
    JSON = "json"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint (exactly one of the first five fields set, as vLLM's): ``json`` a JSON
    schema (an object, kept as its text), ``json_object`` any JSON object, ``regex`` a regular
    expression, ``choice`` one of these strings, ``grammar`` an EBNF grammar (xgrammar's, GBNF
    style, rule ``root`` first) or a Lark one (rule ``start``; told apart by :func:`is_lark`, as
    vLLM does). ``disable_any_whitespace``: JSON without optional whitespace."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", json.dumps(self.json))  # the properties in their order
        if self.choice is not None:
            strings = isinstance(self.choice, list | tuple) and all(isinstance(c, str) and c for c in self.choice)
            if not strings or not self.choice:
                raise StructuredOutputsError("structured_outputs.choice must be a list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("json_object", "disable_any_whitespace"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise StructuredOutputsError(f"structured_outputs.{name} must be a boolean")
        given = [kind.value for kind in ConstraintKind if getattr(self, kind.value) not in (None, False)]
        if len(given) != 1:
            raise StructuredOutputsError(
                "structured_outputs must set exactly one of json, json_object, regex, choice, grammar; "
                f"got {given or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, str):
            raise StructuredOutputsError("structured_outputs.json must be a JSON schema (an object or its text)")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise StructuredOutputsError(f"structured_outputs.{name} must be a string")

    @property
    def kind(self) -> ConstraintKind:
        return next(kind for kind in ConstraintKind if getattr(self, kind.value) not in (None, False))


def _whitespace(params: StructuredOutputsParams) -> dict[str, Any]:
    """xgrammar's JSON options: no optional whitespace and compact separators when asked (vLLM's)."""
    if params.disable_any_whitespace:
        return {"any_whitespace": False, "separators": (",", ":")}
    return {"any_whitespace": True}


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (string literals JSON-escaped)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def is_lark(grammar: str) -> bool:
    """Whether ``grammar`` reads as Lark rather than EBNF: no line defines a rule with ``::=``
    once comments (``#``, ``//``) are cut (vLLM's test, so the same text means the same grammar)."""
    return bool(grammar) and not any("::=" in re.sub(r"(#|//).*$", "", line) for line in grammar.split("\n"))


def _message(error: Exception) -> str:
    """xgrammar's error text without its log prefix (``[time] file.cc:line: ``)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    text = re.sub(r"^\[[^\]]*\] \S+:\d+: ", "", text)
    return text.removeprefix("Check failed: (error.empty()) is false: ")


class GrammarCompiler:
    """Compiles constraints for one tokenizer and model vocabulary (``vocab_size`` logits a row;
    ``stop_token_ids`` end a complete output). xgrammar is imported and its tokenizer tables built
    at the first constraint, so engines that never see one do not pay for them."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._lock = threading.Lock()
        self._compiler: Any = None

    def _xgrammar(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_limit_bytes=CACHE_LIMIT_BYTES)
            return self._compiler

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``params`` (xgrammar caches by content); ``StructuredOutputsError``
        naming the field when it does not parse."""
        compiler = self._xgrammar()
        kind = params.kind
        try:
            if kind is ConstraintKind.JSON:
                assert isinstance(params.json, str)
                return compiler.compile_json_schema(params.json, **_whitespace(params))
            if kind is ConstraintKind.JSON_OBJECT:
                return compiler.compile_json_schema('{"type": "object"}', **_whitespace(params))
            if kind is ConstraintKind.REGEX:
                return compiler.compile_regex(params.regex)
            if kind is ConstraintKind.CHOICE:
                assert params.choice is not None
                return compiler.compile_grammar(choice_grammar(params.choice))
            assert params.grammar is not None
            if is_lark(params.grammar):
                return compiler.compile_lark(params.grammar)
            return compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError, TypeError) as error:
            raise StructuredOutputsError(f"structured_outputs.{kind.value}: {_message(error)}") from None

    def matcher(self, params: StructuredOutputsParams, stop_token_ids: tuple[int, ...] = ()) -> Any:
        """A new matcher (one sample's state) at the start of ``params``' grammar; a complete
        output ends with EOS or one of the request's ``stop_token_ids`` (vLLM's)."""
        import xgrammar

        stops = sorted({*self.stop_token_ids, *stop_token_ids})
        return xgrammar.GrammarMatcher(self.compile(params), override_stop_tokens=stops)


def fill_bitmasks(matchers: list[Any], vocab_size: int) -> np.ndarray:
    """``[len(matchers), ceil(vocab_size / 32)]`` int64 holding each matcher's next-token bitmask
    words (int32 values: bit ``t % 32`` of word ``t // 32`` is 1 when token ``t`` may come next)."""
    words = -(-vocab_size // BITS)
    bitmask = torch.zeros(len(matchers), words, dtype=torch.int32)  # [rows, words] int32
    for row, matcher in enumerate(matchers):
        matcher.fill_next_token_bitmask(bitmask, row)
    return bitmask.numpy().astype(np.int64)


def apply_bitmasks(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """``logits[rows[i], t] = -inf`` where bit ``t`` of ``bitmask[i]`` is 0, in place.

    logits: [num_rows, vocab] float32; rows: [g] int64; bitmask: [g, ceil(vocab / 32)] int64 (int32
    values, as :func:`fill_bitmasks` makes them).
    """
    if not rows.numel():
        return
    shifts = torch.arange(BITS, device=bitmask.device, dtype=bitmask.dtype)  # [32]
    bits = (bitmask[:, :, None] >> shifts) & 1  # [g, words, 32]
    allowed = bits.reshape(rows.numel(), -1)[:, : logits.shape[1]].bool()  # [g, vocab]
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
