"""Sampling parameters, logits -> tokens, and the request-level validation of sampling values.

Each request samples with its own ``torch.Generator`` (seeded from ``SamplingParams.seed``, or from the
engine seed and the request id), so its tokens do not depend on which other requests share its
batch. Greedy (temperature 0, or below ``MIN_TEMPERATURE``) is argmax, ties to the lowest token id.

A token is chosen in this order (vLLM's): the logits are *adjusted* for the request's history
(``min_tokens`` masks its end tokens, ``logit_bias`` is added, then the repetition, frequency and
presence penalties), then temperature, top-k and top-p shape the distribution it is drawn from.
Every adjustment depends only on the prompt and the output before the token, so a speculative
verify applies it exactly at each of its positions (``LogitContext.extended`` by the drafts before
it): speculation stays lossless under every option. A request's log-probabilities are those of
that final distribution (a greedy request's: the log-softmax of its adjusted logits, as vLLM
reports at temperature 0); a token it can never draw has ``-inf``.
"""

from __future__ import annotations

import math

import attrs
import torch

from pipeline.errors import RequestError

# A temperature below this is treated as greedy: dividing logits by it would overflow to inf (and
# sampling raise), and the distribution it asks for is already the argmax to float precision.
MIN_TEMPERATURE = 1e-5


def _check(ok: bool, field: str, value: object, rule: str) -> None:
    if not ok:
        raise RequestError(field, value, rule)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    """An int or float with a finite float value; bools are not numbers here."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int beyond the float range
        return False


def _stop_tuple(value: object) -> object:
    """``stop`` as given, a list becoming a tuple (so the frozen params stay hashable)."""
    return tuple(value) if isinstance(value, list) else value


def _bias_pairs(value: object) -> object:
    """``logit_bias`` as ``((token id, bias), ...)`` sorted by id: a dict or a list of pairs becomes
    that tuple (kept hashable); anything else is left for ``validate`` to name."""
    if isinstance(value, dict):
        value = list(value.items())
    if isinstance(value, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in value):
        try:
            return tuple(sorted((tuple(p) for p in value), key=lambda p: p[0]))
        except TypeError:  # ids that do not compare: validate names them
            return tuple(tuple(p) for p in value)
    return value


@attrs.frozen
class TokenLogprob:
    """One output token's log-probability under the distribution it was drawn from (after the
    request's logit adjustments, temperature, top-k and top-p; ``-inf`` for a token it could not
    draw), and the most likely tokens of that distribution."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first; as many as asked


class NonFiniteLogits(ValueError):
    """A request's logits hold a NaN or an infinity: no token can be chosen from them (the request
    fails with this reason; nothing derived from them is ever used as an index)."""

    def __init__(self) -> None:
        super().__init__("the model's logits hold NaN or infinite values (non-finite weights or activations)")


# a request's entry in ``checked_picks`` when its logits are not all finite
NON_FINITE = -1

# the most alternatives a request may ask log-probabilities for (OpenAI's chat limit)
MAX_LOGPROBS = 20
# the largest |bias| of ``logit_bias`` (OpenAI's range)
MAX_LOGIT_BIAS = 100.0


