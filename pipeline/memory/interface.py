"""The KV memory interface the executor and the speculative code are written against.

Two implementations satisfy it: ``ResidentMemory`` (every token's KV on the device) and
``HiSparseCoordinator`` (a per-request device buffer over a host copy of every token). A request is
known to the memory by its *row* (``0..max_running_requests-1``), handed out by ``admit`` and given
back by ``release``; every other verb takes rows.

A row's residency moves ``PREFILL -> STAGING -> RESIDENT`` (``Residency``): the prompt computed chunk
by chunk (one chunk when it is short), the last chunk's copy to host in flight, then its decode-time
layout. Indices a verb returns
(locations, slots) stay valid until the next verb that changes the same row's layout, unless the
verb's docstring says otherwise.

HiSparse rows also have a ``Layout`` (FULL: every position on the device; HOT: the hot buffer over
the host copy); with dynamic residency a decoding row changes layout at step boundaries, reported by
``take_residency_changes``.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Protocol

import attrs

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

    from pipeline.hisparse.trace import TopKTrace
    from pipeline.memory.prefix_cache import PrefixCache
    from pipeline.memory.targets import VerifyLayout, WriteTargets
    from pipeline.model.attention_api import AttentionBackend, RowStore


class Residency(enum.Enum):
    """Where a live row's KV is (one fact; ``check_integrity`` compares it with the request's state)."""

    PREFILL = "prefill"  # admitted: the prompt is being computed, chunk by chunk
    STAGING = "staging"  # prompt KV computed; its copy to host is in flight
    RESIDENT = "resident"  # decode layout: the device buffer (HiSparse) or the resident pool


class Layout(enum.Enum):
    """How a HiSparse row's KV sits on the device (``HiSparseConfig.residency``; one fact, kept in
    the coordinator's record of the row, from its admission on)."""

    FULL = "full"  # every committed position has a device slot of its own (no swap-in, no hot buffer)
    HOT = "hot"  # the device buffer over the host copy (HiSparse's hot region and swap-in)


@attrs.frozen
class ResidencyChange:
    """One change of a decoding row's layout (dynamic residency), reported once
    (``take_residency_changes``)."""

    row: int  # the request row
    kind: str  # "demoted" (FULL -> HOT) | "promoted" (HOT -> FULL)
    num_bytes: int  # device bytes freed (demoted) or bytes copied host -> device (promoted)


# (hits, misses, bytes): entries found on the device, rows loaded host -> device, the bytes they moved
Transfers = tuple[int, int, int]
NO_TRANSFERS: Transfers = (0, 0, 0)


@attrs.frozen
class TransferTotals:
    """Rows brought host -> device since the memory was built, summed over layers (zeros for a
    memory that never swaps). A command's figures are the difference of two readings."""

    swap_in: Transfers = NO_TRANSFERS  # decode and verify top-k swap-ins
    prefill: Transfers = NO_TRANSFERS  # a prefill chunk's earlier positions (found, loaded, bytes)


