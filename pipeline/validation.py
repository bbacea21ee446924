"""Request-level checks, made once when a request is submitted and before it reaches any batch.

A request that breaks a rule raises ``RequestError`` naming the field (``prompt``, ``params`` or a
``SamplingParams`` field) for that request alone; nothing about it has been recorded yet, so the
engine and every other request go on as if it had never been submitted.

The rules:

* ``prompt`` is a string (encoded with the engine's tokenizer; it must be valid Unicode, so a lone
  surrogate is refused) or a list or tuple of token ids: Python ints (bools are not token ids) in
  ``[0, vocab_size)``; not empty, and shorter than ``max_context_len`` so that at least one output
  token fits;
* ``params`` is a ``SamplingParams`` whose own ``validate`` passes (every field's type and range),
  and whose ``logit_bias`` names ids of the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pipeline.errors import RequestError
from pipeline.sampling import SamplingParams


class Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


def encode_prompt(prompt: object, tokenizer: Encoder) -> list[int]:
    """``prompt`` as token ids: a string is encoded, a list or tuple of ids is copied (and checked
    later by ``validate_request``); anything else raises ``RequestError`` naming ``prompt``."""
    if isinstance(prompt, str):
        try:
            return list(tokenizer.encode(prompt))
        except UnicodeEncodeError as exc:
            raise RequestError(
                "prompt",
                prompt[max(0, exc.start - 8) : exc.end + 8],
                f"is not valid Unicode text ({exc.reason} at character {exc.start})",
            ) from None
        except Exception as exc:  # the tokenizer's own failure on this text: this request's error alone
            raise RequestError(
                "prompt", prompt[:40], f"the tokenizer could not encode it ({type(exc).__name__}: {exc})"
            ) from exc
    if isinstance(prompt, (list, tuple)):
        return list(prompt)
    raise RequestError("prompt", type(prompt).__name__, "must be a string or a list of token ids")


def validate_params(params: object) -> SamplingParams:
    """``params``, checked: raise ``RequestError`` naming the field of ``params`` that breaks a rule
    (the checks a request makes without its prompt)."""
    if not isinstance(params, SamplingParams):
        raise RequestError(
            "params", type(params).__name__, "must be a SamplingParams (or None for the defaults)"
        )
    params.validate()
    return params


def validate_request(
    prompt_ids: Sequence[int], params: object, *, vocab_size: int, max_context_len: int
) -> None:
    """Raise ``RequestError`` naming the first field of the request that breaks a rule."""
    params = validate_params(params)
    if not isinstance(prompt_ids, (list, tuple)):
        raise RequestError("prompt", type(prompt_ids).__name__, "must be a list of token ids")
    if not prompt_ids:
        raise RequestError("prompt", prompt_ids, "must not be empty")
    bad = [
        t for t in prompt_ids if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size)
    ]
    if bad:
        raise RequestError("prompt", bad[:8], f"token ids must be ints (not bools) in [0, {vocab_size})")
    biased = [t for t, _ in params.logit_bias if t >= vocab_size]
    if biased:
        raise RequestError("logit_bias", biased[:8], f"token ids must be in [0, {vocab_size})")
    if len(prompt_ids) >= max_context_len:
        raise RequestError(
            "prompt",
            list(prompt_ids),
            f"length {len(prompt_ids)} leaves no room: max_context_len is {max_context_len}",
        )
