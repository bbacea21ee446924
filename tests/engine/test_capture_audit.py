"""Decode over fixed-size inputs (``pipeline/graphs.py``), and what still blocks a CUDA graph.

On a CPU nothing is captured, but the padded, fixed-size inputs a graph would replay run the same
way: their tokens must be the eager step's, padding included. The audit lists what a capture of
the all-resident decode step still meets on the torch path (the CPU's numba loops switched off, as
CUDA never takes them): exactly the blockers ``docs/cuda.md`` names, so a new host read on the path
fails here, and so does a removed one until the list is updated.
"""

from __future__ import annotations

import re
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
)
from pipeline.model import fused
from pipeline.sampling import SamplingParams

from tiny_models import build_tiny_model

DOCS = Path(__file__).resolve().parents[2] / "docs" / "cuda.md"
LENGTHS = [9, 14, 20, 11, 17]  # prompts
NEW_TOKENS = [2, 4, 6, 8, 10]  # so the batch shrinks 5, 4, 3, 2, 1: buckets 8 (padded), 4, 4 (padded), 2, 1


@attrs.define(eq=False)
class Recorded(DecodeGraphs):
    """``DecodeGraphs`` that records the batch sizes it ran, and audits its first step of
    ``audit_size`` tokens."""

    sizes: list[int] = attrs.field(factory=list)
    audit_size: int = 0
    findings: list[Finding] = attrs.field(factory=list)

    def forward(self, rows, *args):
        self.sizes.append(len(rows))
        if len(rows) != self.audit_size or self.findings:
            return DecodeGraphs.forward(self, rows, *args)
        out: list = []
        self.findings.extend(audit(lambda: out.append(DecodeGraphs.forward(self, rows, *args))))
        return out[0]


def run(model, buckets: tuple[int, ...] | None = None, audit_size: int = 0):
    """Greedy outputs of the all-resident engine, and (with ``buckets``) its decode steps through
    ``Recorded`` graphs of those buckets, which it returns too."""
    executor = Executor(config(hisparse=False, max_running_requests=8), model=model)
    graphs = None
    if buckets is not None:
        graphs = Recorded(executor.model, executor.memory, buckets=buckets, audit_size=audit_size)
        plain = executor._forwards
        executor._forwards = lambda: attrs.evolve(plain(), graphs=graphs)
    driver = SyncDriver(executor)
    prompts = make_prompts(LENGTHS, seed=3)
    reqs = [driver.submit(p, SamplingParams(max_new_tokens=n, ignore_eos=True), request_id=f"r{i}")
            for i, (p, n) in enumerate(zip(prompts, NEW_TOKENS))]
    driver.run()
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
    [({"hisparse": "default"}, "hisparse=None"), ({"tensor_parallel_size": 2}, "tensor_parallel_size=1"),
     ({"cuda_graphs": "yes"}, "True or False")],
)
def test_the_cuda_graphs_option_is_checked(fields, says):
    from pipeline.config import EngineConfig, HiSparseConfig
    from pipeline.errors import ConfigError

    options = {"hisparse": None, "cuda_graphs": True} | fields
    if options["hisparse"] == "default":
        options["hisparse"] = HiSparseConfig()
    with pytest.raises(ConfigError, match=re.escape(says)) as info:
        EngineConfig(**options)
    assert info.value.field == "cuda_graphs"
