"""Errors that hispec raises to its callers.

Every error names what was wrong (a field, a request, a pool) so that the caller can act on it; a
request-level error affects that request only and the engine keeps serving.
"""

from __future__ import annotations


class HispecError(Exception):
    """Base class of hispec's own errors."""


class ConfigError(HispecError, ValueError):
    """A configuration value breaks a rule; the message names the field, the value and the rule."""

    def __init__(self, field: str, value: object, rule: str) -> None:
        self.field = field
        self.value = value
        self.rule = rule
        super().__init__(f"{field}={value!r}: {rule}")


class RequestError(HispecError, ValueError):
    """A request is invalid (bad prompt or sampling values); raised for that request only."""

    def __init__(self, field: str, value: object, rule: str) -> None:
        self.field = field
        self.value = value
        self.rule = rule
        shown = (
            value
            if not isinstance(value, (list, tuple, str)) or len(value) <= 40
            else f"<{len(value)} items>"
        )
        super().__init__(f"{field}={shown!r}: {rule}")


class EngineClosed(HispecError):
    """The engine is not running (not entered yet, or shutting down)."""


class EngineError(HispecError):
    """The engine cannot go on; every live request has been failed."""


class RequestFailed(HispecError):
    """The request ended FAILED (an internal error affecting it alone); other requests continue."""

    def __init__(self, request_id: str, reason: str, output_ids: tuple[int, ...]) -> None:
        self.request_id = request_id
        self.reason = reason
        self.output_ids = output_ids  # what it had generated before it failed
        super().__init__(f"request {request_id!r} failed: {reason}")
