"""Shared pieces of the benchmarks: held-out prompts, timed runs, tables and JSON output."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch

from pipeline import cli_config
from pipeline.config import EngineConfig, HiSparseConfig, SpeculativeConfig
from pipeline.logs import configure_logging
from pipeline.model.corpus import build_corpus


def add_common_args(parser: argparse.ArgumentParser, out: str) -> None:
    parser.add_argument("--model", default="tiny", help="'tiny' (bundled) or an HF-format directory")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (0 = torch's default; 1 by default: two busy threads on "
                        "a shared small machine run far slower)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating repeats; the median is reported")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=out, help="JSON results")
    parser.add_argument("-v", "--verbose", action="store_true", help="print an error's traceback too")


def setup(threads: int) -> int:
    """Quiet logging (warnings only) and the torch thread count; returns the threads in use."""
    configure_logging(level="warning")
    if threads > 0:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def held_out_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    """``count`` windows of ``length`` tokens from held-out files (never seen in training).

    Windows start at a line start so that a prompt reads like the beginning of real code or prose.
    """
    stream = build_corpus().held_out
    gen = torch.Generator().manual_seed(seed)
    newline_starts = torch.nonzero(stream[: len(stream) - length - 1] == 10).reshape(-1) + 1
    picks = newline_starts[torch.randperm(len(newline_starts), generator=gen)[:count]]
    return [stream[int(s) : int(s) + length].tolist() for s in picks]


class Timer:
    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start


def measured(seconds: float | None) -> float:
    """A timing every finished request has (its first and last token times, its time to first token)."""
    if seconds is None:
        raise ValueError("a finished request lacks a timing")
    return seconds


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) as the nearest value of ``values`` (NaN for none)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "processor": platform.machine(),
        "cuda": torch.cuda.is_available(),
    }


def write_json(path: str, payload: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(payload, indent=2) + "\n")


def table(headers: list[str], rows: list[list[object]]) -> str:
    """A small markdown table."""

    def cell(v: object) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def batch_config(
    args: argparse.Namespace, *, requests: int, prompt_len: int, hisparse: bool, num_steps: int | None
) -> EngineConfig:
    """The engine configuration of a batch benchmark: pages of 16, room for ``requests`` requests of
    ``prompt_len + args.new_tokens`` tokens, HOT ``args.hot`` (``hisparse``), ``num_steps`` draft
    steps (None: plain decoding)."""
    page = 16
    context = prompt_len + args.new_tokens + page
    per_request = -(-(context + 2 * page) // page) * page
    return cli_config.engine_config(
        args,
        page_size=page,
        max_context_len=context,
        max_running_requests=requests,
        device_pool_tokens=max(per_request * requests, args.hot + page),
        hisparse=HiSparseConfig(device_buffer_size=args.hot) if hisparse else None,
        speculative=SpeculativeConfig(num_steps=num_steps) if num_steps else None,
        tensor_parallel_size=1,  # (``bench tp``'s --tp lists the sizes it runs; each run sets its own)
    )


async def completion_chunks(client: Any, prompt: list[int], max_tokens: int) -> AsyncIterator[dict[str, Any]]:
    """The chunks of one greedy, streamed ``/v1/completions`` request of ``max_tokens`` tokens
    (usage included), parsed; a chunk the server sent as an error raises."""
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"the server failed a request: {chunk['error']['message']}")
            yield chunk
