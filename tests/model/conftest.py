"""Model-test settings.

The model tests run tiny tensors, where intra-op threading costs more than it saves (and stalls
badly when the cores are shared), so each test here runs single-threaded; the previous setting is
restored afterwards.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
