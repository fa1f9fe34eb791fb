"""Batched tokenizing of prepared rows, with the checks that must pass before a row can run.

Chat rows (and prompt rows when a chat template is used) are rendered to text with the chat
template (RowSpec.chat_template, else the tokenizer's) one row at a time, so one broken
conversation fails alone, then all rendered texts go through ONE batched fast-tokenizer call
with ``add_special_tokens=False``: the template already writes BOS where the model wants it.
Prompt rows without a template are tokenized in a second batched call with
``add_special_tokens=True``. An OpenAI Batch ``/v1/completions`` row is always raw text
(tokenized as a server tokenizes a completions prompt, with the tokenizer's BOS), whatever the
chat template setting: only chat rows are templated. Pre-tokenized rows
(``prompt_token_ids``) skip both: their ids are checked against the model's vocabulary instead.

The template gets the row's keyword arguments (``chat_template_kwargs`` over
``--chat-template-kwargs``, ``tools``, ``reasoning_effort``: io/row_chat.py). Past assistant turns
reach it as the model's templates read them: a tool call's ``arguments`` as an object (OpenAI
sends text), the reasoning as ``reasoning_content`` (Qwen's) and as ``thinking`` (gpt-oss's); the
template decides whether past reasoning is kept. A row whose prompt leaves a thinking block open
(templates that write ``<think>`` after the assistant header) is marked so, for the reasoning
parser (batchrun/chat/); a response format applies to the answer after it (engine/thinking.py).
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from batchrun.chat.markers import think_markers
from batchrun.io.rows import PreparedRow, RowError, RowSpec


class TokenizedRow(NamedTuple):
    prepared: PreparedRow
    input_ids: list[int]


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def check_chat_template(text: str) -> None:
    """Compile a Jinja chat template as transformers does when it renders one; ValueError with
    the compiler's message (and line) when it does not compile."""
    import jinja2  # local: only for --chat-template

    if not text.strip():
        raise ValueError("the template is empty")
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # a transformers that compiles templates elsewhere: plain Jinja
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def _compile_jinja_template(text: str):
            env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
            return env.from_string(text)

    try:
        _compile_jinja_template(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the template does not compile: {e.message} (line {e.lineno})") from e
    except jinja2.TemplateError as e:
        raise ValueError(f"the template does not compile: {e}") from e


def tokenize_rows(
    tokenizer: Any,
    rows: list[PreparedRow],
    spec: RowSpec,
    context_len: int,
    vocab_size: int | None = None,
) -> list[TokenizedRow | RowError]:
    """One result per input row, in input order. ``vocab_size``: the model's, which bounds a
    pre-tokenized row's ids (None: not checked)."""
    template = spec.chat_template  # None: the tokenizer's
    has_template = template is not None or has_chat_template(tokenizer)
    use_template = spec.use_chat_template and has_template
    markers = think_markers(tokenizer)
    out: list[TokenizedRow | RowError | None] = [None] * len(rows)
    templated: list[tuple[int, str]] = []  # (position in rows, rendered text)
    plain: list[tuple[int, str]] = []
    for i, row in enumerate(rows):
        if row.params.max_thinking_tokens is not None and markers is None:
            out[i] = _error(
                row,
                "invalid_request",
                "max_thinking_tokens needs a thinking model: this tokenizer has no <think> / "
                "</think> or harmony (<|channel|>) tokens",
            )
            continue
        if row.prompt_token_ids is not None:
            out[i] = _check_token_ids(row, vocab_size) or _check(
                row, row.prompt_token_ids, context_len
            )
            continue
        if row.messages is not None:
            if not has_template:
                out[i] = _error(
                    row,
                    "invalid_request",
                    "this row has chat messages but the tokenizer has no chat template; give "
                    "one with --chat-template FILE (or add a chat_template to the model "
                    "directory) or send plain 'prompt' rows (--no-chat-template does not apply "
                    "to messages)",
                )
                continue
            conversation = _template_messages(row.messages)
        elif use_template and not _is_text_completion(row):
            conversation = [{"role": "user", "content": row.prompt}]
            if spec.system_prompt:
                conversation.insert(0, {"role": "system", "content": spec.system_prompt})
        else:
            plain.append((i, row.prompt or ""))
            continue
        kwargs = {**(spec.chat_template_kwargs or {}), **(row.template_kwargs or {})}
        try:
            text = tokenizer.apply_chat_template(
                conversation,
                chat_template=template,
                add_generation_prompt=True,
                tokenize=False,
                **kwargs,
            )
        except Exception as e:  # jinja raises TemplateError (e.g. "roles must alternate")
            out[i] = _error(row, "invalid_request", f"chat template failed: {e}")
            continue
        templated.append((i, text))

    for batch, add_special in ((templated, False), (plain, True)):
        if not batch:
            continue
        encoded = tokenizer(
            [text for _, text in batch],
            add_special_tokens=add_special,
            return_attention_mask=False,
            return_token_type_ids=False,
        )["input_ids"]
        for (i, _), ids in zip(batch, encoded, strict=True):
            out[i] = _check(rows[i], list(ids), context_len)
    if markers is not None:
        for i, item in enumerate(out):
            if isinstance(item, TokenizedRow) and markers.opens_in(item.input_ids):
                out[i] = item._replace(prepared=item.prepared._replace(thinking_open=True))
    return out  # type: ignore[return-value]  # every slot was filled above


def _template_messages(messages: list[dict]) -> list[dict]:
    """`messages` as chat templates read them (the module's docstring); a message is copied
    only when it changes."""
    out = messages
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        changed = dict(m)
        reasoning = m.get("reasoning_content", m.get("reasoning"))
        if reasoning is not None:
            changed.setdefault("reasoning_content", reasoning)
            changed.setdefault("thinking", reasoning)
        if isinstance(m.get("tool_calls"), list):
            changed["tool_calls"] = [_template_call(c) for c in m["tool_calls"]]
        if changed != m:
            if out is messages:
                out = list(messages)
            out[i] = changed
    return out


def _template_call(call: Any) -> Any:
    """An OpenAI tool call with its ``function.arguments`` text as an object (templates write
    it with ``tojson``); arguments that are not a JSON object's text stay as they are."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    fn = dict(call["function"])
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            fn["arguments"] = parsed
    return {**call, "function": fn}


def _is_text_completion(row: PreparedRow) -> bool:
    return row.openai and row.extra.get("url") == "/v1/completions"


def _check(row: PreparedRow, ids: list[int], context_len: int) -> TokenizedRow | RowError:
    if not ids:
        return _error(row, "invalid_request", "the prompt tokenizes to 0 tokens")
    max_new = row.params.max_new_tokens
    if len(ids) + max_new > context_len:
        return _error(
            row,
            "context_length_exceeded",
            f"prompt ({len(ids)} tokens) + max_tokens ({max_new}) = {len(ids) + max_new} "
            f"exceeds the context length ({context_len}: the model's, or --max-model-len); "
            "shorten the prompt or lower max_tokens (per row, or --max-tokens)",
        )
    return TokenizedRow(row, ids)


def _check_token_ids(row: PreparedRow, vocab_size: int | None) -> RowError | None:
    """The first id outside the vocabulary, as a row error (batchrun/io/rows.py checked the
    rest: a non-empty list of ints >= 0)."""
    if vocab_size is None:
        return None
    ids = row.prompt_token_ids or []
    if max(ids) < vocab_size:
        return None
    i = next(i for i, t in enumerate(ids) if t >= vocab_size)
    return _error(
        row,
        "invalid_request",
        f"prompt_token_ids[{i}] is {ids[i]}, outside the model's vocabulary (ids 0 to "
        f"{vocab_size - 1}); tokenize with this model's tokenizer",
    )


def _error(row: PreparedRow, kind: str, message: str) -> RowError:
    return RowError(row.id, row.row, kind, f"row {row.row}: {message}", row.kept)
