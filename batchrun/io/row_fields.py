"""A row's per-row sampling fields (``max_tokens``, ``temperature``, ...; ROW_PARAM_FIELDS) over
the CLI defaults, and the checks every row field shares: what a bad value raises (InvalidRow, a
row problem that batchrun/io/rows.py turns into the row's error record) and nested JSON sent as
text (Parquet / CSV columns)."""

from __future__ import annotations

from typing import Any

import msgspec

from batchrun.params import SamplingParams


class InvalidRow(Exception):
    """A row problem; prepare_row turns it into a RowError naming the row."""


def decode_text(value: Any, what: str) -> Any:
    """Parquet / CSV-born columns often hold nested JSON (messages, schemas) as text."""
    if not isinstance(value, str):
        return value
    try:
        return msgspec.json.decode(value)
    except msgspec.DecodeError:
        raise InvalidRow(f"{what} is a string but not valid JSON") from None


# Row field -> (SamplingParams field, converter). Same names as the OpenAI / vLLM APIs.
def _as_int(v: Any, name: str) -> int:
    if isinstance(v, float) and v.is_integer():
        return int(v)  # pandas turns an int column with nulls into float64
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidRow(f"{name!r} must be an integer, got {type(v).__name__} {v!r}")
    return v


def _as_float(v: Any, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InvalidRow(f"{name!r} must be a number, got {type(v).__name__} {v!r}")
    return float(v)


def _as_bool(v: Any, name: str) -> bool:
    if not isinstance(v, bool):
        raise InvalidRow(f"{name!r} must be true or false, got {type(v).__name__} {v!r}")
    return v


def _as_stop(v: Any, name: str) -> tuple[str, ...]:
    if isinstance(v, str):
        return (v,)
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return tuple(v)
    raise InvalidRow(f"{name!r} must be a string or a list of strings, got {v!r}")


def _as_ids(v: Any, name: str) -> tuple[int, ...]:
    if not isinstance(v, list):
        raise InvalidRow(f"{name!r} must be a list of token ids, got {type(v).__name__}")
    return tuple(_as_int(t, name) for t in v)


ROW_PARAM_FIELDS: dict[str, tuple[str, Any]] = {
    "max_tokens": ("max_new_tokens", _as_int),
    "max_completion_tokens": ("max_new_tokens", _as_int),  # wins over max_tokens (later)
    "min_tokens": ("min_new_tokens", _as_int),
    "temperature": ("temperature", _as_float),
    "top_p": ("top_p", _as_float),
    "top_k": ("top_k", _as_int),
    "min_p": ("min_p", _as_float),
    "repetition_penalty": ("repetition_penalty", _as_float),
    "frequency_penalty": ("frequency_penalty", _as_float),
    "presence_penalty": ("presence_penalty", _as_float),
    "stop": ("stop", _as_stop),
    "stop_token_ids": ("stop_token_ids", _as_ids),
    "ignore_eos": ("ignore_eos", _as_bool),
    "seed": ("seed", _as_int),
    "n": ("n", _as_int),
    "top_logprobs": ("top_logprobs", _as_int),
    "max_thinking_tokens": ("max_thinking_tokens", _as_int),
}


# SamplingParams field -> the row field that sets it
_ROW_NAME = {field: name for name, (field, _) in reversed(ROW_PARAM_FIELDS.items())}


def parse_params(data: dict, defaults: SamplingParams, where: str = "") -> SamplingParams:
    """The row's sampling fields over ``defaults``; ``where`` prefixes the names in messages
    (``body.`` for OpenAI Batch rows)."""
    kw: dict[str, Any] = {}
    names: dict[str, str] = {}  # SamplingParams field -> the row field that set it
    for name, (field, convert) in ROW_PARAM_FIELDS.items():
        value = data.get(name)
        if value is not None:
            kw[field] = convert(value, name)
            names[field] = name
    logprobs = data.get("logprobs")
    if isinstance(logprobs, bool):
        kw["logprobs"] = logprobs
    elif logprobs is not None:
        # /v1/completions style: logprobs=N means "chosen token plus the N most likely".
        kw["logprobs"] = True
        if "top_logprobs" not in kw:
            kw["top_logprobs"] = _as_int(logprobs, "logprobs")
            names["top_logprobs"] = "logprobs"
    if not kw:
        return defaults  # the common case; the CLI validates the defaults once
    params = msgspec.structs.replace(defaults, **kw)
    # a field the row did not set comes from the defaults (a CLI option, the API's sampling)
    shown = {f: f"the default {n}" for f, n in _ROW_NAME.items()}
    shown.update({f: f"'{where}{n}'" for f, n in names.items()})
    try:
        params.validate(names=shown)
    except (ValueError, TypeError) as e:
        raise InvalidRow(str(e)) from None
    return params
