"""A target forward over a batch: its inputs built from the memory, its outputs read per request.

Three kinds, one flat batch of tokens each::

    prefill:  [chunk 0 tokens | chunk 1 tokens | ...]          one row per token, T in all
    decode:   [next token of request 0, 1, ..., B - 1]        one row per request
    mixed:    [decode tokens (B) | prefill tokens (T)]        attention dispatched per segment

Nothing here commits: the memory's write targets are prepared, the forward runs, and the caller
commits what returned (so a failing forward can be retried on part of its batch).
"""

from __future__ import annotations

import attrs
import torch

from pipeline.graphs import DecodeGraphs
from pipeline.hisparse.trace import TopKTrace
from pipeline.memory.interface import KVMemory
from pipeline.memory.mixed import MixedBackend
from pipeline.memory.step_inputs import to_device
from pipeline.memory.targets import WriteTargets
from pipeline.model import DeepseekV32
from pipeline.model.attention_api import AttentionBackend
from pipeline.sampling import checked_picks
from pipeline.sequence import Sequence

Chunk = tuple[Sequence, int, int]  # (request, start, end): positions [start, end) of its token_ids
# (the chunk, its hidden states [end - start, D] when kept, the logits of its last token [V])
PrefillOut = tuple[Chunk, torch.Tensor | None, torch.Tensor]
# (the request, (its new row's slot [1], logits [V], hidden state [D], greedy pick / NON_FINITE / None))
DecodeOut = tuple[Sequence, tuple[torch.Tensor, torch.Tensor, torch.Tensor, int | None]]


@attrs.frozen
class Batch:
    """The model inputs of one forward's tokens and the backend prepared for them."""

    ids: torch.Tensor
    positions: torch.Tensor
    backend: AttentionBackend
    slots: torch.Tensor | None = None  # decode: the device slot of each token's new row


