"""Compile the CPU's loops once per install: ``python -m pipeline.precompile``.

The loops of ``kernels/*_numba.py`` are compiled at their first call for each argument type and kept
in numba's on-disk cache (``cache=True``: the ``__pycache__`` beside each module). A fresh install
has no cache, so its first float32 request and its first float64 request would each wait about half
a minute while they compile. ``make venv`` (and so ``make run`` and ``make test``) runs this once
after installing: a few tokens of the bundled model in both dtypes, with HiSparse and speculation
and all-resident, which compiles every loop a CPU step takes. Later processes load the compiled
code from the cache; an edited module is compiled again at its next call (numba checks the source's
time stamp). Without numba there is nothing to compile and this says so.
"""

from __future__ import annotations

import argparse
import io
import sys
import time

import anyio

DTYPES = ("float32", "float64")
PROMPT = "def push(self, item):\n    self.items"


async def _warm(dtype: str) -> None:
    from pipeline import Engine, EngineConfig, SamplingParams

    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    for memory in ({}, {"hisparse": None}):  # HiSparse with speculation (the default), all-resident
        async with Engine(EngineConfig(model="tiny", dtype=dtype, **memory)) as engine:  # type: ignore[arg-type]
            await engine.generate_text(PROMPT, params)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.precompile", description=__doc__.split("\n")[0])
    p.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated (default: float32,float64)")
    args = p.parse_args(argv)
    dtypes = [d for d in args.dtypes.split(",") if d]
    unknown = sorted(set(dtypes) - set(DTYPES))
    if unknown:
        print(
            f"precompile: --dtypes: {', '.join(unknown)} has no compiled loops ({', '.join(DTYPES)} do)",
            file=sys.stderr,
        )
        return 2
    try:
        import numba  # noqa: F401
    except ImportError:
        print("precompile: numba is not installed, so there are no CPU loops to compile")
        return 0
    from pipeline.logs import configure_logging

    sink = configure_logging(level="warning", stream=io.StringIO())
    began = time.perf_counter()
    try:
        for dtype in dtypes:
            anyio.run(_warm, dtype)
    finally:
        sink.close()
    took = time.perf_counter() - began
    print(
        f"precompile: the CPU loops for {', '.join(dtypes)} are compiled ({took:.0f} s; numba's cache, "
        "which later runs load)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
