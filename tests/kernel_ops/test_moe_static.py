"""The fixed-shape routed experts (``kernels/moe_static.py``): the expert-aligned layout's invariants,
shapes that do not follow the routing, no host read, and the module path's sums.

Float64 agrees with ``RoutedExperts``' loop to 1e-12 (the products are batched matmuls instead of one
matmul per expert; the sums are added in the same order). Float32 differs by the matmuls' rounding
only: over 300 random cases of up to 40 tokens, 12 experts, D 64 and I 48 the largest difference was
7e-7 of ``|ref| + 1``; the tests allow 2e-6.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from kernels import moe_fixed
from kernels.moe_static import align_by_expert, max_padded, routed_experts_static
from pipeline.model.moe import MoE, RoutedExperts

from tiny_models import build_tiny_model

# the ops whose result size follows the data, or that copy a device value to the host
HOST_READS = {
    "nonzero",
    "unique",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "_local_scalar_dense",
    "masked_select",
    "item",
}


class OpRecorder(TorchDispatchMode):
    """Records every aten op a computation dispatches, with its outputs' shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list[tuple[int, ...]]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = out if isinstance(out, tuple | list) else (out,)
        shapes = [tuple(t.shape) for t in flat if isinstance(t, torch.Tensor)]
        self.calls.append((func._schema.name.removeprefix("aten::"), shapes))
        return out


def routing(gen: torch.Generator, tokens: int, experts: int, k: int, mode: str) -> torch.Tensor:
    """``[tokens, k]`` distinct experts per token: ``spread`` over all experts, ``one`` with every
    token choosing expert ``experts - 1`` (plus others), ``few`` over only ``k`` of the experts
    (the rest unused)."""
    if mode == "spread":
        rows = [torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)]
    elif mode == "one":
        rest = experts - 1
        rows = [
            torch.cat([torch.tensor([rest]), torch.randperm(rest, generator=gen)[: k - 1]])
            for _ in range(tokens)
        ]
    else:
        chosen = torch.randperm(experts, generator=gen)[:k]
        rows = [chosen[torch.randperm(k, generator=gen)] for _ in range(tokens)]
    return torch.stack(rows) if tokens else torch.zeros(0, k, dtype=torch.int64)


def loop_experts(x, ids, weights, gate_up, down):
    """The module path: ``RoutedExperts`` with the switch off, holding the given weights."""
    experts = RoutedExperts.__new__(RoutedExperts)
    torch.nn.Module.__init__(experts)
    experts.static_shapes = False
    experts.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=False)
    experts.down_proj = torch.nn.Parameter(down, requires_grad=False)
    return experts(x, ids, weights)


def problem(seed, tokens, experts, k, dim, inner, mode, dtype):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, dim, generator=gen).to(dtype)
    gate_up = (torch.randn(experts, 2 * inner, dim, generator=gen) / dim**0.5).to(dtype)
    down = (torch.randn(experts, dim, inner, generator=gen) / inner**0.5).to(dtype)
    ids = routing(gen, tokens, experts, k, mode)
    weights = torch.rand(tokens, k, generator=gen, dtype=torch.float64).to(
        torch.promote_types(dtype, torch.float32)
    )
    return x, ids, weights, gate_up, down


