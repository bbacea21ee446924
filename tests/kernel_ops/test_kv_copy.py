"""KV row movement: the four movements, one layer and all layers, canaries, rejected indices."""

from __future__ import annotations

import pytest
import torch

from kernels import kv_copy
from kernels.kv_copy import backup_rows, copy_rows, load_rows, move_rows, scatter_rows

C = 2  # canary rows on each side
# "auto" on these CPU tensors: the compiled loop (kernels.kv_copy_numba)
IMPLS = ["torch", "auto", pytest.param("triton", marks=pytest.mark.interpreter)]


def _pool(layers: int | None, rows: int, dim: int, dtype, seed: int) -> torch.Tensor:
    """A pool with C canary rows on each side of the rows the op sees."""
    g = torch.Generator().manual_seed(seed)
    shape = (rows + 2 * C, dim) if layers is None else (layers, rows + 2 * C, dim)
    return torch.randn(shape, generator=g).to(dtype)


def _inner(full: torch.Tensor) -> torch.Tensor:
    return full[..., C:-C, :]


def _expected(dst: torch.Tensor, dst_idx, src: torch.Tensor, src_idx) -> torch.Tensor:
    out = dst.clone()
    for d, s in zip(dst_idx.tolist(), src_idx.tolist()):
        out[..., C + d, :] = src[..., C + s, :]
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layers", [None, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_copy_rows_matches_loop(impl, layers, dtype):
    dst, src = _pool(layers, 20, 5, dtype, 0), _pool(layers, 12, 5, dtype, 1)
    dst_idx = torch.randperm(20)[:9]
    src_idx = torch.randint(0, 12, (9,))  # a source row may be read twice
    want = _expected(dst, dst_idx, src, src_idx)
    src_before = src.clone()
    copy_rows(_inner(dst), dst_idx, _inner(src), src_idx, impl=impl)
    assert torch.equal(dst, want)  # canaries included
    assert torch.equal(src, src_before)


@pytest.mark.parametrize("impl", IMPLS)
def test_four_movements(impl):
    layers, dim = 2, 7
    device, host = _pool(layers, 16, dim, torch.float32, 2), _pool(layers, 24, dim, torch.float32, 3)

    fresh = torch.randn(layers, 3, dim)
    slots = torch.tensor([5, 0, 15])
    want = device.clone()
    want[:, C + slots] = fresh
    scatter_rows(_inner(device), slots, fresh, impl=impl)
    assert torch.equal(device, want)

    host_slots = torch.tensor([23, 4, 9])
    want_host = _expected(host, host_slots, device, slots)
    backup_rows(_inner(host), host_slots, _inner(device), slots, impl=impl)
    assert torch.equal(host, want_host)

    dev_slots = torch.tensor([1, 2])
    want = _expected(device, dev_slots, host, torch.tensor([23, 9]))
    load_rows(_inner(device), dev_slots, _inner(host), torch.tensor([23, 9]), impl=impl)
    assert torch.equal(device, want)

    want = _expected(device, torch.tensor([14]), device, torch.tensor([5]))
    move_rows(_inner(device), torch.tensor([14]), torch.tensor([5]), impl=impl)  # into the "newest" row
    assert torch.equal(device, want)


@pytest.mark.parametrize("impl", IMPLS)
def test_one_layer_of_a_strided_pool(impl):
    # a [rows, L, dim] allocation viewed as [L, rows, dim]: the layer stride is dim, the row stride L*dim
    base = torch.randn(20 + 2 * C, 3, 4)
    pool = base.transpose(0, 1)
    layer1 = pool[1]
    want = base.clone()
    want[C + 7, 1] = base[C + 2, 1]
    want[C + 8, 1] = base[C + 3, 1]
    move_rows(layer1[C:-C], torch.tensor([7, 8]), torch.tensor([2, 3]), impl=impl)
    assert torch.equal(base, want)


def test_empty_copy_is_a_no_op():
    dst = torch.zeros(4, 3)
    copy_rows(dst, torch.empty(0, dtype=torch.int64), torch.ones(2, 3), torch.empty(0, dtype=torch.int64))
    assert not dst.any()


@pytest.mark.parametrize(
    ("dst_idx", "src_idx", "match"),
    [
        ([0, 4], [0, 1], "dst_idx"),  # out of range
        ([-1, 2], [0, 1], "dst_idx"),
        ([1, 1], [0, 1], "dst_idx must not repeat"),
        ([0, 1], [0, 5], "src_idx"),
        ([0, 1, 2], [0, 1], "src_idx"),  # lengths differ
    ],
)
def test_bad_indices_rejected(dst_idx, src_idx, match):
    dst, src = torch.zeros(4, 3), torch.ones(5, 3)
    with pytest.raises(ValueError, match=match):
        copy_rows(dst, torch.tensor(dst_idx), src, torch.tensor(src_idx))
    assert not dst.any()


