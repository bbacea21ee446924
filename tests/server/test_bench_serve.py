"""``hispec bench serve`` plumbing: both sides get one configuration; every prompt is sent once
(no timing is asserted)."""

from __future__ import annotations

import anyio
import pytest

from pipeline.benchmarks.serve import Record, build_parser, run_round, serve_argv, summary
from pipeline.server.serve import build_parser as serve_parser
from pipeline.server.serve import engine_config


@pytest.mark.parametrize("extra", [[], ["--no-spec", "--no-hisparse"]])
def test_the_server_and_the_engine_side_share_one_configuration(extra):
    args = build_parser().parse_args(
        ["--clients", "1", "8", "--prompt-len", "32", "--max-tokens", "16", *extra]
    )
    cfg = engine_config(serve_parser().parse_args(serve_argv(args)))
    assert cfg.max_running_requests == 8
    assert cfg.max_context_len == 32 + 16 + 16
    assert (cfg.speculative is None, cfg.hisparse is None) == (bool(extra), bool(extra))
    if not extra:
        assert cfg.hisparse.device_buffer_size == args.hot and cfg.speculative == "auto"


def test_run_round_sends_every_prompt_once_with_n_clients():
    sent: list[int] = []
    active = {"now": 0, "most": 0}

    async def send(prompt: list[int], max_tokens: int) -> Record:
        active["now"] += 1
        active["most"] = max(active["most"], active["now"])
        record = Record()
        for token in prompt[:max_tokens]:
            await anyio.sleep(0)
            record.chunk(str(token))
            record.num_tokens += 1
        sent.append(prompt[0])
        active["now"] -= 1
        return record

    prompts = [[i, i, i] for i in range(7)]
    seconds, records = anyio.run(run_round, send, prompts, 3, 2)
    assert sorted(sent) == list(range(7)) and active["most"] == 3
    assert ["".join(r.text) for r in records] == [f"{i}{i}" for i in range(7)]
    figures = summary(seconds, records)
    assert figures["tokens_per_s"] == pytest.approx(14 / seconds)
    assert figures["requests_per_s"] == pytest.approx(7 / seconds)
    assert figures["ttft_p50_s"] <= figures["ttft_p99_s"] and figures["itl_p50_s"] <= figures["itl_p99_s"]
