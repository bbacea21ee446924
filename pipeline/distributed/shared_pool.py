"""One HiSparse host pool per node, shared by the node's tensor-parallel ranks.

MLA's latent KV is the same on every rank, so the host pool's rows (``HostPool.kv``, the one
structure HiSparse makes large on purpose) need not be held once per rank. The ranks of a node map
one shared-memory segment instead::

    segment (a file under /dev/shm, unlinked once every rank of the node has mapped it)
    ┌──────────────────────────────┬──────────────────────────────────────────────────────┐
    │ header: one record a stream  │ kv [num_layers, host_tokens, row_dim]                │
    │ [settled, closed, num_failed,│ written by the leader's copies only, read by every   │
    │  failed copy numbers...]     │ rank's swap-in, loads and integrity checks           │
    └──────────────────────────────┴──────────────────────────────────────────────────────┘

The node's leader (``local_rank`` 0) creates the segment and names it under a key of the group's
store; the other ranks (followers) map it. A follower waits for the name as long as the ranks'
start may take (the leader creates the segment once its own shard has loaded); a leader that cannot
start names the reason instead, and its followers fail with it at once. Each rank keeps its own
allocator and ``req_to_host`` map: every rank makes the same decisions from the same commands, so
their slots agree (the integrity check compares the ranks' maps).

Written once. Every rank issues the same copies to the host pool in the same order, on the same
streams (staging, backup). The leader makes them; a follower skips its own and numbers it instead.
A leader thread per stream waits for the stream's copies in issue order (copies on one stream
complete in that order) and publishes the number of the last one settled, and the numbers of
those that failed, in the stream's header record. A follower's handle for copy ``n`` is landed
once ``settled >= n``, and fails as the leader's copy ``n`` failed, so the follower fails (or redoes)
exactly what the leader does, and issues the same redone copies, keeping the numbering in step.
A follower that waits for a copy polls the record, each wait bounded by the group's timeout: a
leader that is gone (the record says closed, or nothing settles in time) fails the wait, and the
engine stops as it does when a rank is lost (``WorkerLost``).

Out of step. The record also keeps, for the newest copies issued, which rows each wrote (their
count and first slot); a follower's copy whose rows differ from the leader's copy of the same
number fails as a lost leader does (``HostPoolLost``), never reads rows it did not ask for. That
can happen only after a failed copy: a backup redone row by row is redone when each rank finds it
failed, which a follower may find later than the leader (after issuing later copies). The follower
then fails rows the leader does not, the ranks' outcomes differ, and the engine stops
(``RanksDiverged``), as it does today when a copy fails on one rank only.

Memory order. A record's words are stored after the rows they vouch for, and a follower reads the
words before the rows: that a follower which sees ``settled >= n`` also sees copy ``n``'s rows rests
on the CPU making one core's stores visible to the others in order (x86's total store order). A
weakly ordered CPU (Arm) would need a release fence before each publish and an acquire after each
read; hispec has not been run on one.

On CUDA the segment is registered with the device (``cudaHostRegister``), so it is pinned memory
the row-copy kernel addresses directly, as a rank's own pinned pool is.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import queue
import threading
import time
import uuid
import weakref
import zlib
from collections.abc import Callable

import numpy as np
import structlog
import torch

from pipeline.config import EngineConfig
from pipeline.distributed.group import START_TIMEOUT_S, TensorGroup
from pipeline.errors import ConfigError
from pipeline.hisparse.transfer import DoneHandle, FailedHandle, TransferHandle, TransferStream

log = structlog.get_logger(__name__)

SEGMENT_DIR = "/dev/shm"
SEGMENT_PREFIX = "hispec-host-pool-"
STREAMS = ("staging", "backup")  # the coordinator's streams that write the host pool
_SETTLED, _CLOSED, _NUM_FAILED, _FAILED = 0, 1, 2, 3  # a record's words; failed numbers from _FAILED on
_FAILED_KEPT = 61  # the newest failed copy numbers a record keeps
_ISSUED = _FAILED + _FAILED_KEPT  # then (number, fingerprint) of the newest _ISSUED_KEPT copies issued
_ISSUED_KEPT = 256
_RECORD_WORDS = _ISSUED + 2 * _ISSUED_KEPT  # int64 words of a stream's record
_HEADER_BYTES = 16384  # the records, padded: the rows start page-aligned
_POLL_S = (0.00002, 0.001)  # a follower's wait polls the record: the first pause, the longest


class LeaderCopyFailed(RuntimeError):
    """The leader's copy of rows this rank would have written failed (the leader reports why)."""