@attrs.frozen
class SamplingParams:
    """How one request samples; checked when the request is submitted (``validate``).

    ``temperature`` 0 is greedy, and so is any temperature below ``MIN_TEMPERATURE``.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 (or below MIN_TEMPERATURE) = greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # 0 = no limit
    stop: tuple[str, ...] = attrs.field(default=(), converter=_stop_tuple)  # end the request (not output)
    seed: int | None = None  # None: derived from the engine seed and the request id
    ignore_eos: bool = False  # as vLLM: the model's end ids do not end the request; stop_token_ids still do
    # extra ids that end the request (kept in token_ids, not in text)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_stop_tuple)
    # OpenAI's penalties over the output so far: logit -= frequency * count + presence * (count > 0)
    presence_penalty: float = 0.0  # in [-2, 2]
    frequency_penalty: float = 0.0  # in [-2, 2]
    # HF's and vLLM's over prompt and output: a seen token's logit is divided by it if positive,
    # multiplied if not (> 1 discourages repeats); 1 = off
    repetition_penalty: float = 1.0
    # added to those tokens' logits, ((token id, bias), ...) sorted by id (a dict is accepted)
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_bias_pairs)
    min_tokens: int = 0  # the request's end tokens cannot be drawn before this many output tokens
    # None: no log-probabilities; 0: the chosen token's; k: also the k most likely (at most MAX_LOGPROBS)
    logprobs: int | None = None

    def validate(self) -> None:
        """Raise ``RequestError`` naming the first bad field."""
        n = self.max_new_tokens
        _check(_is_int(n), "max_new_tokens", n, "must be an integer")
        _check(n >= 1, "max_new_tokens", n, "must be >= 1")
        t = self.temperature
        _check(_is_real(t), "temperature", t, "must be a finite number")
        _check(t >= 0, "temperature", t, f"must be >= 0 (0, or below {MIN_TEMPERATURE}, = greedy)")
        p = self.top_p
        _check(_is_real(p), "top_p", p, "must be a finite number")
        _check(0 < p <= 1, "top_p", p, "must be in (0, 1]")
        k = self.top_k
        _check(_is_int(k) and k >= 0, "top_k", k, "must be an integer >= 0 (0 = no limit)")
        _check(
            isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop),
            "stop",
            self.stop,
            "must be a tuple or list of non-empty strings",
        )
        _check(
            isinstance(self.stop_token_ids, tuple)
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            self.stop_token_ids,
            "must be a tuple of token ids (ints >= 0)",
        )
        _check(self.seed is None or _is_int(self.seed), "seed", self.seed, "must be an integer or None")
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", self.ignore_eos, "must be True or False")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_real(value) and -2 <= value <= 2, name, value, "must be a finite number in [-2, 2]")
        r = self.repetition_penalty
        _check(_is_real(r) and r > 0, "repetition_penalty", r, "must be a finite number > 0 (1 = off)")
        bias = self.logit_bias
        _check(
            isinstance(bias, tuple)
            and all(
                isinstance(p, tuple)
                and len(p) == 2
                and _is_int(p[0])
                and p[0] >= 0
                and _is_real(p[1])
                and abs(p[1]) <= MAX_LOGIT_BIAS
                for p in bias
            )
            and len({p[0] for p in bias}) == len(bias),
            "logit_bias",
            bias,
            "must map distinct token ids (ints >= 0) to finite numbers in "
            f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
        )
        m = self.min_tokens
        _check(_is_int(m) and m >= 0, "min_tokens", m, "must be an integer >= 0")
        _check(m <= n, "min_tokens", m, f"must be at most max_new_tokens ({n})")
        num_logprobs = self.logprobs
        _check(
            num_logprobs is None or (_is_int(num_logprobs) and 0 <= num_logprobs <= MAX_LOGPROBS),
            "logprobs",
            num_logprobs,
            f"must be None or an integer in [0, {MAX_LOGPROBS}]",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits depend on the request's history (penalties, bias, ``min_tokens``)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )

    @property
    def plain_choice(self) -> bool:
        """Neither adjusted logits nor log-probabilities: a token is chosen from the raw logits alone
        (the batched greedy ``argmax`` applies)."""
        return self.logprobs is None and not self.adjusts_logits


@attrs.frozen
class LogitContext:
    """What a request's logit adjustments read: its prompt, its output before the token being
    chosen, and the ids that would end it (what ``min_tokens`` masks)."""

    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    end_ids: frozenset[int]

    def extended(self, tokens: tuple[int, ...] | list[int]) -> LogitContext:
        """The context after ``tokens`` more output tokens (a verify's drafts before a position)."""
        return attrs.evolve(self, output_ids=(*self.output_ids, *tokens))


def adjust_logits(logits: torch.Tensor, params: SamplingParams, context: LogitContext) -> torch.Tensor:
    """``logits [V]`` after ``min_tokens``, ``logit_bias`` and the penalties, as float64 (a copy)."""
    out = logits.to(torch.float64).clone()
    vocab = out.shape[-1]
    outputs = context.output_ids
    if len(outputs) < params.min_tokens:
        ends = [t for t in context.end_ids if 0 <= t < vocab]
        if ends:
            out[torch.tensor(ends, device=out.device)] = float("-inf")
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], device=out.device)
        out.index_add_(
            0, ids, torch.tensor([float(b) for _, b in params.logit_bias], dtype=out.dtype, device=out.device)
        )
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({*context.prompt_ids, *outputs}), dtype=torch.int64, device=out.device)
        if seen.numel():
            values = out[seen]
            r = float(params.repetition_penalty)
            out[seen] = torch.where(values > 0, values / r, values * r)
    if (params.frequency_penalty or params.presence_penalty) and outputs:
        counts = torch.bincount(torch.tensor(outputs, dtype=torch.int64), minlength=vocab).to(out)
        out -= float(params.frequency_penalty) * counts + float(params.presence_penalty) * (counts > 0)
    return out


