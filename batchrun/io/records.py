"""Output records, as msgspec Structs so one shared encoder writes them fast and in field order.

Plain output, one line per completion (n > 1 gives n lines that share the id)::

    {"id", "text", "reasoning"?, "tool_calls"?, "warning"?, "finish_reason", "usage":
     {"prompt_tokens", "completion_tokens", "cached_tokens"}, "index"?, "token_ids"?,
     "logprobs"?, "row"?, "input"?, "latency_s"?, "ttft_s"?}

``reasoning``: a thinking model's reasoning, apart from its answer ``text`` (batchrun/chat/);
``tool_calls``: ``[{"id", "type": "function", "function": {"name", "arguments"}}]`` as the chat
completions API gives them (``arguments``: a JSON object as text), and then ``finish_reason`` is
``tool_calls``; ``warning``: what of the output did not parse (e.g. a malformed tool call, kept
in ``text``). A completion whose thinking never ended has its reasoning, an empty ``text`` and
the finish reason that ended it (``length`` at max_tokens).

``index`` appears only when the request asked for n > 1. ``logprobs`` is one entry per generated
token: ``{"token_id", "token", "logprob", "top"?: [{"token_id", "token", "logprob"}, ...]}``
(``token``: the token's text, as OpenAI's ``logprobs.content[].token``; ``top`` only when
top_logprobs > 0). Errors: ``{"id", "row", "error": {"type", "message"}, "input"?}``.

``input`` holds the input columns of ``--keep-columns`` (``{"column": value, ...}``, null where
the row lacks one). NOTE: under one key, not at the top level: an input column may be called
``id``, ``text`` or ``error``, and a record's own fields must keep their meaning.

OpenAI Batch output follows the OpenAI Batch API files: all n choices of a request in ONE line;
``response`` / ``error`` are always present (one of them null). A chat choice's ``message`` has
``content`` (null when the answer is only tool calls), the reasoning of a thinking model both as
``reasoning_content`` (SGLang's name, and vLLM's before it took ``reasoning``) and as
``reasoning``, and ``tool_calls`` when there are any. A text completion's choice has no
reasoning field: the servers keep the reasoning to the chat endpoint (its reasoning stays in
``text``). This module is the one owner of these shapes.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec

from batchrun.chat.types import ToolCall
from batchrun.io.rows import PreparedRow, RowError
from batchrun.params import TopLogprobs


class Completion(NamedTuple):
    """One finished sample, as the runner hands it to the record builders."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: list[float] | None = None
    top_logprobs: list[TopLogprobs] | None = None
    latency_s: float | None = None  # from admission to the last token
    ttft_s: float | None = None  # from admission to the first token
    reasoning: str | None = None  # a thinking model's reasoning (None: it did not think)
    tool_calls: tuple[ToolCall, ...] | None = None
    warning: str | None = None  # what of the output did not parse (kept in text)


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class TopEntry(msgspec.Struct, kw_only=True, omit_defaults=True):
    token_id: int
    token: str | None = None  # None: no token_text given (result_records)
    logprob: float


class TokenLogprob(msgspec.Struct, kw_only=True, omit_defaults=True):
    token_id: int
    token: str | None = None
    logprob: float
    top: list[TopEntry] | None = None


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str


class ToolCallRecord(msgspec.Struct):
    id: str
    type: str
    function: FunctionCall


class ResultRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: str
    text: str
    reasoning: str | None = None
    tool_calls: list[ToolCallRecord] | None = None
    warning: str | None = None
    finish_reason: str
    usage: Usage
    index: int | None = None
    token_ids: list[int] | None = None
    logprobs: list[TokenLogprob] | None = None
    row: int | None = None
    input: dict[str, Any] | None = None
    latency_s: float | None = None
    ttft_s: float | None = None


class ErrorInfo(msgspec.Struct):
    type: str
    message: str


