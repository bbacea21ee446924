"""Suite-wide settings.

Triton reads TRITON_INTERPRET when a kernel is decorated, so it is set here, before any test module
imports ``kernels``: without a GPU every Triton kernel runs in the interpreter on CPU tensors.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
    # The suite's tensors are small: one intra-op thread is faster than two fighting over two cores
    # with whatever else runs (and keeps timings steady on a loaded machine).
    torch.set_num_threads(1)
except ImportError:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from hypothesis import Phase, settings

# Hypothesis profiles, chosen by HYPOTHESIS_PROFILE: ``ci`` (the default, what `make test` runs) and
# ``thorough`` (`make proptest`: every state machine with many more and longer runs). The state
# machines scale their own example and step counts by the loaded profile (``shadow_model``).
# A failure prints the ``@reproduce_failure`` decorator that replays it (README, "Property tests").
settings.register_profile("ci", deadline=None, print_blob=True)
settings.register_profile(
    "thorough", deadline=None, print_blob=True, max_examples=1500, stateful_step_count=100
)
# ``mutation`` (`make mutation`, docs/mutation.md): the ``ci`` runs without shrinking, since a mutant's
# failure only needs to be found, not minimised.
settings.register_profile(
    "mutation", parent=settings.get_profile("ci"), phases=[Phase.explicit, Phase.generate]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model():
    """The default random tiny model in float64, shared by the tests that only read it."""
    from tiny_models import build_tiny_model

    return build_tiny_model()


@pytest.fixture(autouse=True)
def _structlog_as_it_was():
    """A test that configures logging (a benchmark's ``main``, the CLI) leaves structlog as it found
    it: otherwise a later test's ``capture_logs`` sees only what that configuration's level lets
    through, and the suite's result depends on its order."""
    import structlog

    before = structlog.get_config()
    yield
    structlog.configure(**before)
