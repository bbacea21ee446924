"""The ``hispec`` command line.

Subcommands are thin: each hands its remaining arguments to the ``main(argv)`` of the module that
owns the work, imported only when that subcommand runs (so ``hispec --help`` stays fast). Errors are
reported here, for every subcommand alike (``main``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import select
import sys
import traceback

from pipeline.cli_types import OptionError
from pipeline.errors import ConfigError, HispecError, RequestError

# subcommand -> (module, help); a bench target adds one more word: `hispec bench kernels ...`
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("pipeline.generate", "generate text for prompts; print it with a lifecycle trace"),
    "chat": ("pipeline.chat", "talk to a model through its chat template, answers streamed"),
    "trace": ("pipeline.timeline", "draw a JSON-lines log as a request timeline; Perfetto, OTLP"),
    "replay": (
        "pipeline.hisparse.replay",
        "replay a top-k trace: every replacement policy beside Belady's MIN",
    ),
    "plan": ("pipeline.plan", "what a device memory budget holds: bytes per structure, seats, trade-offs"),
    "train": ("pipeline.model.train", "train the bundled tiny model (never part of the tests)"),
    "serve": ("pipeline.server.serve", "the OpenAI-compatible HTTP server (needs the `server` extra)"),
}
# bench target -> (module, help); each target's module is pipeline.benchmarks.<target> ("-" as "_")
BENCH_TARGETS: dict[str, tuple[str, str]] = {
    name: (f"pipeline.benchmarks.{name.replace('-', '_')}", text)
    for name, text in {
        "engine": "async engine throughput beside the synchronous driver",
        "kernels": "time each kernel op beside the machine's copy bandwidth",
        "hisparse": "HiSparse decode beside all-resident decode",
        "spec": "speculative decoding (num_steps 1-3) beside plain decoding",
        "peer": "the engine beside HF transformers generate on the same weights",
        "profile": "a cProfile of plain HiSparse decoding (one process, tiny runs)",
        "soak": "a long seeded workload with injected faults: hangs, leaks, wrong outputs",
        "chunked": "chunked prefill beside whole prompts: a long prompt, device rows, latency",
        "prefix": "prefix caching on beside off: a shared system prompt, multi-turn chats",
        "capacity": "one device budget: resident beside HiSparse on long contexts",
        "serve": "streaming clients over HTTP beside the in-process engine",
        "policy": "HiSparse replacement policies on recorded traces, and end to end",
        "tp": "tensor parallelism at TP 1 and 2: tokens/s, step time, time in collectives",
        "kv-cache": "FP8 KV beside bfloat16 KV: token agreement and logit error on held-out prompts",
        "gpu-check": "the prepared device check: the cuda tests, then V3.2 attention shapes at 32K",
    }.items()
}

# the commands that run over a launched group (torchrun): rank 0 runs them, the other ranks follow
LAUNCHED_COMMANDS = ("generate", "serve")

VERBOSE_FLAGS = ("-v", "--verbose")
# a mistake in what the user asked for: exit status 2 (ConfigError and RequestError are ValueErrors)
USER_ERRORS = (ConfigError, RequestError, OptionError, ValueError, OSError)
# the engine or a request failed while serving (EngineError, RequestFailed, ...): exit status 1
RUN_ERRORS = (HispecError,)
# stdout's reader has gone (`hispec plan | head`): no message, and the status a shell reports for a
# program that SIGPIPE ended, 128 + 13 (as `seq 100000 | head` under `set -o pipefail`)
CLOSED_STDOUT = 141


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hispec",
        description="Serve a DeepSeek-V3.2-style model with HiSparse and MTP speculative decoding.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="print the traceback of an error too")
    parser.add_argument("--version", action="version", version=f"hispec {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, text) in COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    bench = sub.add_parser("bench", help="benchmarks (separate from the tests)")
    bench_sub = bench.add_subparsers(dest="target", metavar="TARGET")
    for name, (_, text) in BENCH_TARGETS.items():
        bench_sub.add_parser(name, help=text, add_help=False)
    # what a command line that names no command (or no bench target) prints
    parser.set_defaults(command_help=parser.format_help, target_help=bench.format_help)
    return parser


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("hispec")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _dispatch(table: dict[str, tuple[str, str]], name: str, rest: list[str]) -> int:
    module = importlib.import_module(table[name][0])
    return int(module.main(rest) or 0)


def main(argv: list[str] | None = None) -> int:
    """Run one ``hispec`` command and return its exit status.

    A user error (a bad value, request, configuration or file) is one line on stderr,
    ``hispec COMMAND: message``, and status 2; a request or engine failure is one such line and
    status 1. ``-v`` / ``--verbose`` (``hispec -v COMMAND ...`` or among the command's options)
    prints the traceback too. argparse's own errors print usage and exit 2 as usual, and so does a
    command line without a command. Ctrl+C is one line and status 130; a closed stdout (the reader
    of a pipe has gone) ends the command quietly with status 141.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = bool(argv) and argv[0] in VERBOSE_FLAGS
    argv = argv[1:] if verbose else argv
    verbose = verbose or any(arg in VERBOSE_FLAGS for arg in argv)
    try:
        status = _run(argv)
        sys.stdout.flush()  # what is still buffered meets a closed pipe here, not at exit
        return status
    except SystemExit as exc:  # argparse has printed its message already
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{_prog(argv)}: interrupted", file=sys.stderr)
        return 130
    except BaseException as exc:
        error, others = reportable(exc)
        broken_pipe = any(isinstance(e, BrokenPipeError) for e in _leaves(exc))
        if error is not None and broken_pipe and _stdout_closed():
            return CLOSED_STDOUT
        if error is None:
            raise  # a bug, not a mistake: the traceback is the report
        if verbose:
            traceback.print_exception(exc)
        more = f" (and {others} more error{'s' if others > 1 else ''})" if others else ""
        print(f"{_prog(argv)}: {one_line(error)}{more}", file=sys.stderr)
        user_error = isinstance(error, (ConfigError, RequestError, OptionError))
        failed = isinstance(error, RUN_ERRORS) and not user_error
        return 1 if failed else 2


def _run(argv: list[str]) -> int:
    parser = build_parser()
    if argv and argv[0] in LAUNCHED_COMMANDS:
        from pipeline.distributed import launch

        if launch.is_follower():  # torchrun's rank 1..N-1: rank 0 runs the command, this one follows
            launch.follow()
            return 0
    if argv and argv[0] in COMMANDS:
        return _dispatch(COMMANDS, argv[0], argv[1:])
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCH_TARGETS:
        return _dispatch(BENCH_TARGETS, argv[1], argv[2:])
    args = parser.parse_args(argv)  # --help, --version, or an unknown command: argparse's answer
    # no command, or `bench` without a target: the choices, and a usage error's status
    shown = args.command_help if args.command is None else args.target_help
    print(shown(), end="", file=sys.stderr)
    return 2


def _stdout_closed() -> bool:
    """Whether stdout's reader has gone; if so, stdout is pointed at the null device, so that the
    interpreter's last flush at exit does not fail again (nobody reads what is left anyway). Where
    that cannot be told (stdout is no pipe one can poll), a broken pipe is taken to be stdout's."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by an object without a descriptor
        return True
    if hasattr(select, "poll"):  # a pipe whose reader has gone polls as an error on its write end
        poll = select.poll()
        poll.register(fd, select.POLLOUT)
        if not any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0)):
            return False
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)
    return True


def _prog(argv: list[str]) -> str:
    if argv and argv[0] in COMMANDS:
        return f"hispec {argv[0]}"
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCH_TARGETS:
        return f"hispec bench {argv[1]}"
    return "hispec"


def reportable(exc: BaseException) -> tuple[BaseException | None, int]:
    """The error to report in one line and how many others came with it (task groups raise groups),
    or ``(None, 0)`` when any part of ``exc`` is not a user's or a request's error."""
    leaves = list(_leaves(exc))
    if not leaves or not all(isinstance(e, (*USER_ERRORS, *RUN_ERRORS)) for e in leaves):
        return None, 0
    return leaves[0], len(leaves) - 1


def _leaves(exc: BaseException):
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


def one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror and exc.filename is not None:
        text = f"{exc.strerror}: {str(exc.filename)!r}"
    else:
        text = str(exc) or type(exc).__name__
    return " ".join(text.split())


if __name__ == "__main__":
    raise SystemExit(main())
