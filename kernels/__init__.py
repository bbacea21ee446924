"""hispec's hot-path ops.

Each op lives in one file: the Triton kernel, a plain torch reference beside it, and a wrapper that
checks shapes, dtypes and strides before launch. Kernels take tensors only, never request objects,
and this package imports nothing from ``pipeline``.
"""
