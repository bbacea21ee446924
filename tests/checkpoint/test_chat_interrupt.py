"""``hispec chat`` stops at the first Ctrl+C while it waits for the next message: one line, status
130. The message is read in a thread; Ctrl+C used to wait for that thread, which waited for a line."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import pipeline

ROOT = Path(pipeline.__file__).resolve().parents[1]
HANG = 120  # seconds: only against a hang, never a measure


def read_until(fd: int, marker: bytes) -> bytes:
    """What ``fd`` gives up to and with ``marker``; fails past ``HANG`` seconds or at its end."""
    seen = b""
    deadline = time.monotonic() + HANG
    while marker not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"no {marker!r} on the chat's output: {seen!r}"
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 4096)
            assert chunk, f"the chat's output ended before {marker!r}: {seen!r}"
            seen += chunk
    return seen


# the pipe variant may be signalled before its read starts, so it cannot catch a read that swallows
# Ctrl+C; the terminal one waits for the prompt and does: only it runs in the default selection
@pytest.mark.slow  # a chat process under a pseudo-terminal: `make test-all`
@pytest.mark.parametrize("stdin", ["terminal", "pipe"])
def test_the_first_ctrl_c_ends_the_chat(checkpoint, stdin):
    command = [
        sys.executable,
        "-m",
        "pipeline.cli",
        "chat",
        "--model",
        str(checkpoint.path),
        "--dtype",
        "float64",
        "--max-new-tokens",
        "8",
    ]
    if stdin == "terminal":
        if not hasattr(os, "openpty"):
            pytest.skip("no pseudo-terminals here")
        terminal, reader = os.openpty()
        chat = subprocess.Popen(
            command, cwd=ROOT, stdin=reader, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        os.close(reader)
        marker = b"> "  # the prompt: it reads the terminal now
    else:
        terminal = None
        chat = subprocess.Popen(
            command, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        chat.stdin.write(b"hello\n")
        chat.stdin.flush()
        marker = b"\n"  # the end of the answer: it reads the next line now (stdin stays open)
    try:
        read_until(chat.stdout.fileno(), marker)
        chat.send_signal(signal.SIGINT)
        chat.wait(timeout=HANG)  # stdin stays open: no end of input ends it instead
        err = chat.stderr.read()
    finally:
        if chat.poll() is None:
            chat.kill()
            chat.wait()
        for stream in (chat.stdin, chat.stdout, chat.stderr):
            if stream is not None:
                stream.close()
        if terminal is not None:
            os.close(terminal)
    assert chat.returncode == 130
    assert err.decode() == "hispec chat: interrupted\n"
