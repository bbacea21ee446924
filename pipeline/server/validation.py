"""Pydantic validation errors -> one OpenAI error message naming the field.

A field's location is written as OpenAI writes ``param``: ``max_tokens``, ``messages.0.content``.
Union branches that pydantic adds to a location (``prompt.str``, ``prompt.list[int].3``) are left
out; when every branch of a union failed, the message lists what each expected.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

MAX_SHOWN = 60  # characters of a bad value quoted in the message


def field_path(loc: Sequence[Any]) -> str | None:
    parts = [str(p) for p in loc if isinstance(p, int) or str(p).isidentifier()]
    if parts and parts[0] == "body":
        parts = parts[1:]
    # union branch tags are type names (str, int, list[int] was dropped above as not an identifier)
    parts = [p for p in parts if p not in {"str", "int", "float", "bool", "dict", "list", "none"}]
    return ".".join(parts) or None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 3] + "..."


def _message(error: dict[str, Any]) -> str:
    kind = error.get("type")
    if kind == "extra_forbidden":
        return "unrecognized request argument"
    if kind == "missing":
        return "field required"
    text = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"{text} (got {_shown(error.get('input'))})"


def describe_validation_error(errors: Sequence[dict[str, Any]]) -> tuple[str, str | None]:
    """(message, param) for the first field at fault in FastAPI's ``RequestValidationError.errors()``."""
    if not errors:
        return "invalid request body", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "")
        return f"the request body is not valid JSON ({reason})".replace(" ()", ""), None
    param = field_path(first.get("loc", ()))
    if param is None:
        return f"the request body must be a JSON object: {_message(first)}", None
    same = [e for e in errors if field_path(e.get("loc", ())) == param or _top(e) == param]
    messages = list(dict.fromkeys(_message(e) for e in same))[:3]
    return f"{param}: {'; or '.join(messages)}", param


def _top(error: dict[str, Any]) -> str | None:
    path = field_path(error.get("loc", ()))
    return None if path is None else path.split(".")[0]
