"""The FP8 KV cache: DeepSeek-V3.2's row layouts, quantized as rows are written and read back inside
sparse attention and the indexer.

A pool in this format is a ``uint8`` tensor whose last dimension is one row's bytes:

* an MLA row of ``C`` latent and ``R`` rope values (``kv_lora_rank`` 512 and ``qk_rope_head_dim``
  64 in V3.2) is ``[C e4m3 values | one float32 scale per tile of 128 latent values | R bfloat16
  rope values]``: 512 + 4 * 4 + 2 * 64 = 656 bytes;
* an indexer key of ``Di`` values (128) is ``[Di e4m3 values | one float32 scale]``: 132 bytes.

A tile's scale is its largest magnitude over e4m3's largest finite value (448), so the tile's
largest value lands on 448 and nothing is clipped; an all-zero tile has scale 1. The rope part is
kept in bfloat16 because its small values carry the position (as V3.2's own cache does). A value
is read back as ``e4m3 * scale`` in float32 and then the compute dtype; the same stored bytes always
give the same values, so every reader of a row (resident, the HiSparse buffer, the host copy, the
prefix cache) sees exactly the same numbers.

``KVCacheFormat`` says how a model's pools are stored ("auto": the run dtype, unquantized);
``store_rows`` / ``store_keys`` write into a pool as its format says; the kernels recognise a
``uint8`` pool and read it through ``dequantize_rows`` / ``dequantize_keys``.
"""

from __future__ import annotations

import math

import attrs
import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # e4m3's largest finite value
TILE = 128  # latent values per scale
STORAGE = torch.uint8  # the dtype of a pool in this format
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8")  # "fp8": e4m3, as vLLM and SGLang read it


def row_bytes(latent: int, rope: int) -> int:
    """Bytes of one FP8 MLA row of ``latent`` + ``rope`` values."""
    return latent + 4 * math.ceil(latent / TILE) + 2 * rope


def key_bytes(dim: int) -> int:
    """Bytes of one FP8 indexer key of ``dim`` values."""
    return dim + 4


