"""The ``hispec`` command line.

Subcommands are thin: each hands its remaining arguments to the ``main(argv)`` of the module that
owns the work, imported only when that subcommand runs (so ``hispec --help`` stays fast).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, help); a bench target adds one more word: `hispec bench kernels ...`
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("pipeline.generate", "generate text for prompts; print it with a lifecycle trace"),
    "chat": ("pipeline.chat", "talk to a model through its chat template, answers streamed"),
    "trace": ("pipeline.timeline", "draw a JSON-lines log as a request timeline (PNG and HTML)"),
    "replay": ("pipeline.hisparse.replay", "replay a top-k trace against LRU, CLOCK and Belady's MIN"),
    "train": ("pipeline.model.train", "train the bundled tiny model (never part of the tests)"),
}
BENCH_TARGETS: dict[str, tuple[str, str]] = {
    "engine": ("pipeline.benchmarks.engine", "async engine throughput beside the synchronous driver"),
    "kernels": ("pipeline.benchmarks.kernels", "time each kernel op beside the machine's copy bandwidth"),
    "hisparse": ("pipeline.benchmarks.hisparse", "HiSparse decode beside all-resident decode"),
    "spec": ("pipeline.benchmarks.spec", "speculative decoding (num_steps 1-3) beside plain decoding"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hispec",
        description="Serve a DeepSeek-V3.2-style model with HiSparse and MTP speculative decoding.",
    )
    parser.add_argument("--version", action="version", version=f"hispec {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, text) in COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    bench = sub.add_parser("bench", help="benchmarks (separate from the tests)")
    bench_sub = bench.add_subparsers(dest="target", metavar="TARGET")
    for name, (_, text) in BENCH_TARGETS.items():
        bench_sub.add_parser(name, help=text, add_help=False)
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
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0] in COMMANDS:
        return _dispatch(COMMANDS, argv[0], argv[1:])
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCH_TARGETS:
        return _dispatch(BENCH_TARGETS, argv[1], argv[2:])
    args = parser.parse_args(argv)
    if args.command is None or args.command == "bench":
        parser.print_help()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
