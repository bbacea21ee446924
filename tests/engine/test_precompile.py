"""``python -m pipeline.precompile`` (run by ``make venv``): the CPU loops a step takes are compiled
(or loaded from numba's cache) by it, so that no first request waits for them."""

from __future__ import annotations

import subprocess
import sys

from pipeline.precompile import main

# what a fresh process holds after the float64 warm-up: the loops of a CPU decode, verify and
# prefill step, HiSparse and all-resident (the swap-in's is compiled into the attention's)
PROBE = """
import sys
from pipeline.precompile import main
from kernels import hisparse_attend_numba as ha, indexer_topk_numba, layer_numba, moe_numba
from kernels import small_ops_numba, sparse_mla_numba
assert main(["--dtypes", "float64"]) == 0
loops = {
    "attend": ha._attend, "attend_resident": ha._attend_resident, "project": layer_numba._project,
    "finish": layer_numba._finish, "experts": moe_numba._kernel, "rms_norm": small_ops_numba._rms_norm,
    "indexer": indexer_topk_numba._kernel, "sparse_mla": sparse_mla_numba._kernel,
}
missing = [n for n, f in loops.items() if not any("float64" in str(s) for s in f.signatures)]
print("missing:", missing)
sys.exit(1 if missing else 0)
"""


def test_the_warm_up_compiles_every_loop_of_a_cpu_step():
    run = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (
        "missing: []" in run.stdout and "precompile: the CPU loops for float64 are compiled (" in run.stdout
    )


def test_a_dtype_without_loops_is_one_line_and_exit_2(capsys):
    assert main(["--dtypes", "float64,bfloat16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--dtypes: bfloat16 has no compiled loops" in err