class HostPoolLost(RuntimeError):
    """The node's leader stopped publishing its copies: it closed, died or hung past the timeout."""


def shares_host_pool(config: EngineConfig, group: TensorGroup) -> bool:
    """Whether the ranks of ``group``'s node share one host pool: asked for, HiSparse on, and more
    than one rank on this node."""
    return config.shared_host_pool and config.hisparse is not None and group.local_size > 1


class SharedHostPool:
    """This rank's view of its node's shared host pool (``pipeline.memory.host_pool.HostRows``): the
    rows, mapped, and the streams that write them once per node."""

    def __init__(self, group: TensorGroup, *, key: str = "hispec.host_pool") -> None:
        self.group = group
        self._key = f"{key}.node{group.node}"
        self.is_leader = group.local_rank == 0
        self.path: str | None = None
        self.nbytes = 0  # of the rows (the segment is a header larger)
        self._header: np.ndarray | None = None  # [len(STREAMS), _RECORD_WORDS] int64, shared
        self.kv: torch.Tensor | None = None
        self._unlink: weakref.finalize | None = None
        self._unregister: Callable[[], None] | None = None  # CUDA: undo the registration, once
        self._open_streams = 0  # the last to close ends the registration
        self._leading: list[LeaderStream] = []  # the leader's streams: their publishers end with the pool
        self._published = False  # the leader has named the segment, or said why there is none

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, *, pinned: bool) -> torch.Tensor:
        """The host rows ``shape`` of ``dtype``, zeros, mapped from the node's segment (the leader
        creates it; the others wait for its name in the store, as long as the ranks' start may take:
        the leader may still be loading its shard)."""
        assert self.kv is None, "a shared host pool holds one tensor"
        self.nbytes = _numel(shape) * dtype.itemsize
        size = _HEADER_BYTES + self.nbytes
        if self.is_leader:
            path = os.path.join(SEGMENT_DIR, f"{SEGMENT_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
            self._unlink = weakref.finalize(self, _unlink_quietly, path)
            try:
                _reserve(path, size)
                segment = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)  # zeros
            except Exception as exc:  # the followers wait for the name: they get the reason instead
                self.abandon(str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}")
                raise
            self._publish(path)
        else:
            path = self._leaders_path()
            self._unlink = weakref.finalize(self, _unlink_quietly, path)
            segment = _map_existing(path, size)
        self.path = path
        # the last rank of the node to map it removes the name: from then on no crash leaves it behind
        if self.group.store.add(f"{self._key}.attached", 1) == self.group.local_size:
            self._unlink()
        if pinned:  # pragma: no cover - needs a GPU
            self._unregister = _register(segment)
        # the records as a numpy view of the same memory: a word read or written there costs a
        # tenth of a torch scalar index, and followers poll them on the decode path
        header = segment[: len(STREAMS) * _RECORD_WORDS * 8].view(torch.int64).view(len(STREAMS), -1)
        self._header = header.numpy()
        self.kv = segment[_HEADER_BYTES:].view(dtype).view(shape)
        return self.kv

    def abandon(self, why: str) -> None:
        """This rank cannot start (``why``): a leader that has not named its segment yet tells the
        followers waiting for the name, so that they fail at once rather than at their wait's bound."""
        if self.is_leader and not self._published:
            with contextlib.suppress(RuntimeError):  # (a store that is gone: the followers' wait fails too)
                self._publish(_REFUSED + why)

    def _publish(self, name: str) -> None:
        self.group.store.set(f"{self._key}.path", name)
        self._published = True

    def _leaders_path(self) -> str:
        """The segment's name, once the leader has published it (``ConfigError`` if it could not)."""
        key, bound = f"{self._key}.path", max(START_TIMEOUT_S, self.group.timeout_s)
        try:
            self.group.store.wait([key], datetime.timedelta(seconds=bound))
        except RuntimeError as exc:  # (a store whose host is gone fails the wait at once)
            raise HostPoolLost(f"the node's leader named no host pool within {bound:g} s: {exc}") from None
        path = self.group.store.get(key).decode()
        if path.startswith(_REFUSED):
            raise ConfigError("shared_host_pool", True, f"the node's leader could not create it: "
                              f"{path[len(_REFUSED):]}")
        return path

    def stream(self, name: str, inner: TransferStream) -> TransferStream:
        """``inner`` with its copies to the shared rows made once per node: by the leader, which
        publishes them, while a follower's wait for them reads what the leader published."""
        assert self.kv is not None and self._header is not None, "allocate the rows first"
        record = self._header[STREAMS.index(name)]
        self._open_streams += 1
        if self.is_leader:
            stream = LeaderStream(name, inner, self.kv, record, on_close=self._stream_closed)
            self._leading.append(stream)
            return stream
        group = self.group
        return FollowerStream(name, inner, self.kv, record, group.timeout_s, on_close=self._stream_closed,
                              lost=lambda: getattr(group, "broken", None))

    def close(self) -> None:
        """Remove the segment's name if it is still there (the memory goes with the last mapping),
        and end its registration with the device. Nothing copies to or from the rows after this: the
        leader's publishers end (a start that failed closes the pool, not its streams; a publisher
        left waiting would keep the rows mapped), and the followers' waits fail at once."""
        for stream in self._leading:
            stream.stop_publishing()
        if self._unlink is not None:
            self._unlink()
        unregister, self._unregister = self._unregister, None
        if unregister is not None:  # pragma: no cover - needs a GPU
            unregister()

    def _stream_closed(self) -> None:
        self._open_streams -= 1
        if self._open_streams <= 0:  # every copy to or from the rows has been waited for
            self.close()


