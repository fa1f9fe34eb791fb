"""A row's structured output (``response_format``, ``regex``, ``choice``, ``ebnf``), normalized
into ``{"type": "json_object" | "json_schema" | "regex" | "choice" | "ebnf", ...}`` and into the
engine's GrammarSpec; the same from the CLI's defaults (structured_from_options)."""

from __future__ import annotations

import msgspec

from batchrun.io.row_fields import InvalidRow, decode_text
from batchrun.params import GrammarSpec, SamplingParams


def parse_structured(data: dict, params: SamplingParams) -> tuple[SamplingParams, dict | None]:
    """The row's structured output, if any, as params.grammar (over the default's)."""
    response_format, is_text = _parse_response_format(data)
    if response_format is not None:
        params = msgspec.structs.replace(params, grammar=grammar_spec(response_format))
    elif is_text and params.grammar is not None:
        params = msgspec.structs.replace(params, grammar=None)
    return params, response_format


def grammar_spec(response_format: dict) -> GrammarSpec:
    """A normalized response_format (as in PreparedRow) -> the engine's GrammarSpec."""
    kind = response_format["type"]
    if kind == "json_schema":
        # NOTE: key order kept (no sorting): it is the order of the fields in the output
        return GrammarSpec(
            kind, msgspec.json.encode(response_format["json_schema"]["schema"]).decode()
        )
    if kind == "choice":
        return GrammarSpec(kind, msgspec.json.encode(response_format["choice"]).decode())
    if kind == "json_object":
        return GrammarSpec(kind)
    return GrammarSpec(kind, response_format[kind])


def parse_structured_fields(data: dict) -> GrammarSpec | None:
    """``response_format`` / ``regex`` / ``choice`` / ``ebnf`` as in a row -> a GrammarSpec (None
    for none or ``text``). Raises ValueError (for the CLI's defaults)."""
    try:
        response_format, _ = _parse_response_format(data)
    except InvalidRow as e:
        raise ValueError(str(e)) from None
    return grammar_spec(response_format) if response_format is not None else None


def _parse_response_format(data: dict) -> tuple[dict | None, bool]:
    """(normalized structured output or None, whether response_format was {"type": "text"})."""
    found: list[dict] = []
    rf = decode_text(data.get("response_format"), "'response_format'")
    if rf is not None:
        if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
            raise InvalidRow("'response_format' must be an object with a 'type'")
        kind = rf["type"]
        if kind == "json_schema":
            spec = rf.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            schema = decode_text(schema, "response_format.json_schema.schema")
            if not isinstance(schema, dict):
                raise InvalidRow(
                    "response_format json_schema needs {'json_schema': {'schema': {}}}"
                )
            found.append({**rf, "json_schema": {**spec, "schema": schema}})
        elif kind == "json_object":
            found.append({"type": "json_object"})
        elif kind != "text":
            raise InvalidRow(
                f"response_format.type {kind!r} is not supported; use text, json_object "
                "or json_schema (or the 'regex' / 'choice' / 'ebnf' fields)"
            )
    for key in ("regex", "ebnf"):
        value = data.get(key)
        if value is not None:
            if not isinstance(value, str) or not value:
                raise InvalidRow(f"{key!r} must be a non-empty string")
            found.append({"type": key, key: value})
    choice = data.get("choice")
    if choice is not None:
        if not (isinstance(choice, list) and choice and all(isinstance(c, str) for c in choice)):
            raise InvalidRow("'choice' must be a non-empty list of strings")
        found.append({"type": "choice", "choice": choice})
    if len(found) > 1:
        kinds = [f["type"] for f in found]
        raise InvalidRow(f"row asks for more than one structured output {kinds}; keep one")
    is_text = isinstance(rf, dict) and rf.get("type") == "text"
    return (found[0] if found else None), is_text


def structured_from_options(
    response_format: str | None,
    json_schema: str | None,
    regex: str | None,
    choice: tuple[str, ...],
    ebnf: str | None,
) -> GrammarSpec | None:
    """The CLI's structured-output defaults -> a GrammarSpec (None: none). Files are read here.
    Raises ValueError naming the option and what to do."""
    given = {
        "--response-format": response_format,
        "--json-schema": json_schema,
        "--regex": regex,
        "--choice": choice or None,
        "--ebnf": ebnf,
    }
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"use only one of {', '.join(given)} (they all set the output format)")
    ((option, value),) = given.items()
    try:
        if option == "--response-format":
            text = _read_option_file(value[1:]) if value.startswith("@") else value
            data = {"response_format": text}
        elif option == "--json-schema":
            schema = decode_text(_read_option_file(value), f"the file {value}")
            data = {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}
        elif option == "--choice":
            # one JSON list, or the option repeated once per choice
            items = list(value)
            if len(items) == 1 and items[0].lstrip().startswith("["):
                items = decode_text(items[0], "the JSON list")
            data = {"choice": items}
        elif option == "--ebnf":
            data = {"ebnf": _read_option_file(value)}
        else:
            data = {"regex": value}
        return parse_structured_fields(data)
    except (InvalidRow, ValueError, OSError) as e:
        raise ValueError(f"{option}: {e}") from None


def _read_option_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise InvalidRow(f"cannot read {path}: {e.strerror}; give a readable file") from None