class KVMemory(Protocol):
    """What the executor may ask of a KV memory. Nothing here is thread-safe: one caller at a time."""

    # the prefix cache over the memory's pools (None without one): the executor reads and marks the
    # MTP rows its pages hold for later (``PrefixCache.pending``)
    cache: PrefixCache | None

    @property
    def req_to_token(self) -> torch.Tensor:
        """``[rows, max_request_len]`` int64 location of each (row, position); a live view."""
        ...

    # --- admission and prefill ------------------------------------------------------------------

    def can_admit(
        self,
        num_tokens: int,
        *,
        speculative: bool = False,
        tokens: Sequence[int] | None = None,
        final: int | None = None,
    ) -> bool:
        """Whether ``admit`` would succeed now (changes nothing)."""
        ...

    def admit(
        self,
        num_tokens: int,
        *,
        speculative: bool = False,
        tokens: Sequence[int] | None = None,
        final: int | None = None,
    ) -> int:
        """A free row holding everything its prompt needs to reach decode: locations for every
        position, its host copy, the device rows of one prefill chunk and (HiSparse) the device
        buffer it decodes through, so that neither a later chunk nor ``collect_ready`` waits for
        memory. Raises ``OutOfMemory`` and changes nothing when a pool is short; any other error on
        the way also leaves nothing allocated (all or nothing). With ``tokens``
        (the prompt) and a prefix cache, the longest cached prefix is shared: ``length(row)`` says
        how many positions that is (computed already); cached pages nobody shares count as free.
        ``final``: the most positions the request can reach (its prompt, ``max_new_tokens`` and a
        round's drafts), a hint dynamic residency reserves room for (None: unknown)."""
        ...

    def prefill_targets(self, row: int, start: int, end: int) -> WriteTargets:
        """Where prompt positions ``[start, end)`` write (``start`` = the positions computed so far);
        idempotent until ``commit_prefill``. May wait for the previous chunk's copy to host."""
        ...

    def commit_prefill(self, row: int, start: int, end: int, *, final: bool) -> None:
        """The forward computed positions ``[start, end)`` (``final``: the prompt's last chunk)."""
        ...

    def start_staging(self, row: int, length: int) -> None:
        """The prompt's ``length`` positions are computed: copy to host what is not there yet; the
        row is STAGING."""
        ...

    def staging_rows(self) -> list[int]:
        """STAGING rows in FIFO order."""
        ...

    def wait_staging(self) -> None:
        """Block until every staging copy in flight has landed."""
        ...

    def collect_ready(self, rows: list[int] | None = None, *, speculative: bool = False) -> list[int]:
        """Pop, in FIFO order, the STAGING rows (of ``rows``; all when None) whose copy has landed,
        and give each its decode layout (RESIDENT). Stops at the first whose copy is in flight."""
        ...

    def take_staging_failures(self) -> dict[int, str]:
        """Rows whose staging copy failed since the last call, with the reason (each once): they
        never become RESIDENT; the caller fails and releases them."""
        ...

    def take_backup_failures(self, rows: list[int]) -> dict[int, str]:
        """Rows of ``rows`` whose backup of committed KV to host failed, with the reason (each once):
        they cannot go on; the caller fails and releases them."""
        ...

    # --- decode ----------------------------------------------------------------------------------

    def length(self, row: int) -> int:
        """Committed positions of ``row`` (their KV exists)."""
        ...

    def can_decode(self, row: int, *, new_tokens: int = 1, speculative: bool = False) -> bool:
        """Whether ``ensure_capacity`` would succeed (changes nothing)."""
        ...

    def ensure_capacity(self, row: int, *, new_tokens: int, speculative: bool) -> None:
        """Locations and device room for ``new_tokens`` more positions; idempotent; raises
        ``OutOfMemory`` before changing anything when a pool is short."""
        ...

    def prepare_decode(self, rows: list[int]) -> WriteTargets:
        """Where each row's next token (position = its length) writes; idempotent until
        ``commit_decode``. Raises ``OutOfMemory`` for a row without room."""
        ...

    def commit_decode(self, rows: list[int], slots: torch.Tensor, num_new: list[int] | None = None) -> None:
        """The forward wrote ``num_new[i]`` (default 1) new positions of ``rows[i]`` at ``slots``:
        they are committed (lengths grow; HiSparse backs them up to host)."""
        ...

    def backend(
        self,
        rows: torch.Tensor,
        positions: torch.Tensor,
        locs: torch.Tensor,
        slots: torch.Tensor,
        *,
        steps: int = 0,
        chunk_starts: torch.Tensor | None = None,
        trace: TopKTrace | None = None,
        labels: dict[int, str] | None = None,
    ) -> AttentionBackend:
        """The attention backend of one target forward (``steps``: 0 = prefill, whose tokens are
        chunks starting at ``chunk_starts`` [T]; else tokens per row)."""
        ...

    def draft_backend(self, rows: torch.Tensor, positions: torch.Tensor, locs: torch.Tensor) -> RowStore:
        """The MTP layer's backend: its own all-resident rows, addressed by logical location. It is
        also a ``RowStore`` (``store_rows``: a draft extend stores rows nobody reads alone)."""
        ...

    # --- speculative verify ------------------------------------------------------------------------

    def prepare_verify(self, rows: list[int], draft_tokens: int) -> VerifyLayout:
        """Bind the ``draft_tokens`` verify tokens of each row to device slots (room reserved before
        with ``ensure_capacity``); idempotent until ``finalize_verify``."""
        ...

    def finalize_verify(self, rows: list[int], accepted: list[int], layout: VerifyLayout) -> list[int]:
        """Commit ``accepted[i]`` (>= 1) verify tokens of ``rows[i]``; returns the rows whose finalize
        was rolled back (nothing changed for them; ``take_failure`` says why)."""
        ...

    def take_failure(self, row: int) -> Exception | None:
        """Why ``row``'s last finalize was rolled back (once), or None."""
        ...

    # --- ending ------------------------------------------------------------------------------------

    def release(self, row: int, *, tokens: Sequence[int] | None = None) -> None:
        """Give back everything ``row`` owns, in any residency, exactly once (raises only for a row
        that is not live). Never leaves a pool inconsistent: a copy that failed is logged and its
        slots freed all the same; a step that fails is retried from where it stopped, and a row that
        still holds memory then is finished later (``reclaim``). With ``tokens`` (the request's known
        tokens) and a prefix cache, a decoding row's full computed pages are left to the cache."""
        ...

    def reclaim(self) -> int:
        """Finish the releases a fault interrupted; returns how many rows still hold memory."""
        ...

    def flush_cache(self) -> int:
        """Evict every prefix-cache page no live row shares; returns how many (0 without a cache)."""
        ...

    def cache_stats(self) -> dict[str, float] | None:
        """The prefix cache's counters (None without one)."""
        ...

    def end_forward(self) -> None:
        """A forward has ended (however it ended): return any workspace lent to it."""

    def close(self) -> None:
        """Wait for the copies in flight and stop the transfer workers."""
        ...

    # --- figures and checks ------------------------------------------------------------------------

    def live_rows(self) -> list[int]: ...

    def residency(self, row: int) -> Residency: ...

    def free_counts(self) -> dict[str, int]:
        """Free count of every pool (back at its initial value once nothing is live)."""
        ...

    def pools(self) -> dict[str, dict[str, int]]:
        """Every pool's free count and capacity."""
        ...

    def counters_dict(self) -> dict[str, object] | None:
        """HiSparse transfer counters per layer (None for resident memory)."""
        ...

    def transfer_totals(self) -> TransferTotals:
        """The running swap-in and prefill-load totals (reads only; zeros for resident memory)."""
        ...

    def device_kv_bytes(self, row: int) -> int:
        """Device bytes of the target's MLA KV that ``row`` holds."""
        ...

    def check_integrity(self, *, data: bool = True) -> None:
        """Every invariant of ``docs/invariants.md`` this memory is responsible for."""
        ...

    # --- dynamic residency (``docs/residency.md``) ----------------------------------------------------

    def rebalance(self) -> None:
        """A step boundary after a command that changed memory: promote a demoted row when memory
        has returned (HiSparse in dynamic residency; nothing otherwise)."""
        ...

    def take_residency_changes(self) -> list[ResidencyChange]:
        """Layout changes since the last call, in order, each once (none without dynamic residency)."""
        ...

    def residency_stats(self) -> dict[str, object] | None:
        """Rows by layout and the demotions and promotions so far (None for resident memory)."""
        ...
