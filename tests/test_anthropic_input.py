"""An Anthropic Messages request's system messages as the chat messages they stand for (vLLM 0.32's
rules), and the probe that tells whether a chat template takes system messages after the first turn."""

from __future__ import annotations

import copy
from typing import Any

from loraserve.api.anthropic_input import chat_messages
from loraserve.api.anthropic_protocol import MessagesRequest
from loraserve.api.chat_template import refuses_inline_system

# A system message anywhere but first refused, as Qwen's and other templates do.
SYSTEM_FIRST = (
    "{% for message in messages %}{% if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}{% endfor %}"
)


def _request(**fields: Any) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 4, **fields})


def _roles_and_texts(request: MessagesRequest, merge: bool) -> list[tuple[str, Any]]:
    messages, _ = chat_messages(request, merge)
    return [(m.role, m.content) for m in messages]


REMINDER = [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]
TURNS = [
    {"role": "user", "content": "Hi."},
    {"role": "system", "content": REMINDER},
    {"role": "system", "content": [{"type": "text", "text": ""}]},  # no text: left out
    {"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]},
]


def test_inline_system_messages_keep_their_place_joined_without_separator() -> None:
    request = _request(system="You help.", messages=TURNS)
    assert _roles_and_texts(request, merge=False) == [
        ("system", "You help."),
        ("user", "Hi."),
        ("system", "Be brief."),
        ("user", "A\nB"),  # a user's blocks joined by newlines, as the chat template joins them
    ]


def test_inline_system_messages_merge_into_the_leading_one_where_the_template_refuses_them() -> None:
    assert _roles_and_texts(_request(system="You help. ", messages=TURNS), merge=True) == [
        ("system", "You help. Be brief."),
        ("user", "Hi."),
        ("user", "A\nB"),
    ]
    billing = {"type": "text", "text": "x-anthropic-billing-header: cc=1"}
    only_inline = _request(messages=[{"role": "system", "content": [billing, *REMINDER]}, *TURNS[:1]])
    assert _roles_and_texts(only_inline, merge=True) == [("system", "Be brief."), ("user", "Hi.")]
    assert _roles_and_texts(only_inline, merge=False) == [("system", "Be brief."), ("user", "Hi.")]
    as_string = _request(messages=[{"role": "system", "content": "x-anthropic-billing-header: cch=1"}, *TURNS[:1]])
    for merge in (False, True):  # dropped as a string too: its per-request hash would defeat the prefix cache
        assert _roles_and_texts(as_string, merge=merge) == [("user", "Hi.")]


def test_the_probe_tells_templates_that_refuse_inline_system_messages(tokenizer: Any) -> None:
    assert not refuses_inline_system(tokenizer)  # SmolLM2's ChatML template takes them
    strict = copy.deepcopy(tokenizer)
    strict.chat_template = SYSTEM_FIRST
    assert refuses_inline_system(strict)
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    assert refuses_inline_system(bare)  # no template: vLLM's rule
