"""Decode over fixed-size inputs (``pipeline/graphs.py``), and what still blocks a CUDA graph.

On a CPU nothing is captured, but the padded, fixed-size inputs a graph would replay run the same
way: their tokens must be the eager step's, padding included. The audit lists what a capture of
the all-resident decode step still meets on the torch path (the CPU's numba loops switched off, as
CUDA never takes them): exactly the blockers ``docs/cuda.md`` names, so a new host read on the path
fails here, and so does a removed one until the list is updated.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import re
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
import torch
from _engine_util import config, make_prompts

import kernels
from kernels import indexer_topk_numba, moe_numba, small_ops_numba, sparse_mla_numba
from pipeline.driver import SyncDriver
from pipeline.executor import Executor
from pipeline.graphs import (
    DYNAMIC_SHAPE,
    HOST_COPY,
    HOST_READ,
    DecodeGraphs,
    Finding,
    audit,
    bucket_for,
    classify,
    static_moe,
)
from pipeline.hisparse.coordinator import HiSparseCoordinator
from pipeline.memory.interface import Layout
from pipeline.model import fused
from pipeline.sampling import SamplingParams

from tiny_models import build_tiny_model

DOCS = Path(__file__).resolve().parents[2] / "docs" / "cuda.md"
LENGTHS = [9, 14, 20, 11, 17]  # prompts
NEW_TOKENS = [2, 4, 6, 8, 10]  # so the batch shrinks 5, 4, 3, 2, 1: buckets 8 (padded), 4, 4 (padded), 2, 1
POOL_FOR_A_MIX = 64  # device tokens: dynamic residency keeps some of the five requests FULL, not all


@attrs.define(eq=False)
class Recorded(DecodeGraphs):
    """``DecodeGraphs`` that records the batch sizes it ran, and audits its first step of
    ``audit_size`` tokens."""

    sizes: list[int] = attrs.field(factory=list)
    audit_size: int = 0
    findings: list[Finding] = attrs.field(factory=list)
    audited: bool = False
    # what the audited step runs under (``cuda_kernels``: the kernels a CUDA step takes)
    kernels: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    _auditing: bool = False

    def forward(self, rows, *args):
        self.sizes.append(len(rows))
        self._auditing = len(rows) == self.audit_size and not self.audited
        return DecodeGraphs.forward(self, rows, *args)

    def _body(self, step):
        """The step a capture records (not the inputs' fill, nor a bucket's first allocation)."""
        if not self._auditing:
            return DecodeGraphs._body(self, step)
        self._auditing, self.audited = False, True
        out: list = []
        with self.kernels():
            self.findings.extend(audit(lambda: out.append(DecodeGraphs._body(self, step))))
        return out[0]


def run(model, buckets: tuple[int, ...] | None = None, audit_size: int = 0, *, cfg=None, counters=None,
        kernels=contextlib.nullcontext, graphs_type=None):
    """Greedy outputs of the engine (all-resident unless ``cfg``), and (with ``buckets``) its decode
    steps through ``Recorded`` graphs of those buckets, which it returns too; ``counters``: a dict
    the HiSparse transfer counters are written to."""
    executor = Executor(cfg or config(hisparse=False, max_running_requests=8), model=model)
    graphs = None
    if buckets is not None:
        graphs = (graphs_type or Recorded)(executor.model, executor.memory, buckets=buckets,
                                           audit_size=audit_size, kernels=kernels)
        plain = executor._forwards
        executor._forwards = lambda: attrs.evolve(plain(), graphs=graphs)
    driver = SyncDriver(executor)
    prompts = make_prompts(LENGTHS, seed=3)
    reqs = [driver.submit(p, SamplingParams(max_new_tokens=n, ignore_eos=True), request_id=f"r{i}")
            for i, (p, n) in enumerate(zip(prompts, NEW_TOKENS))]
    driver.run()
    if counters is not None:
        counters.update(executor.memory.counters.as_dict())
    executor.close()
    return {r.request_id: list(r.output_ids) for r in reqs}, graphs


def test_static_inputs_decode_the_eager_tokens(tiny_model):
    eager, _ = run(tiny_model)
    static, graphs = run(tiny_model, buckets=(1, 2, 4, 8))
    assert static == eager
    assert graphs.sizes and {bucket_for(n, (1, 2, 4, 8)) for n in graphs.sizes} == {1, 2, 4, 8}
    assert {5, 3} <= set(graphs.sizes)  # padded to 8 and to 4
    assert graphs.captured() == []  # (a CPU captures nothing)


def test_above_the_largest_bucket_is_not_covered(tiny_model):
    eager, _ = run(tiny_model)
    static, graphs = run(tiny_model, buckets=(1, 2))
    assert static == eager
    assert set(graphs.sizes) == {1, 2}  # the batches of 3 to 5 ran eagerly


@pytest.fixture
def torch_path(monkeypatch):
    """The CPU's compiled loops off: every op takes the torch path CUDA's graphs would record."""
    for module in (indexer_topk_numba, sparse_mla_numba, moe_numba, small_ops_numba):
        monkeypatch.setattr(module, "fits", lambda *a, **k: False)
    monkeypatch.setattr(fused, "MAX_HYBRID_TOKENS", 0)
    monkeypatch.setattr(kernels, "warm_up", lambda *a, **k: None)  # (nothing to compile)


def documented_blockers() -> set[tuple[str, str]]:
    """(op, site) of every row of the "Audit of the torch path" table in docs/cuda.md."""
    text = DOCS.read_text().split("### Audit of the torch path", 1)[1].split("\n#", 1)[0]
    return {(op, site) for op, site in re.findall(r"^\| `(aten\.[\w.]+)` +\| `([\w/.:]+)` +\|", text, re.M)}


def test_audit_of_a_decode_step_lists_the_documented_blockers(torch_path):
    # a model of its own: the shared one's norms keep the compiled handles earlier tests made
    _, graphs = run(build_tiny_model(), buckets=(1, 2, 4, 8), audit_size=3)  # a padded bucket's step
    assert graphs.findings, "the step of 3 was audited"
    assert {(f.op, f.site) for f in graphs.findings} == documented_blockers()
    assert all(f.stack[-1].startswith(f.site.split(":")[0]) for f in graphs.findings)


# --- HiSparse ---------------------------------------------------------------------------------------


def hisparse(residency: str = "always", dtype: str = "float64", **fields):
    cfg = config(hisparse=True, max_running_requests=8)
    assert cfg.hisparse is not None
    return attrs.evolve(cfg, dtype=dtype, hisparse=attrs.evolve(cfg.hisparse, residency=residency, **fields))


def test_hisparse_static_inputs_decode_the_eager_tokens_at_exact_sizes(tiny_model):
    """HiSparse is not padded (a padding token would swap its request's row in twice in one call):
    each batch size is its own bucket, and the tokens and transfer counts are the eager step's."""
    eager_counts: dict = {}
    static_counts: dict = {}
    eager, _ = run(tiny_model, cfg=hisparse(), counters=eager_counts)
    static, graphs = run(tiny_model, buckets=(1, 2, 4, 8), cfg=hisparse(), counters=static_counts)
    assert static == eager
    assert sorted(set(graphs.sizes)) == [1, 2, 3, 4, 5]
    assert sorted(graphs._buckets) == [(n, False) for n in range(1, 6)]  # (no padding, no FULL row)
    assert static_counts == eager_counts and sum(eager_counts["misses"]) > 0  # (swap-ins that load)


def test_a_batch_of_full_rows_decodes_through_buckets_of_its_own(tiny_model):
    """Dynamic residency with room for every request: every row is FULL, so every step goes through
    the FULL buckets (one per batch size, the slots through a fixed-size copy of the page table),
    with the eager tokens and no swap-in."""
    eager_counts: dict = {}
    static_counts: dict = {}
    eager, _ = run(tiny_model, cfg=hisparse("dynamic"), counters=eager_counts)
    static, graphs = run(tiny_model, buckets=(1, 2, 4, 8), cfg=hisparse("dynamic"), counters=static_counts)
    assert static == eager
    assert sorted(set(graphs.sizes)) == [1, 2, 3, 4, 5]
    assert sorted(graphs._buckets) == [(n, True) for n in range(1, 6)]
    assert static_counts == eager_counts and sum(eager_counts["misses"]) == 0


def test_a_batch_of_both_layouts_runs_eagerly(tiny_model, monkeypatch):
    """Dynamic residency short of room: some rows are demoted (HOT) while others stay FULL. A batch
    of both (as its step's room left it: a demotion may make one) runs eagerly, a batch of one
    layout through that layout's buckets; the tokens are the eager engine's either way."""
    cfg = attrs.evolve(hisparse("dynamic"), device_pool_tokens=POOL_FOR_A_MIX, max_context_len=48)
    eager, _ = run(tiny_model, cfg=cfg)
    steps: list[tuple[int, int]] = []  # (batch size, FULL rows) of each decode forward, after its room
    make_backend = HiSparseCoordinator.backend

    def backend(coord, rows, *args, **kwargs):
        made = make_backend(coord, rows, *args, **kwargs)
        if kwargs.get("steps") == 1:
            full = [coord.layout(r) is Layout.FULL for r in rows.tolist()]
            steps.append((len(full), sum(full)))
        return made

    monkeypatch.setattr(HiSparseCoordinator, "backend", backend)
    static, graphs = run(tiny_model, buckets=(1, 2, 4, 8), cfg=cfg)
    assert static == eager
    mixed = [(n, full) for n, full in steps if 0 < full < n]
    assert mixed, f"no step mixed the layouts: {steps}"
    assert any(full == 0 for _, full in steps), "no step of HOT rows only"
    assert len(graphs.sizes) <= len(steps) - len(mixed)  # (none of them went through a bucket)
    assert {full for _, full in graphs._buckets} == {False, True}  # HOT batches' buckets and FULL ones'


def test_a_full_batch_its_room_turns_into_both_layouts_runs_eagerly(tiny_model, monkeypatch):
    """A step of FULL rows only is covered, but its room (``prepare_decode``) may demote one of them
    (dynamic residency under pressure): that step runs eagerly, with the targets already prepared,
    and gives the eager engine's tokens."""
    prepare = HiSparseCoordinator.prepare_decode
    calls = []

    def demoting(coord, rows):
        calls.append(len(rows))
        if len(calls) == 3:  # (as a step's room might: the first row of a batch of FULL rows)
            assert all(coord.layout(r) is Layout.FULL for r in rows)
            coord.demote(rows[0])
        return prepare(coord, rows)

    monkeypatch.setattr(HiSparseCoordinator, "prepare_decode", demoting)
    eager, _ = run(tiny_model, cfg=hisparse("dynamic"))
    calls.clear()
    static, graphs = run(tiny_model, buckets=(1, 2, 4, 8), cfg=hisparse("dynamic"))
    assert static == eager
    assert len(graphs.sizes) < len(calls)  # the step whose room demoted a row ran eagerly (and others)
    assert (5, True) in graphs._buckets  # (the steps before it went through the FULL rows' bucket)


TRITON_KERNELS = [
    ("kernels.indexer_topk_triton", "indexer_topk_triton"),
    ("kernels.swap_in_triton", "swap_in_triton"),
    ("kernels.sparse_mla_triton", "sparse_mla_triton"),
]


@pytest.fixture
def cuda_kernels(monkeypatch):
    """While entered: the kernels a CUDA step takes, on the CPU: Triton (in the interpreter) wherever
    it fits, the CPU's compiled loops off. (And all along, so that the engine is built with them:
    the swap-in counts kept on their device until read.)"""
    from kernels import hisparse_attend_numba
    from kernels.checks import resolve_impl
    from pipeline.hisparse import coordinator
    from pipeline.hisparse.counters import LayerCounters

    def as_on_cuda(impl, tensors, *, triton_fits=True):
        if impl == "auto" and triton_fits:
            return "triton"
        return resolve_impl(impl, tensors, triton_fits=triton_fits)

    kernel = coordinator.swap_in
    launched: list[str] = []  # the Triton kernels the entered steps ran

    def recorded(module_name: str, name: str, patch) -> None:
        module = importlib.import_module(module_name)
        run_kernel = getattr(module, name)

        def launch(*args, **kwargs):
            launched.append(name)
            return run_kernel(*args, **kwargs)

        patch.setattr(module, name, launch)

    @contextlib.contextmanager
    def entered():
        with monkeypatch.context() as patch:
            for module_name, name in TRITON_KERNELS:
                recorded(module_name, name, patch)
            for name in ("kernels.indexer_topk", "kernels.sparse_mla"):  # (the package's names are functions)
                patch.setattr(importlib.import_module(name), "resolve_impl", as_on_cuda)
            patch.setattr(coordinator, "swap_in", lambda *a, **k: kernel(*a, **k, impl="triton"))
            for module in (indexer_topk_numba, sparse_mla_numba, moe_numba, small_ops_numba,
                           hisparse_attend_numba):
                patch.setattr(module, "fits", lambda *a, **k: False)
            patch.setattr(small_ops_numba.CompiledNorm, "takes", lambda *a: False)  # (a handle made earlier)
            # as if another row of the memory were FULL (dynamic residency): finding the batch's
            # FULL rows reads the rows back; the fixed-size inputs know there are none
            read_back = lambda _, rows: rows.tolist() and []  # noqa: E731
            patch.setattr(coordinator.HiSparseCoordinator, "full_flags", read_back)
            patch.setattr(fused, "MAX_HYBRID_TOKENS", 0)
            yield

    monkeypatch.setattr(coordinator, "LayerCounters", functools.partial(LayerCounters, defer=True))
    entered.launched = launched  # type: ignore[attr-defined]
    return entered


@pytest.mark.interpreter
@pytest.mark.parametrize("residency", ["always", "dynamic"])
def test_a_hisparse_decode_step_on_the_cuda_kernels_audits_clean(cuda_kernels, residency):
    """What a capture records of a HiSparse decode step, with the kernels CUDA runs (float32, so
    that every one fits Triton), reads nothing back and has no data-dependent shape: the indexer
    scores a fixed width, the swap-in is one call a layer whose counts stay on the device, the MoE
    takes its fixed-shape path (``static_moe``). Dynamic residency with room for all: a step of
    FULL rows, which reads its slots through the bucket's page table and swaps nothing in."""
    model = build_tiny_model(torch.float32)
    with static_moe(model):
        _, graphs = run(model, buckets=(1, 2, 4, 8), audit_size=3,
                        cfg=hisparse(residency, dtype="float32"), kernels=cuda_kernels)
    assert graphs.audited
    swap_ins = model.cfg.num_hidden_layers if residency == "always" else 0  # (one call a layer)
    want = {name for _, name in TRITON_KERNELS if swap_ins or name != "swap_in_triton"}
    assert set(cuda_kernels.launched) == want
    assert cuda_kernels.launched.count("swap_in_triton") == swap_ins
    assert [(f.op, f.site) for f in graphs.findings] == []


@pytest.mark.parametrize(
    ("call", "kind"),
    [
        (lambda t: t.sum().item(), HOST_READ),
        (lambda t: bool(t.any()), HOST_READ),
        (lambda t: t.nonzero(), DYNAMIC_SHAPE),
        (lambda t: torch.unique(t), DYNAMIC_SHAPE),
        (lambda t: t[t > 1], DYNAMIC_SHAPE),
        (lambda t: t.repeat_interleave(t), DYNAMIC_SHAPE),
        (lambda t: torch.tensor([1, 2]), HOST_COPY),
    ],
)
def test_audit_names_each_kind(call, kind):
    t = torch.arange(4)
    findings = audit(lambda: call(t))
    assert [f.kind for f in findings] == [kind]
    assert findings[0].site.endswith(":<lambda>") and findings[0].count == 1


def test_audit_passes_capturable_ops():
    t = torch.arange(4.0)
    assert audit(lambda: (t * 2).index_select(0, torch.arange(2)).repeat_interleave(2)) == []
    assert classify(torch.ops.aten.repeat_interleave.Tensor, (torch.ones(2, dtype=torch.long),),
                    {"output_size": 2}) is None


def test_the_cuda_graphs_option_runs_decode_through_the_fixed_size_inputs(tiny_model, monkeypatch):
    """``EngineConfig.cuda_graphs``: the executor builds one ``DecodeGraphs`` and every plain decode
    step of a covered batch goes through it (on a CPU: the fixed-size inputs, run eagerly), with the
    eager tokens."""
    eager, _ = run(tiny_model)
    ran: list[int] = []
    original = DecodeGraphs.forward

    def forward(self, rows, *args):
        ran.append(len(rows))
        return original(self, rows, *args)

    monkeypatch.setattr(DecodeGraphs, "forward", forward)
    executor = Executor(attrs.evolve(config(hisparse=False, max_running_requests=8), cuda_graphs=True),
                        model=tiny_model)
    assert isinstance(executor.graphs, DecodeGraphs)
    driver = SyncDriver(executor)
    prompts = make_prompts(LENGTHS, seed=3)
    reqs = [driver.submit(p, SamplingParams(max_new_tokens=n, ignore_eos=True), request_id=f"r{i}")
            for i, (p, n) in enumerate(zip(prompts, NEW_TOKENS))]
    driver.run()
    executor.close()
    assert {r.request_id: list(r.output_ids) for r in reqs} == eager
    assert sorted(set(ran)) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    ("fields", "says"),
    [({"tensor_parallel_size": 2}, "tensor_parallel_size=1"), ({"cuda_graphs": "yes"}, "True or False")],
)
def test_the_cuda_graphs_option_is_checked(fields, says):
    from pipeline.config import EngineConfig
    from pipeline.errors import ConfigError

    options = {"hisparse": None, "cuda_graphs": True} | fields
    with pytest.raises(ConfigError, match=re.escape(says)) as info:
        EngineConfig(**options)
    assert info.value.field == "cuda_graphs"
