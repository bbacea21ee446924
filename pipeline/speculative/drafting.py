"""The MTP layer's drafting: the draft extend over committed positions, chain drafting, proposals.

Positions (``n`` committed positions, the bonus token sits at position ``n``)::

    target KV:   0 ........ n-1 | verify: n (bonus), n+1 (d_1), ..., n+k (d_k)
    MTP row p:   pairs the target hidden of position p with the token at p+1 and predicts p+2;
                 its KV lives at p's logical location in the draft pool.

* ``draft_extend``: MTP rows over newly committed positions (the prompt after a prefill; the
  accepted tokens after a verify) with the target's hidden states; yields each request's bonus,
  first proposal ``d_1`` and MTP hidden (the draft state).
* ``draft_chain``: ``k - 1`` chained top-1 MTP steps; step j runs at MTP position ``n + j - 2``.

A round runs them over a batch (``batch_round.py``): the chain, then the verify, whose accepted tokens
get their rows from a draft extend for the next round.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import torch

from pipeline.sampling import SamplingParams, greedy_picks, probabilities
from pipeline.speculative.draft_state import DraftBatch, DraftState

if TYPE_CHECKING:
    from pipeline.memory.interface import KVMemory
    from pipeline.model.model import DeepseekV32


# a draft extend with at least this many positions whose outputs are not read stores their rows
# alone first (``draft_extend``); below it, one forward over every position costs less
ROWS_ONLY_MIN = 16


@attrs.frozen(eq=False)
class ExtendInput:
    """One request's rows of a draft extend."""

    row: int
    start: int  # position of the first row
    next_ids: tuple[int, ...]  # the token after each position (the last is the new bonus)
    hidden: torch.Tensor  # [m, D] target hidden states at those positions
    params: SamplingParams
    generator: torch.Generator | None
    # False for a prompt chunk that is not the prompt's last: only the MTP rows are written (the next
    # id of its last position is the next chunk's first token; nothing is proposed or sampled)
    propose: bool = True


def propose(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[int, torch.Tensor | None]:
    """A draft token from MTP logits ``[V]``: argmax when greedy, else a sample from q (returned)."""
    if params.greedy:
        return int(logits.argmax()), None
    q = probabilities(logits.cpu(), params)
    return int(torch.multinomial(q, 1, generator=generator)), q


def propose_rows(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[tuple[int, torch.Tensor | None]]:
    """``propose`` for each row of ``logits [B, V]``: the greedy rows' tokens from one ``argmax``
    over the batch, read back in one transfer (each row's first maximum, as ``propose`` takes it)."""
    picks = greedy_picks(logits, params)
    return [(pick, None) if pick is not None else propose(logits[i], p, gen)
            for i, (pick, p, gen) in enumerate(zip(picks, params, generators))]


def draft_extend(model: DeepseekV32, memory: KVMemory, inputs: list[ExtendInput]) -> list[DraftState | None]:
    """MTP rows over each request's new positions. Each input that ``propose``s gets its draft
    state (from its last position's output); the others None.

    Only the proposing positions' outputs are read, and a row depends on its own token alone, so
    when many positions are not read (a prompt, a catch-up) the rows of all of them are stored
    first (``mtp_store``: no attention, MLP or head) and the full forward runs over the proposing
    positions only; otherwise one flat forward computes everything."""
    dev = model.device
    rows = torch.cat([torch.full((len(x.next_ids),), x.row, dtype=torch.int64) for x in inputs])
    positions = torch.cat([torch.arange(x.start, x.start + len(x.next_ids)) for x in inputs])
    locs = memory.req_to_token[rows, positions]
    ids = torch.tensor([t for x in inputs for t in x.next_ids], device=dev)
    hidden = torch.cat([x.hidden for x in inputs])
    ends = (torch.cumsum(torch.tensor([len(x.next_ids) for x in inputs]), 0) - 1).tolist()
    read = [end for x, end in zip(inputs, ends) if x.propose]  # the positions whose outputs are read
    if len(ends) and ends[-1] + 1 - len(read) >= ROWS_ONLY_MIN:
        every = memory.draft_backend(rows.to(dev), positions.to(dev), locs.to(dev))
        model.mtp_store(ids, positions.to(dev), hidden, every)
        if not read:
            return [None] * len(inputs)
        at = torch.tensor(read)
        backend = memory.draft_backend(rows[at].to(dev), positions[at].to(dev), locs[at].to(dev))
        out = model.mtp_forward(ids[at.to(dev)], positions[at].to(dev), hidden[at.to(hidden.device)], backend)
        where = dict(zip(read, range(len(read))))
    else:
        backend = memory.draft_backend(rows.to(dev), positions.to(dev), locs.to(dev))
        out = model.mtp_forward(ids, positions.to(dev), hidden, backend)
        where = {end: end for end in read}
    proposing = [x for x in inputs if x.propose]
    read_at = [where[end] for x, end in zip(inputs, ends) if x.propose]
    generators = [x.generator for x in proposing]
    proposals = iter(propose_rows(out.logits[read_at], [x.params for x in proposing], generators))
    states: list[DraftState | None] = []
    for x, end in zip(inputs, ends):
        if not x.propose:
            states.append(None)
            continue
        end = where[end]
        token, q = next(proposals)
        # a copy: a view would keep the whole batch's hidden states alive as long as this request
        hidden = out.hidden[end].clone()
        states.append(DraftState(x.next_ids[-1], hidden, (token,), None if q is None else (q,)))
    return states


def draft_chain(
    model: DeepseekV32,
    memory: KVMemory,
    rows: list[int],
    states: list[DraftState],
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    num_steps: int,
) -> list[DraftState]:
    """Extend each request's one proposal to ``num_steps`` chained proposals."""
    batch = DraftBatch.merge(states)
    dev = model.device
    row_t = torch.tensor(rows, dtype=torch.int64)
    lengths = torch.tensor([memory.length(r) for r in rows], dtype=torch.int64)
    drafts = [list(s.drafts) for s in states]
    probs = [list(s.draft_probs) if s.draft_probs is not None else None for s in states]
    hidden = batch.hidden
    for j in range(2, num_steps + 1):
        positions = lengths + (j - 2)
        locs = memory.req_to_token[row_t, positions]
        backend = memory.draft_backend(row_t.to(dev), positions.to(dev), locs.to(dev))
        last = torch.tensor([d[-1] for d in drafts], device=dev)
        out = model.mtp_forward(last, positions.to(dev), hidden, backend)
        hidden = out.hidden
        for i, (token, q) in enumerate(propose_rows(out.logits, params, generators)):
            drafts[i].append(token)
            kept = probs[i]
            if kept is not None:  # (a sampling request: ``propose`` returns its q)
                assert q is not None
                kept.append(q)
    return [
        DraftState(s.bonus, hidden[i].clone(), tuple(drafts[i]), None if q is None else tuple(q))
        for i, (s, q) in enumerate(zip(states, probs))
    ]

