"""Tensor-parallel tests: the helpers of the engine and model tests are importable here (and in the
ranks these tests spawn, which inherit ``sys.path``); logging is configured quietly for every test
and reset afterwards (a benchmark configures it for itself)."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import structlog

from pipeline.logs import configure_logging

_TESTS = Path(__file__).resolve().parent.parent
for folder in ("engine", "model"):
    if str(_TESTS / folder) not in sys.path:
        sys.path.insert(0, str(_TESTS / folder))


@pytest.fixture(autouse=True)
def quiet_logs():
    sink = configure_logging(level="warning", stream=io.StringIO())
    yield
    sink.close()
    structlog.reset_defaults()
