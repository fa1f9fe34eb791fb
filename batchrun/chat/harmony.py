"""gpt-oss's harmony format, parsed from the tokenizer's special tokens (the ``openai-harmony``
package cannot load its encoding offline, so it is not used).

An output is a run of messages after the prompt's ``<|start|>assistant``::

  <|channel|>analysis<|message|>...<|end|>
  <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{}<|call|>
  <|start|>assistant<|channel|>final<|message|>...<|return|>

``analysis`` is the reasoning; ``final`` the answer; a ``commentary`` message with a recipient
(``to=functions.NAME``, in the channel or the role part of the header) is a tool call whose
content is its arguments; one without a recipient is a preamble, kept in the answer text.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

from batchrun.chat.types import RawCall, arguments_text
from batchrun.chat.vocab import token_ids

TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


class Message(NamedTuple):
    channel: str
    recipient: str | None
    content_ids: list[int]
    ended: bool  # closed by <|end|>, <|call|> or <|return|> (not cut by max_tokens)


class HarmonyResult(NamedTuple):
    reasoning: str | None
    text: str
    calls: list[RawCall]
    bad_calls: list[str]  # commentary calls whose arguments are not a JSON object
    unfinished: bool  # the output ended inside an analysis message


class HarmonyParser:
    def __init__(self, tokenizer: Any):
        ids = token_ids(tokenizer, *TOKENS)
        if ids is None:
            raise ValueError(
                "the harmony parser needs gpt-oss's special tokens "
                f"({', '.join(TOKENS)}); this tokenizer lacks some"
            )
        self.tokenizer = tokenizer
        self.start, self.channel, self.message, *ends = ids
        self.ends = frozenset(ends)  # <|end|>, <|call|>, <|return|>

    def messages(self, ids: list[int]) -> list[Message]:
        out: list[Message] = []
        i, n = 0, len(ids)
        while i < n:
            try:
                m = ids.index(self.message, i)
            except ValueError:
                break  # a header cut by max_tokens: nothing of its content was written
            header = self._decode(ids[i:m], skip=False)
            j = m + 1
            while j < n and ids[j] not in self.ends and ids[j] != self.start:
                j += 1
            channel = header.split("<|channel|>", 1)[1] if "<|channel|>" in header else ""
            channel = channel.split()[0] if channel.split() else ""
            found = _RECIPIENT.search(header)
            recipient = found.group(1) if found else None
            out.append(Message(channel, recipient, ids[m + 1 : j], j < n and ids[j] in self.ends))
            i = j + 1
        return out

    def parse(self, ids: list[int], with_calls: bool) -> HarmonyResult:
        reasoning: list[str] = []
        text: list[str] = []
        calls: list[RawCall] = []
        bad: list[str] = []
        unfinished = False
        messages = self.messages(ids)
        if not messages:  # no harmony header at all: the output is plain text
            return HarmonyResult(None, self._decode(ids).strip(), [], [], False)
        for msg in messages:
            content = self._decode(msg.content_ids)
            if msg.channel == "analysis":
                reasoning.append(content)
                unfinished = not msg.ended
            elif msg.recipient is not None and with_calls:
                args = arguments_text(content.strip() or "{}")
                name = msg.recipient.removeprefix("functions.")
                if args is None:
                    bad.append(content)
                else:
                    calls.append(RawCall(name, args))
            else:
                text.append(content)
        return HarmonyResult(
            "\n".join(r.strip() for r in reasoning) if reasoning else None,
            "".join(text).strip() if not unfinished else "",
            calls,
            bad,
            unfinished,
        )

    def _decode(self, ids: list[int], skip: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip)
