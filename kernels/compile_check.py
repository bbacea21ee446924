"""Compile every Triton kernel for a CUDA architecture without a GPU, and report its resources.

The interpreter checks what a kernel computes but not whether it compiles for a GPU (tile shapes
``tl.dot`` accepts, types, register pressure). Triton's wheel carries ``ptxas``, so the full
pipeline (Triton IR -> PTX -> cubin) runs on any machine; ``cuobjdump -res-usage`` then reads the
registers and the stack (spill) bytes from the cubin. Run it in a process where ``TRITON_INTERPRET``
is unset (``python -m kernels.compile_check [--arch 90] [--quick]``); it never launches anything.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

P = "*"  # pointer prefix in Triton signatures

_SWAP_IN = dict(
    pos_ptr="*i32",
    seq_ptr="*i64",
    rows_ptr="*i64",
    tok_ptr="*i32",
    loc_ptr="*i64",
    lru_ptr="*i32",
    host_ptr="*i64",
    s32_ptr="*i32",
    s64_ptr="*i64",
    slot_ptr="*i32",
    src_ptr="*i64",
    dst_ptr="*i64",
    count_ptr="*i32",
    near_ptr="*i32",
    S="i32",
    K="i32",
    HOT="i32",
    W="i32",
    M="i32",
    seq_stride_b="i32",
    tok_stride="i32",
    loc_stride="i32",
    lru_stride="i32",
    host_stride="i32",
)
_SELECT = dict(score_ptr="*fp32", lens_ptr="*i64", out_ptr="*i32", max_len="i32", top_k="i32")


def _scores(dt: str) -> dict:
    return dict(
        q_ptr=P + dt,
        w_ptr=P + dt,
        k_ptr=P + dt,
        r2t_ptr="*i64",
        rows_ptr="*i64",
        lens_ptr="*i64",
        out_ptr="*fp32",
        H="i32",
        D="i32",
        max_len="i32",
        scale="fp32",
        q_stride_t="i32",
        q_stride_h="i32",
        w_stride_t="i32",
        k_stride="i32",
        r2t_stride="i32",
    )


def _mla(dt: str) -> dict:
    return dict(
        ql_ptr=P + dt,
        qr_ptr=P + dt,
        kv_ptr=P + dt,
        slot_ptr="*i32",
        out_ptr=P + dt,
        H="i32",
        K="i32",
        C="i32",
        R="i32",
        scale="fp32",
        ql_stride_t="i32",
        ql_stride_h="i32",
        qr_stride_t="i32",
        qr_stride_h="i32",
        kv_stride="i32",
        slot_stride_t="i32",
        out_stride_t="i32",
        out_stride_h="i32",
    )


def _copy(dt: str) -> dict:
    return dict(
        dst_ptr=P + dt,
        dst_idx_ptr="*i64",
        src_ptr=P + dt,
        src_idx_ptr="*i64",
        n="i32",
        dst_stride_l="i64",
        dst_stride_r="i32",
        src_stride_l="i64",
        src_stride_r="i32",
    )


def _swap_in(tile_k: int, tile_h: int, tile_x: int, tile_m: int, *, policy: int, warps: int) -> tuple:
    """A swap-in launch: top-k, hot, newest/draft and near tiles, the policy's code."""
    consts = dict(TK=tile_k, TH=tile_h, TX=tile_x, TM=tile_m, POLICY=policy)
    return ("swap_in_triton", "_swap_in_kernel", _SWAP_IN, consts, warps)


