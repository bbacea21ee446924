"""An application's event loop stays free while the engine works (structural, without timing).

With the default configuration, every executor command, every forward of the model (the target's
and the draft's), every copy of KV rows and the encoding of a long text prompt run outside the
event loop's thread, so none of them can run there unbroken between two of the loop's turns. While
each forward runs, the loop takes a turn (a callback handed to it from the forward's thread runs
before the forward goes on). The lag itself is the benchmark's (``hispec bench engine --loop-lag``).
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import anyio
import pytest
from _engine_util import config, driver_outputs, make_prompts

import kernels.kv_copy
import pipeline.engine
import pipeline.hisparse.transfer
from pipeline import Engine, SamplingParams
from pipeline.errors import RequestError
from pipeline.model.model import DeepseekV32
from pipeline.model.tokenizer import ByteTokenizer

HANG_S = 60.0  # only against a hang: a turn of the loop that never comes


class Recorder:
    """Notes the thread each heavy call runs in; from a forward's thread, waits for one loop turn."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.loop_thread = threading.get_ident()
        self.calls: Counter[str] = Counter()
        self.on_loop: list[str] = []  # heavy calls that ran on the loop's thread (none may)
        self.turns = 0  # loop turns seen while a forward ran

    def wrap(self, name: str, fn: Callable[..., Any], *, wait_for_turn: bool = False) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            if threading.get_ident() == self.loop_thread:
                self.on_loop.append(name)
            elif wait_for_turn:
                self._loop_turns()
            return fn(*args, **kwargs)

        return recorded

    def _loop_turns(self) -> None:
        turned = threading.Event()
        self.loop.call_soon_threadsafe(turned.set)
        assert turned.wait(HANG_S), "the event loop took no turn while a forward ran"
        self.turns += 1


def install(monkeypatch: pytest.MonkeyPatch, recorder: Recorder) -> None:
    for name in ("forward", "mtp_forward"):
        fn = getattr(DeepseekV32, name)
        monkeypatch.setattr(DeepseekV32, name, recorder.wrap(name, fn, wait_for_turn=True))
    copy = kernels.kv_copy.copy_rows_unchecked  # what every KV copy of the CPU path ends in
    monkeypatch.setattr(kernels.kv_copy, "copy_rows_unchecked", recorder.wrap("copy", copy))
    monkeypatch.setattr(pipeline.hisparse.transfer, "copy_rows_unchecked", recorder.wrap("copy", copy))
    monkeypatch.setattr(ByteTokenizer, "encode", recorder.wrap("encode", ByteTokenizer.encode))
    monkeypatch.setattr(pipeline.engine, "OFF_LOOP_CHARS", 24)  # the test's text prompts are long


def text_of(ids: list[int]) -> str:
    return bytes(t % 95 + 32 for t in ids).decode("ascii")  # printable: one byte, one token


@pytest.mark.asyncio
async def test_no_forward_copy_or_encoding_runs_on_the_event_loop(tiny_model, monkeypatch):
    cfg = config(num_steps=2)
    assert cfg.executor_thread is None  # the default
    texts = [text_of(p) for p in make_prompts([40, 90, 33, 60], seed=11)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    ids = ["a", "b", "c", "d"]
    recorder = Recorder(asyncio.get_running_loop())
    install(monkeypatch, recorder)
    results: dict[str, list[int]] = {}

    async with Engine(cfg, model=tiny_model) as engine:
        assert engine._pipe is not None and not engine._pipe.actor._thread.inline

        async def whole(rid: str, text: str) -> None:
            results[rid] = list((await engine.generate_text(text, params, request_id=rid)).token_ids)

        async def streamed(rid: str, text: str) -> None:
            async with engine.generate(text, params, request_id=rid) as stream:
                results[rid] = [t async for delta in stream for t in delta.token_ids]

        async with anyio.create_task_group() as tg:
            for i, (rid, text) in enumerate(zip(ids, texts)):
                tg.start_soon(whole if i % 2 else streamed, rid, text)

    assert recorder.on_loop == []
    # each kind of heavy call did happen (else the check above proves nothing)
    assert recorder.calls["forward"] > 0 and recorder.calls["mtp_forward"] > 0
    assert recorder.calls["copy"] > 0 and recorder.calls["encode"] >= len(texts)
    assert recorder.turns == recorder.calls["forward"] + recorder.calls["mtp_forward"]
    prompts = [list(t.encode("ascii")) for t in texts]
    monkeypatch.undo()  # the oracle runs unrecorded
    assert results == driver_outputs(tiny_model, cfg, prompts, [params] * len(ids), ids)


@pytest.mark.asyncio
async def test_a_long_prompt_encoded_off_the_loop_fails_alone(tiny_model, monkeypatch):
    """A text prompt encoded in a worker thread still fails as its own request: ``generate_text``
    raises its ``RequestError``, ``generate`` raises it when iteration starts; the engine serves
    the next request."""
    monkeypatch.setattr(pipeline.engine, "OFF_LOOP_CHARS", 24)
    bad = "x" * 30 + "\ud800"
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    async with Engine(config(), model=tiny_model) as engine:
        with pytest.raises(RequestError, match="not valid Unicode") as info:
            await engine.generate_text(bad, params)
        assert info.value.field == "prompt"
        stream = engine.generate(bad, params)  # nothing encoded yet
        with pytest.raises(RequestError, match="not valid Unicode"):
            async with stream:
                async for _ in stream:
                    pass
        # what needs no tokens is still refused at the call, naming the field
        with pytest.raises(RequestError) as info:
            engine.generate("z" * 30, SamplingParams(temperature=-1.0))
        assert info.value.field == "temperature"
        with pytest.raises(RequestError) as info:
            engine.generate("z" * 30, params, request_id="")
        assert info.value.field == "request_id"
        good = await engine.generate_text("y" * 30, params)
        assert len(good.token_ids) == 3
        assert engine._registry.live == {}


@pytest.mark.slow  # a whole benchmark run: `make test-all`
def test_the_loop_lag_benchmark_reports_each_mode(tmp_path, monkeypatch):
    """``hispec bench engine --loop-lag`` at its smallest (a random tiny model, random prompts):
    every mode has its figures, the same tokens."""
    import json

    import pipeline.benchmarks.common
    from pipeline.benchmarks.engine import main

    def no_corpus(*args: object) -> list[list[int]]:
        raise FileNotFoundError("no corpus here")

    monkeypatch.setattr(pipeline.benchmarks.common, "held_out_prompts", no_corpus)

    out = tmp_path / "lag.json"
    argv = ["--loop-lag", "--model", str(tmp_path / "no-model"), "--requests", "2", "--long-prompt-len",
            "40", "--prompt-len", "8", "--new-tokens", "2", "--repeats", "1", "--warmup", "0",
            "--modes", "loop", "default", "idle", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["outputs_identical"] and report["paired_against"] == "loop"
    rows = {row["mode"]: row for row in report["rows"]}
    assert set(rows) == {"loop", "default", "idle"}
    assert all(rows[m]["tokens_per_s"]["median"] > 0 for m in ("loop", "default"))
    assert all(row["lag_max_ms"]["median"] >= row["lag_p50_ms"]["median"] >= 0 for row in rows.values())
