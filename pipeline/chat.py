"""``hispec chat``: talk to a model through its chat template, each answer streamed as it is generated.

Interactive: each line read from stdin is a user message; the answer streams back and joins the
conversation, so the next message is answered in context. ``/reset`` starts a new conversation,
``/exit`` (or the end of input) ends the session. ``--message TEXT`` sends one message, prints the
answer and exits. The model must have a chat template (the bundled byte-level model has none: pass
``--chat-template FILE``). Sampling flags not given take the checkpoint's ``generation_config.json``
defaults. Ctrl+C ends the session at once, an answer being streamed or not (exit status 130).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import anyio
from anyio.from_thread import BlockingPortal

from pipeline.cli_config import engine_config
from pipeline.generate import add_engine_arguments, drop, sampling_params, user_error
from pipeline.logs import configure_logging

EXIT, RESET = "/exit", "/reset"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hispec chat", description=__doc__.split("\n\n")[0])
    p.add_argument("--message", metavar="TEXT", help="send one message, print the answer, exit")
    p.add_argument("--system", metavar="TEXT", help="a system message opening the conversation")
    add_engine_arguments(p, max_new_tokens=256)
    return p


class StdinLines:
    """Messages from stdin, one a line (a prompt shown on a terminal); None at the end of input.

    Read from stdin's descriptor with ``os.read``, not through ``sys.stdin``: a thread blocked in
    ``sys.stdin.readline()`` holds its buffer's lock, and an interpreter exiting after Ctrl+C with
    that lock held by a daemon thread aborts ("could not acquire lock ... at interpreter
    shutdown"). A ``sys.stdin`` without a descriptor (a test's ``StringIO``) is read as it is."""

    def __init__(self) -> None:
        self._pending = b""
        self._ended = False

    def __call__(self) -> str | None:
        stdin = sys.stdin
        try:
            fd = stdin.fileno()
        except (AttributeError, OSError, ValueError):
            line = stdin.readline()
            return line.rstrip("\n") if line else None
        if stdin.isatty():
            print("> ", end="", flush=True)
        while b"\n" not in self._pending and not self._ended:
            chunk = os.read(fd, 1 << 16)
            self._ended = not chunk
            self._pending += chunk
        if not self._pending:
            return None
        line, _, self._pending = self._pending.partition(b"\n")
        text = line.decode(stdin.encoding or "utf-8", stdin.errors or "strict")
        return text.removesuffix("\r")


async def read_message(read: Callable[[], str | None], portal: BlockingPortal) -> str | None:
    """``read()`` in a daemon thread of its own. A cancelled session (Ctrl+C) leaves that thread
    blocked on stdin and goes: a worker thread of anyio's would hold the cancellation until a line
    came, and keep the process from exiting."""
    done = anyio.Event()
    result: list[Any] = []

    def work() -> None:
        try:
            result.append(read())
        except BaseException as exc:  # handed to the session, raised there
            result.append(exc)
        with contextlib.suppress(RuntimeError):  # the portal has closed: nobody waits any more
            portal.call(done.set)

    threading.Thread(target=work, name="hispec chat stdin", daemon=True).start()
    await done.wait()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


async def session(
    args: argparse.Namespace, model: Any, read: Callable[[], str | None], write: Callable[[str], None]
) -> int:
    from pipeline.engine import Engine
    from pipeline.errors import RequestError

    sampling_params(args).validate()  # a bad sampling flag is reported before the model loads
    async with BlockingPortal() as portal, Engine(engine_config(args), model=model) as engine:
        params = sampling_params(args, defaults=engine.generation_defaults)  # the checkpoint's fill the gaps
        if engine.tokenizer.chat_template is None:
            message = f"the model {args.model!r} has no chat template; use hispec generate"
            print(f"hispec chat: {message}", file=sys.stderr)
            return 2
        opening = [{"role": "system", "content": args.system}] if args.system else []
        history = list(opening)
        while True:
            if args.message is not None:  # sent as it is: /reset and /exit are the session's words
                text = args.message
            else:
                text = await read_message(read, portal)
                if text is None or text.strip() == EXIT:
                    return 0
                if text.strip() == RESET:
                    history = list(opening)
                    continue
                if not text.strip():
                    continue
            history.append({"role": "user", "content": text})
            answer: list[str] = []
            try:
                async for delta in engine.chat(history, params):
                    write(delta.text)
                    answer.append(delta.text)
            except RequestError as exc:  # e.g. the conversation outgrew max_context_len
                history.pop()
                print(f"hispec chat: {exc}", file=sys.stderr)
                if args.message is not None:
                    return 2
                continue
            write("\n")
            history.append({"role": "assistant", "content": "".join(answer)})
            if args.message is not None:
                return 0
    # reached only when the engine or the portal swallows an exception the loop raised: the session
    # ends as at the end of input
    return 0


def main(argv: Sequence[str] | None = None, *, model: Any = None) -> int:
    """Entry point of ``hispec chat``; ``model`` replaces loading ``--model`` (tests)."""
    args = build_parser().parse_args(argv)
    if args.message is not None and not args.message.strip():  # before the model loads
        print(f"hispec chat: --message={args.message!r}: must hold some text", file=sys.stderr)
        return 2
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    quiet = not (args.log_json or args.verbose)
    sink = configure_logging(json=args.log_json or False, level="info", processors=[drop] if quiet else [])

    def write(text: str) -> None:
        print(text, end="", flush=True)

    try:
        return anyio.run(session, args, model, StdinLines(), write)
    except FileNotFoundError as exc:
        print(f"hispec chat: model {args.model!r} not found ({exc}); pass --model PATH", file=sys.stderr)
        return 2
    except Exception as exc:
        error = user_error(exc)
        if error is None:
            raise
        print(f"hispec chat: {error}", file=sys.stderr)
        return 2
    finally:
        sink.close()
