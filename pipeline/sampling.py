"""Sampling parameters, logits -> tokens, and the request-level validation of sampling values.

Each request samples with its own ``torch.Generator`` (seeded from ``SamplingParams.seed``, or from the
engine seed and the request id), so its tokens do not depend on which other requests share its
batch. Greedy (temperature 0, or below ``MIN_TEMPERATURE``) is argmax, ties to the lowest token id.
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
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_stop_tuple)  # extra ids that end the request (kept in token_ids, not in text)

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

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


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


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from ``logits [V]``."""
    if params.greedy:
        return int(logits.argmax())
    probs = probabilities(logits.cpu(), params)
    return int(torch.multinomial(probs, 1, generator=generator))


def greedy_picks(logits: torch.Tensor, params: list[SamplingParams]) -> list:
    """The greedy requests' tokens of ``logits [B, ..., V]`` (one request per leading row), from one
    ``argmax`` over the batch read back in one transfer: each row's first maximum, as ``sample``
    takes it alone (a list per row when the rows have more dimensions); None for the others."""
    greedy = [p.greedy for p in params]
    if not any(greedy):
        return [None] * len(params)
    return [pick if g else None for pick, g in zip(logits.argmax(-1).tolist(), greedy)]


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from a distribution ``probs [V]`` (argmax when no generator: the greedy case)."""
    if generator is None:
        return int(probs.argmax())
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
