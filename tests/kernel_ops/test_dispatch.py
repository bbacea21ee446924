"""The torch/Triton dispatch rule and the shared argument checks."""

from __future__ import annotations

import pytest
import torch

from kernels.checks import check_index_range, check_tensor, check_unique, next_power_of_2, resolve_impl


def test_auto_picks_torch_for_cpu_tensors_even_under_the_interpreter():
    t = torch.zeros(2)
    assert resolve_impl("auto", (t,)) == "torch"
    assert resolve_impl("torch", (t,)) == "torch"


def test_explicit_triton_on_cpu_needs_the_interpreter(monkeypatch):
    t = torch.zeros(2)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_impl("triton", (t,)) == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        resolve_impl("triton", (t,))


def test_triton_beyond_size_limits_is_refused():
    with pytest.raises(ValueError, match="size limits"):
        resolve_impl("triton", (torch.zeros(2),), triton_fits=False)
    with pytest.raises(ValueError, match="impl"):
        resolve_impl("gpu", (torch.zeros(2),))


def test_checks_name_the_argument():
    with pytest.raises(ValueError, match="x must have 2 dims"):
        check_tensor("x", torch.zeros(3), ndim=2)
    with pytest.raises(ValueError, match=r"y must have shape \(4, \*\)"):
        check_tensor("y", torch.zeros(3, 2), shape=(4, None))
    with pytest.raises(ValueError, match=r"z must be a torch\.Tensor"):
        check_tensor("z", [1, 2])
    with pytest.raises(ValueError, match="idx values"):
        check_index_range("idx", torch.tensor([0, 3]), 3)
    check_index_range("idx", torch.tensor([-1, 2]), 3, allow_negative=True)
    with pytest.raises(ValueError, match="idx must not repeat"):
        check_unique("idx", torch.tensor([1, 1]))
    check_unique("idx", torch.tensor([-1, -1, 2]), ignore_negative=True)


def test_next_power_of_2():
    assert [next_power_of_2(n) for n in (0, 1, 2, 3, 16, 17)] == [1, 1, 2, 4, 16, 32]
