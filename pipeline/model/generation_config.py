"""Sampling defaults from a checkpoint's ``generation_config.json`` (vLLM's ``--generation-config auto``).

Of the file's fields, ``temperature``, ``top_p``, ``top_k``, ``repetition_penalty`` and
``max_new_tokens`` become the defaults of a request that sets none of its own (the engine's
``generation_defaults``); the rest of the file is ignored here (its ``eos_token_id`` is read with
the tokenizer). ``do_sample: false`` means greedy decoding in HF's ``generate``: it becomes
``temperature`` 0 whatever temperature the file names (``do_sample`` absent or true keeps the file's
temperature). A field set to ``null`` counts as absent.

Precedence, field by field: what the request sets, then the checkpoint's default, then hispec's
built-in default (``SamplingParams``). A value that breaks a rule is a ``ConfigError`` on ``model``
naming the file and the field.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from pipeline.errors import ConfigError

GENERATION_CONFIG = "generation_config.json"
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "repetition_penalty", "max_new_tokens")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# field -> (its check, the rule it states, the type the default takes)
_RULES = {
    "temperature": (lambda v: _is_real(v) and v >= 0, "must be a number >= 0", float),
    "top_p": (lambda v: _is_real(v) and 0 < v <= 1, "must be a number in (0, 1]", float),
    "top_k": (lambda v: _is_int(v) and v >= 0, "must be an integer >= 0 (0 = no limit)", int),
    "repetition_penalty": (lambda v: _is_real(v) and v > 0, "must be a number > 0", float),
    "max_new_tokens": (lambda v: _is_int(v) and v >= 1, "must be an integer >= 1", int),
}


def generation_defaults(model_dir: str | Path) -> dict[str, float | int]:
    """The sampling defaults of ``model_dir``'s ``generation_config.json`` (see the module docstring):
    the fields it sets, validated; empty without the file."""
    path = Path(model_dir)
    file = path / GENERATION_CONFIG
    if not file.is_file():
        return {}
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError("model", str(path), f"{GENERATION_CONFIG} is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError("model", str(path), f"{GENERATION_CONFIG} must hold a JSON object")
    out: dict[str, float | int] = {}
    for name in SAMPLING_FIELDS:
        value = raw.get(name)
        if value is None:
            continue
        check, rule, kind = _RULES[name]
        if not check(value):
            raise ConfigError("model", str(path), f"{GENERATION_CONFIG}: {name}={value!r} {rule}")
        out[name] = kind(value)
    sample = raw.get("do_sample")
    if sample is not None and not isinstance(sample, bool):
        raise ConfigError(
            "model", str(path), f"{GENERATION_CONFIG}: do_sample={sample!r} must be true or false"
        )
    if sample is False:  # HF's generate decodes greedily then, whatever the temperature
        out["temperature"] = 0.0
    return out
