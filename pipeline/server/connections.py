"""The server's HTTP connections: what a client may hold, and for how long.

uvicorn's httptools protocol, with limits it does not have of its own:

* **A connection limit** (``max_connections``): a connection past it is answered at once with a 503
  (OpenAI's error body, ``code: "too_many_connections"``, ``Connection: close``) and closed, before
  anything is read from it, so idle connections cannot take every file descriptor.
* **A header deadline** (uvicorn's ``timeout_keep_alive``): from the moment a connection is idle
  (opened, or its last response sent), the next request's head must be in within that many seconds,
  or the connection is closed. uvicorn's own keep-alive timer only starts after a first response and
  starts over with every byte received, so a connection that sends nothing, or a head one byte at a
  time, would be held forever.
* **A header size limit** (``MAX_HEADER_BYTES``): a request head larger than that is a 431, closed,
  before the rest is buffered (httptools buffers a header of any length).
* **Shutdown** closes the connections whose request has not all arrived (its body is still coming)
  along with the idle ones; uvicorn would wait for those bodies, that is, on the client.

``ConnectionWatch`` logs what the limits do, once per run rather than once per connection: one
``server.connections_full`` warning while connections are refused, and one ``server.accept_failed``
warning while ``accept`` fails for want of file descriptors (a run ends when a connection is accepted
again). As an event loop exception handler it takes those ``accept`` errors over from asyncio, which
logs each failed try with a traceback, thousands a second while it lasts. asyncio pauses and retries
accepting by itself, a second later (``ACCEPT_RETRY_DELAY_S``), once per failed try: the retries that
find the listening socket closed (the server stopped meanwhile) are dropped here too.
"""

from __future__ import annotations

import errno
import resource
from collections.abc import Callable
from typing import Any, ClassVar

import structlog
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pipeline.server.protocol import ErrorDetail, ErrorResponse

log = structlog.get_logger("hispec.server")

MAX_HEADER_BYTES = 64 * 1024  # a request's line and headers
DEFAULT_MAX_CONNECTIONS = 512
FD_RESERVE = 64  # descriptors kept for everything but connections (logs, model files, the loop's own)
RESOURCE_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
ACCEPT_RETRY_DELAY_S = 1.0  # asyncio's (asyncio.constants.ACCEPT_RETRY_DELAY)


