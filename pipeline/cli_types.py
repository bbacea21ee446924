"""Option types shared by the ``hispec`` commands' parsers.

A type here reports a bad value as ``OptionError``, which ``hispec`` prints as one line naming the
option, with exit status 2 (``pipeline/cli.py``). argparse turns a ``ValueError`` or an
``ArgumentTypeError`` of a type into its own report, the usage first; ``OptionError`` is neither,
so it passes through ``parse_args`` unchanged.
"""

from __future__ import annotations

from pipeline.errors import HispecError

MAX_PORT = 65535


class OptionError(HispecError):
    """A command-line option's value breaks a rule; the message names the option, the value and the rule."""

    def __init__(self, option: str, value: object, rule: str) -> None:
        self.option = option
        self.value = value
        self.rule = rule
        super().__init__(f"{option}={value!r}: {rule}")


def port_number(text: str) -> int:
    """``--port``: a TCP port, 0 for any free one (the socket would only refuse it once the model
    has loaded, and not in one line)."""
    rule = f"must be a port number from 0 to {MAX_PORT} (0: any free port)"
    try:
        port = int(text)
    except ValueError:
        raise OptionError("--port", text, rule) from None
    if not 0 <= port <= MAX_PORT:
        raise OptionError("--port", port, rule)
    return port
