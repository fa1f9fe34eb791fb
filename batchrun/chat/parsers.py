"""The reasoning and tool-call parsers a run uses, by name or detected from the tokenizer
(``auto``), and the one call that parses a finished completion.

``--reasoning-parser``: ``auto`` | ``none`` | ``think`` (aliases ``qwen3``, ``qwen3_5``,
``deepseek_r1``, ``phi4_reasoning``) | ``harmony`` (alias ``gpt_oss``) | ``gemma4``.
``--tool-call-parser``: ``auto`` | ``none`` | ``hermes`` (alias ``qwen``) | ``llama3_json``
(alias ``llama3``) | ``mistral`` | ``gemma4`` | ``harmony`` (alias ``gpt_oss``; with the harmony
reasoning parser, which reads the same messages).

auto: harmony when the vocabulary has gpt-oss's ``<|channel|>`` tokens; gemma4 when it has
Gemma 4's ``<|channel>``, ``<channel|>`` and ``<|turn>``; the ``think`` parser when it has
``<think>`` and ``</think>``; hermes with ``<tool_call>``, mistral with ``[TOOL_CALLS]``,
llama3_json with ``<|python_tag|>``, gemma4 with ``<|tool_call>``; else none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchrun.chat.gemma4_calls import KEEP as GEMMA4_KEEP
from batchrun.chat.gemma4_calls import parse_gemma4
from batchrun.chat.harmony import HarmonyParser
from batchrun.chat.markers import GEMMA4, HARMONY, THINK, ThinkMarkers, think_markers
from batchrun.chat.reasoning import split_think
from batchrun.chat.tool_calls import TOOL_PARSERS, ToolParse
from batchrun.chat.types import Parsed, RawCall, ToolCall, call_ids
from batchrun.chat.vocab import special_ids, token_id

NONE, AUTO = "none", "auto"
REASONING_ALIASES = {
    THINK: THINK, "qwen3": THINK, "qwen3_5": THINK, "deepseek_r1": THINK,
    "phi4_reasoning": THINK, HARMONY: HARMONY, "gpt_oss": HARMONY, GEMMA4: GEMMA4,
}  # fmt: skip
# the tokens each reasoning parser needs, for the error that names them
_NEEDS = {THINK: "<think> / </think>", HARMONY: "harmony (<|channel|>)",
          GEMMA4: "Gemma 4 (<|channel> / <channel|> / <|turn>)"}  # fmt: skip
TOOL_ALIASES = {
    "hermes": "hermes", "qwen": "hermes", "llama3_json": "llama3_json", "llama3": "llama3_json",
    "mistral": "mistral", HARMONY: HARMONY, "gpt_oss": HARMONY, GEMMA4: GEMMA4,
}  # fmt: skip
# name -> (parse, the marker tokens a decode must keep for it)
_TOOL_PARSERS = {**TOOL_PARSERS, GEMMA4: (parse_gemma4, GEMMA4_KEEP)}
REASONING_CHOICES = (AUTO, NONE, *REASONING_ALIASES)
TOOL_CHOICES = (AUTO, NONE, *TOOL_ALIASES)
# tool parser -> the token whose presence in the vocabulary picks it (auto)
_TOOL_DETECT = (("hermes", "<tool_call>"), ("mistral", "[TOOL_CALLS]"),
                ("llama3_json", "<|python_tag|>"), (GEMMA4, "<|tool_call>"))  # fmt: skip


@dataclass(frozen=True)
class ParserChoice:
    """The parsers resolved for one tokenizer: None where none applies."""

    reasoning: str | None  # THINK | HARMONY | GEMMA4 | None
    tools: str | None  # a TOOL_PARSERS name | HARMONY | None


def resolve_parsers(tokenizer: Any, reasoning: str = AUTO, tools: str = AUTO) -> ParserChoice:
    """ValueError naming what is supported when a name is unknown or the tokenizer lacks the
    tokens of the parser named."""
    if reasoning not in REASONING_CHOICES:
        raise ValueError(
            f"--reasoning-parser {reasoning!r} is not supported; use one of "
            f"{', '.join(REASONING_CHOICES)}"
        )
    if tools not in TOOL_CHOICES:
        raise ValueError(
            f"--tool-call-parser {tools!r} is not supported; use one of {', '.join(TOOL_CHOICES)}"
        )
    markers = think_markers(tokenizer)
    if reasoning == AUTO:
        r = markers.family if markers is not None else None
    elif reasoning == NONE:
        r = None
    else:
        r = REASONING_ALIASES[reasoning]
        if think_markers(tokenizer, r) is None:
            raise ValueError(
                f"--reasoning-parser {reasoning}: the tokenizer has no "
                f"{_NEEDS[r]} tokens; "
                "use --reasoning-parser auto or none"
            )
    if tools == AUTO:
        t = HARMONY if r == HARMONY else None
        if t is None and (markers is None or markers.family != HARMONY):
            found = (name for name, tok in _TOOL_DETECT if token_id(tokenizer, tok) is not None)
            t = next(found, None)
    elif tools == NONE:
        t = None
    else:
        t = TOOL_ALIASES[tools]
        if t == HARMONY and r != HARMONY:
            raise ValueError(
                "--tool-call-parser harmony reads gpt-oss's messages with the harmony reasoning "
                "parser; use --reasoning-parser harmony (or auto) with it"
            )
    return ParserChoice(r, t)


class OutputParser:
    """Turns a completion's token ids into its text, reasoning and tool calls."""

    def __init__(self, tokenizer: Any, choice: ParserChoice):
        self.tokenizer = tokenizer
        self.choice = choice
        self.markers: ThinkMarkers | None = (
            think_markers(tokenizer, choice.reasoning) if choice.reasoning else None
        )
        self.harmony = HarmonyParser(tokenizer) if choice.reasoning == HARMONY else None
        self._parse_tools = None
        self._drop: frozenset[int] = frozenset()
        if choice.tools is not None and choice.tools != HARMONY:
            self._parse_tools, keep = _TOOL_PARSERS[choice.tools]
            kept = {token_id(tokenizer, t) for t in keep}
            self._drop = special_ids(tokenizer) - kept

    @property
    def is_plain(self) -> bool:
        """No parser applies: the text is the whole decoded output."""
        return self.choice.reasoning is None and self.choice.tools is None

    def parse(
        self,
        ids: list[int],
        prompt_open: bool = False,
        call_seed: str = "",
        with_tools: bool = True,
    ) -> Parsed:
        """`prompt_open`: the prompt left a thinking block open (ThinkMarkers.opens_in);
        `call_seed`: what the tool call ids derive from (the row id and sample index);
        `with_tools`: the row gave the model tools (else its answer holds no calls to parse,
        as an OpenAI-compatible server reads it)."""
        if self.harmony is not None:
            h = self.harmony.parse(ids, with_calls=with_tools and self.choice.tools == HARMONY)
            text = "\n".join([h.text, *h.bad_calls]).strip() if h.bad_calls else h.text
            return self._result(text, h.reasoning, h.calls, h.bad_calls, h.unfinished, call_seed)
        reasoning = None
        unfinished = False
        answer = ids
        if self.markers is not None:
            split = split_think(ids, self.markers, prompt_open)
            answer, unfinished = split.answer_ids, split.unfinished
            if split.reasoning_ids is not None:
                reasoning = self._decode(split.reasoning_ids).strip()
        if self._parse_tools is not None and with_tools and answer:
            raw = self.tokenizer.decode(
                [t for t in answer if t not in self._drop], skip_special_tokens=False
            )
            tp: ToolParse = self._parse_tools(raw)
            if tp.calls or tp.bad:
                text = "\n".join([tp.text, *tp.bad]).strip() if tp.bad else tp.text
                return self._result(text, reasoning, tp.calls, tp.bad, unfinished, call_seed)
        text = self._decode(answer)
        return Parsed(text.strip() if reasoning is not None else text, reasoning,
                      warning=None, thinking_unfinished=unfinished)  # fmt: skip

    def _result(
        self,
        text: str,
        reasoning: str | None,
        calls: list[RawCall],
        bad: list[str],
        unfinished: bool,
        call_seed: str,
    ) -> Parsed:
        tool_calls = None
        if calls:
            ids = call_ids(call_seed, len(calls))
            tool_calls = tuple(ToolCall(i, c.name, c.arguments) for i, c in zip(ids, calls))
        warning = None
        if bad:
            warning = (
                f"{len(bad)} tool call(s) did not parse ({self.choice.tools} format: a function "
                "name and a JSON object of arguments); kept in text"
            )
        return Parsed(text, reasoning, tool_calls, warning, unfinished)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