class ErrorRecord(msgspec.Struct, omit_defaults=True):
    id: str
    row: int
    error: ErrorInfo
    input: dict[str, Any] | None = None


_encoder = msgspec.json.Encoder()


def encode_line(record: msgspec.Struct) -> bytes:
    """One JSONL line, newline included."""
    return _encoder.encode(record) + b"\n"


def result_records(
    prepared: PreparedRow,
    completions: list[Completion],
    *,
    with_token_ids: bool = False,
    with_row: bool = True,
    with_timing: bool = True,
    token_text: Callable[[int], str] | None = None,
) -> list[ResultRecord]:
    """One record per completion, sorted by sample index. ``token_text`` renders token ids for
    the logprobs entries (e.g. job/token_text.TokenTexts); without it they have no ``token``."""
    multi = prepared.params.n > 1 or len(completions) > 1
    records = []
    for c in sorted(completions, key=lambda c: c.index):
        records.append(
            ResultRecord(
                id=prepared.id,
                text=c.text,
                reasoning=c.reasoning,
                tool_calls=_tool_calls(c),
                warning=c.warning,
                finish_reason=c.finish_reason,
                usage=Usage(c.prompt_tokens, c.completion_tokens, c.cached_tokens),
                index=c.index if multi else None,
                token_ids=list(c.token_ids) if with_token_ids else None,
                logprobs=_token_logprobs(c, token_text),
                row=prepared.row if with_row else None,
                input=prepared.kept,
                latency_s=_round(c.latency_s) if with_timing else None,
                ttft_s=_round(c.ttft_s) if with_timing else None,
            )
        )
    return records


def _tool_calls(c: Completion) -> list[ToolCallRecord] | None:
    if not c.tool_calls:
        return None
    return [
        ToolCallRecord(t.id, "function", FunctionCall(t.name, t.arguments)) for t in c.tool_calls
    ]


def error_record(error: RowError) -> ErrorRecord:
    return ErrorRecord(error.id, error.row, ErrorInfo(error.type, error.message), error.kept)


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 4)


def _token_logprobs(
    c: Completion, token_text: Callable[[int], str] | None
) -> list[TokenLogprob] | None:
    if c.logprobs is None:
        return None
    text = token_text or (lambda t: None)
    tops = c.top_logprobs or [None] * len(c.logprobs)
    out = []
    for token_id, logprob, top in zip(c.token_ids, c.logprobs, tops, strict=False):
        entries = None
        if top is not None and top.token_ids:
            entries = [
                TopEntry(token_id=t, token=text(t), logprob=lp)
                for t, lp in zip(top.token_ids, top.logprobs, strict=True)
            ]
        out.append(
            TokenLogprob(token_id=token_id, token=text(token_id), logprob=logprob, top=entries)
        )
    return out


def logprob_token_ids(completions: list[Completion]) -> list[int]:
    """Every token id the logprobs of `completions` name (chosen and top), to decode at once."""
    ids: list[int] = []
    for c in completions:
        if c.logprobs is None:
            continue
        ids += c.token_ids[: len(c.logprobs)]
        for top in c.top_logprobs or ():
            ids += top.token_ids
    return ids


# ----------------------------------------------------------------------------- OpenAI Batch


class OpenAIUsageDetails(msgspec.Struct):
    cached_tokens: int


class OpenAIUsage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: OpenAIUsageDetails


class ChatMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | None  # always written; null when the answer is only tool calls
    reasoning_content: str | None = None
    tool_calls: list[ToolCallRecord] | None = None
    reasoning: str | None = None  # the same text: vLLM's current name for it


class ChatChoice(msgspec.Struct, omit_defaults=True):
    index: int
    message: ChatMessage
    finish_reason: str
    logprobs: dict | None = None


class TextChoice(msgspec.Struct, omit_defaults=True):
    index: int
    text: str
    finish_reason: str
    logprobs: dict | None = None


