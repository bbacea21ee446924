"""Reference decoders: synchronous, one request, all KV resident. The oracle and the baseline.

:class:`ReferenceDecoder` is plain decoding (greedy or sampled). :class:`ReferenceSpecDecoder` is
chain speculative decoding with the model's MTP layer (greedy acceptance), laid out like the engine's::

    prefill       target over prompt x[0..n-1]                      -> H[0..n-1], bonus b = argmax
    draft extend  MTP over (x[1..n-1], b) with H[0..n-1], slots 0..n-1 -> draft d1 (and its hidden)
    round         chain: MTP step j >= 2 at slot n+j-2 reads (d[j-1], previous MTP hidden) -> d[j]
                  verify: target over [b, d1..dk] at positions n..n+k -> t[0..k] = argmax
                  accept the longest prefix with d[j+1] == t[j] (a tokens), bonus b' = t[a]
                  draft extend over (d1..da, b') with the verify's H[n..n+a] at slots n..n+a
                  n += a + 1; b = b'

The MTP layer keeps its own KV (its layer slice of the store), filled only by draft extends and the
chain steps; a slot written by a chain step is rewritten by the next draft extend before anything
reads it as context. Rows left behind by rejected tokens are never visible: every forward writes its
tokens' rows before attending, and a token sees only positions up to its own.
"""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

from pipeline.model.model import DeepseekV32
from pipeline.model.resident import ForwardLayout, ResidentBackend, ResidentKV


@attrs.frozen
class Sampling:
    """``temperature == 0`` is greedy; otherwise softmax sampling after top-k / top-p filtering."""

    temperature: float = 0.0
    top_p: float = 1.0  # in (0, 1]
    top_k: int = 0  # 0 = no limit
    seed: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")


@attrs.frozen
class Generation:
    token_ids: tuple[int, ...]  # generated tokens (the prompt excluded), eos included if hit
    finish_reason: str  # "eos" or "length"
    num_target_forwards: int  # prefill included
    accept_lengths: tuple[int, ...] = ()  # per verify: accepted drafts + the bonus token

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0