def test_bad_tensors_rejected():
    dst = torch.zeros(4, 3)
    idx = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="src"):
        copy_rows(dst, idx, torch.ones(5, 3, dtype=torch.float64), idx)
    with pytest.raises(ValueError, match="src shape"):
        copy_rows(dst, idx, torch.ones(5, 4), idx)
    with pytest.raises(ValueError, match="dst_idx"):
        copy_rows(dst, idx.float(), torch.ones(5, 3), idx)
    with pytest.raises(ValueError, match="dst"):
        copy_rows(torch.zeros(3, 4).t(), idx, torch.ones(5, 3), idx)
    with pytest.raises(ValueError, match="disjoint"):
        move_rows(dst, torch.tensor([0, 1]), torch.tensor([1, 2]))


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_auto_on_cpu_runs_the_compiled_loop(monkeypatch, index_dtype):
    from kernels import kv_copy_numba

    calls = []
    compiled = kv_copy_numba.copy_rows_numba
    monkeypatch.setattr(kv_copy_numba, "copy_rows_numba", lambda *a: calls.append(1) or compiled(*a))
    dst, src = _pool(2, 10, 3, torch.bfloat16, 2), _pool(2, 6, 3, torch.bfloat16, 3)
    dst_idx, src_idx = torch.tensor([4, 0, 9], dtype=index_dtype), torch.tensor([5, 5, 1], dtype=index_dtype)
    want = _expected(dst, dst_idx, src, src_idx)
    copy_rows(_inner(dst), dst_idx, _inner(src), src_idx)
    assert calls and torch.equal(dst, want)


@pytest.mark.parametrize("impl", ["torch", "auto"])
@pytest.mark.parametrize(("dst_idx", "src_idx"), [([0, 9], [1, 2]), ([0, 1], [2, 6]), ([0, 1], [-1, 2])])
def test_an_index_out_of_range_raises_unvalidated(impl, dst_idx, src_idx):
    # without validate=True the copy itself must still refuse to read or write outside a pool; the
    # compiled loop checks every index first and writes nothing (torch's scatter may have written
    # the rows before the bad one)
    dst, src = torch.zeros(2, 9, 3), torch.ones(2, 6, 3)
    with pytest.raises((IndexError, RuntimeError)):
        copy_rows(dst, torch.tensor(dst_idx), src, torch.tensor(src_idx), impl=impl, validate=False)
    if impl == "auto":
        assert not dst.any()


# --- copies addressing pinned host memory (docs/cuda.md, items 6 and 7) ------------------------------
# On a CPU the kernel runs in the interpreter, CPU tensors standing for both the device pool and the
# pinned host pool; which path a call takes is decided by ``host_addressable`` and ``mapped_copy``.


class _Stand:
    """What the dispatch reads of a tensor: where it lives, and whether it is pinned."""

    def __init__(self, where: str, pinned: bool = False) -> None:
        self.device, self.is_cuda, self._pinned = torch.device(where), where == "cuda", pinned

    def is_pinned(self) -> bool:
        return self._pinned


@pytest.mark.parametrize("cuda_build", [True, False])
def test_host_addressable_is_pinned_host_memory_of_a_cuda_build(monkeypatch, cuda_build):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_build)
    monkeypatch.setattr(kv_copy, "_host_launch_failure", None)
    pinned, pageable, device = _Stand("cpu", pinned=True), _Stand("cpu"), _Stand("cuda")
    assert kv_copy.host_addressable(pinned) is cuda_build
    assert not kv_copy.host_addressable(pageable) and not kv_copy.host_addressable(device)
    assert not kv_copy.host_addressable(torch.zeros(2))  # (nothing is pinned without a device)
    # the kernel takes a copy between the device and pinned host memory, either way round
    assert kv_copy.mapped_copy(device, pinned) is cuda_build
    assert kv_copy.mapped_copy(pinned, device) is cuda_build
    for dst, src in ((device, pageable), (pageable, device), (pinned, pinned), (device, device)):
        assert not kv_copy.mapped_copy(dst, src)
    monkeypatch.setattr(kv_copy, "_host_launch_failure", "ValueError: no")  # after a failed launch
    assert not kv_copy.mapped_copy(device, pinned)