def _quantize(values: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``values [N, D]`` -> (e4m3 bytes ``[N, D]``, float32 scales ``[N, ceil(D / width)]``), one
    scale per ``width`` consecutive values (the last tile may be shorter)."""
    n, d = values.shape
    tiles = math.ceil(d / width)
    padded = torch.nn.functional.pad(values.to(torch.float32), (0, tiles * width - d)).view(n, tiles, width)
    amax = padded.abs().amax(dim=-1)  # [N, tiles]
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (padded / scale[..., None]).clamp_(-E4M3_MAX, E4M3_MAX).view(n, tiles * width)[:, :d]
    return q.to(E4M3).view(STORAGE), scale


def _scales(raw: torch.Tensor) -> torch.Tensor:
    """float32 values from their bytes ``[..., 4 * n]`` (a copy: the bytes need not be aligned)."""
    return raw.contiguous().view(torch.float32)


def _dequantize(q: torch.Tensor, scale: torch.Tensor, width: int) -> torch.Tensor:
    """e4m3 bytes ``[..., D]`` and their scales ``[..., ceil(D / width)]`` -> float32 ``[..., D]``."""
    values = q.contiguous().view(E4M3).to(torch.float32)
    per_value = scale.repeat_interleave(width, dim=-1)[..., : q.shape[-1]]
    return values * per_value


def quantize_rows(rows: torch.Tensor, latent: int) -> torch.Tensor:
    """MLA rows ``[N, latent + rope]`` (any float dtype) -> their FP8 bytes ``[N, row_bytes]``."""
    q, scale = _quantize(rows[:, :latent], TILE)
    rope = rows[:, latent:].to(torch.bfloat16).contiguous().view(STORAGE)
    return torch.cat([q, scale.view(STORAGE), rope], dim=-1)


def dequantize_rows(stored: torch.Tensor, latent: int, dtype: torch.dtype) -> torch.Tensor:
    """FP8 MLA rows ``[..., row_bytes]`` -> ``[..., latent + rope]`` in ``dtype``."""
    tiles = math.ceil(latent / TILE)
    cut = latent + 4 * tiles
    values = _dequantize(stored[..., :latent], _scales(stored[..., latent:cut]), TILE)
    rope = stored[..., cut:].contiguous().view(torch.bfloat16)
    return torch.cat([values.to(dtype), rope.to(dtype)], dim=-1)


def quantize_keys(keys: torch.Tensor) -> torch.Tensor:
    """Indexer keys ``[N, Di]`` -> their FP8 bytes ``[N, Di + 4]``."""
    q, scale = _quantize(keys, keys.shape[-1])
    return torch.cat([q, scale.view(STORAGE)], dim=-1)


def dequantize_keys(stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 indexer keys ``[..., Di + 4]`` -> ``[..., Di]`` in ``dtype``."""
    dim = stored.shape[-1] - 4
    return _dequantize(stored[..., :dim], _scales(stored[..., dim:]), dim).to(dtype)


@attrs.frozen
class KVCacheFormat:
    """How one model's MLA rows and indexer keys are stored: in the run dtype (``"auto"``) or in
    the FP8 layouts above (``"fp8_e4m3"``). Pools are allocated ``[..., row_width]`` /
    ``[..., key_width]`` of ``storage_dtype``; rows and keys go in through ``write_rows`` /
    ``write_keys``."""

    latent: int  # C
    rope: int  # R
    index_dim: int  # Di
    dtype: torch.dtype  # the run dtype: what rows are computed in and read back as
    kind: str = "auto"

    def __attrs_post_init__(self) -> None:
        if self.kind not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kind!r}")

    @property
    def quantized(self) -> bool:
        return self.kind != "auto"

    @property
    def storage_dtype(self) -> torch.dtype:
        return STORAGE if self.quantized else self.dtype

    @property
    def row_width(self) -> int:
        """Elements of ``storage_dtype`` per MLA row."""
        return row_bytes(self.latent, self.rope) if self.quantized else self.latent + self.rope

    @property
    def key_width(self) -> int:
        """Elements of ``storage_dtype`` per indexer key."""
        return key_bytes(self.index_dim) if self.quantized else self.index_dim

    @property
    def row_bytes(self) -> int:
        return self.row_width * self._element

    @property
    def key_bytes(self) -> int:
        return self.key_width * self._element

    @property
    def _element(self) -> int:
        return torch.empty((), dtype=self.storage_dtype).element_size()

    def encode_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """MLA rows ``[N, C + R]`` as stored."""
        return quantize_rows(rows, self.latent) if self.quantized else rows.to(self.dtype)

    def encode_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """Indexer keys ``[N, Di]`` as stored."""
        return quantize_keys(keys) if self.quantized else keys.to(self.dtype)


def store_rows(
    fmt: KVCacheFormat | None, pool: torch.Tensor, where: torch.Tensor, rows: torch.Tensor
) -> None:
    """``pool[where] = rows`` as ``fmt`` stores them (``pool``: one layer's ``[slots, row_width]``;
    ``fmt`` None: an unquantized pool)."""
    if _quantized(fmt, pool):
        assert fmt is not None
        rows = quantize_rows(rows, fmt.latent)
    pool[where.to(pool.device)] = rows.to(pool.device, pool.dtype)


def store_keys(
    fmt: KVCacheFormat | None, pool: torch.Tensor, where: torch.Tensor, keys: torch.Tensor
) -> None:
    """``pool[where] = keys`` as ``fmt`` stores them (``pool``: one layer's ``[slots, key_width]``)."""
    if _quantized(fmt, pool):
        keys = quantize_keys(keys)
    pool[where.to(pool.device)] = keys.to(pool.device, pool.dtype)


def _quantized(fmt: KVCacheFormat | None, pool: torch.Tensor) -> bool:
    """Whether ``pool`` holds FP8 bytes; a pool that does not match ``fmt`` is refused (casting
    values to bytes would store garbage silently)."""
    quantized = fmt is not None and fmt.quantized
    if quantized != (pool.dtype == STORAGE):
        raise TypeError(f"a {pool.dtype} pool does not hold KV cache format {fmt}")
    return quantized
