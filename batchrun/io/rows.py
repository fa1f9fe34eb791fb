"""Turn a raw input row into a prepared row (id, prompt or messages, sampling params) or an error.

Two row shapes are accepted:

- plain rows: a prompt column (string), a messages column (chat messages) or a
  ``prompt_token_ids`` column (a pre-tokenized prompt: it wins over the other two and skips the
  tokenizer and the chat template), an optional id column, and optional per-row sampling fields
  at the top level (``max_tokens``, ``temperature``, ...; row_fields.ROW_PARAM_FIELDS) that override
  the CLI defaults. A null value means "not set", because Parquet / datasets rows carry every
  column, null where a row does not use it.
- OpenAI Batch rows: ``{"custom_id", "method", "url", "body": {...}}`` with ``url`` one of
  ``/v1/chat/completions`` (``body.messages``) or ``/v1/completions`` (``body.prompt``).

Structured output fields (``response_format``, ``regex``, ``choice``, ``ebnf``) are normalized into
``PreparedRow.response_format`` as ``{"type": "json_object" | "json_schema" | "regex" | "choice" |
"ebnf", ...}`` and into ``params.grammar`` (a GrammarSpec, overriding the CLI default;
``{"type": "text"}`` turns a default grammar off; row_structured.py). Whether a spec compiles is
decided by the engine: a bad one fails that row alone, with the compiler's message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from batchrun.io.readers import RawRow
from batchrun.io.row_chat import parse_template_kwargs
from batchrun.io.row_fields import InvalidRow, decode_text, parse_params
from batchrun.io.row_structured import parse_structured
from batchrun.params import SamplingParams

# "developer": the OpenAI chat API's, which harmony (gpt-oss's chat template) reads as instructions
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
PROMPT_TOKEN_IDS = "prompt_token_ids"  # a pre-tokenized prompt: a list of token ids
OPENAI_URLS = ("/v1/chat/completions", "/v1/completions")


@dataclass(frozen=True)
class RowSpec:
    prompt_column: str | None = "prompt"  # None or "": never read a prompt column
    messages_column: str | None = "messages"  # None or "": never read a messages column
    id_column: str | None = None
    system_prompt: str | None = None
    use_chat_template: bool = True
    chat_template: str | None = None  # Jinja text used instead of the tokenizer's template
    keep_columns: tuple[str, ...] = ()  # input columns copied into the records (under "input")
    # --chat-template-kwargs: template variables for every row (a row's own win)
    chat_template_kwargs: dict | None = None


class PreparedRow(NamedTuple):
    id: str
    row: int
    prompt: str | None
    messages: list[dict] | None
    params: SamplingParams
    openai: bool  # the row came in OpenAI Batch format
    response_format: dict | None
    extra: dict  # OpenAI: "url", "method", "model", maybe "unsupported_fields"
    prompt_token_ids: list[int] | None = None  # pre-tokenized: no tokenizer, no chat template
    kept: dict | None = None  # the RowSpec.keep_columns of the input row (None when none kept)
    # chat_template_kwargs, tools, reasoning_effort of the row (io/row_chat.py); None: none
    template_kwargs: dict | None = None
    thinking_open: bool = False  # its prompt leaves a thinking block open (job/tokenize.py)


class RowError(NamedTuple):
    id: str
    row: int
    # "invalid_json" | "invalid_csv" | "invalid_request" | "context_length_exceeded" |
    # "duplicate_id"
    type: str
    message: str
    kept: dict | None = None  # as PreparedRow.kept


# OpenAI body fields we accept but do not act on; reported so the CLI can warn once.
_OPENAI_UNSUPPORTED = tuple(
    "logit_bias functions suffix echo best_of audio modalities prediction".split()
)


def schema_problem(columns: list[str] | None, spec: RowSpec) -> str | None:
    """Why every row of an input with these columns would fail, or None. A CSV or Parquet
    file's (or a datasets split's) columns are every row's, so a missing prompt or id column is
    the whole input's problem, refused before the model loads; JSON rows (no schema, None) each
    have their own keys and fail one by one. OpenAI Batch rows (custom_id and body) are left to
    the row checks."""
    if columns is None or {"custom_id", "body"} <= set(columns):
        return None
    shown = show_columns([repr(c) for c in columns])
    if spec.id_column and spec.id_column not in columns:
        return (
            f"no id column {spec.id_column!r}: the input's columns are {shown}; name another "
            "with --id-column, or drop it to use the row numbers"
        )
    wanted = [c for c in (spec.prompt_column, spec.messages_column) if c]
    if PROMPT_TOKEN_IDS in columns or any(c in columns for c in wanted):
        return None
    named = " or ".join(map(repr, wanted or [PROMPT_TOKEN_IDS]))
    return (
        f"no {named} column: the input's columns are {shown}; name the prompt's with "
        "--prompt-column (text) or --messages-column (chat messages)"
    )


def show_columns(names: list[str], most: int = 20) -> str:
    """An input's column names for a message: the first `most`, then "..." if there are more."""
    return ", ".join(names[:most]) + (", ..." if len(names) > most else "")


