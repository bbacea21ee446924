"""Engine tests: logging is configured (quietly) for every test, and reset afterwards."""

from __future__ import annotations

import io

import pytest
import structlog

from pipeline.logs import configure_logging


@pytest.fixture(autouse=True)
def quiet_logs():
    sink = configure_logging(level="warning", stream=io.StringIO())
    yield
    sink.close()
    structlog.reset_defaults()
