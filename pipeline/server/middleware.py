"""ASGI middleware of the server: the API key check, the access log, the body limit, internal errors.

All are plain ASGI (not Starlette's ``BaseHTTPMiddleware``): they pass ``receive`` through (the body
limit counts what it passes), so an endpoint still sees its client's ``http.disconnect`` the moment
it comes.

* ``ApiKeyCheck``: every ``/v1`` route, ``/tokenize`` and ``/detokenize`` need the header
  ``Authorization: Bearer <key>`` (compared in constant time); without it, or with another key, the
  answer is a 401 with OpenAI's error body. ``/health``, ``/metrics`` and ``/version`` stay open.
* ``AccessLog``: one ``server.access`` log line (info) per request once its response has ended:
  method, path, status, seconds, client. A response that never started logs status 499 (the client
  went away first), one whose endpoint raised logs 500.
* ``BodyLimit``: a request body over ``max_bytes`` is a 413 with OpenAI's error body
  (``code: "request_too_large"``), and the connection is closed. A ``Content-Length`` over the limit
  is answered before any of the body is read; a body without one (chunked) is counted as it is read,
  and answered once past the limit.
* ``InternalErrors``: an error an endpoint did not expect is a 500 whose body says
  ``internal error (request id: ...)`` and nothing else; the error itself, its traceback and that id
  are logged (``server.internal_error``).
"""

from __future__ import annotations

import secrets
import time
import uuid

import structlog
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipeline.server.protocol import ErrorDetail, ErrorResponse

log = structlog.get_logger("hispec.server")

KEYED_PATHS = ("/tokenize", "/detokenize")  # beside every path under /v1
CLIENT_GONE = 499  # nginx's "client closed request"


async def send_error(
    send: Send, status: int, detail: ErrorDetail, headers: list[tuple[bytes, bytes]]
) -> None:
    """A whole response with OpenAI's error body."""
    body = ErrorResponse(error=detail).model_dump_json().encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def internal_error_message(request_id: str) -> str:
    return f"internal error (request id: {request_id})"


def needs_key(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/") or path in KEYED_PATHS


def bearer_token(scope: Scope) -> str | None:
    """The token of the request's ``Authorization: Bearer <token>`` header (None without one)."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


class ApiKeyCheck:
    """401 for a keyed path without ``Authorization: Bearer <api_key>``."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or not needs_key(scope["path"]):
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope)
        if token is not None and secrets.compare_digest(token.encode(), self._key):
            await self.app(scope, receive, send)
            return
        message = (
            "missing API key: send the header 'Authorization: Bearer <key>'"
            if token is None
            else "incorrect API key"
        )
        error = ErrorDetail(message=message, type="invalid_request_error", code="invalid_api_key")
        await send_error(send, 401, error, [(b"www-authenticate", b"Bearer")])


class AccessLog:
    """One ``server.access`` line per HTTP request, after its response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status = CLIENT_GONE

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except Exception:
            status = 500
            raise
        finally:
            client = scope.get("client")
            log.info(
                "server.access",
                method=scope["method"],
                path=scope["path"],
                status=status,
                seconds=round(time.monotonic() - started, 6),
                client=None if client is None else f"{client[0]}:{client[1]}",
            )


class BodyLimit:
    """413 for a request body over ``max_bytes``, without reading more of it than that."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if _content_length(scope) > self.max_bytes:
            await self._too_large(send)
            return
        received = 0
        started = answered = False

        async def counted_receive() -> Message:
            nonlocal received, answered
            message = await receive()
            if message["type"] == "http.request" and not answered:
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    answered = True
                    if not started:
                        await self._too_large(send)
                    return {"type": "http.disconnect"}  # the endpoint ends; its answer is not sent
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if not answered:
                started = started or message["type"] == "http.response.start"
                await send(message)

        await self.app(scope, counted_receive, guarded_send)

    async def _too_large(self, send: Send) -> None:
        error = ErrorDetail(
            message=f"the request body is over the limit of {self.max_bytes} bytes",
            type="invalid_request_error",
            code="request_too_large",
        )
        # closed after the answer: the rest of the body is never read
        await send_error(send, 413, error, [(b"connection", b"close")])


def _content_length(scope: Scope) -> int:
    """The request's ``Content-Length`` (0 without one, or with one that is not a number)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


class InternalErrors:
    """A 500 naming a request id for an error no endpoint handled; the error is logged with that id."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_started(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_started)
        except Exception as exc:
            request_id = f"req-{uuid.uuid4().hex}"
            log_internal_error(exc, request_id, method=scope["method"], path=scope["path"])
            if started:
                raise  # too late for a status: the server closes the connection
            error = ErrorDetail(message=internal_error_message(request_id), type="internal_error")
            await send_error(send, 500, error, [])


def log_internal_error(exc: BaseException, request_id: str, **fields: object) -> None:
    log.error(
        "server.internal_error", request_id=request_id, error=type(exc).__name__, exc_info=exc, **fields
    )