def _any_pool(layers: int | None, rows: int, dim: int, dtype, seed: int) -> torch.Tensor:
    """Random rows: floats, or an FP8 pool's bytes (``uint8``)."""
    if dtype != torch.uint8:
        return _pool(layers, rows - 2 * C, dim, dtype, seed)
    shape = (rows, dim) if layers is None else (layers, rows, dim)
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _mapped_case(layers, rows_dst, rows_src, dim, dtype, index_dtype, n, seed):
    """(dst, dst_idx, src, src_idx): distinct destinations, sources that may repeat."""
    g = torch.Generator().manual_seed(seed)
    dst_idx = torch.randperm(rows_dst, generator=g)[:n].to(index_dtype)
    src_idx = torch.randint(0, rows_src, (n,), generator=g).to(index_dtype)
    dst = _any_pool(layers, rows_dst, dim, dtype, seed)
    return dst, dst_idx, _any_pool(layers, rows_src, dim, dtype, seed + 1), src_idx


@pytest.mark.interpreter
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("layers", [None, 3])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.bfloat16, torch.float16])
def test_the_mapped_copy_equals_the_reference(monkeypatch, dtype, layers, index_dtype):
    """Both directions (a backup writing the host pool, a load reading it), every row width a pool
    has here (an FP8 pool's bytes included), one layer or all."""
    monkeypatch.setattr(kv_copy, "_host_launch_failure", None)
    for seed, (rows_dst, rows_src, dim) in enumerate([(24, 16, 40), (16, 40, 7)]):
        case = _mapped_case(layers, rows_dst, rows_src, dim, dtype, index_dtype, 9, seed)
        dst, dst_idx, src, src_idx = case
        want = dst.clone()
        kv_copy.copy_rows_reference(want, dst_idx, src, src_idx)
        src_before = src.clone()
        assert kv_copy.copy_rows_mapped(dst, dst_idx, src, src_idx)
        assert torch.equal(dst, want) and torch.equal(src, src_before)


@pytest.mark.interpreter
@pytest.mark.parametrize("layers", [None, 2])
def test_the_mapped_copy_runs_a_swap_in_plan(monkeypatch, layers):
    """The plan as the swap-in kernel writes it: int64 host and device slots, -1 where an entry loads
    nothing; ``_run_plan`` hands it over as it is. The torch path gives the same rows."""
    from kernels.swap_in_triton import _run_plan_through_host

    monkeypatch.setattr(kv_copy, "_host_launch_failure", None)
    device, _, host, _ = _mapped_case(layers, 20, 30, 12, torch.float32, torch.int64, 1, 4)
    src = torch.tensor([7, -1, 29, -1, 0, 3])
    dst = torch.tensor([19, -1, 2, -1, 5, 0])
    keep = dst >= 0
    want = device.clone()
    kv_copy.copy_rows_reference(want, dst[keep], host, src[keep])
    got = device.clone()
    assert kv_copy.copy_rows_mapped(got, dst, host, src)
    assert torch.equal(got, want)
    if layers is None:  # (the swap-in's plan is one layer's)
        by_torch = device.clone()
        _run_plan_through_host(host, by_torch, src, dst)
        assert torch.equal(by_torch, want)


@pytest.mark.interpreter
def test_auto_takes_the_mapped_copy_and_falls_back_to_torch_once(monkeypatch):
    """``impl="auto"`` on a copy ``mapped_copy`` accepts runs the kernel; a launch that fails is
    logged once, the copy made by torch, and every later one goes to torch at once."""
    from structlog.testing import capture_logs

    from kernels import kv_copy_numba, kv_copy_triton

    monkeypatch.setattr(kv_copy, "_host_launch_failure", None)
    monkeypatch.setattr(kv_copy, "mapped_copy", lambda dst, src: kv_copy._host_launch_failure is None)
    monkeypatch.setattr(kv_copy_numba, "fits", lambda *a: False)  # (it takes CPU tensors first)
    launched = []
    kernel = kv_copy_triton.copy_rows_triton
    monkeypatch.setattr(kv_copy_triton, "copy_rows_triton", lambda *a: launched.append(1) or kernel(*a))
    dst, dst_idx, src, src_idx = _mapped_case(3, 16, 12, 5, torch.float32, torch.int64, 6, 5)
    want = dst.clone()
    kv_copy.copy_rows_reference(want, dst_idx, src, src_idx)
    got = dst.clone()
    copy_rows(got, dst_idx, src, src_idx)
    assert launched == [1] and torch.equal(got, want)

    def broken(*args):
        raise ValueError("Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)")

    monkeypatch.setattr(kv_copy_triton, "copy_rows_triton", broken)
    with capture_logs() as logs:
        for _ in range(2):
            got = dst.clone()
            copy_rows(got, dst_idx, src, src_idx)
            assert torch.equal(got, want)
    assert [e["event"] for e in logs] == ["kernels.kv_copy_host_fallback"]
    assert "cannot be accessed" in logs[0]["error"]
    assert kv_copy.host_launch_failure() == logs[0]["error"]
    assert not kv_copy.copy_rows_mapped(dst.clone(), dst_idx, src, src_idx)  # (off for the process)