def detect_openai_batch(first_row: dict | None) -> bool:
    """True when a row looks like an OpenAI Batch request line (has custom_id and a body)."""
    return (
        isinstance(first_row, dict)
        and "custom_id" in first_row
        and isinstance(first_row.get("body"), dict)
    )


def prepare_row(
    raw: RawRow, spec: RowSpec, defaults: SamplingParams, openai: bool
) -> PreparedRow | RowError:
    """Never raises on bad row content: every problem becomes a RowError naming the row."""
    row_id = str(raw.row)
    kept = kept_columns(raw.data, spec.keep_columns)
    if raw.data is None:
        message = raw.error or "row could not be parsed"
        return RowError(row_id, raw.row, raw.kind, message, kept)
    data = raw.data
    try:
        if openai:
            row_id = _row_id(data, "custom_id", raw.row)
            return _prepare_openai(data, raw.row, row_id, spec, defaults)
        row_id = _row_id(data, spec.id_column, raw.row)
        return _prepare_plain(data, raw.row, row_id, spec, defaults)._replace(kept=kept)
    except InvalidRow as e:
        return RowError(row_id, raw.row, "invalid_request", f"row {raw.row}: {e}", kept)


def kept_columns(data: dict | None, columns: tuple[str, ...]) -> dict | None:
    """The columns to copy into the row's records: every one named, null where the row lacks it
    (so every record has the same keys). None when no column is kept."""
    if not columns:
        return None
    data = data or {}
    return {c: data.get(c) for c in columns}


def given_id(data: dict, column: str | None) -> str | None:
    """The id a row gives itself in `column` (None: an "id" field, if the row has one), or None
    when it gives none that can be used (then its row number is its id, or the row fails)."""
    if not column:
        value = data.get("id")
        return str(value) if isinstance(value, (str, int)) and value != "" else None
    value = data.get(column)
    return None if value is None or isinstance(value, (dict, list)) else str(value)


def _row_id(data: dict, column: str | None, row: int) -> str:
    row_id = given_id(data, column)
    if row_id is not None:
        return row_id
    if not column:
        return str(row)  # no --id-column and no "id" field: the row number
    value = data.get(column)
    if value is None and column in data:
        raise InvalidRow(f"id column {column!r} is null; give every row an id")
    if value is None:
        raise InvalidRow(f"no value in id column {column!r}; row has columns {_columns(data)}")
    raise InvalidRow(f"{column!r} must be a string or number, got {type(value).__name__}")


def _prepare_plain(
    data: dict, row: int, row_id: str, spec: RowSpec, defaults: SamplingParams
) -> PreparedRow:
    token_ids = data.get(PROMPT_TOKEN_IDS)
    if token_ids is not None:
        # NOTE: the token ids are the prompt; a prompt or messages column next to them is the
        # text they came from (vLLM's TokensPrompt), not run
        token_ids = _check_token_ids(token_ids)
        params, response_format = parse_structured(data, parse_params(data, defaults))
        return PreparedRow(row_id, row, None, None, params, False, response_format, {}, token_ids)
    prompt_col, messages_col = spec.prompt_column or None, spec.messages_column or None
    prompt = data.get(prompt_col) if prompt_col else None
    messages = data.get(messages_col) if messages_col else None
    if prompt is not None and messages is not None:
        raise InvalidRow(
            f"row has both {prompt_col!r} and {messages_col!r}; keep one column, or turn one off "
            "with --prompt-column '' or --messages-column ''"
        )
    if prompt is None and messages is None:
        wanted = [c for c in (prompt_col, messages_col) if c]
        nulls = [repr(c) for c in wanted if c in data]  # present, but null
        if nulls:
            absent = [repr(c) for c in wanted if c not in data]
            raise InvalidRow(
                f"{' and '.join(nulls)} {'is' if len(nulls) == 1 else 'are'} null"
                + (f" and it has no {absent[0]}" if absent else "")
                + "; give the row a prompt string or chat messages"
            )
        raise InvalidRow(
            f"row has no {' or '.join(map(repr, wanted))} column: it has {_columns(data)}; "
            "pick the right one with --prompt-column / --messages-column"
        )
    if messages is not None:
        messages = _check_messages(messages, messages_col or "messages", spec.system_prompt)
    else:
        prompt = _check_prompt(prompt, prompt_col or "prompt")
    params, response_format = parse_structured(data, parse_params(data, defaults))
    return PreparedRow(
        row_id, row, prompt, messages, params, False, response_format, {},
        template_kwargs=parse_template_kwargs(data),
    )  # fmt: skip


