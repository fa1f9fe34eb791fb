"""A parsed completion: the answer text, the reasoning apart from it, the tool calls."""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple


class ToolCall(NamedTuple):
    id: str
    name: str
    arguments: str  # a JSON object as text, as the chat completions API gives it


class Parsed(NamedTuple):
    text: str
    reasoning: str | None = None  # None: the model did not think (or no reasoning parser)
    tool_calls: tuple[ToolCall, ...] | None = None
    warning: str | None = None  # a part of the output that did not parse (it stays in text)
    thinking_unfinished: bool = False  # the output ended inside the thinking block


class RawCall(NamedTuple):
    """A tool call as a parser finds it, before it gets its id."""

    name: str
    arguments: str


def call_ids(seed: str, num: int) -> list[str]:
    """`num` tool call ids for one completion, the same on every run (``seed``: the row's id
    and sample index), shaped as OpenAI's (``call_`` and 24 characters)."""
    return [
        "call_" + hashlib.blake2b(f"{seed}\0{i}".encode(), digest_size=12).hexdigest()
        for i in range(num)
    ]


def arguments_text(value: Any) -> str | None:
    """A call's arguments as a JSON object's text: a dict, or a string holding one; None when
    they are neither (the call does not parse)."""
    import json

    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)
