"""The OpenAI-compatible HTTP server (FastAPI on Starlette, served by uvicorn).

``create_app(engine)`` builds the ASGI app for one's own stack; ``HttpServer`` serves it with uvicorn
on the engine's event loop; ``hispec serve`` (``pipeline.server.serve``) is the command line. Needs
the ``server`` extra: ``pip install 'hispec[server]'``.
"""

from pipeline.server.app import ServerState, create_app
from pipeline.server.chat import render_chat
from pipeline.server.serve import HttpServer

__all__ = ["HttpServer", "ServerState", "create_app", "render_chat"]
