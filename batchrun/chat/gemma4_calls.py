"""Gemma 4's tool calls (Google's Gemma 4 prompt-formatting and function-calling pages):

    <|tool_call>call:NAME{key:<|"|>text<|"|>,n:15,flag:true,obj:{k:<|"|>v<|"|>},xs:[1,2]}<tool_call|>

Keys are bare; every string value is delimited by the ``<|"|>`` token, so its text may hold any
character (braces, commas, quotes) literally; numbers, ``true``, ``false`` and ``null`` are bare;
objects and lists nest. A call becomes the OpenAI shape: its arguments a JSON object's text. A
call that does not read this way stays in the text (the caller warns), never dropped.
"""

from __future__ import annotations

import json
import re

from batchrun.chat.tool_calls import ToolParse
from batchrun.chat.types import RawCall

CALL_OPEN, CALL_CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
KEEP = (CALL_OPEN, CALL_CLOSE, QUOTE)  # the tokens a decode keeps for this parser
_HEAD = re.compile(r"\s*call:([\w.\-]+)\s*(?=\{)")
_KEY = re.compile(r"\s*([^\s:{}\[\],]+)\s*:")
_BARE = re.compile(r"\s*(-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null)(?=\s*[,}\]])")


class _Bad(ValueError):
    """The call does not read as Gemma 4's format."""


def _value(s: str, i: int) -> tuple[object, int]:
    while i < len(s) and s[i].isspace():
        i += 1
    if s.startswith(QUOTE, i):
        end = s.find(QUOTE, i + len(QUOTE))
        if end < 0:
            raise _Bad("an unclosed string")
        return s[i + len(QUOTE) : end], end + len(QUOTE)
    if s.startswith("{", i):
        return _object(s, i)
    if s.startswith("[", i):
        items: list[object] = []
        i += 1
        while True:
            while i < len(s) and s[i].isspace():
                i += 1
            if s.startswith("]", i) and not items:
                return items, i + 1
            item, i = _value(s, i)
            items.append(item)
            i = _after(s, i, "]")
            if s[i - 1] == "]":
                return items, i
    m = _BARE.match(s, i)
    if m is None:
        raise _Bad(f"an unreadable value at {s[i : i + 20]!r}")
    return json.loads(m.group(1)), m.end()


def _after(s: str, i: int, close: str) -> int:
    """The index after the `,` or `close` that follows an item."""
    while i < len(s) and s[i].isspace():
        i += 1
    if i < len(s) and s[i] in ("," + close):
        return i + 1
    raise _Bad(f"expected ',' or {close!r}")


def _object(s: str, i: int) -> tuple[dict[str, object], int]:
    obj: dict[str, object] = {}
    i += 1  # past "{"
    while True:
        while i < len(s) and s[i].isspace():
            i += 1
        if s.startswith("}", i) and not obj:
            return obj, i + 1
        m = _KEY.match(s, i)
        if m is None:
            raise _Bad("expected a key")
        obj[m.group(1)], i = _value(s, m.end())
        i = _after(s, i, "}")
        if s[i - 1] == "}":
            return obj, i


def _read_call(body: str) -> RawCall:
    head = _HEAD.match(body)
    if head is None:
        raise _Bad("expected call:NAME{...}")
    args, end = _object(body, head.end())
    if body[end:].strip():
        raise _Bad("text after the arguments")
    return RawCall(head.group(1), json.dumps(args, ensure_ascii=False))


def parse_gemma4(text: str) -> ToolParse:
    """`text`: the answer decoded with ``<|tool_call>``, ``<tool_call|>`` and ``<|"|>`` kept."""
    if CALL_OPEN not in text:
        return ToolParse(text, [], [])
    calls: list[RawCall] = []
    bad: list[str] = []
    rest: list[str] = []
    i = 0
    while (start := text.find(CALL_OPEN, i)) >= 0:
        rest.append(text[i:start])
        end = text.find(CALL_CLOSE, start)
        stop = len(text) if end < 0 else end + len(CALL_CLOSE)
        body = text[start + len(CALL_OPEN) : end if end >= 0 else len(text)]
        try:
            if end < 0:
                raise _Bad("an unclosed call")
            calls.append(_read_call(body))
        except _Bad:
            bad.append(text[start:stop])
        i = stop
    rest.append(text[i:])
    return ToolParse("".join(rest).strip(), calls, bad)