def pick_token(logits: Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """``logits [V]`` -> one token id."""
    if sampling.temperature == 0:
        return int(torch.argmax(logits))
    scaled = (
        logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32) / sampling.temperature
    )
    if sampling.top_k:
        kth = torch.topk(scaled, min(sampling.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if sampling.top_p < 1:
        probs_sorted, order = torch.sort(torch.softmax(scaled, -1), descending=True)
        before = probs_sorted.cumsum(-1) - probs_sorted  # mass strictly before each token
        drop = order[before >= sampling.top_p]  # the first token always stays
        scaled = scaled.index_fill(0, drop, float("-inf"))
    probs = torch.softmax(scaled, -1)
    return int(torch.multinomial(probs, 1, generator=generator))


class DecodeSession:
    """One request over a private resident store (request row 0, location = position).

    ``target`` and ``mtp`` run one forward each at consecutive positions from ``start``; rows they
    write replace whatever an earlier forward left at those positions.
    """

    def __init__(self, model: DeepseekV32, max_ctx: int) -> None:
        self.model = model
        self.max_ctx = max_ctx
        store = ResidentKV.allocate(model.cfg, max_ctx, 1, max_ctx, model.dtype, model.device)
        self.backend = ResidentBackend(store)

    def _begin(self, start: int, count: int) -> Tensor:
        positions = torch.arange(start, start + count, device=self.model.device)
        rows = torch.zeros(count, dtype=torch.int64, device=self.model.device)
        self.backend.begin(ForwardLayout(req_rows=rows, positions=positions, write_locs=positions))
        return positions

    def target(self, ids: list[int], start: int) -> Tensor:
        """Target forward over ``ids`` at positions ``start..``; returns hidden ``[T, D]``."""
        positions = self._begin(start, len(ids))
        return self.model(torch.tensor(ids, device=self.model.device), positions, self.backend)

    def mtp(self, next_ids: list[int], prev_hidden: Tensor, start: int) -> tuple[Tensor, Tensor]:
        """MTP forward at slots ``start..``; returns ``(hidden [T, D], logits [T, V])``."""
        positions = self._begin(start, len(next_ids))
        out = self.model.mtp_forward(
            torch.tensor(next_ids, device=self.model.device), positions, prev_hidden, self.backend
        )
        return out.hidden, out.logits


def _check_prompt(prompt_ids: list[int], max_new_tokens: int, max_ctx: int) -> None:
    if not prompt_ids:
        raise ValueError("empty prompt")
    if max_new_tokens <= 0:
        raise ValueError("max_new_tokens must be positive")
    if len(prompt_ids) >= max_ctx:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens does not fit a context of {max_ctx}")


class ReferenceDecoder:
    """Plain decoding, one token per target forward."""

    def __init__(self, model: DeepseekV32, max_ctx: int | None = None) -> None:
        self.model = model
        self.max_ctx = max_ctx or model.cfg.max_position_embeddings

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        sampling: Sampling = Sampling(),
        stop_at_eos: bool = True,
    ) -> Generation:
        _check_prompt(prompt_ids, max_new_tokens, self.max_ctx)
        session = DecodeSession(self.model, self.max_ctx)
        gen = (
            torch.Generator(device=self.model.device).manual_seed(sampling.seed)
            if sampling.seed is not None
            else None
        )
        eos = self.model.cfg.eos_token_id if stop_at_eos else None
        hidden = session.target(list(prompt_ids), 0)
        n, out, forwards = len(prompt_ids), [], 1
        while True:
            token = pick_token(self.model.logits(hidden[-1:])[0], sampling, gen)
            out.append(token)
            if token == eos:
                return Generation(tuple(out), "eos", forwards)
            if len(out) >= max_new_tokens or n + 1 >= self.max_ctx:
                return Generation(tuple(out), "length", forwards)
            hidden = session.target([token], n)
            n, forwards = n + 1, forwards + 1


class ReferenceSpecDecoder:
    """Chain speculative decoding with MTP depth 0, greedy acceptance (the output equals greedy decoding)."""

    def __init__(self, model: DeepseekV32, num_steps: int, max_ctx: int | None = None) -> None:
        if not len(model.mtp):
            raise ValueError("speculative decoding needs a model with an MTP layer")
        if num_steps < 1:
            raise ValueError("num_steps must be >= 1")
        self.model = model
        self.num_steps = num_steps
        self.max_ctx = max_ctx or model.cfg.max_position_embeddings

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, stop_at_eos: bool = True) -> Generation:
        _check_prompt(prompt_ids, max_new_tokens, self.max_ctx)
        s = DecodeSession(self.model, self.max_ctx)
        eos = self.model.cfg.eos_token_id if stop_at_eos else None
        prompt = list(prompt_ids)
        hidden = s.target(prompt, 0)  # [n, D]
        bonus = int(torch.argmax(self.model.logits(hidden[-1:])[0]))
        out, accepts, forwards = [bonus], [], 1
        n = len(prompt)  # committed tokens with target KV; the bonus sits at position n
        draft_hidden, draft_logits = s.mtp([*prompt[1:], bonus], hidden, 0)
        while not _finished(out, eos, max_new_tokens) and n + self.num_steps + 1 < self.max_ctx:
            drafts = self._chain(s, draft_hidden[-1:], draft_logits[-1], n)
            verify_hidden = s.target([bonus, *drafts], n)  # [k + 1, D]
            forwards += 1
            targets = torch.argmax(self.model.logits(verify_hidden), dim=-1).tolist()
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
                accepted += 1
            bonus = targets[accepted]
            new = [*drafts[:accepted], bonus]
            out.extend(new)
            accepts.append(accepted + 1)
            draft_hidden, draft_logits = s.mtp(new, verify_hidden[: accepted + 1], n)
            n += accepted + 1
        tokens, reason = _truncate(out, eos, max_new_tokens)
        return Generation(tokens, reason, forwards, tuple(accepts))

    def _chain(self, s: DecodeSession, prev_hidden: Tensor, logits: Tensor, n: int) -> list[int]:
        """``num_steps`` chained top-1 drafts; step j >= 2 runs at MTP slot ``n + j - 2``."""
        drafts = [int(torch.argmax(logits))]
        for j in range(2, self.num_steps + 1):
            prev_hidden, step_logits = s.mtp([drafts[-1]], prev_hidden, n + j - 2)
            drafts.append(int(torch.argmax(step_logits[0])))
        return drafts


def _finished(out: list[int], eos: int | None, max_new_tokens: int) -> bool:
    return len(out) >= max_new_tokens or (eos is not None and eos in out)


def _truncate(out: list[int], eos: int | None, max_new_tokens: int) -> tuple[tuple[int, ...], str]:
    if eos is not None and eos in out[:max_new_tokens]:
        return tuple(out[: out.index(eos) + 1]), "eos"
    return tuple(out[:max_new_tokens]), "length"
