"""A speculative round over a batch of requests: chain drafting, then verify with acceptance,
finalize and the draft extend for the next round.

The scheduling core orders a round (``Reserve`` -> ``Draft`` -> ``Verify``, see
``pipeline/scheduler.py``); this module is what the executor runs for the last two commands. Room for
the round's D positions is reserved once, by ``Reserve``, before ``draft`` runs: neither step here
allocates anything that can run out, except the host copies of finalize, which roll back per request.

Positions (``n`` committed positions; the bonus token sits at position ``n``)::

    target KV:  0 ........ n-1 | verify: n (bonus), n+1 (d_1), ..., n+k (d_k)
    MTP row p:  pairs the target hidden of position p with the token at p+1 (``drafting.py``)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import torch

from pipeline.isolation import isolate, reason
from pipeline.memory.step_inputs import to_device
from pipeline.sampling import NON_FINITE, NonFiniteLogits, checked_picks
from pipeline.speculative.acceptance import accept
from pipeline.speculative.drafting import ExtendInput, draft_chain, draft_extend

if TYPE_CHECKING:
    from pipeline.memory.interface import KVMemory
    from pipeline.messages import TokenLogprob
    from pipeline.model.model import DeepseekV32
    from pipeline.sequence import Sequence as Request
    from pipeline.speculative.ledger import Extend, MtpLedger


@attrs.frozen
class VerifyRound:
    """What one verify did, per request id."""

    tokens: dict[str, tuple[int, ...]]  # committed after the previous bonus: d_1..d_a, then the new bonus
    accepted: dict[str, int]  # a: accepted drafts (the bonus excluded)
    failed: dict[str, str]  # why a request cannot go on (finalize rolled back, or its own error)
    # one per committed token, for the requests that ask for log-probabilities
    logprobs: dict[str, tuple[TokenLogprob, ...]] = attrs.Factory(dict)


def draft(model: DeepseekV32, memory: KVMemory, seqs: Sequence, num_steps: int) -> None:
    """Extend each request's one proposal to ``num_steps`` chained proposals (its ``draft`` state)."""
    states = draft_chain(
        model,
        memory,
        [s.row for s in seqs],
        [s.draft for s in seqs],
        [s.params for s in seqs],
        [s.generator for s in seqs],
        num_steps,
    )
    for seq, state in zip(seqs, states):
        seq.draft = state


def draft_round(
    model: DeepseekV32, memory: KVMemory, seqs: list[Request], num_steps: int, mtp: MtpLedger, extend: Extend
) -> dict[str, str]:
    """A round's drafting, isolated per request: each request's MTP layer catches up over its plain
    steps first (``MtpLedger.before_draft``), then chain drafting (``draft``). Returns the requests
    that failed, with the reason."""

    def chain(group: list[Request]) -> list[Request]:
        mtp.before_draft(group, memory, extend)
        draft(model, memory, group, num_steps)
        return group

    return isolate(seqs, chain, "draft")[1]


