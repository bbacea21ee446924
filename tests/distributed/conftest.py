"""Tensor-parallel tests: the helpers of the engine and model tests are importable here (and in the
ranks these tests spawn, which inherit ``sys.path``)."""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent.parent
for folder in ("engine", "model"):
    if str(_TESTS / folder) not in sys.path:
        sys.path.insert(0, str(_TESTS / folder))
