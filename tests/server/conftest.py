"""Server tests: one real server for the module that asks for it, logging configured quietly."""

from __future__ import annotations

import io

import pytest
import structlog

from pipeline.logs import configure_logging


@pytest.fixture(scope="module", autouse=True)
def quiet_logs():
    sink = configure_logging(level="warning", stream=io.StringIO())
    yield
    sink.close()
    structlog.reset_defaults()


@pytest.fixture(scope="module")
def server(tiny_model):
    from _server_util import RunningServer

    running = RunningServer(tiny_model)
    yield running
    running.stop()
    assert running.server.pools_restored
    assert running.engine.final_pool_counts == running.engine.initial_pool_counts
