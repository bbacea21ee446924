"""``hispec bench profile``: a cProfile of plain HiSparse decoding through the synchronous driver.

Builds one executor on the model (HiSparse on, no speculation), warms it up, then generates
``--new-tokens`` tokens for ``--batch`` prompts of ``--prompt-len`` bytes under cProfile, and prints
the wall time, tokens/s, a digest of the output tokens (equal digests: the same tokens) and the
functions ranked by ``--sort``. ``--out`` keeps the raw profile for ``pstats``/snakeviz.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import pstats
import time

import torch

from pipeline import cli_config
from pipeline.config import HiSparseConfig
from pipeline.logs import configure_logging
from pipeline.sampling import SamplingParams


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hispec bench profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="'tiny' (bundled) or an HF-format directory")
    parser.add_argument("--batch", type=int, default=32, help="prompts decoded together")
    parser.add_argument("--prompt-len", type=int, default=64, help="bytes per prompt")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--max-context-len", type=int, default=512)
    parser.add_argument("--device-buffer-size", type=int, default=64, help="HOT")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0 = torch's default)")
    parser.add_argument("--sort", default="tottime", help="pstats sort key (tottime, cumulative, ...)")
    parser.add_argument("--top", type=int, default=30, help="functions printed")
    parser.add_argument("--out", default=None, help="write the raw profile here")
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    from pipeline.driver import SyncDriver
    from pipeline.executor import Executor

    sink = configure_logging(level="warning", stream=io.StringIO())
    hisparse = HiSparseConfig(device_buffer_size=args.device_buffer_size)
    config = cli_config.engine_config(args, hisparse=hisparse, speculative=None)
    executor = Executor(config)
    prompts = [[(i * 7 + j * 13) % 250 + 1 for j in range(args.prompt_len)] for i in range(args.batch)]
    SyncDriver(executor).generate(prompts[:1], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    driver = SyncDriver(executor)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    requests = driver.generate(prompts, params)
    profile.disable()
    elapsed = time.perf_counter() - start
    executor.close()
    sink.close()
    digest = hashlib.sha256(repr([r.output_ids for r in requests]).encode()).hexdigest()[:12]
    tokens = sum(len(r.output_ids) for r in requests)
    print(f"batch {args.batch}: {elapsed:.2f} s, {tokens / elapsed:.1f} tokens/s, output digest {digest}")
    stats = pstats.Stats(profile)
    if args.out:
        stats.dump_stats(args.out)
    stats.sort_stats(args.sort).print_stats(args.top)
    return 0