def default_max_connections(fd_limit: int | None = None) -> int:
    """512, or fewer if the descriptor limit (``RLIMIT_NOFILE``'s soft limit, or ``fd_limit``) is
    low: at most half of it, less a reserve, so connections never take the last descriptors."""
    if fd_limit is None:
        fd_limit, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if fd_limit == resource.RLIM_INFINITY or fd_limit <= 0:
        return DEFAULT_MAX_CONNECTIONS
    return max(1, min(DEFAULT_MAX_CONNECTIONS, fd_limit // 2, fd_limit - FD_RESERVE))


def _raw_response(status: int, reason: str, detail: ErrorDetail) -> bytes:
    body = ErrorResponse(error=detail).model_dump_json().encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


class ConnectionWatch:
    """Logs the runs of refused connections and of failed ``accept`` calls; as an event loop
    exception handler, takes the latter over (anything else goes to the handler it replaced, or
    the loop's default)."""

    def __init__(self, previous: Callable[[Any, dict[str, Any]], object] | None = None) -> None:
        self.previous = previous
        self.refusing = 0  # connections refused in the current run
        self.failing = 0  # accept calls failed in the current run
        self.last_failure: float | None = None  # the loop's time of the last one

    def retries_due_by(self) -> float | None:
        """When asyncio's last retry of a failed ``accept`` is due (loop time; None: none failed)."""
        return None if self.last_failure is None else self.last_failure + ACCEPT_RETRY_DELAY_S

    def accepted(self) -> None:
        """A connection was taken: the runs of refusals and failures end."""
        if self.refusing:
            log.info("server.connections_available", refused=self.refusing)
        if self.failing:
            log.info("server.accept_recovered", failures=self.failing)
        self.refusing = self.failing = 0

    def refused(self, limit: int) -> None:
        if not self.refusing:
            log.warning("server.connections_full", max_connections=limit)
        self.refusing += 1

    def __call__(self, loop: Any, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if (
            isinstance(exc, OSError)
            and exc.errno in RESOURCE_ERRNOS
            and "accept" in context.get("message", "")
        ):
            self.last_failure = loop.time()
            if not self.failing:
                log.warning(
                    "server.accept_failed",
                    error=f"{errno.errorcode.get(exc.errno, exc.errno)}: {exc.strerror}",
                    hint="out of file descriptors: lower --max-connections, or raise the limit (ulimit -n)",
                )
            self.failing += 1
            return
        callback = getattr(context.get("handle"), "_callback", None)
        if getattr(callback, "__name__", "") == "_start_serving" and isinstance(exc, (ValueError, OSError)):
            return  # a retry of accept on a listening socket closed since: nothing to accept on
        if self.previous is not None:
            self.previous(loop, context)
        else:
            loop.default_exception_handler(context)


class _HeadersTooLarge(Exception):
    """Raised from a parser callback to stop parsing a head over ``MAX_HEADER_BYTES``."""


class HttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits above; ``configured`` makes the class a server uses."""

    max_connections: ClassVar[int | None] = None
    watch: ClassVar[ConnectionWatch] = ConnectionWatch()

    @classmethod
    def configured(cls, max_connections: int | None, watch: ConnectionWatch) -> type[HttpProtocol]:
        """A subclass with these settings (uvicorn builds one protocol object per connection)."""
        return type("HttpProtocol", (cls,), {"max_connections": max_connections, "watch": watch})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_deadline: Any = None  # asyncio.TimerHandle
        self._reading_head = True  # between two requests, or in a request's head
        self._head_bytes = 0  # bytes received since the request head began (raw, body included)
        self._head_size = 0  # the head's parsed size (line and headers), as the parser reports it
        self._head_too_large = False

    # --- the connection limit and the head deadline -------------------------------------------

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        limit = self.max_connections
        if limit is not None and len(self.connections) > limit:
            self.connections.discard(self)
            self.watch.refused(limit)
            detail = ErrorDetail(
                message=f"the server holds its limit of {limit} connections; try again later",
                type="service_unavailable",
                code="too_many_connections",
            )
            transport.write(_raw_response(503, "Service Unavailable", detail))
            transport.close()
            return
        self.watch.accepted()
        self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_deadline()
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        self._cancel_head_deadline()
        self._head_deadline = self.loop.call_later(self.timeout_keep_alive, self._head_timed_out)

    def _cancel_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if self._reading_head and not self.transport.is_closing():
            self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self._reading_head:
            self._arm_head_deadline()  # idle again: the next request's head has the same time

    # --- the head size limit -------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._reading_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._reading_head and self._head_bytes > MAX_HEADER_BYTES and not self.transport.is_closing():
            self._head_too_large = True  # a head still coming, already over the limit
            self.send_400_response("")

    def on_message_begin(self) -> None:
        self._head_size = 0
        self._head_too_large = False
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value))
        super().on_header(name, value)

    def _count_head(self, size: int) -> None:
        # a head that arrives whole in one read is measured here (data_received measures the rest)
        self._head_size += size
        if self._head_size > MAX_HEADER_BYTES:
            self._head_too_large = True
            raise _HeadersTooLarge

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._cancel_head_deadline()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._reading_head = True
        self._head_bytes = 0

    def send_400_response(self, msg: str) -> None:
        if not self._head_too_large:
            super().send_400_response(msg)
            return
        detail = ErrorDetail(
            message=f"the request's line and headers are over {MAX_HEADER_BYTES} bytes",
            type="invalid_request_error",
            code="request_header_fields_too_large",
        )
        self.transport.write(_raw_response(431, "Request Header Fields Too Large", detail))
        self.transport.close()

    # --- shutdown ------------------------------------------------------------------------------

    def busy(self) -> bool:
        """A request of this connection is being served: its response is not complete, and not held
        up by its client (the transport's buffer over its high-water mark: the client does not read)."""
        cycle = self.cycle
        return cycle is not None and not cycle.response_complete and not self.flow.write_paused

    def shutdown(self) -> None:
        """Close the connection now if it is idle or its request is still arriving; otherwise let
        its response end (then it closes)."""
        cycle = self.cycle
        if (
            cycle is not None
            and not cycle.response_complete
            and cycle.more_body
            and not cycle.response_started
        ):
            self.transport.close()  # its request never reached the engine: nothing is lost
            return
        super().shutdown()
