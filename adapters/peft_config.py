"""Parsing and validation of a PEFT ``adapter_config.json`` for LoRA on a Llama model.

The matching rules (``target_modules``, ``exclude_modules``, ``layers_to_transform``,
``layers_pattern``, ``rank_pattern``, ``alpha_pattern``) mirror peft 0.21's
``check_target_module_exists`` and ``get_pattern_key`` so that an adapter resolves to the same
modules, ranks and scales here as in PEFT. They are re-implemented rather than imported because
importing peft pulls in transformers (seconds at start-up) and its helpers' signatures change
between releases; ``tests/test_adapter_format.py`` cross-checks them against peft's own helpers.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import regex

from .errors import AdapterError
from .lora_weights import PROJECTION_NAMES, PROJECTION_PARENTS, module_key

CONFIG_FILE = "adapter_config.json"

# PEFT's shorthand for "every linear layer except the output head".
ALL_LINEAR = "all-linear"
_PROJECTION_KEY = re.compile(
    r"model\.layers\.\d+\.(?:" + "|".join(f"{PROJECTION_PARENTS[m]}\\.{m}" for m in PROJECTION_NAMES) + ")"
)
# How peft matches a rank/alpha pattern key and a layers pattern against a module key ({} is the
# pattern; the forms are checked as the patterns are used).
_KEY_PATTERN_FORM = r"(.*\.)?({})$"
MATCH_TIMEOUT_S = 0.1  # for each match of a config's pattern against one module name
_LAYERS_PATTERN_FORM = r"(?:^|.*?\.){}\.(?P<idx>\d+)\."
# What peft falls back to for model_type "llama" when target_modules is null.
LLAMA_DEFAULT_TARGETS: tuple[str, ...] = ("q_proj", "v_proj")

# init_lora_weights values whose saved adapters are only correct on a base model PEFT modified at
# initialisation (residual weights). MiCA is not one: it leaves the base alone and its forward
# and merge are plain LoRA's (peft's MiCALinearVariant), so its adapters are served as they are.
_UNSUPPORTED_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


def _truthy(value: Any) -> bool:
    return bool(value)


def _is_unsupported_init(value: Any) -> bool:
    return isinstance(value, str) and value.lower().startswith(_UNSUPPORTED_INITS)


# (config field, predicate on its value, what to tell the user). Checked in order; all are refused
# because they change the forward pass or the base weights in ways plain A/B LoRA cannot express.
_UNSUPPORTED_FEATURES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("use_dora", _truthy, "DoRA (use_dora=true) is not supported"),
    ("modules_to_save", _truthy, "modules_to_save is not supported (only LoRA on the seven projections)"),
    ("bias", lambda v: v not in (None, "none"), "bias other than 'none' is not supported"),
    ("lora_bias", _truthy, "lora_bias=true is not supported"),
    ("fan_in_fan_out", _truthy, "fan_in_fan_out=true is not supported (Llama uses nn.Linear)"),
    ("use_qalora", _truthy, "QA-LoRA (use_qalora=true) is not supported"),
    ("alora_invocation_tokens", _truthy, "activated LoRA (alora_invocation_tokens) is not supported"),
    ("layer_replication", _truthy, "layer_replication is not supported"),
    ("target_parameters", _truthy, "target_parameters is not supported"),
    ("trainable_token_indices", _truthy, "trainable_token_indices is not supported"),
    ("use_bdlora", _truthy, "block-diagonal LoRA (use_bdlora) is not supported"),
    ("arrow_config", _truthy, "Arrow routing (arrow_config) is not supported"),
    ("kasa_config", _truthy, "KaSA (kasa_config) is not supported"),
    ("monteclora_config", _truthy, "MonteCLoRA (monteclora_config) is not supported"),
    (
        "init_lora_weights",
        _is_unsupported_init,
        "this init_lora_weights variant is not supported (PiSSA/OLoRA/CorDA/LoftQ/LoRA-GA adapters need "
        "their modified base model: save them converted to plain LoRA)",
    ),
)


def _fail(message: str) -> AdapterError:
    return AdapterError(f"{CONFIG_FILE}: {message}")


def _non_projection_module_keys(num_layers: int) -> list[str]:
    """Names of the other modules of a transformers LlamaForCausalLM, to detect unsupported targets."""
    keys = ["model", "model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head"]
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}"
        keys += [prefix, f"{prefix}.self_attn", f"{prefix}.mlp", f"{prefix}.mlp.act_fn"]
        keys += [f"{prefix}.input_layernorm", f"{prefix}.post_attention_layernorm"]
    return keys


def _matched(how: Callable[..., Any], form: str, key: str, pattern: str) -> Any:
    """``how(form, key)`` (``regex.match`` or ``regex.fullmatch``, the syntax of ``re``) within
    :data:`MATCH_TIMEOUT_S`: a config's pattern is untrusted input, and a match that backtracks
    without end would hold the interpreter (``re`` never lets go of the GIL) and stop the server."""
    try:
        return how(form, key, timeout=MATCH_TIMEOUT_S)
    except TimeoutError:
        raise _fail(
            f"the pattern {pattern!r} takes more than {MATCH_TIMEOUT_S * 1000:.0f} ms to match the module name "
            f"{key!r}: simplify it (nested repetition such as (.*)* backtracks without end)"
        ) from None


def _match_pattern_key(pattern_keys: Sequence[str], key: str) -> str | None:
    """First pattern key matching a dotted suffix of ``key`` (peft's ``get_pattern_key``)."""
    for pattern in pattern_keys:
        if _matched(regex.match, _KEY_PATTERN_FORM.replace("{}", pattern), key, pattern):
            return pattern
    return None


@dataclass(frozen=True)
class LoraConfigView:
    """The semantically relevant fields of a LoRA ``adapter_config.json``, validated."""

    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: str | tuple[str, ...]
    exclude_modules: str | tuple[str, ...] | None
    layers_to_transform: int | tuple[int, ...] | None
    layers_pattern: tuple[str, ...] | None
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]

    def is_targeted(self, key: str) -> bool:
        """Whether PEFT would wrap the module with full name ``key`` (``check_target_module_exists``)."""
        exclude = self.exclude_modules
        if exclude:
            if isinstance(exclude, str):
                if _matched(regex.fullmatch, exclude, key, exclude):
                    return False
            elif key in exclude or any(key.endswith(f".{name}") for name in exclude):
                return False
        targets = self.target_modules
        if targets == ALL_LINEAR:
            # peft expands the shorthand to the full names of every linear layer except lm_head; each
            # key then matches exactly, which (as in peft) bypasses layers_to_transform.
            return _PROJECTION_KEY.fullmatch(key) is not None
        if isinstance(targets, str):
            return _matched(regex.fullmatch, targets, key, targets) is not None
        if key in targets:
            # peft accepts an exact full-name match without applying layers_to_transform.
            return True
        if not any(key.endswith(f".{target}") for target in targets):
            return False
        return self._layer_selected(key)

    def _layer_selected(self, key: str) -> bool:
        indexes = self.layers_to_transform
        if indexes is None or (isinstance(indexes, tuple) and len(indexes) == 0):
            return True
        match: Any = None
        if not self.layers_pattern:
            # Lazy prefix: the first numbered segment is the layer index.
            match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
        else:
            for pattern in self.layers_pattern:
                match = _matched(regex.match, _LAYERS_PATTERN_FORM.replace("{}", pattern), key, pattern)
                if match is not None:
                    break
        if match is None:
            return False
        layer = int(match.group("idx"))
        return layer == indexes if isinstance(indexes, int) else layer in indexes

    def rank_for(self, key: str) -> int:
        pattern = _match_pattern_key(list(self.rank_pattern), key)
        return self.r if pattern is None else self.rank_pattern[pattern]

    def scale_for(self, key: str) -> float:
        """PEFT's ``LoraLayer.scaling``: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        pattern = _match_pattern_key(list(self.alpha_pattern), key)
        alpha = self.lora_alpha if pattern is None else self.alpha_pattern[pattern]
        rank = self.rank_for(key)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    def resolve_targets(self, num_layers: int) -> set[tuple[int, str]]:
        """The ``(layer, projection)`` pairs PEFT would adapt on a Llama with ``num_layers`` layers.

        Raises :class:`AdapterError` when the config targets anything other than the seven
        projections (embeddings, lm_head, norms, ...) or names modules a Llama does not have.
        """
        if isinstance(self.target_modules, tuple):
            for target in self.target_modules:
                if target.split(".")[-1] not in PROJECTION_NAMES:
                    raise _fail(
                        f"target module {target!r} is not supported; only {', '.join(PROJECTION_NAMES)} can be adapted"
                    )
        unsupported = [key for key in _non_projection_module_keys(num_layers) if self.is_targeted(key)]
        if unsupported:
            raise _fail(
                f"target_modules selects unsupported module(s) {unsupported[:4]}; only "
                f"{', '.join(PROJECTION_NAMES)} can be adapted"
            )
        targets = {
            (layer, module)
            for layer in range(num_layers)
            for module in PROJECTION_NAMES
            if self.is_targeted(module_key(layer, module))
        }
        if not targets:
            raise _fail(f"target_modules {self.target_modules!r} selects no module of the base model")
        return targets


def _as_str_tuple(value: Any, field_name: str) -> tuple[str, ...]:
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise _fail(f"{field_name} must be a string or a list of strings, got {value!r}")
    return tuple(value)


def _check_regex(pattern: str, field_name: str, used_as: str = "{}") -> None:
    """``pattern`` compiles in the form it is matched in (``used_as`` with it in place of ``{}``:
    a pattern valid alone can fail inside another, e.g. with a global flag or a group name)."""
    try:  # re's syntax, as peft's (regex, which matches, would take a global flag mid-pattern)
        re.compile(used_as.replace("{}", pattern))
    except re.error as exc:
        raise _fail(f"{field_name} entry {pattern!r} is not a valid regular expression: {exc}") from exc


def _positive_int(value: Any, field_name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _fail(f"{field_name} must be a positive integer, got {value!r}")
    return value


def _finite_number(value: Any, field_name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _fail(f"{field_name} must be a finite number, got {value!r}")
    return float(value)


def _target_modules(raw: dict[str, Any]) -> str | tuple[str, ...]:
    value = raw.get("target_modules")
    if value is None:
        return LLAMA_DEFAULT_TARGETS
    if isinstance(value, str):
        if value.lower() == ALL_LINEAR:
            return ALL_LINEAR
        _check_regex(value, "target_modules")
        return value
    return _as_str_tuple(value, "target_modules")


def parse_lora_config(data: bytes) -> LoraConfigView:
    """Parse and validate ``adapter_config.json`` bytes; raise :class:`AdapterError` on any problem."""
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _fail(f"malformed JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise _fail(f"expected a JSON object, got {type(raw).__name__}")
    peft_type = raw.get("peft_type")
    if peft_type != "LORA":
        raise _fail(f"peft_type {peft_type!r} is not supported; only 'LORA' adapters can be served")
    for field_name, is_unsupported, message in _UNSUPPORTED_FEATURES:
        if is_unsupported(raw.get(field_name)):
            raise _fail(f"{message} (got {field_name}={raw.get(field_name)!r})")
    r = _positive_int(raw.get("r", 8), "r")
    lora_alpha = _finite_number(raw.get("lora_alpha", 8), "lora_alpha")
    rank_pattern = raw.get("rank_pattern") or {}
    alpha_pattern = raw.get("alpha_pattern") or {}
    if not isinstance(rank_pattern, dict) or not isinstance(alpha_pattern, dict):
        raise _fail("rank_pattern and alpha_pattern must be JSON objects")
    for pattern in [*rank_pattern, *alpha_pattern]:
        _check_regex(pattern, "rank_pattern/alpha_pattern", _KEY_PATTERN_FORM)
    target_modules = _target_modules(raw)
    exclude = raw.get("exclude_modules")
    if exclude is not None and not isinstance(exclude, str):
        exclude = _as_str_tuple(exclude, "exclude_modules")
    elif isinstance(exclude, str):
        _check_regex(exclude, "exclude_modules")
    layers = raw.get("layers_to_transform")
    if layers is not None and not isinstance(layers, int):
        if not isinstance(layers, list) or not all(isinstance(i, int) for i in layers):
            raise _fail(f"layers_to_transform must be an int or a list of ints, got {layers!r}")
        layers = tuple(layers)
    layers_pattern = raw.get("layers_pattern")
    if isinstance(layers_pattern, str):
        layers_pattern = (layers_pattern,)
    elif layers_pattern is not None:
        layers_pattern = _as_str_tuple(layers_pattern, "layers_pattern")
    if layers not in (None, ()):  # peft uses layers_pattern only with layers_to_transform
        for pattern in layers_pattern or ():
            _check_regex(pattern, "layers_pattern", _LAYERS_PATTERN_FORM)
    use_rslora = raw.get("use_rslora")
    if use_rslora not in (None, True, False, 0, 1):  # peft reads it as truthy; a string "false" would be true
        raise _fail(f"use_rslora must be true or false, got {use_rslora!r}")
    return LoraConfigView(
        r=r,
        lora_alpha=lora_alpha,
        use_rslora=bool(use_rslora),
        target_modules=target_modules,
        exclude_modules=exclude or None,
        layers_to_transform=layers,
        layers_pattern=layers_pattern or None,
        rank_pattern={k: _positive_int(v, f"rank_pattern[{k!r}]") for k, v in rank_pattern.items()},
        alpha_pattern={k: _finite_number(v, f"alpha_pattern[{k!r}]") for k, v in alpha_pattern.items()},
    )
