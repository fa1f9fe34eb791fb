"""A batch's input file checked line by line before it runs (the batch's `validating` state).

A file fails whole, as OpenAI's does, when a line is not a batch request: not JSON, no
custom_id, a method other than POST, a url other than the batch's endpoint, no body, a model
that the server does not serve or that differs from the file's first, or a custom_id given
twice. Each error names its line (1-based). What only the model can judge (a prompt too long, a
schema that does not compile) fails that row alone, in the error file, as the job does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

MAX_ERRORS = 100  # errors listed in the batch object; the count says how many more


@dataclass(frozen=True)
class Validation:
    model: str | None
    total: int
    errors: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


def validate_input(path: Path, endpoint: str, models: tuple[str, ...]) -> Validation:
    """Read `path` once (a line at a time) and report its model, its rows and its errors."""
    errors: list[dict] = []
    seen: dict[str, int] = {}
    model: str | None = None
    total = num_errors = 0

    def fail(line: int, code: str, message: str, param: str | None = None) -> None:
        nonlocal num_errors
        num_errors += 1
        if len(errors) < MAX_ERRORS:
            errors.append({"code": code, "message": message, "param": param, "line": line})

    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            total += 1
            try:
                row = json.loads(raw)
            except ValueError as e:
                fail(number, "invalid_json_line", f"line {number} is not valid JSON: {e}")
                continue
            if not isinstance(row, dict):
                fail(number, "invalid_request", f"line {number} is not a JSON object")
                continue
            custom_id = row.get("custom_id")
            if not isinstance(custom_id, str) or not custom_id:
                fail(number, "missing_custom_id", f"line {number} has no custom_id", "custom_id")
            elif custom_id in seen:
                fail(
                    number,
                    "duplicate_custom_id",
                    f"line {number}: custom_id {custom_id!r} is also on line {seen[custom_id]}; "
                    "each request needs its own",
                    "custom_id",
                )
            else:
                seen[custom_id] = number
            if row.get("method", "POST") != "POST":
                fail(number, "invalid_method", f"line {number}: method must be POST", "method")
            if row.get("url") != endpoint:
                fail(
                    number,
                    "invalid_url",
                    f"line {number}: url {row.get('url')!r} differs from the batch's endpoint "
                    f"{endpoint!r}",
                    "url",
                )
            body = row.get("body")
            if not isinstance(body, dict):
                fail(number, "invalid_body", f"line {number}: body must be an object", "body")
                continue
            name = body.get("model")
            if name not in models:
                fail(
                    number,
                    "model_not_found",
                    f"line {number}: model {name!r} is not served here; served: "
                    f"{', '.join(models)}",
                    "body.model",
                )
            elif model is None:
                model = name
            elif name != model:
                fail(
                    number,
                    "mismatched_model",
                    f"line {number}: model {name!r} differs from the file's model {model!r}; a "
                    "batch runs one model",
                    "body.model",
                )
    if total == 0:
        fail(0, "empty_file", "the input file has no requests")
    if num_errors > len(errors):
        more = num_errors - len(errors)
        errors.append({"code": "too_many_errors", "message": f"{more} more errors not listed"})
    return Validation(model, total, errors)
