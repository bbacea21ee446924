"""The serving runtime never loads the benchmarks, training or the command-line tools.

Each entry point is imported in a fresh interpreter and ``sys.modules`` is checked afterwards, so a
module-level import anywhere in the runtime's graph that pulls one of them in fails here.
``pipeline.executor`` stands for what ``Engine.start`` loads.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

RUNTIME = ("pipeline", "pipeline.engine", "pipeline.executor", "pipeline.server.app")
# packages and modules the runtime must not load (a name here covers its submodules too)
FORBIDDEN = (
    "pipeline.benchmarks",
    "pipeline.model.train",
    "pipeline.model.training",
    "pipeline.model.training_attention",
    "pipeline.model.corpus",
    "pipeline.model.evaluation",
    "pipeline.hisparse.replay",
    "pipeline.timeline",
    "pipeline.cli",
    "pipeline.generate",
    "pipeline.chat",
    "pipeline.server.serve",
    "transformers",
    "matplotlib",
)


def loaded_after_import(module: str) -> list[str]:
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def forbidden(names: list[str]) -> list[str]:
    return [n for n in names if any(n == f or n.startswith(f + ".") for f in FORBIDDEN)]


@pytest.mark.parametrize("module", RUNTIME)
def test_the_runtime_loads_no_benchmark_training_or_tool_module(module: str) -> None:
    assert forbidden(loaded_after_import(module)) == []


def test_the_check_sees_a_forbidden_module() -> None:
    assert forbidden(loaded_after_import("pipeline.model.train")) != []
    assert forbidden(["pipeline.benchmarks.soak", "pipeline.model.trainer", "pipeline.engine"]) == [
        "pipeline.benchmarks.soak"
    ]