MODES = st.sampled_from(["spread", "one", "few"])


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    tokens=st.integers(0, 30),
    experts=st.integers(2, 9),
    k=st.integers(1, 3),
    block=st.integers(1, 9),
    mode=MODES,
)
def test_alignment_puts_each_slot_once_in_single_expert_blocks(seed, tokens, experts, k, block, mode):
    k = min(k, experts)
    ids = routing(torch.Generator().manual_seed(seed), tokens, experts, k, mode)
    align = align_by_expert(ids, experts, block)
    slots = tokens * k
    padded = max_padded(slots, experts, block)
    num_blocks = -(-padded // block)
    assert align.token_slots.shape == (padded,) and align.block_expert.shape == (num_blocks,)
    assert align.slot_position.shape == (slots,)
    ts = align.token_slots
    real = ts[ts < slots]
    assert torch.equal(real.sort().values, torch.arange(slots))  # every token-slot exactly once
    assert bool((ts[ts >= slots] == slots).all())  # the rest is the sentinel
    assert torch.equal(ts[align.slot_position], torch.arange(slots))  # the inverse
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=experts)
    used = int(((counts + block - 1) // block).sum())
    assert int(align.num_padded) == used * block
    assert bool((align.block_expert[used:] == -1).all())
    assert align.block_expert[:used].tolist() == sorted(align.block_expert[:used].tolist())
    padded_ts = torch.cat([ts, ts.new_full((num_blocks * block - padded,), slots)]).view(num_blocks, block)
    for b in range(num_blocks):
        members = padded_ts[b][padded_ts[b] < slots]
        if b >= used:
            assert members.numel() == 0
            continue
        assert members.numel() > 0  # a used block holds at least one real slot
        assert bool((flat[members] == align.block_expert[b]).all())  # one expert per block
        assert torch.equal(members, members.sort().values)  # stable: token order kept
    for e in range(experts):  # an expert takes exactly the blocks its count needs
        assert int((align.block_expert == e).sum()) == -(-int(counts[e]) // block)


def recorded(fn, *args):
    with OpRecorder() as rec:
        fn(*args)
    return rec.calls


@pytest.mark.parametrize("block", [1, 4, None])
def test_shapes_follow_the_sizes_never_the_routing(block):
    """Every op and every output shape is the same for two very different routings."""
    x, spread, weights, gate_up, down = problem(3, 13, 8, 2, 12, 5, "spread", torch.float32)
    one = routing(torch.Generator().manual_seed(4), 13, 8, 2, "one")
    few = routing(torch.Generator().manual_seed(5), 13, 8, 2, "few")
    calls = [
        recorded(lambda i: routed_experts_static(x, i, weights, gate_up, down, block), ids)
        for ids in (spread, one, few)
    ]
    assert calls[0] == calls[1] == calls[2]
    aligns = [recorded(align_by_expert, ids, 8, block or 2) for ids in (spread, one, few)]
    assert aligns[0] == aligns[1] == aligns[2]


def test_no_host_read_of_the_routing():
    """The CPU proxy for capturability: no op whose result size follows the data, no scalar copied to
    the host. The module path's loop, recorded the same way, shows them (the recorder sees them)."""
    x, ids, weights, gate_up, down = problem(7, 9, 6, 2, 10, 4, "spread", torch.float32)
    static_ops = {name for name, _ in recorded(routed_experts_static, x, ids, weights, gate_up, down)}
    assert static_ops.isdisjoint(HOST_READS), static_ops & HOST_READS
    loop_ops = {name for name, _ in recorded(loop_experts, x, ids, weights, gate_up, down)}
    assert "nonzero" in loop_ops
    assert loop_ops & {"unique", "_unique", "_unique2"}


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    tokens=st.integers(0, 24),
    experts=st.integers(2, 9),
    k=st.integers(1, 3),
    dim=st.integers(1, 24),
    inner=st.integers(1, 16),
    mode=MODES,
    block=st.sampled_from([None, 1, 2, 5]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_equals_the_module_loop(seed, tokens, experts, k, dim, inner, mode, block, dtype):
    k = min(k, experts)
    x, ids, weights, gate_up, down = problem(seed, tokens, experts, k, dim, inner, mode, dtype)
    got = routed_experts_static(x, ids, weights, gate_up, down, block)
    ref = loop_experts(x, ids, weights, gate_up, down)
    assert got.dtype == dtype and got.shape == x.shape
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("mode", ["spread", "one", "few"])
def test_one_token_and_a_half_dtype(mode):
    """A decode step of one token, and bfloat16 activations with float32 routing weights (each
    contribution weighted in float32, cast to bfloat16, then added: the loop's order of roundings)."""
    x, ids, weights, gate_up, down = problem(11, 1, 6, 3, 16, 8, mode, torch.float64)
    torch.testing.assert_close(
        routed_experts_static(x, ids, weights, gate_up, down),
        loop_experts(x, ids, weights, gate_up, down),
        rtol=1e-12,
        atol=1e-12,
    )
    x, ids, weights, gate_up, down = problem(12, 20, 6, 2, 16, 8, mode, torch.bfloat16)
    assert weights.dtype == torch.float32
    got = routed_experts_static(x, ids, weights, gate_up, down)
    ref = loop_experts(x, ids, weights, gate_up, down)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_a_half_dtype_weights_in_the_wide_dtype_then_casts():
    """With products that are exact whatever their order (small integers, and ``I = 1`` so that each
    output of ``down`` is one product), both paths hold the same bfloat16 expert outputs, and the
    result is bit for bit the loop's: weighted in float32, rounded to bfloat16 once, then added.
    Casting the weights to bfloat16 first would round twice."""
    gen = torch.Generator().manual_seed(5)
    tokens, experts, k, dim = 12, 5, 2, 8
    x = torch.randint(-3, 4, (tokens, dim), generator=gen).to(torch.bfloat16)
    gate_up = torch.randint(-2, 3, (experts, 2, dim), generator=gen).to(torch.bfloat16)
    down = torch.randint(-3, 4, (experts, dim, 1), generator=gen).to(torch.bfloat16)
    ids = routing(gen, tokens, experts, k, "spread")
    weights = torch.rand(tokens, k, generator=gen) + 1 / 3  # not bfloat16 values
    assert not torch.equal(weights, weights.bfloat16().float())
    ref = loop_experts(x, ids, weights, gate_up, down)
    assert ref.abs().sum() > 0
    for block in (None, 1, 3):
        assert torch.equal(routed_experts_static(x, ids, weights, gate_up, down, block), ref)


def test_the_module_switch_selects_the_static_path_with_the_same_values_and_gradients():
    class Cfg:
        n_routed_experts, hidden_size, moe_intermediate_size = 6, 10, 4

    assert RoutedExperts(Cfg()).static_shapes is False  # off unless asked for
    experts = RoutedExperts(Cfg(), static_shapes=True).double()
    x, ids, weights, _, _ = problem(21, 11, 6, 2, 10, 4, "spread", torch.float64)
    x.requires_grad_(True)
    weights.requires_grad_(True)
    params = [x, weights, experts.gate_up_proj, experts.down_proj]
    results = []
    for static in (True, False):
        experts.static_shapes = static
        with OpRecorder() as rec:
            out = experts(x, ids, weights)
        grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(), params)
        results.append((out.detach(), grads, {name for name, _ in rec.calls}))
    (out_s, grads_s, ops_s), (out_l, grads_l, ops_l) = results
    assert "nonzero" not in ops_s and "nonzero" in ops_l  # each setting ran its own path
    torch.testing.assert_close(out_s, out_l, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads_s, grads_l, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


TRITON_CASES = [(1, 6, 2, 16, 8), (20, 6, 2, 40, 24), (37, 9, 3, 17, 5), (5, 40, 1, 8, 70)]


@pytest.mark.interpreter
@pytest.mark.parametrize("mode", ["spread", "one", "few"])
@pytest.mark.parametrize(("tokens", "experts", "k", "dim", "inner"), TRITON_CASES)
def test_triton_kernel_equals_the_module_loop(mode, tokens, experts, k, dim, inner):
    """The grouped-GEMM kernel over the same layout: float32 dots accumulate in their own order
    (largest difference seen 1.5e-6 on these O(1) values)."""
    moe_triton = pytest.importorskip("kernels.moe_triton")
    x, ids, weights, gate_up, down = problem(
        tokens + experts, tokens, experts, k, dim, inner, mode, torch.float32
    )
    got = moe_triton.routed_experts_triton(x, ids, weights, gate_up, down)
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got, loop_experts(x, ids, weights, gate_up, down), rtol=1e-5, atol=1e-5)


@pytest.mark.interpreter
def test_triton_kernel_half_dtype_and_checks():
    moe_triton = pytest.importorskip("kernels.moe_triton")
    x, ids, weights, gate_up, down = problem(8, 19, 7, 2, 24, 12, "spread", torch.bfloat16)
    got = moe_triton.routed_experts_triton(x, ids, weights, gate_up, down)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(
        got.float(), loop_experts(x, ids, weights, gate_up, down).float(), rtol=2e-2, atol=2e-2
    )
    with pytest.raises(ValueError, match="share one of"):
        moe_triton.routed_experts_triton(x.double(), ids, weights, gate_up.double(), down.double())
    with pytest.raises(ValueError, match="shapes disagree"):
        moe_triton.routed_experts_triton(x, ids, weights, gate_up, down[:, :, :-1])
    with pytest.raises(ValueError, match="must be \\[N, k\\]"):
        moe_triton.routed_experts_triton(x, ids, weights[:, :1], gate_up, down)
    empty = moe_triton.routed_experts_triton(x[:0], ids[:0], weights[:0], gate_up, down)
    assert empty.shape == (0, 24)


def test_a_model_moe_layer_gives_the_same_output_with_the_switch_on():
    """The tiny model's MoE (its router, routed and shared experts) with the switch on and off."""
    model = build_tiny_model()
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert layers
    x = torch.randn(
        2, 7, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )
    for moe in layers:
        with torch.no_grad():
            moe.experts.static_shapes = False
            ref = moe(x)
            moe.experts.static_shapes = True
            got = moe(x)
            moe.experts.static_shapes = False
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def test_the_fixed_path_takes_the_static_matmuls_off_cuda():
    """``routed_experts_fixed`` (what ``static_shapes`` calls): on a CPU, ``"auto"`` is
    ``routed_experts_static``, bit for bit; an explicit Triton call outside its dtypes is refused."""
    x, ids, weights, gate_up, down = problem(8, 19, 7, 2, 24, 12, "spread", torch.float64)
    got = moe_fixed.routed_experts_fixed(x, ids, weights, gate_up, down)
    assert torch.equal(got, routed_experts_static(x, ids, weights, gate_up, down))
    assert not moe_fixed.triton_fits(x, gate_up, down)  # (float64)
    assert moe_fixed.triton_fits(x.float(), gate_up.float(), down.float())
    assert not moe_fixed.triton_fits(x.float(), gate_up.float(), down.float().transpose(1, 2))


@pytest.mark.interpreter
def test_the_fixed_path_on_cuda_is_the_triton_kernel_and_captures(monkeypatch):
    """As on CUDA (the implementation resolved as there, Triton in the interpreter): a model's
    routed experts with ``static_shapes`` on run the grouped-GEMM kernel, agree with the module loop,
    and what a graph would record of the call reads nothing back and has no data-dependent shape."""
    pytest.importorskip("kernels.moe_triton")
    from pipeline.graphs import audit

    launched: list[str] = []
    monkeypatch.setattr(moe_fixed, "resolve_impl", lambda impl, tensors, triton_fits: "triton")
    kernel = importlib.import_module("kernels.moe_triton")
    run_kernel = kernel.routed_experts_triton
    monkeypatch.setattr(kernel, "routed_experts_triton",
                        lambda *a: launched.append("triton") or run_kernel(*a))
    model = build_tiny_model(torch.float32)
    experts = next(m.experts for m in model.modules() if isinstance(m, MoE))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, model.cfg.hidden_size, generator=gen)
    ids = torch.randint(0, model.cfg.n_routed_experts, (5, model.cfg.num_experts_per_tok), generator=gen)
    weights = torch.rand(ids.shape, generator=gen)
    with torch.no_grad():
        want = experts(x, ids, weights)  # the module loop
        experts.static_shapes = True
        out: list[torch.Tensor] = []
        findings = audit(lambda: out.append(experts(x, ids, weights)))
    assert launched == ["triton"]
    assert findings == []
    torch.testing.assert_close(out[0], want, rtol=1e-5, atol=1e-5)
