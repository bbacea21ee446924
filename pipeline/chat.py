"""``hispec chat``: talk to a model through its chat template, each answer streamed as it is generated.

Interactive: each line read from stdin is a user message; the answer streams back and joins the
conversation, so the next message is answered in context. ``/reset`` starts a new conversation,
``/exit`` (or the end of input) ends the session. ``--message TEXT`` sends one message, prints the
answer and exits. The model must have a chat template (the bundled byte-level model has none).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

import anyio

from pipeline.generate import add_engine_arguments, drop, engine_config, sampling_params, user_error
from pipeline.logs import configure_logging

EXIT, RESET = "/exit", "/reset"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hispec chat", description=__doc__.split("\n\n")[0])
    p.add_argument("--message", metavar="TEXT", help="send one message, print the answer, exit")
    p.add_argument("--system", metavar="TEXT", help="a system message opening the conversation")
    add_engine_arguments(p, max_new_tokens=256)
    return p


def read_line() -> str | None:
    """One message from stdin (a prompt shown on a terminal); None at the end of input."""
    try:
        if sys.stdin.isatty():
            return input("> ")
        line = sys.stdin.readline()
        return line.rstrip("\n") if line else None
    except EOFError:
        return None


async def session(
    args: argparse.Namespace, model: Any, read: Callable[[], str | None], write: Callable[[str], None]
) -> int:
    from pipeline.engine import Engine
    from pipeline.errors import RequestError

    params = sampling_params(args)
    async with Engine(engine_config(args), model=model) as engine:
        if engine.tokenizer.chat_template is None:
            print(f"hispec chat: the model {args.model!r} has no chat template; use hispec generate", file=sys.stderr)
            return 2
        opening = [{"role": "system", "content": args.system}] if args.system else []
        history = list(opening)
        while True:
            text = args.message if args.message is not None else await anyio.to_thread.run_sync(read)
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


def main(argv: Sequence[str] | None = None, *, model: Any = None) -> int:
    """Entry point of ``hispec chat``; ``model`` replaces loading ``--model`` (tests)."""
    args = build_parser().parse_args(argv)
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    quiet = not (args.log_json or args.verbose)
    sink = configure_logging(json=args.log_json or False, level="info", processors=[drop] if quiet else [])

    def write(text: str) -> None:
        print(text, end="", flush=True)

    try:
        return anyio.run(session, args, model, read_line, write)
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
