"""The device suite: its tests marked ``cuda`` run on the device the ``device`` fixture names (the
others, the device check's script, run everywhere).

Without a CUDA device the suite-wide conftest skips the ``cuda`` tests. ``HISPEC_TEST_DEVICE=cpu``
runs the same bodies on the CPU instead (at the small sizes of ``sizes``), so that they can be
checked on a machine without a GPU; ``hispec bench gpu-check`` does that on such a machine.
``HISPEC_TEST_SIZES=small|v32`` overrides the sizes the device picks (``v32`` on CUDA).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from _device_sizes import SIZES, Sizes

DEVICE_ENV, SIZES_ENV = "HISPEC_TEST_DEVICE", "HISPEC_TEST_SIZES"
HERE = Path(__file__).resolve().parent


def device_name() -> str:
    """The device the bodies run on: ``$HISPEC_TEST_DEVICE``, by default ``cuda``."""
    name = os.environ.get(DEVICE_ENV, "cuda")
    if name not in ("cuda", "cpu"):
        raise pytest.UsageError(f"{DEVICE_ENV} must be 'cuda' or 'cpu', got {name!r}")
    return name


def _no_cuda_skip(mark: pytest.Mark) -> bool:
    return mark.name == "skip" and "CUDA" in str(mark.kwargs.get("reason"))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """The suite-wide conftest skips a test whose keywords hold ``cuda`` on a machine without CUDA,
    and this folder's name is one of every test's keywords here. The skip is taken off this
    folder's tests that are not marked ``cuda``, and with ``HISPEC_TEST_DEVICE=cpu`` off all of them
    (they then run on the CPU)."""
    on_cpu = device_name() == "cpu"
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents and (
            on_cpu or item.get_closest_marker("cuda") is None
        ):
            item.own_markers[:] = [m for m in item.own_markers if not _no_cuda_skip(m)]


def selected_sizes() -> Sizes:
    """DeepSeek-V3.2's attention sizes on CUDA, small ones on the CPU (or ``$HISPEC_TEST_SIZES``)."""
    name = os.environ.get(SIZES_ENV) or ("v32" if device_name() == "cuda" else "small")
    if name not in SIZES:
        raise pytest.UsageError(f"{SIZES_ENV} must be one of {sorted(SIZES)}, got {name!r}")
    return SIZES[name]


def pytest_generate_tests(metafunc):
    """``swap_case``: each swap-in case of the sizes; ``host``: where a swap-in's host pool lives
    (pinned host memory is a CUDA layout: on a CPU the pools share one memory)."""
    if "swap_case" in metafunc.fixturenames:
        cases = selected_sizes().swap_in
        metafunc.parametrize("swap_case", cases, ids=[c.id for c in cases])
    if "host" in metafunc.fixturenames:
        metafunc.parametrize("host", ["device", "pinned"] if device_name() == "cuda" else ["device"])


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device(device_name())


@pytest.fixture(scope="session")
def sizes() -> Sizes:
    return selected_sizes()