def _prepare_openai(
    data: dict, row: int, row_id: str, spec: RowSpec, defaults: SamplingParams
) -> PreparedRow:
    url, method, body = data.get("url"), data.get("method", "POST"), data.get("body")
    if url not in OPENAI_URLS:
        raise InvalidRow(f"url {url!r} is not supported; use one of {list(OPENAI_URLS)}")
    if method != "POST":
        raise InvalidRow(f"method {method!r} is not supported; OpenAI batch requests use POST")
    if not isinstance(body, dict):
        raise InvalidRow(f"'body' must be an object, got {type(body).__name__}")
    prompt = messages = None
    if url == "/v1/chat/completions":
        _require(body, "messages")
        messages = _check_messages(body["messages"], "body.messages", spec.system_prompt)
    else:
        _require(body, "prompt")
        prompt = _check_prompt(body["prompt"], "body.prompt")
    params, response_format = parse_structured(body, parse_params(body, defaults, "body."))
    extra: dict = {"url": url, "method": method}
    if body.get("model") is not None:
        extra["model"] = body["model"]
    unsupported = [k for k in _OPENAI_UNSUPPORTED if body.get(k) is not None]
    if unsupported:
        extra["unsupported_fields"] = unsupported
    return PreparedRow(
        row_id, row, prompt, messages, params, True, response_format, extra,
        template_kwargs=parse_template_kwargs(body, "body."),
    )  # fmt: skip


def _require(body: dict, key: str) -> None:
    if key in body and body[key] is None:
        raise InvalidRow(f"body.{key} is null; give it a value")
    if key not in body:
        raise InvalidRow(f"body has no {key!r} (it has {_columns(body)})")


def _check_token_ids(value: Any) -> list[int]:
    """A non-empty list of non-negative ints (the upper bound, the vocabulary, is checked where
    the model is known: batchrun/job/tokenize.py)."""
    value = decode_text(value, repr(PROMPT_TOKEN_IDS))
    if not isinstance(value, list):
        raise InvalidRow(
            f"{PROMPT_TOKEN_IDS!r} must be a list of token ids, got {type(value).__name__}"
        )
    if not value:
        raise InvalidRow(f"{PROMPT_TOKEN_IDS!r} is empty")
    ids = value
    for i, t in enumerate(value):
        if type(t) is int and t >= 0:
            continue
        if isinstance(t, float) and t.is_integer() and t >= 0:
            if ids is value:
                ids = list(value)
            ids[i] = int(t)  # pandas writes an int list column with nulls as floats
            continue
        raise InvalidRow(f"{PROMPT_TOKEN_IDS}[{i}] is {t!r}: token ids are integers >= 0")
    return ids


def _check_prompt(prompt: Any, column: str) -> str:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # OpenAI allows a one-element list of prompts
    if not isinstance(prompt, str):
        raise InvalidRow(f"{column!r} must be a string, got {type(prompt).__name__}")
    if not prompt:
        raise InvalidRow(f"{column!r} is empty")
    return prompt


def _check_messages(messages: Any, column: str, system_prompt: str | None) -> list[dict]:
    messages = decode_text(messages, repr(column))
    if not isinstance(messages, list):
        raise InvalidRow(f"{column!r} must be a list of messages, got {type(messages).__name__}")
    if not messages:
        raise InvalidRow(f"{column!r} is empty")
    out: list[dict] = []
    for i, m in enumerate(messages):
        where = f"{column}[{i}]"
        if not isinstance(m, dict):
            raise InvalidRow(f"{where} must be an object with 'role' and 'content'")
        # Drop nulls: Parquet structs carry every field of every message (name, tool_calls, ...).
        m = {k: v for k, v in m.items() if v is not None}
        role = m.get("role")
        if role not in ROLES:
            raise InvalidRow(f"{where}.role must be one of {sorted(ROLES)}, got {role!r}")
        m["content"] = _check_content(m.get("content"), where, allow_none="tool_calls" in m)
        out.append(m)
    if system_prompt and not any(m["role"] == "system" for m in out):
        out.insert(0, {"role": "system", "content": system_prompt})
    return out


def _check_content(content: Any, where: str, allow_none: bool) -> str | None:
    if isinstance(content, str) or (content is None and allow_none):
        return content
    if isinstance(content, list):  # OpenAI content parts: only text parts can run here
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidRow(
                    f"{where}.content: only text parts are supported, got {kind!r} (batchrun "
                    "runs the text model: images and other media are not read, and a row "
                    "with them is not run)"
                )
            if not isinstance(part.get("text"), str):
                raise InvalidRow(f"{where}.content: a text part needs a string 'text'")
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidRow(f"{where}.content must be a string, got {type(content).__name__}")


def _columns(data: dict) -> list[str]:
    return [k for k, v in data.items() if v is not None]
