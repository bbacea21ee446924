"""The tensors of a checkpoint directory, read one at a time, straight from the files.

A directory holds either ``model.safetensors.index.json`` (HF's sharded form: ``weight_map`` names
the shard of every tensor) or plain ``*.safetensors`` files. A safetensors file is

    [u64 little-endian N][N bytes of JSON header: name -> dtype, shape, data_offsets][tensor bytes]

Only the headers are read up front. A tensor's bytes are then read with one positioned read, into
the destination tensor itself when its dtype and layout match (no copy), else into one temporary
the size of that tensor. The files are not memory-mapped on purpose: the pages of a mapped shard
count as resident until the shard is closed, so reading a mapped shard tensor by tensor would cost
the whole shard in resident memory; a positioned read costs the tensor only.

Every problem (missing file, bad header, a tensor outside its file, a shape that does not match) is
a :class:`CheckpointError` naming the file or tensor.
"""

from __future__ import annotations

import io
import json
import struct
from collections.abc import Iterator
from pathlib import Path

import attrs
import torch
from torch import Tensor

from pipeline.model.config import INDEX_FILE, ModelConfigError

_MAX_HEADER = 100 << 20  # bytes; a larger header is not a safetensors file

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
if hasattr(torch, "float8_e8m0fnu"):
    SAFETENSORS_DTYPES["F8_E8M0"] = torch.float8_e8m0fnu


class CheckpointError(ModelConfigError):
    """The weights of a model directory cannot be loaded (missing, unknown, unreadable, wrong shape)."""


@attrs.frozen
class TensorEntry:
    """Where one tensor's bytes are."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


class CheckpointFiles:
    """The tensor table of a checkpoint directory; open files are closed by :meth:`close` (or ``with``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, TensorEntry] = {}
        self._files: dict[Path, io.BufferedReader] = {}
        for file, names in self._shards().items():
            table = read_header(file, self.path)
            for name in names if names is not None else sorted(table):
                if name not in table:
                    raise CheckpointError(
                        f"{INDEX_FILE} puts {name} in {file.name}, which lacks it", str(path)
                    )
                self.entries[name] = table[name]

    def _shards(self) -> dict[Path, list[str] | None]:
        """shard file -> the tensor names the index assigns it (None: every tensor in the file)."""
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError("weight_map is not an object")
            except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{INDEX_FILE} is not readable ({exc!r})", str(self.path)) from None
            shards: dict[Path, list[str] | None] = {}
            for name, file in weight_map.items():
                shard = self.path / str(file)
                if not shard.is_file():
                    raise CheckpointError(f"{INDEX_FILE} names {file}, which does not exist", str(self.path))
                names = shards.setdefault(shard, [])
                assert names is not None
                names.append(name)
            return shards
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError("the directory has no *.safetensors files", str(self.path))
        return dict.fromkeys(files)

    def __enter__(self) -> CheckpointFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def _handle(self, file: Path) -> io.BufferedReader:
        if file not in self._files:
            self._files[file] = open(file, "rb")  # noqa: SIM115 - kept open until close()
        return self._files[file]

    def read(self, name: str) -> Tensor:
        """The tensor as stored (its own dtype and shape), in a fresh CPU tensor."""
        entry = self.entries[name]
        out = torch.empty(entry.shape, dtype=entry.dtype)
        self._read_bytes(entry, out)
        return out

    def read_rows(self, name: str, start: int, stop: int) -> Tensor:
        """Entries ``[start, stop)`` of the tensor's first dimension, read alone (one positioned read
        of their bytes; a tensor-parallel rank reads its shard so)."""
        entry = self.entries[name]
        if not entry.shape or not 0 <= start <= stop <= entry.shape[0]:
            raise CheckpointError(
                f"tensor {name} {list(entry.shape)} has no rows [{start}, {stop})", str(self.path)
            )
        row_bytes = entry.nbytes // entry.shape[0] if entry.shape[0] else 0
        part = attrs.evolve(
            entry,
            shape=(stop - start, *entry.shape[1:]),
            offset=entry.offset + start * row_bytes,
            nbytes=(stop - start) * row_bytes,
        )
        out = torch.empty(part.shape, dtype=entry.dtype)
        self._read_bytes(part, out)
        return out

    def read_into(self, name: str, dest: Tensor) -> None:
        """Copy the tensor into ``dest`` (cast to its dtype); the shapes must be equal."""
        entry = self.entries[name]
        if tuple(dest.shape) != entry.shape:
            raise CheckpointError(
                f"tensor {name} has shape {list(entry.shape)}, the config implies {list(dest.shape)}",
                str(self.path),
            )
        if dest.dtype == entry.dtype and dest.device.type == "cpu" and dest.is_contiguous():
            self._read_bytes(entry, dest)
        else:
            dest.copy_(self.read(name))

    def _read_bytes(self, entry: TensorEntry, out: Tensor) -> None:
        if entry.nbytes == 0:
            return
        f = self._handle(entry.file)
        f.seek(entry.offset)
        view = out.reshape(-1).view(torch.uint8).numpy()  # the tensor's own bytes, writable
        if f.readinto(view.data) != entry.nbytes:
            raise CheckpointError(f"{entry.file.name} ends inside tensor {entry.name}", str(self.path))


def read_header(file: Path, model_dir: Path) -> dict[str, TensorEntry]:
    """A safetensors file's tensor table, checked against the file's size."""

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{file.name} is not a readable safetensors file: {why}", str(model_dir))

    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise bad("shorter than its 8-byte header length")
            (length,) = struct.unpack("<Q", head)
            if length > min(size - 8, _MAX_HEADER):
                raise bad(f"header length {length} does not fit the file")
            header = json.loads(f.read(length))
    except OSError as exc:
        raise bad(repr(exc)) from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise bad(f"header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    base = 8 + length
    table: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = SAFETENSORS_DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor {name} has an unknown dtype or a malformed entry {info!r}") from None
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        if end - begin != nbytes or begin < 0 or base + end > size:
            raise bad(f"tensor {name} ({info['dtype']} {list(shape)}) does not fit its byte range")
        table[name] = TensorEntry(name, file, dtype, shape, base + begin, nbytes)
    return table