def configs(quick: bool) -> list[tuple[str, str, dict, dict, int]]:
    """(module, kernel, argument types, constexprs, num_warps): the launches the wrappers make."""
    import triton.language as tl

    bf16 = tl.bfloat16
    small = [
        _swap_in(64, 128, 8, 1, policy=0, warps=8),
        # a policy other than LRU (kernels.swap_in_policy: 3 = adaptive, slide's path and more; 5 =
        # near-adaptive, which compares the hot columns with the step's near row too) takes the
        # key-search path
        _swap_in(64, 128, 8, 1, policy=3, warps=8),
        _swap_in(64, 128, 8, 64, policy=5, warps=8),
        ("indexer_topk_triton", "_select_kernel", _SELECT, dict(NONE_KEY=-(2**31), BLOCK_K=64), 4),
        (
            "indexer_topk_triton",
            "_scores_kernel",
            _scores("bf16"),
            dict(BLOCK_H=16, BLOCK_D=64, BLOCK_S=64, DOT_DTYPE=bf16),
            4,
        ),
        (
            "sparse_mla_triton",
            "_sparse_mla_kernel",
            _mla("bf16"),
            dict(BLOCK_H=16, BLOCK_N=64, BLOCK_C=64, BLOCK_R=16, DOT_DTYPE=bf16),
            8,
        ),
        ("kv_copy_triton", "_copy_rows_kernel", _copy("bf16"), dict(DIM=576, BLOCK_R=8, BLOCK_D=256), 4),
    ]
    if quick:
        return small
    return [
        *small,
        # the tiles of every size from top-k 64 / HOT 128 up (``swap_in_triton.TILE_*``)
        _swap_in(64, 128, 64, 1, policy=0, warps=8),
        _swap_in(64, 128, 64, 1, policy=2, warps=8),
        _swap_in(64, 128, 64, 64, policy=5, warps=8),
        ("indexer_topk_triton", "_select_kernel", _SELECT, dict(NONE_KEY=-(2**31), BLOCK_K=2048), 4),
        (
            "indexer_topk_triton",
            "_scores_kernel",
            _scores("bf16"),
            dict(BLOCK_H=64, BLOCK_D=128, BLOCK_S=64, DOT_DTYPE=bf16),
            4,
        ),
        (
            "indexer_topk_triton",
            "_scores_kernel",
            _scores("fp32"),
            dict(BLOCK_H=64, BLOCK_D=128, BLOCK_S=64, DOT_DTYPE=tl.float32),
            4,
        ),
        (
            "sparse_mla_triton",
            "_sparse_mla_kernel",
            _mla("bf16"),
            dict(BLOCK_H=16, BLOCK_N=32, BLOCK_C=512, BLOCK_R=64, DOT_DTYPE=bf16),
            8,
        ),
        (
            "sparse_mla_triton",
            "_sparse_mla_kernel",
            _mla("fp32"),
            dict(BLOCK_H=16, BLOCK_N=32, BLOCK_C=512, BLOCK_R=64, DOT_DTYPE=tl.float32),
            8,
        ),
    ]


def compile_one(fn, types: dict, consts: dict, arch: int, num_warps: int):
    """Compile one JIT function; every runtime argument must have a type in ``types``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    missing = [p.name for p in fn.params if not p.is_constexpr and p.name not in types]
    if missing:
        raise ValueError(f"{fn.__name__}: no type for {missing}")
    signature = {p.name: "constexpr" if p.is_constexpr else types[p.name] for p in fn.params}
    constexprs = {(i,): consts[p.name] for i, p in enumerate(fn.params) if p.is_constexpr}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps))


def resources(kernel) -> str:
    """``REG:.. STACK:..`` of the cubin, read with the wheel's cuobjdump."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return f"registers {found.group(1)}, stack {found.group(2)} B" if found else "resources unknown"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kernels.compile_check", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10 (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="small tiles only (seconds, for the tests)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter replaces the kernels", file=sys.stderr)
        return 2
    import importlib

    for module, name, types, consts, warps in configs(args.quick):
        fn = getattr(importlib.import_module(f"kernels.{module}"), name)
        kernel = compile_one(fn, types, consts, args.arch, warps)
        shown = {k: (v if isinstance(v, int) else str(v)) for k, v in consts.items()}
        print(f"{name:20s} {shown} warps={warps}: {resources(kernel)}, shared {kernel.metadata.shared} B")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
