"""Strict reads of ``config.json`` values: each one of the JSON type its field takes, in its range.

JSON tells its types apart, and a checkpoint's ``config.json`` is read by them: an integer field
takes a JSON integer (not ``256.7``, not ``256.0``, not ``"256"``, not ``true``), a flag a JSON
``true`` / ``false`` (the string ``"false"`` is not false), a number a finite one (Python's JSON
reader accepts ``NaN`` and ``Infinity``), a name a string. A value of the wrong type or out of
range raises :class:`FieldError`, whose message names the field and shows the value as the file
spells it; the callers turn it into their own error (``ModelConfigError``: a ``ConfigError`` on
``model``).
"""

from __future__ import annotations

import json
import math
from typing import TypeGuard


class FieldError(ValueError):
    """A ``config.json`` value of the wrong type or out of its range; the message names the field."""


def show(value: object, limit: int = 60) -> str:
    """``value`` as JSON spells it (``true``, ``"false"``, ``NaN``), cut at ``limit`` characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_integer(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    """An int or a float (never a bool), finite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def integer(value: object, name: str, minimum: int | None = 1) -> int:
    """A JSON integer >= ``minimum`` (None: any)."""
    if not is_integer(value):
        raise FieldError(f"{name} must be an integer, got {show(value)}")
    if minimum is not None and value < minimum:
        rule = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise FieldError(f"{name} must be {rule}, got {show(value)}")
    return int(value)


def number(value: object, name: str, *, positive: bool = False) -> float:
    """A finite JSON number (an integer or a float), > 0 when ``positive``."""
    if not is_number(value) or (positive and value <= 0):
        rule = "a finite number > 0" if positive else "a finite number"
        raise FieldError(f"{name} must be {rule}, got {show(value)}")
    return float(value)


def flag(value: object, name: str) -> bool:
    """A JSON bool."""
    if not isinstance(value, bool):
        raise FieldError(f"{name} must be true or false, got {show(value)}")
    return value


def string(value: object, name: str) -> str:
    if not isinstance(value, str):
        raise FieldError(f"{name} must be a string, got {show(value)}")
    return value


def strings(value: object, name: str) -> tuple[str, ...]:
    """A JSON list of strings."""
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise FieldError(f"{name} must be a list of strings, got {show(value)}")
    return tuple(value)


def token_ids(value: object, name: str, vocab_size: int) -> tuple[int, ...]:
    """An id or a list of ids (None: none), each in ``[0, vocab_size)``."""
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    for item in items:
        if not is_integer(item):
            raise FieldError(f"{name} must be a token id or a list of token ids, got {show(value)}")
        if not 0 <= item < vocab_size:
            raise FieldError(
                f"{name} {item} is outside the model's vocabulary of {vocab_size} ids (0..{vocab_size - 1})"
            )
    return tuple(items)