@attrs.frozen
class Forwards:
    """Builds and reads the forwards of one step over ``model`` and ``memory``."""

    model: DeepseekV32
    memory: KVMemory
    device: torch.device
    trace: TopKTrace | None
    labels: dict[int, str] | None  # row -> request id, for the trace
    keep_hidden: bool  # a prefill returns each chunk's hidden states (the draft extend's input)
    # decode over fixed-size inputs (CUDA graphs where captured), None: off
    graphs: DecodeGraphs | None = None

    def prefill(self, items: list[Chunk]) -> list[PrefillOut]:
        batch = self.prefill_batch(items)
        try:
            hidden = self.model(batch.ids, batch.positions, batch.backend)  # [T, D]
        finally:
            self.memory.end_forward()  # swap-in workspace lent to this forward goes back
        return self.prefill_outputs(items, hidden)

    def decode(self, seqs: list[Sequence]) -> list[DecodeOut]:
        graphs = self.graphs
        if graphs is not None and self.trace is None and graphs.covers([s.row for s in seqs]):
            return self.decode_static(seqs, graphs)
        return self._decode_eager(seqs)

    def _decode_eager(self, seqs: list[Sequence], targets: WriteTargets | None = None) -> list[DecodeOut]:
        """``decode`` step by step (``targets``: ``prepare_decode``'s, when it ran already)."""
        batch = self.decode_batch(seqs, targets)
        hidden = self.model(batch.ids, batch.positions, batch.backend)  # [B, D]
        assert batch.slots is not None, "a decode batch carries its new rows' slots"
        return self.decode_outputs(seqs, batch.slots, hidden)

    def decode_static(self, seqs: list[Sequence], graphs: DecodeGraphs) -> list[DecodeOut]:
        """``decode`` through ``graphs``' fixed-size inputs of the batch's bucket (padded to it;
        replayed from a graph where one was captured): the same results as the eager step."""
        row_list = [s.row for s in seqs]
        targets = self.memory.prepare_decode(row_list)
        if not graphs.covers(row_list):  # its room demoted a row of a FULL batch: both layouts now
            return self._decode_eager(seqs, targets)
        positions = [self.memory.length(r) for r in row_list]
        ids = [s.next_token for s in seqs]
        hidden = graphs.forward(row_list, positions, ids, targets.locs, targets.slots)  # [B, D]
        return self.decode_outputs(seqs, targets.slots, hidden)

    def mixed(self, seqs: list[Sequence], chunks: list[Chunk]) -> list[DecodeOut | PrefillOut]:
        """One forward over decode requests and prefill chunks (both kinds present); the results of
        ``decode`` and of ``prefill``, decode first."""
        decode, prefill = self.decode_batch(seqs), self.prefill_batch(chunks)
        backend = MixedBackend(decode.backend, prefill.backend, len(seqs))
        ids = torch.cat([decode.ids, prefill.ids])
        try:
            hidden = self.model(ids, torch.cat([decode.positions, prefill.positions]), backend)  # [B + T, D]
        finally:
            self.memory.end_forward()  # swap-in workspace lent to the chunks goes back
        n = len(seqs)
        assert decode.slots is not None, "a decode batch carries its new rows' slots"
        return [
            *self.decode_outputs(seqs, decode.slots, hidden[:n]),
            *self.prefill_outputs(chunks, hidden[n:]),
        ]

    def prefill_batch(self, items: list[Chunk]) -> Batch:
        targets = [self.memory.prefill_targets(seq.row, start, end) for seq, start, end in items]
        # built on the host, sent in one asynchronous copy on CUDA (``pipeline/memory/step_inputs.py``)
        ids, positions, rows, starts = to_device(
            self.device,
            [t for seq, start, end in items for t in seq.token_ids[start:end]],
            torch.cat([torch.arange(start, end) for _, start, end in items]),
            [seq.row for seq, start, end in items for _ in range(start, end)],
            [start for _, start, end in items for _ in range(start, end)],
        )
        locs = torch.cat([t.locs for t in targets])
        slots = torch.cat([t.slots for t in targets])
        backend = self.memory.backend(
            rows, positions, locs, slots, chunk_starts=starts, trace=self.trace, labels=self.labels
        )
        return Batch(ids, positions, backend)

    def prefill_outputs(self, items: list[Chunk], hidden: torch.Tensor) -> list[PrefillOut]:
        """Per chunk: (the item, its hidden states (when kept: the draft extend's input), the logits
        of its last token)."""
        lens = [end - start for _, start, end in items]
        (ends,) = to_device(self.device, torch.cumsum(torch.tensor(lens), 0) - 1)
        logits = self.model.logits(hidden[ends])  # [B, V]
        out: list[PrefillOut] = []
        at = 0
        for i, (item, n) in enumerate(zip(items, lens)):
            # own copies (the draft extend's input): no batch retained
            own = hidden[at : at + n].clone() if self.keep_hidden else None
            out.append((item, own, logits[i]))
            at += n
        return out

    def decode_batch(self, seqs: list[Sequence], targets: WriteTargets | None = None) -> Batch:
        """A decode step's batch; ``targets``: where its rows are written, when ``prepare_decode`` ran
        already."""
        row_list = [s.row for s in seqs]
        if targets is None:
            targets = self.memory.prepare_decode(row_list)
        positions_list = [self.memory.length(r) for r in row_list]
        # one asynchronous copy from a pinned block on CUDA (``pipeline/memory/step_inputs.py``)
        rows, positions, ids = to_device(self.device, row_list, positions_list, [s.next_token for s in seqs])
        backend = self.memory.backend(
            rows, positions, targets.locs, targets.slots, steps=1, trace=self.trace, labels=self.labels
        )
        return Batch(ids, positions, backend, targets.slots)

    def decode_outputs(
        self, seqs: list[Sequence], slots: torch.Tensor, hidden: torch.Tensor
    ) -> list[DecodeOut]:
        """Per request: (its new row's slot (of ``slots [B]``), its logits, its hidden state, its
        greedy token or None, or ``NON_FINITE``). The greedy requests' tokens are one ``argmax``
        over the batch's rows (the one ``sample`` takes of each row alone: the first maximum), read
        back in one transfer with whether each request's logits are finite."""
        logits = self.model.logits(hidden)  # [B, V]
        picks = checked_picks(logits, [s.params for s in seqs])
        return [(s, (slots[i : i + 1], logits[i], hidden[i], picks[i])) for i, s in enumerate(seqs)]
