"""After a forward returns: commit what it computed and choose each request's next token.

A forward (``pipeline/forward.py``) computed KV, hidden states and logits for a batch; here, request
by request, the memory commits the new positions, the request chooses its next token with its own
generator, and in speculative mode the MTP ledger takes the hidden states
(``pipeline/speculative/ledger.py``). A request whose commit or sampling raises fails alone: the
others' results stand.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pipeline.isolation import reason
from pipeline.messages import PrefillResult, StepResult, TokenLogprob
from pipeline.sampling import NON_FINITE, NonFiniteLogits
from pipeline.sequence import Sequence
from pipeline.speculative.drafting import ExtendInput

if TYPE_CHECKING:
    from pipeline.forward import DecodeOut, PrefillOut
    from pipeline.memory.interface import KVMemory
    from pipeline.speculative.ledger import Extend, MtpLedger


def finish_prefill(
    ran: list[PrefillOut],
    failed: dict[str, str],
    memory: KVMemory,
    mtp: MtpLedger | None,
    extend: Extend,
    max_context_len: int,
) -> PrefillResult:
    """Commit each chunk; a prompt's last chunk samples its first token, draft-extends (``extend``)
    or holds its MTP rows (``mtp``: speculative mode) and starts staging. ``failed`` collects the
    failures."""
    first: dict[str, int] = {}
    logprobs: dict[str, TokenLogprob] = {}
    finished: list[Sequence] = []
    extending: list[tuple[Sequence, ExtendInput]] = []
    for (seq, start, end), hidden, logits in ran:
        final = end == len(seq.token_ids)
        try:
            memory.commit_prefill(seq.row, start, end, final=final)
            seq.prefilled = end
            if not final:
                rows = None if mtp is None or hidden is None else mtp.after_chunk(seq, start, end, hidden)
                if rows is not None:
                    extending.append((seq, rows))
                continue
            token, logprob = seq.choose(logits)
        except Exception as exc:  # this request's commit or sampling, this request's failure
            failed[seq.request_id] = reason(exc)
            continue
        first[seq.request_id] = token
        if logprob is not None:
            logprobs[seq.request_id] = logprob
        seq.produced.append(token)
        finished.append(seq)
        rows = None if mtp is None or hidden is None else mtp.after_prompt(seq, start, hidden, token)
        if rows is not None:
            extending.append((seq, rows))
        else:
            seq.plain_next, seq.draft = token, None
    if mtp is not None:
        errors = mtp.write(extending, extend)
        failed.update(errors)
        for rid in errors:
            first.pop(rid, None)
            logprobs.pop(rid, None)
    for seq in finished:
        if seq.request_id in first and not ends_at_first(seq, first[seq.request_id], max_context_len):
            memory.start_staging(seq.row, len(seq.token_ids))
    return PrefillResult(first, failed, logprobs)


def ends_at_first(seq: Sequence, token: int, max_context_len: int) -> bool:
    """The first token certainly ends the request (the caller ends it at once): its prompt KV is not
    copied to host for nothing. A stop string is only known to the caller: it still copies."""
    return seq.params.max_new_tokens == 1 or len(seq.token_ids) + 1 >= max_context_len or token in seq.end_ids


def finish_decode(
    ran: list[DecodeOut],
    failed: dict[str, str],
    refused: tuple[str, ...],
    memory: KVMemory,
    mtp: MtpLedger | None,
    extend: Extend,
) -> StepResult:
    """Commit the new rows, sample each request's next token; in speculative mode (``mtp``) the step
    is a plain one, whose hidden states the ledger holds. ``failed`` collects the failures."""
    out: dict[str, tuple[int, ...]] = {}
    logprobs: dict[str, tuple[TokenLogprob, ...]] = {}
    lost: dict[int, str] = {}
    if ran:
        memory.commit_decode([s.row for s, _ in ran], torch.cat([slots for _, (slots, *_) in ran]))
        lost = memory.take_backup_failures([s.row for s, _ in ran])
    stepped: list[tuple[Sequence, int, torch.Tensor]] = []  # (request, the position it computed, hidden)
    for seq, (_, logits, hidden, pick) in ran:
        if seq.row in lost:  # its KV has no host copy: it cannot go on
            failed[seq.request_id] = lost[seq.row]
            continue
        try:
            if pick == NON_FINITE:
                raise NonFiniteLogits()
            if pick is not None and seq.params.plain_choice:
                seq.plain_next, logprob = pick, None
            else:
                seq.plain_next, logprob = seq.choose(logits, pick)
        except Exception as exc:  # this request's sampling, this request's failure
            failed[seq.request_id] = reason(exc)
            continue
        out[seq.request_id] = (seq.plain_next,)
        if logprob is not None:
            logprobs[seq.request_id] = (logprob,)
        seq.produced.append(seq.plain_next)
        if mtp is not None:
            stepped.append((seq, memory.length(seq.row) - 1, hidden))
    if mtp is not None:  # a plain step of speculative requests (adaptive speculation)
        for rid, why in mtp.after_step(stepped, extend).items():  # a catch-up that failed
            failed[rid] = why
            out.pop(rid, None)
            logprobs.pop(rid, None)
    return StepResult(out, refused, failed=failed, logprobs=logprobs)
