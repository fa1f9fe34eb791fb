"""Tool calls in an answer's text, for the formats current models write (harmony's calls are
parsed with its channels: harmony.py).

- ``hermes`` (Qwen2.5 / Qwen3 / Qwen3.5, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>``, one block a call, after optional text.
- ``llama3_json`` (Llama 3.1 / 3.2 / 3.3): the whole answer is ``{"name": ..., "parameters":
  {...}}`` (``arguments`` also read), optionally after ``<|python_tag|>``, several separated by
  ``;``.
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v3 tokenizers), or
  ``[TOOL_CALLS]NAME[ARGS]{...}`` per call (v11+ tokenizers), after optional text.

A parser gets the answer decoded with its marker tokens kept and returns the text around the
calls, the calls, and the raw text of each call that does not parse (kept in the text by the
caller, with a warning: a call is never dropped).
"""

from __future__ import annotations

import json
import re
from typing import NamedTuple

from batchrun.chat.types import RawCall, arguments_text


class ToolParse(NamedTuple):
    text: str  # the answer without its calls
    calls: list[RawCall]
    bad: list[str]  # raw text of the calls that do not parse


def _call(obj: object, args_keys: tuple[str, ...] = ("arguments",)) -> RawCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if not any(k in obj for k in args_keys):
        return None
    args = next(obj[k] for k in args_keys if k in obj)
    text = arguments_text(args)
    return None if text is None else RawCall(obj["name"], text)


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> ToolParse:
    first = text.find("<tool_call>")
    if first < 0:
        return ToolParse(text, [], [])
    calls, bad = [], []
    for m in _HERMES.finditer(text, first):
        call = _call(_loads(m.group(1).strip()))
        if call is None:
            bad.append(m.group(0))
        else:
            calls.append(call)
    return ToolParse(text[:first].strip(), calls, bad)


def parse_llama3_json(text: str) -> ToolParse:
    body = text.strip()
    tagged = body.startswith("<|python_tag|>")
    body = body.removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return ToolParse(text, [], [])
    decoder = json.JSONDecoder()
    calls: list[RawCall] = []
    i = 0
    while i < len(body):
        try:
            obj, end = decoder.raw_decode(body, i)
        except ValueError:
            obj, end = None, len(body)
        call = _call(obj, ("parameters", "arguments"))
        if call is None:
            if not calls and not tagged and obj is not None:
                return ToolParse(text, [], [])  # a JSON answer that is not a call
            return ToolParse("", calls, [body[i:]])
        calls.append(call)
        i = end
        while i < len(body) and body[i] in " \t\r\n;":
            i += 1
    return ToolParse("", calls, [])


_MISTRAL_NAMED = re.compile(r"\s*([\w.\-]+)\s*\[ARGS\]", re.DOTALL)


def parse_mistral(text: str) -> ToolParse:
    first = text.find("[TOOL_CALLS]")
    if first < 0:
        return ToolParse(text, [], [])
    calls: list[RawCall] = []
    bad: list[str] = []
    decoder = json.JSONDecoder()
    for part in text[first:].split("[TOOL_CALLS]")[1:]:
        named = _MISTRAL_NAMED.match(part)
        if named is not None:  # NAME[ARGS]{...}
            try:
                args, _ = decoder.raw_decode(part, named.end())
            except ValueError:
                args = None
            call = _call({"name": named.group(1), "arguments": args})
            if call is None:
                bad.append("[TOOL_CALLS]" + part)
            else:
                calls.append(call)
            continue
        try:  # [{...}, ...]
            obj, _ = decoder.raw_decode(part.strip())
        except ValueError:
            obj = None
        items = obj if isinstance(obj, list) else [obj]
        parsed = [_call(o) for o in items]
        if obj is None or any(c is None for c in parsed):
            bad.append("[TOOL_CALLS]" + part)
        else:
            calls.extend(c for c in parsed if c is not None)
    return ToolParse(text[:first].strip(), calls, bad)


# name -> (parse, the marker tokens a decode must keep for it)
TOOL_PARSERS = {
    "hermes": (parse_hermes, ("<tool_call>", "</tool_call>")),
    "llama3_json": (parse_llama3_json, ("<|python_tag|>",)),
    "mistral": (parse_mistral, ("[TOOL_CALLS]", "[ARGS]")),
}
