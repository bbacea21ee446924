"""Small helpers shared by the Triton kernel modules (imported only where triton is)."""

from __future__ import annotations

import torch
import triton.language as tl

from kernels.checks import interpreting

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def dot_dtype(*tensors: torch.Tensor) -> tl.dtype:
    """Operand dtype for ``tl.dot`` (accumulation is always float32).

    float32 (with IEEE precision) for float32 or mixed inputs, and always under the interpreter, which
    multiplies bfloat16 bit patterns; the inputs' half dtype on a GPU, so the dots use tensor cores.
    """
    dtypes = {t.dtype for t in tensors}
    if interpreting() or len(dtypes) != 1 or torch.float32 in dtypes:
        return tl.float32
    return _TL_DTYPES[dtypes.pop()]