def logprob_row(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The log-probabilities ``[V]`` (float64) of the distribution a token is drawn from given these
    (adjusted) logits: after temperature, top-k and top-p; a greedy request's is the log-softmax of
    the logits themselves (its token is their argmax)."""
    if params.greedy:
        return torch.log_softmax(logits.to(torch.float64), dim=-1)
    return torch.log(probabilities(logits, params))


def token_logprob(logits: torch.Tensor, params: SamplingParams, token: int) -> TokenLogprob:
    """``token``'s log-probability under ``logits [V]`` (adjusted) and the ``params.logprobs`` most
    likely tokens, most likely first (ties: lower id first)."""
    row = logprob_row(logits.cpu(), params)
    k = min(int(params.logprobs or 0), row.shape[-1])
    top: tuple[tuple[int, float], ...] = ()
    if k:
        order = torch.sort(row, descending=True, stable=True).indices[:k]
        top = tuple((int(i), float(row[i])) for i in order)
    return TokenLogprob(int(token), float(row[token]), top)


def choose(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    context: LogitContext | None = None,
    pick: int | None = None,
) -> tuple[int, TokenLogprob | None]:
    """One token from ``logits [V]`` and its log-probabilities (None unless asked): ``sample`` on the
    logits adjusted for ``context`` (needed when ``params.adjusts_logits``). ``pick``: the greedy
    argmax of the raw logits, when the caller read it already (used only if nothing adjusts them)."""
    if pick is None and not bool(torch.isfinite(logits).all()):
        raise NonFiniteLogits()
    if params.adjusts_logits:
        assert context is not None, "adjusted logits need the request's context"
        logits = adjust_logits(logits, params, context)
        pick = None
    token = pick if pick is not None else sample(logits, params, generator)
    return token, None if params.logprobs is None else token_logprob(logits, params, token)


def make_generator(params: SamplingParams, engine_seed: int, request_id: str) -> torch.Generator | None:
    """The request's own generator (None when greedy: nothing random happens)."""
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else _stable_hash(f"{engine_seed}:{request_id}")
    return torch.Generator().manual_seed(seed % (1 << 63))


def _stable_hash(text: str) -> int:
    value = 1469598103934665603  # FNV-1a, stable across processes (unlike hash())
    for byte in text.encode():
        value = ((value ^ byte) * 1099511628211) % (1 << 64)
    return value


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``logits [..., V]`` -> the sampling distribution ``[..., V]`` (float64) after temperature,
    top-k and top-p. Greedy gives a one-hot at the argmax."""
    logits = logits.to(torch.float64)
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(torch.float64)
    logits = logits / float(params.temperature)  # a Python int beyond int64 would not divide
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly above each token
        drop = before >= params.top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def checked_picks(logits: torch.Tensor, params: list[SamplingParams]) -> list:
    """``greedy_picks`` of ``logits [B, ..., V]``, and ``NON_FINITE`` for every request whose rows
    hold a NaN or an infinity (whatever its parameters), from one read-back: a request the caller
    fails (``NonFiniteLogits``) instead of choosing a token from garbage."""
    batch = logits.shape[0]
    finite = torch.isfinite(logits).reshape(batch, -1).all(-1)  # [B]
    greedy = [p.greedy and not p.adjusts_logits for p in params]
    if not any(greedy):
        return [None if ok else NON_FINITE for ok in finite.tolist()]
    argmax = logits.argmax(-1).reshape(batch, -1)  # [B, rows per request]
    picks = torch.where(finite[:, None], argmax, NON_FINITE).tolist()
    whole = logits.dim() > 2  # a list of picks per request (a verify's rows)
    out: list = []
    for row, g in zip(picks, greedy):
        if row[0] == NON_FINITE:
            out.append(NON_FINITE)
        else:
            out.append((row if whole else row[0]) if g else None)
    return out


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from ``logits [V]``."""
    if params.greedy:
        return int(logits.argmax())
    probs = probabilities(logits.cpu(), params)
    return int(torch.multinomial(probs, 1, generator=generator))


def greedy_picks(logits: torch.Tensor, params: list[SamplingParams]) -> list:
    """The greedy requests' tokens of ``logits [B, ..., V]`` (one request per leading row), from one
    ``argmax`` over the batch read back in one transfer: each row's first maximum, as ``sample``
    takes it alone (a list per row when the rows have more dimensions); None for the others, and for
    a request whose logits are adjusted (``SamplingParams.adjusts_logits``: its argmax is another)."""
    greedy = [p.greedy and not p.adjusts_logits for p in params]
    if not any(greedy):
        return [None] * len(params)
    return [pick if g else None for pick, g in zip(logits.argmax(-1).tolist(), greedy)]