class LeaderStream:
    """A ``TransferStream`` whose copies to the shared rows are published, in issue order, by a
    thread that waits for each (the leader's own waits use the inner handles, as without sharing)."""

    def __init__(
        self, name: str, inner: TransferStream, kv: torch.Tensor, record: np.ndarray, *,
        on_close: Callable[[], None],
    ) -> None:
        self._inner, self._kv, self._record, self._on_close = inner, kv, record, on_close
        self._issued: queue.SimpleQueue[TransferHandle | None] = queue.SimpleQueue()
        self._issued_count = 0
        self._stopped = False
        self._publisher = threading.Thread(target=self._publish, name=f"hispec-{name}-publish", daemon=True)
        self._publisher.start()

    def copy_rows(
        self, dst: torch.Tensor, dst_idx: torch.Tensor, src: torch.Tensor, src_idx: torch.Tensor
    ) -> TransferHandle:
        if not _writes(dst, self._kv):
            return self._inner.copy_rows(dst, dst_idx, src, src_idx)
        if src_idx.numel() == 0:  # no copy, no number (a follower skips it alike)
            return DoneHandle()
        self._issued_count += 1
        slot = _ISSUED + 2 * (self._issued_count % _ISSUED_KEPT)
        # a follower may be checking the copy this slot held: the number is cleared while the
        # fingerprint changes, so that no reader pairs the old number with the new fingerprint
        self._record[slot] = 0
        self._record[slot + 1] = _fingerprint(dst_idx)
        self._record[slot] = self._issued_count
        try:
            handle = self._inner.copy_rows(dst, dst_idx, src, src_idx)
        except Exception as exc:  # not even issued: published failed, raised here as before
            self._issued.put(FailedHandle(exc))
            raise
        self._issued.put(handle)
        return handle

    def synchronize(self) -> None:
        self._inner.synchronize()

    def close(self) -> None:
        try:
            self._inner.close()
        finally:
            self.stop_publishing()
            self._on_close()

    def stop_publishing(self) -> None:
        """Publish the copies issued so far, then mark the record closed (once; a follower's wait for
        a later copy fails at once)."""
        if self._stopped:
            return
        self._stopped = True
        self._issued.put(None)
        self._publisher.join()
        self._record[_CLOSED] = 1

    def _publish(self) -> None:
        number = 0
        while (handle := self._issued.get()) is not None:
            number += 1
            try:
                handle.wait()
            except Exception:  # (reported to the leader's coordinator by its own handle)
                failed = int(self._record[_NUM_FAILED])
                self._record[_FAILED + failed % _FAILED_KEPT] = number
                self._record[_NUM_FAILED] = failed + 1
            self._record[_SETTLED] = number  # after the rows and the failure: readers see both


