"""hispec's hot-path ops.

Each op lives in one file: a plain torch reference and a dispatching wrapper that checks shapes,
dtypes and strides before launch; its Triton kernel sits beside it in ``<op>_triton.py`` and is
imported only when a call resolves to Triton (``triton`` is an optional dependency). Kernels take
tensors only, never request objects, and this package imports nothing from ``pipeline``.

Dispatch: every op takes ``impl="auto" | "torch" | "triton"``; ``auto`` is Triton when the tensors
are on CUDA (and the shapes fit the kernel's limits), the torch reference otherwise; swap-in also
has ``"numba"``: on a CPU ``auto`` runs the compiled numba loops. The indexer also has ``"numba"``:
on a CPU ``auto`` sends decode and verify queries there and prefill to the torch matmuls.
"""

import torch

from kernels.indexer_topk import (
    indexer_topk,
    indexer_topk_oracle,
    indexer_topk_reference,
    score_dtype,
    stable_topk_positions,
    topk_positions,
)
from kernels.kv_copy import backup_rows, copy_rows, copy_rows_reference, load_rows, move_rows, scatter_rows
from kernels.selection import AttentionShapes, KernelChoice, log_selected, select_kernels
from kernels.sparse_mla import sparse_mla, sparse_mla_reference
from kernels.swap_in import SwapInResult, swap_in
from kernels.swap_in_oracle import swap_in_oracle
from kernels.swap_in_reference import swap_in_reference


def warm_up(
    device: torch.device, dtype: torch.dtype, *, index_heads: int, index_dim: int, swap_in: bool,
    attention: tuple[int, int, int] | None = None,
) -> None:
    """On a CPU, compile (or load from numba's disk cache) the compiled loops a run will call: the decode
    indexer when ``impl="auto"`` gives it an indexer of ``index_heads`` x ``index_dim`` in ``dtype``
    (``indexer_topk_numba.pays_for``), the sparse attention when it gives it queries of ``attention`` =
    (heads, C + R, top-k) (``sparse_mla_numba.pays_for``), the one-call decode attention when both do
    (``hisparse_attend_numba``), the norms and rotations (``small_ops_numba``), a few tokens' experts
    (``moe_numba``) and layers (``layer_numba``), and the swap-in when the run has one (HiSparse). The
    executor calls it when it starts, so that the first decode step does not pay for the compilation.
    Elsewhere, nothing."""
    if torch.device(device).type != "cpu":
        return
    from kernels import (
        hisparse_attend_numba,
        indexer_topk_numba,
        kv_copy_numba,
        layer_numba,
        moe_numba,
        small_ops_numba,
        sparse_mla_numba,
        swap_in_numba,
    )

    small_ops_numba.warm_up(dtype)  # every layer's norms and rotations
    moe_numba.warm_up(dtype)  # a few tokens' experts (a model without experts never calls it)
    layer_numba.warm_up(dtype)  # a few tokens' projections and MLP (``pipeline.model.fused``)
    indexer = indexer_topk_numba.pays_for(index_heads, index_dim)
    if indexer:
        indexer_topk_numba.warm_up(dtype)
    if attention is not None and sparse_mla_numba.pays_for(*attention):
        sparse_mla_numba.warm_up(dtype)
        if indexer:  # decode, verify and draft layers then take the one call
            hisparse_attend_numba.warm_up(dtype)
    if swap_in:
        swap_in_numba.warm_up()
        kv_copy_numba.warm_up()  # its misses' row copies, and the backups


__all__ = [
    "AttentionShapes",
    "KernelChoice",
    "SwapInResult",
    "backup_rows",
    "copy_rows",
    "copy_rows_reference",
    "indexer_topk",
    "indexer_topk_oracle",
    "indexer_topk_reference",
    "load_rows",
    "log_selected",
    "move_rows",
    "scatter_rows",
    "score_dtype",
    "select_kernels",
    "sparse_mla",
    "sparse_mla_reference",
    "stable_topk_positions",
    "swap_in",
    "swap_in_oracle",
    "swap_in_reference",
    "topk_positions",
    "warm_up",
]
