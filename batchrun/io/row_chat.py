"""A row's chat-template fields: ``chat_template_kwargs`` (e.g. ``{"enable_thinking": false}``),
``tools`` and ``tool_choice`` (OpenAI's), and ``reasoning_effort`` (OpenAI's; gpt-oss's template
reads it). They become the keyword arguments its chat template is rendered with
(batchrun/job/tokenize.py), over ``--chat-template-kwargs``.

``tool_choice``: ``auto`` (or absent) renders the tools; ``none`` leaves them out of the prompt,
so the model cannot call them. ``required`` and a named function need decoding constrained to
a call, which batchrun does not do: refused.
"""

from __future__ import annotations

from typing import Any

from batchrun.io.row_fields import InvalidRow, decode_text

REASONING_EFFORTS = ("low", "medium", "high")
TOOL_CHOICES = ("auto", "none")


def parse_template_kwargs(data: dict, where: str = "") -> dict | None:
    """The row's template keyword arguments, or None when it sets none. ``where`` prefixes the
    names in messages (``body.`` for OpenAI Batch rows)."""
    kwargs: dict[str, Any] = {}
    given = data.get("chat_template_kwargs")
    if given is not None:
        given = decode_text(given, f"'{where}chat_template_kwargs'")
        if not isinstance(given, dict) or not all(isinstance(k, str) for k in given):
            raise InvalidRow(
                f"'{where}chat_template_kwargs' must be an object of template variables, e.g. "
                '{"enable_thinking": false}'
            )
        kwargs.update(given)
    effort = data.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise InvalidRow(
                f"'{where}reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}, "
                f"got {effort!r}"
            )
        kwargs["reasoning_effort"] = effort
    tools = data.get("tools")
    if tools is not None:
        tools = decode_text(tools, f"'{where}tools'")
        if not isinstance(tools, list) or not all(_is_tool(t) for t in tools):
            raise InvalidRow(
                f"'{where}tools' must be a list of tools, each "
                '{"type": "function", "function": {"name": ..., "parameters": {...}}}'
            )
        if _tool_choice(data.get("tool_choice"), where) == "auto" and tools:
            kwargs["tools"] = tools
    elif data.get("tool_choice") is not None:
        _tool_choice(data["tool_choice"], where)
    return kwargs or None


def check_cli_kwargs(value: Any) -> dict:
    """--chat-template-kwargs' JSON object; ValueError when it is not one."""
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError(
            'give a JSON object of template variables, e.g. {"enable_thinking": false}'
        )
    return value


def _is_tool(tool: Any) -> bool:
    if not isinstance(tool, dict):
        return False
    fn = tool.get("function")
    return (
        tool.get("type", "function") == "function"
        and isinstance(fn, dict)
        and isinstance(fn.get("name"), str)
    )


def _tool_choice(value: Any, where: str) -> str:
    if value is None:
        return "auto"
    if value in TOOL_CHOICES:
        return value
    raise InvalidRow(
        f"'{where}tool_choice' {value!r} is not supported: use 'auto' or 'none' (a required or "
        "named call needs decoding constrained to a call, which batchrun does not do)"
    )
