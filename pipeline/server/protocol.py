"""The OpenAI-compatible request and response bodies (pydantic models).

Requests are validated strictly (``"5"`` is not an integer, ``true`` is not a number) and refuse
unknown fields, as OpenAI's API does. Fields of the OpenAI API that hispec cannot honour are
accepted only at their neutral value (no ``suffix``, no tools, ``response_format`` text, ``best_of``
equal to ``n``, no ``echo`` together with ``logprobs``), so that a client setting them gets a clear
400 instead of a silently different answer. ``top_k``, ``ignore_eos``, ``repetition_penalty`` and
``min_tokens`` are extensions (as in vLLM and SGLang).

Text that is tokenized or matched (``prompt``, a message's ``content``, ``stop``) must be valid
Unicode: JSON can carry a lone surrogate (``"\\ud800"``), which no tokenizer can encode; it is refused
here, naming the field.
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_CHOICES = 16  # n: each choice is one engine request
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat's top_logprobs
MAX_LOGIT_BIAS = 100.0  # |bias| at most this (OpenAI's range)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _unicode(text: str) -> str:
    """``text``, or ``ValueError`` if it holds a lone surrogate (JSON's ``"\\ud800"``)."""
    found = None if text.isascii() else _SURROGATE.search(text)
    if found is not None:
        raise ValueError(
            f"a lone surrogate (U+{ord(found.group()):04X} at character {found.start()}) is not valid "
            "Unicode text"
        )
    return text


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


def _neutral(value: Any, neutral: tuple[Any, ...], what: str) -> Any:
    if value not in neutral:
        raise ValueError(f"{what} is not supported")
    return value


class StreamOptions(_Strict):
    include_usage: bool = False  # one more chunk before [DONE]: empty choices, the request's usage


class _Generation(_Strict):
    """What completions and chat completions share: the model and the sampling fields."""

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None  # OpenAI's default: 1
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # extension; 0 or -1: no limit
    stop: str | list[str] | None = None
    seed: int | None = None  # with n > 1, choice i samples with seed + i
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    ignore_eos: bool = False  # extension: keep generating past the end-of-sequence token
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None  # over the output so far
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None  # extension: over prompt and output
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    min_tokens: Annotated[int, Field(ge=0)] = 0  # extension: no end token before this many
    user: str | None = None  # accepted and ignored

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in strings):
            raise ValueError("stop strings must not be empty")
        for string in strings:
            _unicode(string)
        return stop

    @field_validator("logit_bias")
    @classmethod
    def _token_biases(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"keys must be token ids written as decimal strings (got key {key!r})")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"biases must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}] (got {bias} for {key})"
                )
        return value

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def token_biases(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias) pairs, by id."""
        return tuple(sorted((int(key), float(bias)) for key, bias in (self.logit_bias or {}).items()))

    def logprobs_asked(self) -> int | None:
        """How many alternatives to report per token (0: the chosen token's only); None: no logprobs."""
        raise NotImplementedError


class CompletionRequest(_Generation):
    """``POST /v1/completions``: one prompt, as text or token ids (a batch of one is accepted)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    echo: bool = False  # the prompt's text is prepended to each choice's text
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError(
                    f"a batch of {len(prompt)} prompts is not supported (send one request per prompt)"
                )
            prompt = prompt[0]
        return _unicode(prompt) if isinstance(prompt, str) else prompt

    @field_validator("echo")
    @classmethod
    def _echo_without_logprobs(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("logprobs") is not None:
            raise ValueError(
                "echo together with logprobs is not supported (it would need the prompt's logprobs); "
                "send one or the other"
            )
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if value is not None and value != n:
            raise ValueError(f"only best_of equal to n ({n}) is supported (each choice is returned)")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        return _neutral(value or None, (None,), "suffix")

    def logprobs_asked(self) -> int | None:
        return self.logprobs


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _valid_text(cls, content: str | list[TextPart]) -> str | list[TextPart]:
        for text in [content] if isinstance(content, str) else [part.text for part in content]:
            _unicode(text)
        return content

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Generation):
    """``POST /v1/chat/completions``: the conversation goes through the model's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None  # OpenAI's newer name of max_tokens
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None  # needs logprobs: true
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        return _neutral(value or None, (None,), "tools")

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, value: Any) -> Any:
        return _neutral(value, (None, "none"), "tool_choice")

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return _neutral(value, (None, {"type": "text"}), "a response_format other than text")

    def logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (vLLM's): a ``prompt``, or ``messages`` rendered as chat completions renders
    them (``add_generation_prompt``: with the assistant's cue, as a chat completion sends them)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_generation_prompt: bool = True

    @field_validator("prompt")
    @classmethod
    def _valid_text(cls, prompt: str | None) -> str | None:
        return None if prompt is None else _unicode(prompt)

    @field_validator("messages")
    @classmethod
    def _one_input(cls, value: list[ChatMessage] | None, info: ValidationInfo) -> list[ChatMessage] | None:
        if value is not None and info.data.get("prompt") is not None:
            raise ValueError("give either prompt or messages, not both")
        return value


class DetokenizeRequest(_Strict):
    """``POST /detokenize`` (vLLM's): token ids -> text."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


# --- responses ---------------------------------------------------------------------------------------

FinishReason = Literal["stop", "length"]


def api_finish_reason(reason: str | None) -> FinishReason | None:
    """The engine's finish reason as a response spells it (an aborted or failed request never gets
    one: its response is an error)."""
    if reason is None:
        return None
    if reason == "stop":
        return "stop"
    if reason == "length":
        return "length"
    raise ValueError(f"finish reason {reason!r} has no place in a response")


def ended_finish_reason(reason: str | None) -> FinishReason:
    """``api_finish_reason`` of a choice that has ended, which always has one."""
    ended = api_finish_reason(reason)
    if ended is None:
        raise ValueError("a choice that ended has no finish reason")
    return ended


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from a prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy shape: one entry per output token in each list."""

    tokens: list[str]
    token_logprobs: list[float]
    # the most likely tokens and the chosen one: token text -> logprob
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]  # where each token's text starts in the choice's text


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None


class Completion(BaseModel):
    """A completion, whole (``object="text_completion"``) or one streamed chunk of it (the same shape)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None  # the token text's UTF-8 bytes


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]  # the most likely tokens, most likely first


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "hispec"
    max_model_len: int  # prompt plus output tokens per request (vLLM's field)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class ErrorDetail(BaseModel):
    message: str
    # "invalid_request_error", "authentication_error", "not_found_error", "internal_error",
    # "service_unavailable"
    type: str
    param: str | None = None  # the request field at fault
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