class FollowerStream:
    """A ``TransferStream`` that skips its copies to the shared rows: each returns a handle on the
    leader's copy of the same number. ``timeout_s`` bounds every wait for one; ``lost`` says why the
    group is broken (None while it works): then ``synchronize`` does not wait for a leader that may be
    gone."""

    def __init__(
        self, name: str, inner: TransferStream, kv: torch.Tensor, record: np.ndarray, timeout_s: float,
        *, on_close: Callable[[], None], lost: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.name = name
        self._lost = lost
        self._inner, self._kv, self._record, self._on_close = inner, kv, record, on_close
        self._timeout_s = timeout_s
        self._issued = 0
        # set by the first copy found out of step or never settled: every later wait fails at once
        # (the numbering cannot recover, and a wait a copy could never end would stall each row)
        self._broken: str | None = None

    def _why_lost(self) -> str | None:
        return self._lost() or self._broken

    def _break(self, why: str) -> None:
        self._broken = self._broken or why

    def copy_rows(
        self, dst: torch.Tensor, dst_idx: torch.Tensor, src: torch.Tensor, src_idx: torch.Tensor
    ) -> TransferHandle:
        if not _writes(dst, self._kv):
            return self._inner.copy_rows(dst, dst_idx, src, src_idx)
        if src_idx.numel() == 0:
            return DoneHandle()
        self._issued += 1
        return LeaderCopy(self._record, self._issued, self._timeout_s, self.name, _fingerprint(dst_idx),
                          lost=self._why_lost, on_lost=self._break)

    def synchronize(self) -> None:
        self._inner.synchronize()
        if not self._issued or self._why_lost() is not None:
            return
        try:
            LeaderCopy(self._record, self._issued, self._timeout_s, self.name).settle()
        except HostPoolLost as exc:  # raises nothing (each copy's handle reports its own failure)
            log.error("tp.host_pool_lost", stream=self.name, error=str(exc))

    def close(self) -> None:
        try:
            self.synchronize()
            self._inner.close()
        finally:
            self._on_close()


class LeaderCopy:
    """A follower's handle on the leader's copy ``number`` of one stream (``TransferHandle``);
    ``fingerprint``: the rows this rank would have written."""

    def __init__(
        self, record: np.ndarray, number: int, timeout_s: float, stream: str,
        fingerprint: int | None = None, *, lost: Callable[[], str | None] = lambda: None,
        on_lost: Callable[[str], None] = lambda why: None,
    ) -> None:
        self._record, self._number, self._timeout_s, self._stream = record, number, timeout_s, stream
        self._lost = lost  # why the group (or this stream) is broken, if it is: a wait gives up at once
        self._on_lost = on_lost  # told when this copy finds the stream out of step or the leader gone
        self._fingerprint = fingerprint  # of the rows this rank would have written (None: not checked)

    def query(self) -> bool:
        if int(self._record[_SETTLED]) < self._number:
            if int(self._record[_CLOSED]):
                raise HostPoolLost(f"the node's leader closed its {self._stream} copies before copy "
                                   f"{self._number} settled")
            return False
        if self._failed():
            raise LeaderCopyFailed(f"the node's leader's {self._stream} copy {self._number} failed")
        slot = _ISSUED + 2 * (self._number % _ISSUED_KEPT)
        # the number read before and after the fingerprint: a slot the leader is rewriting, or has
        # reused for a newer copy since, is not checked
        number, fingerprint, again = (int(self._record[i]) for i in (slot, slot + 1, slot))
        checked = self._fingerprint is not None and number == again == self._number
        if checked and fingerprint != self._fingerprint:
            raise self._lose(f"the node's leader's {self._stream} copy {self._number} wrote other rows "
                             "than this rank's: the ranks' copies are out of step")
        return True

    def _lose(self, why: str) -> HostPoolLost:
        self._on_lost(why)
        return HostPoolLost(why)

    def settle(self) -> None:
        """Block until the leader's copy has settled, failed or not (raises ``HostPoolLost`` only)."""
        deadline = time.monotonic() + self._timeout_s
        pause = _POLL_S[0]
        while int(self._record[_SETTLED]) < self._number:
            if int(self._record[_CLOSED]):
                raise HostPoolLost(f"the node's leader closed its {self._stream} copies before copy "
                                   f"{self._number} settled")
            if (why := self._lost()) is not None:
                raise HostPoolLost(f"the group broke ({why}) before the leader's {self._stream} copy "
                                   f"{self._number} settled")
            if time.monotonic() > deadline:
                raise self._lose(f"the node's leader's {self._stream} copy {self._number} did not "
                                 f"settle within {self._timeout_s:g} s")
            time.sleep(pause)  # a wait for another process: there is no event to block on
            pause = min(pause * 2, _POLL_S[1])

    def wait(self) -> None:
        self.settle()
        self.query()

    def order_after(self) -> None:
        # the device cannot wait for another process's copy: the CPU does (docs/cuda.md)
        self.wait()

    def _failed(self) -> bool:
        count = int(self._record[_NUM_FAILED])
        if not count:
            return False
        kept = self._record[_FAILED : _FAILED + min(count, _FAILED_KEPT)]
        return bool((kept == self._number).any())


def host_map_digest(memory) -> tuple[int, ...] | None:
    """What the ranks sharing a host pool must agree on: every request's host slots and the free
    pages (None: no host pool)."""
    host = getattr(memory, "host", None)
    if host is None:
        return None
    table = host.req_to_host.contiguous()
    free = host.allocator.num_free_pages
    return (zlib.crc32(table.numpy().tobytes()), free, table.numel())


def host_pool_figures(memory, group: TensorGroup) -> dict[str, object] | None:
    """This rank's host pool: its rows' bytes, whether the node's ranks share them, and what the
    node holds for them (once when shared, once a rank when not), whether this rank writes them
    (only the node's leader does when they are shared). None: no host pool."""
    host = getattr(memory, "host", None)
    if host is None:
        return None
    rows = host.rows
    shared = isinstance(rows, SharedHostPool)
    nbytes = host.kv.numel() * host.kv.element_size()
    return {"bytes": nbytes, "shared": shared, "writes": not shared or rows.is_leader,
            "bytes_per_node": nbytes if shared else nbytes * group.local_size}


def _fingerprint(dst_idx: torch.Tensor) -> int:
    """Which rows a copy writes, in brief: their count and, read on the CPU only, the first."""
    first = int(dst_idx[0]) if dst_idx.device.type == "cpu" else 0
    return dst_idx.numel() << 32 | first & 0xFFFFFFFF


def _writes(dst: torch.Tensor, kv: torch.Tensor) -> bool:
    return dst.data_ptr() == kv.data_ptr() and dst.device == kv.device


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


_REFUSED = "!"  # a name the leader publishes instead of a path: why it has no segment


def _reserve(path: str, size: int) -> None:
    """Create the segment's file with all ``size`` bytes allocated now: a shared-memory file system
    too small for it (a container's /dev/shm is often 64 MB) refuses here, with the field to change,
    rather than the process dying of a bus error on the first row written past what it holds."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        _unlink_quietly(path)
        free = os.statvfs(SEGMENT_DIR)
        raise ConfigError(
            "shared_host_pool", True,
            f"the node's host pool needs {size / 2**20:.1f} MiB of shared memory in {SEGMENT_DIR}, which has "
            f"{free.f_bavail * free.f_frsize / 2**20:.1f} MiB free ({exc.strerror}): enlarge it "
            "(a container's --shm-size), shrink the host pool, or give each rank its own "
            "(--no-shared-host-pool)",
        ) from None
    finally:
        os.close(fd)


def _map_existing(path: str, size: int) -> torch.Tensor:
    """The leader's segment ``path``, mapped: the file it created, never a new one (a file system
    that does not hold it, another machine's or another container's /dev/shm, is refused)."""
    try:
        fd = os.open(path, os.O_RDWR)  # (no O_CREAT: the leader's file or an error)
    except FileNotFoundError:
        raise ConfigError(
            "shared_host_pool", True,
            f"the node's leader created its host pool at {path}, which this rank does not see: the ranks "
            "LOCAL_RANK places on one machine must share its /dev/shm (or give each rank its own pool, "
            "--no-shared-host-pool)",
        ) from None  # fmt: skip
    try:  # through the descriptor: the inode opened, even if its name goes meanwhile
        return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=size, dtype=torch.uint8)
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _register(segment: torch.Tensor) -> Callable[[], None]:  # pragma: no cover - needs a GPU
    """Page-lock the segment and map it for the device (as torch's pinned allocations are); returns
    what undoes it."""
    cudart, ptr = torch.cuda.cudart(), segment.data_ptr()
    error = cudart.cudaHostRegister(ptr, segment.numel(), 0)
    if int(error) != 0:
        raise RuntimeError(f"cudaHostRegister of the shared host pool failed: error {int(error)}")
    return lambda: cudart.cudaHostUnregister(ptr)