class OpenAIBody(msgspec.Struct):
    id: str
    object: str  # "chat.completion" | "text_completion"
    created: int
    model: str
    choices: list[Any]  # ChatChoice for chat.completion, TextChoice for text_completion
    usage: OpenAIUsage


class OpenAIResponse(msgspec.Struct):
    status_code: int
    request_id: str
    body: OpenAIBody


class OpenAIError(msgspec.Struct):
    code: str
    message: str


class OpenAIRecord(msgspec.Struct):
    # No defaults on purpose: "response" and "error" are always written, one of them null.
    id: str
    custom_id: str
    response: OpenAIResponse | None
    error: OpenAIError | None


def openai_result_record(
    prepared: PreparedRow,
    completions: list[Completion],
    *,
    model: str,
    created: int | None = None,
    token_str: Callable[[int], str] | None = None,
) -> OpenAIRecord:
    """All n choices of one request in one line. ``token_str`` renders token ids for logprobs
    (e.g. ``lambda t: tokenizer.decode([t])``); without it tokens read ``"token_id:123"``."""
    chat = prepared.extra.get("url", "/v1/chat/completions") == "/v1/chat/completions"
    render = token_str or (lambda t: f"token_id:{t}")
    choices: list[Any] = []
    for c in sorted(completions, key=lambda c: c.index):
        if chat:
            lp = _chat_logprobs(c, render) if c.logprobs is not None else None
            calls = _tool_calls(c)
            content = None if calls and not c.text else c.text
            message = ChatMessage("assistant", content, c.reasoning, calls, c.reasoning)
            choices.append(ChatChoice(c.index, message, c.finish_reason, lp))
        else:
            lp = _text_logprobs(c, render) if c.logprobs is not None else None
            choices.append(TextChoice(c.index, c.text, c.finish_reason, lp))
    # The prompt runs once for all n samples; sample 0 is the one that paid for it.
    prompt_tokens = completions[0].prompt_tokens if completions else 0
    cached = min((c.cached_tokens for c in completions), default=0)
    completion_tokens = sum(c.completion_tokens for c in completions)
    hex_id = uuid.uuid4().hex
    body = OpenAIBody(
        id=("chatcmpl-" if chat else "cmpl-") + hex_id,
        object="chat.completion" if chat else "text_completion",
        created=int(time.time()) if created is None else created,
        model=model,
        choices=choices,
        usage=OpenAIUsage(
            prompt_tokens,
            completion_tokens,
            prompt_tokens + completion_tokens,
            OpenAIUsageDetails(cached),
        ),
    )
    return OpenAIRecord(f"batch_req_{hex_id}", prepared.id, OpenAIResponse(200, hex_id, body), None)


def openai_error_record(error: RowError) -> OpenAIRecord:
    return OpenAIRecord(
        f"batch_req_{uuid.uuid4().hex}", error.id, None, OpenAIError(error.type, error.message)
    )


def _chat_logprobs(c: Completion, render: Callable[[int], str]) -> dict:
    tops = c.top_logprobs or [None] * len(c.logprobs or [])
    content = []
    for token_id, logprob, top in zip(c.token_ids, c.logprobs or [], tops, strict=False):
        pairs = zip(top.token_ids, top.logprobs, strict=True) if top is not None else ()
        content.append(
            {
                "token": render(token_id),
                "logprob": logprob,
                "top_logprobs": [{"token": render(t), "logprob": lp} for t, lp in pairs],
            }
        )
    return {"content": content}


def _text_logprobs(c: Completion, render: Callable[[int], str]) -> dict:
    tokens = [render(t) for t in c.token_ids[: len(c.logprobs or [])]]
    top = None
    if c.top_logprobs:
        top = [
            {render(t): lp for t, lp in zip(x.token_ids, x.logprobs, strict=True)}
            for x in c.top_logprobs
        ]
    return {"tokens": tokens, "token_logprobs": list(c.logprobs or []), "top_logprobs": top}