def verify(
    model: DeepseekV32,
    memory: KVMemory,
    seqs: Sequence,
    draft_tokens: int,
    *,
    trace: object = None,
    labels: dict[int, str] | None = None,
) -> VerifyRound:
    """One target forward over ``[bonus, d_1..d_k]`` of every request, acceptance (per request),
    finalize, and the draft extend over the accepted tokens; each request's committed tokens join
    its ``produced``.

    A batched step that raises is bisected to the requests that cause it (``isolate``); per-request
    work is guarded one by one."""
    d = draft_tokens
    failed: dict[str, str] = {}

    def forward(group):
        row_list = [s.row for s in group]
        lengths = [memory.length(r) for r in row_list]
        layout = memory.prepare_verify(row_list, d)
        # one asynchronous copy from a pinned block on CUDA (``pipeline/memory/step_inputs.py``)
        ids, positions, rows = to_device(
            model.device,
            [t for s in group for t in (s.draft.bonus, *s.draft.drafts)],
            [p for n in lengths for p in range(n, n + d)],
            [r for r in row_list for _ in range(d)],
        )
        backend = memory.backend(
            rows, positions, layout.targets.locs, layout.targets.slots, steps=d, trace=trace, labels=labels
        )
        hidden = model(ids, positions, backend)  # [B * D, H]
        logits = model.logits(hidden).reshape(len(group), d, -1)
        # the greedy requests' target choices in one argmax over the batch, read back at once with
        # whether each request's logits are finite
        choices = checked_picks(logits, [s.params for s in group])
        return [(s, n, layout, hidden[i * d : (i + 1) * d], logits[i], choices[i])
                for i, (s, n) in enumerate(zip(group, lengths))]

    ran, errors = isolate(list(seqs), forward, "verify")
    failed.update(errors)
    # acceptance, one request at a time (its own sampling can fail it alone)
    decided = []
    logprob_of: dict[str, tuple[TokenLogprob, ...]] = {}
    for seq, n, layout, hidden, logits, choice in ran:
        try:
            if choice == NON_FINITE:
                raise NonFiniteLogits()
            a, token, logprobs = accept(list(seq.draft.drafts), seq.draft.draft_probs, logits, seq.params,
                                        seq.generator, choice, seq.context())
        except Exception as exc:  # one request's fault fails that request
            failed[seq.request_id] = reason(exc)
            continue
        if logprobs is not None:
            logprob_of[seq.request_id] = logprobs
        decided.append((seq, n, layout, hidden, a, token))
    tokens: dict[str, tuple[int, ...]] = {}
    accepted: dict[str, int] = {}
    extend: list[tuple[object, ExtendInput]] = []
    # finalize per layout group (one layout per isolated forward)
    groups: dict[int, list] = {}
    for item in decided:
        groups.setdefault(id(item[2]), []).append(item)
    for items in groups.values():
        layout = items[0][2]
        # finalize wants every row of the layout, in the layout's order; rows that failed acceptance
        # commit nothing beyond the bonus position and are released by the caller anyway
        rolled_back = set(memory.finalize_verify([s.row for s, *_ in items], [a + 1 for *_, a, _ in items],
                                                 _sub_layout(layout, items, d)))
        for seq, n, _, hidden, a, token in items:
            if seq.row in rolled_back:
                failed[seq.request_id] = str(memory.take_failure(seq.row))
                continue
            new = (*seq.draft.drafts[:a], token)
            tokens[seq.request_id], accepted[seq.request_id] = new, a
            extend.append((seq, ExtendInput(seq.row, n, new, hidden[: a + 1], seq.params, seq.generator)))

    def extend_drafts(group):
        states = draft_extend(model, memory, [x for _, x in group])
        return list(zip([s for s, _ in group], states))

    extended, errors = isolate(extend, extend_drafts, "draft extend")
    for seq, state in extended:
        seq.draft = state
    for rid, why in errors.items():
        failed[rid] = why
        tokens.pop(rid, None)
        accepted.pop(rid, None)
    for seq in seqs:
        if seq.request_id in tokens:
            seq.produced.extend(tokens[seq.request_id])
    return VerifyRound(tokens, accepted, failed, {rid: lp for rid, lp in logprob_of.items() if rid in tokens})


def _sub_layout(layout, items, d: int):
    """The layout restricted to the requests of ``items`` (acceptance may have dropped some)."""
    from pipeline.memory.targets import VerifyLayout, WriteTargets

    rows_in_layout = layout.rows
    keep = [rows_in_layout.index(seq.row) for seq, *_ in items]
    if keep == list(range(len(rows_in_layout))):
        return layout
    flat = [i * d + j for i in keep for j in range(d)]
    idx = torch.tensor(flat, device=layout.targets.locs.device)
    targets = WriteTargets(layout.targets.locs[idx], layout.targets.slots[idx])
    host = None if layout.host_slots is None else tuple(layout.host_slots[k] for k in flat)
    return VerifyLayout(targets, d, tuple(rows_in_layout[i] for i in keep), host)
