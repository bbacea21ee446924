"""The reliability suite: what a user can get wrong (inputs, configurations, the command line) and
what the engine must survive (faults, cancellations, memory pressure), each case checked for the
error it gets or for the engine's recovery.

Logging is configured quietly for every test here and reset afterwards; shared helpers live in
``_reliability_util``.
"""

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
