"""The OpenAI-compatible HTTP server (FastAPI on Starlette, served by uvicorn).

``create_app(engine)`` builds the ASGI app for one's own stack; ``HttpServer`` serves it with uvicorn
on the engine's event loop; ``hispec serve`` (``pipeline.server.serve``) is the command line. Needs
the ``server`` extra: ``pip install 'hispec[server]'``.

``HttpServer`` loads on first access: its module is the command line's too, so importing the app
does not pull in the command-line modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.server.app import ServerState, create_app
from pipeline.server.chat import render_chat

if TYPE_CHECKING:
    from pipeline.server.serve import HttpServer


def __getattr__(name: str) -> object:
    if name != "HttpServer":
        raise AttributeError(f"module 'pipeline.server' has no attribute {name!r}")
    from pipeline.server.serve import HttpServer

    globals()[name] = HttpServer
    return HttpServer


__all__ = ["HttpServer", "ServerState", "create_app", "render_chat"]
