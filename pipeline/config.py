"""Frozen, validated engine configuration.

Every rule that can be checked without the model is checked when the object is built; the rules
that need the model (``top_k`` against ``index_topk``, an MTP layer for speculative decoding, the
context limit against the model's positions) are checked by ``check_against_model`` when the engine
loads it, and those that need the machine (device, memory) by ``pipeline.preflight`` before that.
``check_engine_options`` checks the engine's keyword arguments. A violation raises ``ConfigError``
naming the field, the value and the rule.

Three defaults come from the model: ``speculative="auto"`` (on exactly when it has an MTP layer),
``max_context_len=None`` (its positions, as far as the pools hold) and
``hisparse.device_buffer_size=None`` (HOT: 128, or the indexer's top-k in whole pages when that is
more); ``resolve_for_model`` fills them in where the model is loaded.

Derived sizes live in ``MemoryPlan`` (built by ``EngineConfig.memory_plan``), never written back.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import attrs
import structlog

from kernels.swap_in_policy import DEFAULT_POLICY, POLICIES
from pipeline.capacity import (
    ModelDims,
    Shape,
    chunk_rows,
    device_budget,
    held_requests,
    longest_context,
    size_for_budget,
)
from pipeline.errors import ConfigError

log = structlog.get_logger("hispec.config")

DEFAULT_CHUNK = 512  # chunked_prefill_tokens
DEFAULT_PREFILL_BATCH = 2048  # prefill_batch_tokens="auto" (the least of it, with a chunk of 512 or less)
DEFAULT_POOL_TOKENS, DEFAULT_ROWS, DEFAULT_RATIO = 16384, 16, 4  # without a device memory budget
MAX_RATIO = 64  # the largest host_to_device_ratio a budget chooses
# SpeculativeConfig's "auto" limits: requests stepped together (CPU, CUDA), tokens a request holds (CPU)
CPU_SPEC_MAX_BATCH, CUDA_SPEC_MAX_BATCH = 1, 8
CPU_SPEC_MAX_CONTEXT = 1024
CPU_DEFAULT_POLICY = "adaptive"  # HiSparseConfig.policy="auto" on a CPU
DEFAULT_HOT = 128  # HiSparseConfig.device_buffer_size=None: at least this many hot columns (auto_hot)
DTYPES = ("float32", "bfloat16", "float16", "float64")
DEVICES = ("cpu", "cuda")


def _require(ok: bool, field: str, value: object, rule: str) -> None:
    if not ok:
        raise ConfigError(field, value, rule)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require_int(field: str, value: object, minimum: int) -> None:
    _require(_is_int(value), field, value, "must be an integer")
    _require(value >= minimum, field, value, f"must be >= {minimum}")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def auto_hot(index_topk: int | None, page_size: int) -> int:
    """HOT when ``device_buffer_size`` is None: the larger of ``DEFAULT_HOT`` and the model's top-k
    (the hot region must hold one step's whole selection), in whole pages."""
    return _round_up(max(DEFAULT_HOT, index_topk or 0), page_size)


@attrs.frozen
class HiSparseConfig:
    """The per-request device buffer over a host copy of every token's KV."""

    # HOT: hot columns per request; a multiple of page_size and >= the model's top_k. None: the
    # larger of 128 and the model's index_topk, in whole pages (``auto_hot``; resolve_for_model)
    device_buffer_size: int | None = None
    # logical (and host) pool = device pool * ratio. None: with a device memory budget, the ratio
    # that seats the most requests of max_context_len; without one, 4
    host_to_device_ratio: int | None = None
    # None = the model's index_topk; when given it must equal it (HiSparse never changes the answer)
    top_k: int | None = None
    # the hot region's replacement policy (kernels.swap_in_policy; docs/cache-policy.md). "auto":
    # "adaptive" on a CPU (5-21% fewer misses than LRU on the bundled model's traces, decode
    # tokens/s level with LRU's), "lru" on CUDA (where the Triton swap-in has not been measured
    # against it yet) (``policy_for``)
    policy: str = "auto"
    # positions the indexer ranks past its top-k for the swap-in (the near-policies' hint; recorded
    # in a top-k trace). None: ``default_near_margin(top_k)`` under a near-policy or while a trace is
    # recorded, else 0 (kernels.swap_in_policy)
    near_margin: int | None = None
    # with speculation, keep the draft (MTP) layer's KV rows in host memory instead of the device:
    # the device keeps its indexer keys and token table, and each draft forward copies the rows its
    # top-k names to the device. Frees the device bytes of one KV row per logical location (the
    # seats a budget holds with speculation); on CUDA each draft forward then reads its top-k slots
    # back to the host (one synchronisation) before the copy. Output unchanged either way.
    draft_rows_on_host: bool = False
    # with draft_rows_on_host, the draft layer's indexer keys in host memory too: it then holds no
    # device memory of its own (it reads the target's token table), and each draft forward's
    # indexer scores on the host (on CUDA, on the CPU, after copying its queries there). Frees the
    # rest of the draft layer's device bytes per logical location, so speculation seats what plain
    # decoding seats. Output unchanged.
    draft_keys_on_host: bool = False

    def hot_for(self, index_topk: int | None, page_size: int) -> int:
        """HOT for a model whose indexer selects ``index_topk`` positions: ``device_buffer_size``,
        or when it is None ``auto_hot``."""
        if self.device_buffer_size is not None:
            return self.device_buffer_size
        return auto_hot(index_topk, page_size)

    def policy_for(self, device: str) -> str:
        """The replacement policy an engine on ``device`` runs: ``policy``, ``"auto"`` resolved."""
        if self.policy != "auto":
            return self.policy
        return CPU_DEFAULT_POLICY if device == "cpu" else DEFAULT_POLICY

    def __attrs_post_init__(self) -> None:
        _require(self.policy in (*POLICIES, "auto"), "hisparse.policy", self.policy,
                 f"must be one of {(*POLICIES, 'auto')}")
        for name in ("draft_rows_on_host", "draft_keys_on_host"):
            _require(isinstance(getattr(self, name), bool), f"hisparse.{name}", getattr(self, name), "must be a bool")
        _require(self.draft_rows_on_host or not self.draft_keys_on_host, "hisparse.draft_keys_on_host",
                 self.draft_keys_on_host, "needs hisparse.draft_rows_on_host (the keys go to the host with the rows)")
        if self.near_margin is not None:
            _require_int("hisparse.near_margin", self.near_margin, 0)
        if self.device_buffer_size is not None:
            _require_int("hisparse.device_buffer_size", self.device_buffer_size, 1)
        if self.host_to_device_ratio is not None:
            _require_int("hisparse.host_to_device_ratio", self.host_to_device_ratio, 1)
        if self.top_k is not None:
            _require_int("hisparse.top_k", self.top_k, 1)
        if self.top_k is not None and self.device_buffer_size is not None:
            _require(
                self.device_buffer_size >= self.top_k,
                "hisparse.device_buffer_size",
                self.device_buffer_size,
                f"must be >= top_k ({self.top_k}): one step's top-k must fit in the hot region",
            )


@attrs.frozen
class SpeculativeConfig:
    """Chain speculative decoding with the model's MTP layer as the drafter."""

    num_steps: int = 3
    # 1 = chain; trees need page_size == 1, which HiSparse does not support
    eagle_topk: int = 1
    # D, the tokens verified per round (the bonus token first); None = num_steps + 1
    num_draft_tokens: int | None = None
    # Adaptive speculation: a round is run only while it pays; otherwise the step decodes plainly
    # (one token per request), with the same output (greedy identical, sampling distribution kept).
    # Speculate while the batch stepped together has at most this many requests (None: any size):
    # a verify multiplies the tokens of a forward by D, which stops being free once the forward is
    # compute-bound (vLLM's disable_by_batch_size). "auto": 8 on CUDA; 1 on a CPU, whose forward is
    # compute-bound from two requests on (a round over 4 or 8 requests delivers what as many plain
    # steps do, so its measuring and its tail only cost) (``for_device``).
    max_batch_size: int | Literal["auto"] | None = "auto"
    # ... and while every request of the batch holds at most this many tokens (None: any length;
    # vLLM's speculative_max_model_len): a verify's D queries each scan the whole context in the
    # indexer, and the MTP drafts too, so past some length a round costs more than the tokens it
    # adds. "auto": None on CUDA; 1024 on a CPU (the bundled model served alone: rounds 1.12x plain
    # at 512 tokens, level at 1,000, 0.94x at 1,500) (``for_device``).
    max_context: int | Literal["auto"] | None = "auto"
    # ... and while the measured accept length (tokens per round, bonus included; a moving average
    # over rounds, engine-wide) is at least this (None, the default: ignore acceptance). Below it, a
    # probe round runs every ``probe_every`` plain steps to measure again. Off by default because
    # it makes a seeded sampled request's tokens depend on what ran before it (the distribution is
    # the same either way); the batch-size rule keeps a request served alone reproducible.
    min_accept_length: float | None = None
    probe_every: int = 16
    # ... and, for 2..max_batch_size requests, while rounds have delivered more tokens per second
    # than plain steps at about that batch size (both measured as the engine runs; the losing mode is
    # tried again after ``probe_every`` turns, an interval each probe that keeps the lead doubles, up
    # to 8x, and a change of lead resets); a batch of one too when its request is greedy (a
    # sampled request served alone always speculates, so a seeded one stays reproducible).
    timed: bool = True
    # ... and not for the last tokens of every stream: while no request of the batch may produce
    # D more tokens (``max_new_tokens`` or the context), a round's drafts cannot all count, and at the
    # tail of a batch it would pay the MTP layer's catch-up over its plain steps for a token or two
    plain_tail: bool = True
    # ... and not while prompts wait for prefill with mixed steps (``EngineConfig.mixed_steps``): a
    # plain step carries the next chunk in its own forward, a round (several forwards) cannot, so
    # the chunk would cost a forward of its own
    plain_while_prefilling: bool = True

    def __attrs_post_init__(self) -> None:
        _require_int("speculative.num_steps", self.num_steps, 1)
        for name in ("max_batch_size", "max_context"):
            value = getattr(self, name)
            if value not in (None, "auto"):
                _require(_is_int(value), f"speculative.{name}", value, 'must be an integer, None or "auto"')
                _require(value >= 1, f"speculative.{name}", value, "must be >= 1")
        for name in ("timed", "plain_tail", "plain_while_prefilling"):
            _require(isinstance(getattr(self, name), bool), f"speculative.{name}", getattr(self, name), "must be a bool")
        _require_int("speculative.eagle_topk", self.eagle_topk, 1)
        if self.min_accept_length is not None:
            value = self.min_accept_length
            _require(
                isinstance(value, (int, float)) and not isinstance(value, bool) and 1 <= value <= self.num_steps + 1,
                "speculative.min_accept_length",
                value,
                f"must be a number in [1, num_steps + 1 = {self.num_steps + 1}] or None",
            )
        _require_int("speculative.probe_every", self.probe_every, 1)
        if self.num_draft_tokens is not None:
            _require_int("speculative.num_draft_tokens", self.num_draft_tokens, 2)
            if self.eagle_topk == 1:
                _require(
                    self.num_draft_tokens == self.num_steps + 1,
                    "speculative.num_draft_tokens",
                    self.num_draft_tokens,
                    f"a chain verifies num_steps + 1 = {self.num_steps + 1} tokens",
                )

    @property
    def draft_tokens(self) -> int:
        """D: tokens verified per round, the bonus token included."""
        return self.num_draft_tokens if self.num_draft_tokens is not None else self.num_steps + 1

    def for_device(self, device: str) -> SpeculativeConfig:
        """This configuration with its ``"auto"`` limits set for ``device`` (``"cpu"`` or ``"cuda"``)."""
        cpu = device == "cpu"
        batch = (CPU_SPEC_MAX_BATCH if cpu else CUDA_SPEC_MAX_BATCH) if self.max_batch_size == "auto" else self.max_batch_size
        context = (CPU_SPEC_MAX_CONTEXT if cpu else None) if self.max_context == "auto" else self.max_context
        return attrs.evolve(self, max_batch_size=batch, max_context=context)


@attrs.frozen
class MemoryPlan:
    """Sizes derived from a validated config and the model's top_k (never written back).

    Device buffer of one request (HOT = ``hot``, P = ``page_size``)::

        columns  0 ............ HOT-1 | HOT    | HOT+1 ... HOT+P-1
                 hot region (LRU)      | newest | draft zone (verify tokens)
    """

    page_size: int
    hot: int  # hot columns per request; 0 when HiSparse is off
    buffer_columns: int  # hot + page_size (the newest column and the draft zone)
    top_k: int
    device_tokens: int  # usable physical slots (page 0, the sink, is extra)
    logical_tokens: int  # usable logical locations (page 0 extra)
    host_tokens: int  # host pool slots
    max_context_len: int
    max_running_requests: int
    draft_tokens: int  # D, 0 without speculation
    hisparse: bool
    # tokens of one request one prefill forward computes at most (chunked prefill; max_context_len
    # when prompts are prefilled whole)
    prefill_chunk: int = 0
    prefix_cache: bool = False  # finished requests' pages stay, found again by their tokens
    policy: str = DEFAULT_POLICY  # the hot region's replacement policy
    near_margin: int | None = None  # HiSparseConfig.near_margin (None: resolved per forward)

    def chunk_area(self, num_tokens: int) -> int:
        """HiSparse: device rows a prompt of ``num_tokens`` holds besides its buffer while it is
        prefilled (whole pages). A chunk's positions past HOT go first to the buffer's newest column
        and draft zone (idle until decode), then to these rows."""
        return chunk_rows(hot=self.hot, page_size=self.page_size, chunk=self.prefill_chunk, num_tokens=num_tokens)

    @property
    def device_pages(self) -> int:
        return self.device_tokens // self.page_size

    @property
    def logical_pages(self) -> int:
        return self.logical_tokens // self.page_size

    @property
    def host_pages(self) -> int:
        return self.host_tokens // self.page_size

    @property
    def max_request_len(self) -> int:
        """Locations one request may hold: its context plus the speculative over-allocation."""
        return self.max_context_len + self.draft_tokens


@attrs.frozen
class EngineConfig:
    """Everything the engine needs to start; frozen and validated once."""

    # "tiny" (the bundled model) or a path to an HF-format directory
    model: str = "tiny"
    # a directory whose tokenizer files replace the model's (None: the model directory's own); the
    # end ids still come from the model's config.json and generation_config.json
    tokenizer: str | None = None
    # a Jinja file whose chat template replaces the tokenizer's (None: the checkpoint's own)
    chat_template: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    page_size: int = 16
    # None: the model's max_position_embeddings, lowered to what the pools hold (resolve_for_model)
    max_context_len: int | None = None
    # request rows. None: with a device memory budget, the requests of max_context_len the plan
    # holds at once; without one, 16
    max_running_requests: int | None = None
    # physical device KV slots (excluding the reserved sink page). None: with a device memory
    # budget, what it has left once the request rows are paid; without one, 16384
    device_pool_tokens: int | None = None
    # device memory budget of the memory layer in bytes (KV rows, indexer keys, HiSparse buffers,
    # the draft layer's KV, the tables; not the weights): the pools and rows are derived from it
    # (``pipeline.capacity``), device_pool_tokens / max_running_requests given stay as overrides
    device_memory_bytes: int | None = None
    # CUDA: the budget as this fraction of the device memory free once the weights are loaded
    # (SGLang's mem_fraction_static, vLLM's gpu_memory_utilization, for the KV memory alone)
    device_memory_fraction: float | None = None
    # chunked prefill: a prompt longer than this is prefilled this many tokens per forward (vLLM's
    # long_prefill_token_threshold, SGLang's chunked_prefill_size); None prefills every prompt whole.
    # With HiSparse a request holds at most this chunk plus its buffer in device rows while it is
    # prefilled, whatever its length.
    chunked_prefill_tokens: int | None = DEFAULT_CHUNK
    # the prompt tokens one prefill forward carries over all its requests (vLLM's
    # max_num_batched_tokens for prefill): short prompts share a forward up to it, each request's
    # part at most its chunk. "auto": max(2048, chunked_prefill_tokens), None with whole prompts;
    # None: no bound. Resolved by ``prefill_budget``
    prefill_batch_tokens: int | Literal["auto"] | None = "auto"
    # mixed steps: while requests decode, the next prefill chunk runs in the same forward as their
    # decode step (the step pays its fixed cost once); False runs the two as separate forwards
    mixed_steps: bool = True
    # prefix caching: a finished (or retracted) request's full pages stay cached, and a prompt that
    # starts with the same tokens shares them and prefills only the rest
    prefix_cache: bool = True
    hisparse: HiSparseConfig | None = attrs.field(factory=HiSparseConfig)
    # "auto": SpeculativeConfig() exactly when the model has an MTP layer, else None (resolve_for_model)
    speculative: SpeculativeConfig | Literal["auto"] | None = "auto"
    seed: int = 0
    # torch intra-op threads the executor runs with (None: leave torch's setting). On a shared or
    # small machine an oversubscribed CPU runs many times slower: 1 is best for small models.
    num_threads: int | None = None
    # where the executor's commands run: True in a worker thread of their own (the event loop stays
    # free while a forward runs), False on the event loop itself, between its other work. None:
    # a thread on CUDA and with tensor parallelism (where a command mostly waits on the device or
    # the ranks, without the GIL), the event loop on a CPU (where a forward holds the GIL between
    # its ops, so the loop gets little done beside it, and handing every command to another core
    # and back was measured to cost up to half the decode speed)
    executor_thread: bool | None = None
    # ranks of tensor parallelism: the engine's process is rank 0 and spawns the others
    # (pipeline/distributed/); 1 runs the model in this process alone
    tensor_parallel_size: int = 1
    # the engine, once started, moves every object then alive out of Python's cyclic garbage
    # collector (``gc.freeze``, as SGLang and vLLM do after start-up): the model, torch's and the
    # application's modules are never scanned again, so a full collection during decoding takes
    # milliseconds instead of a pause of 100-150 ms (measured with transformers imported: ~390,000
    # tracked objects). The first engine to freeze after another has closed collects first (what a
    # closed engine left behind is not frozen for good). Process-wide; False leaves the collector alone
    freeze_gc: bool = True

    def __attrs_post_init__(self) -> None:
        _require(
            isinstance(self.model, str) and bool(self.model), "model", self.model, "must be 'tiny' or a path"
        )
        self._check_tokenizer_files()
        _require(self.device in DEVICES, "device", self.device, f"must be one of {DEVICES}")
        _require(self.dtype in DTYPES, "dtype", self.dtype, f"must be one of {DTYPES}")
        _require(
            not (self.dtype == "float64" and self.device == "cuda"),
            "dtype",
            self.dtype,
            "float64 is for exactness checks on the CPU only",
        )
        _require_int("page_size", self.page_size, 1)
        _require(
            self.hisparse is None or isinstance(self.hisparse, HiSparseConfig),
            "hisparse",
            self.hisparse,
            "must be a HiSparseConfig or None (every token's KV on the device)",
        )
        if self.max_context_len is not None:
            _require_int("max_context_len", self.max_context_len, 1)
        self._check_budget()
        if self.max_running_requests is not None:
            _require_int("max_running_requests", self.max_running_requests, 1)
        if self.device_pool_tokens is not None:
            _require_int("device_pool_tokens", self.device_pool_tokens, 1)
            _require(
                self.device_pool_tokens % self.page_size == 0,
                "device_pool_tokens",
                self.device_pool_tokens,
                f"must be a multiple of page_size ({self.page_size})",
            )
        _require(_is_int(self.seed), "seed", self.seed, "must be an integer")
        if self.chunked_prefill_tokens is not None:
            _require_int("chunked_prefill_tokens", self.chunked_prefill_tokens, 1)
        self._check_prefill_batch()
        _require(isinstance(self.prefix_cache, bool), "prefix_cache", self.prefix_cache, "must be True or False")
        _require(isinstance(self.mixed_steps, bool), "mixed_steps", self.mixed_steps, "must be True or False")
        if self.num_threads is not None:
            _require_int("num_threads", self.num_threads, 1)
        _require(isinstance(self.freeze_gc, bool), "freeze_gc", self.freeze_gc, "must be True or False")
        _require(self.executor_thread is None or isinstance(self.executor_thread, bool), "executor_thread",
                 self.executor_thread, "must be True, False or None (by the device)")
        _require_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        _require(
            self.speculative in (None, "auto") or isinstance(self.speculative, SpeculativeConfig),
            "speculative",
            self.speculative,
            "must be a SpeculativeConfig, 'auto' (on when the model has an MTP layer) or None",
        )
        if isinstance(self.speculative, SpeculativeConfig):
            self._check_speculative(self.speculative)
        if self.hisparse is not None:
            self._check_hisparse(self.hisparse)
        # None: checked once resolve_for_model has set them (a budget sizes the pool there)
        elif self.max_context_len is not None and self.device_pool_tokens is not None:
            need = _round_up(self.max_context_len + self._draft_tokens(), self.page_size)
            _require(
                self.device_pool_tokens >= need,
                "device_pool_tokens",
                self.device_pool_tokens,
                f"without HiSparse every token is resident: must hold one request of max_context_len "
                f"plus the draft tokens ({need})",
            )

    def _check_tokenizer_files(self) -> None:
        if self.tokenizer is not None:
            value = self.tokenizer
            _require(isinstance(value, str) and bool(value), "tokenizer", value, "must be a directory path or None")
            _require(Path(value).is_dir(), "tokenizer", value, "no such directory (give one holding tokenizer files)")
        if self.chat_template is not None:
            value = self.chat_template
            _require(isinstance(value, str) and bool(value), "chat_template", value, "must be a file path or None")
            _require(Path(value).is_file(), "chat_template", value, "no such file (give a Jinja template file)")
            _require(os.access(value, os.R_OK), "chat_template", value, "is not readable")

    @property
    def has_budget(self) -> bool:
        return self.device_memory_bytes is not None or self.device_memory_fraction is not None

    def _check_prefill_batch(self) -> None:
        batch, chunk = self.prefill_batch_tokens, self.chunked_prefill_tokens
        if batch is None or batch == "auto":
            return
        _require(_is_int(batch), "prefill_batch_tokens", batch, "must be an integer, 'auto' or None")
        _require(batch >= 1, "prefill_batch_tokens", batch, "must be >= 1")
        _require(chunk is not None, "prefill_batch_tokens", batch,
                 "bounds the chunks of a forward: with whole prompts (chunked_prefill_tokens None) use None")
        _require(batch >= chunk, "prefill_batch_tokens", batch,
                 f"must be at least chunked_prefill_tokens ({chunk}): a forward carries one whole chunk")

    @property
    def prefill_budget(self) -> int | None:
        """The prompt tokens of one prefill forward (``prefill_batch_tokens`` resolved): None, no bound."""
        batch, chunk = self.prefill_batch_tokens, self.chunked_prefill_tokens
        if batch != "auto":
            return batch
        return None if chunk is None else max(DEFAULT_PREFILL_BATCH, chunk)

    def _check_budget(self) -> None:
        if self.device_memory_bytes is not None:
            _require_int("device_memory_bytes", self.device_memory_bytes, 1)
            _require(
                self.device_memory_fraction is None,
                "device_memory_fraction",
                self.device_memory_fraction,
                "give device_memory_bytes or device_memory_fraction, not both",
            )
        if self.device_memory_fraction is not None:
            value = self.device_memory_fraction
            _require(
                isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1,
                "device_memory_fraction",
                value,
                "must be a number in (0, 1): the fraction of the device memory free once the weights are loaded",
            )
            _require(
                self.device == "cuda",
                "device_memory_fraction",
                value,
                "is a fraction of CUDA memory: on a CPU give device_memory_bytes",
            )
        if not self.has_budget:  # the pools are sized in tokens: the defaults apply
            if self.device_pool_tokens is None:
                object.__setattr__(self, "device_pool_tokens", DEFAULT_POOL_TOKENS)
            if self.max_running_requests is None:
                object.__setattr__(self, "max_running_requests", DEFAULT_ROWS)
            hs = self.hisparse
            if isinstance(hs, HiSparseConfig) and hs.host_to_device_ratio is None:
                object.__setattr__(self, "hisparse", attrs.evolve(hs, host_to_device_ratio=DEFAULT_RATIO))

    def shape(self, *, context: int | None = None, ratio: int | None = None) -> Shape:
        """The pools' shape (not their size) for budget sizing; ``context``: max_context_len,
        ``ratio``: host_to_device_ratio (default: the config's)."""
        context = self.max_context_len if context is None else context
        hs = self.hisparse
        return Shape(
            hisparse=hs is not None,
            page=self.page_size,
            hot=0 if hs is None else hs.device_buffer_size,
            ratio=1 if hs is None else ratio or hs.host_to_device_ratio or DEFAULT_RATIO,
            draft_tokens=self._draft_tokens(),
            chunk=_prefill_chunk(self.chunked_prefill_tokens, context),
            context=context,
        )

    def _draft_tokens(self) -> int:
        spec = self.speculative
        return spec.draft_tokens if isinstance(spec, SpeculativeConfig) else 0

    def context_capacity(self) -> int:
        """The longest max_context_len the pools of this config hold (the rules below, solved)."""
        draft = self._draft_tokens()
        if self.hisparse is None:
            return self.device_pool_tokens - draft
        logical = self.device_pool_tokens * self.hisparse.host_to_device_ratio
        if self.chunked_prefill_tokens is None:  # a whole prompt is prefilled in device rows
            return min(self.device_pool_tokens, logical - draft)
        return logical - draft

    def _check_speculative(self, spec: SpeculativeConfig) -> None:
        _require(
            not (spec.eagle_topk > 1 and self.page_size > 1),
            "speculative.eagle_topk",
            spec.eagle_topk,
            f"trees (eagle_topk > 1) need page_size == 1; page_size is {self.page_size}: use a chain",
        )
        _require(
            spec.eagle_topk == 1,
            "speculative.eagle_topk",
            spec.eagle_topk,
            "only chain drafting (eagle_topk == 1) is implemented",
        )

    def _check_hisparse(self, hs: HiSparseConfig) -> None:
        page = self.page_size
        if hs.device_buffer_size is not None:
            _require(
                hs.device_buffer_size % page == 0,
                "hisparse.device_buffer_size",
                hs.device_buffer_size,
                f"must be a multiple of page_size ({page})",
            )
        draft = self._draft_tokens()
        if draft:
            spec = self.speculative
            given = spec.num_draft_tokens is not None  # else D is num_steps + 1: name what the user set
            _require(
                draft <= page - 1,
                "speculative.num_draft_tokens" if given else "speculative.num_steps",
                draft if given else spec.num_steps,
                f"{'' if given else f'num_steps + 1 = {draft} '}verify tokens live in the draft zone of "
                f"page_size - 1 = {page - 1} columns",
            )
        if self.device_pool_tokens is None:  # sized from the budget by resolve_for_model; checked then
            return
        # HOT None is resolved from the model (checked again then): here the least it can become, as
        # what the pool must hold grows with HOT
        hot = hs.device_buffer_size if hs.device_buffer_size is not None else auto_hot(hs.top_k, page)
        buffer_columns = hot + page
        _require(
            self.device_pool_tokens >= buffer_columns,
            "device_pool_tokens",
            self.device_pool_tokens,
            f"must hold one device buffer (device_buffer_size + page_size = {buffer_columns})",
        )
        if self.max_context_len is None:  # checked once resolve_for_model has set it
            return
        chunk = self.max_context_len if self.chunked_prefill_tokens is None else self.chunked_prefill_tokens
        beyond = min(chunk, self.max_context_len - hot)  # a chunk's rows past HOT: newest, draft zone, more
        prefill = max(buffer_columns, hot + _round_up(beyond, page))
        what = (
            "a prompt of max_context_len is prefilled whole"
            if self.chunked_prefill_tokens is None or chunk >= self.max_context_len
            else f"a prompt is prefilled in chunks of chunked_prefill_tokens ({chunk})"
        )
        _require(
            self.device_pool_tokens >= prefill,
            "device_pool_tokens",
            self.device_pool_tokens,
            f"{what}: the device pool must hold one request's hot region and the chunk's rows past "
            f"it ({prefill}); lower chunked_prefill_tokens or raise device_pool_tokens",
        )
        if hs.host_to_device_ratio is None:  # a budget chooses it in resolve_for_model; checked then
            return
        logical = self.device_pool_tokens * hs.host_to_device_ratio
        need = _round_up(self.max_context_len + draft, page)
        _require(
            logical >= need,
            "hisparse.host_to_device_ratio",
            hs.host_to_device_ratio,
            f"the logical and host pools (device_pool_tokens * ratio = {logical}) must hold one request "
            f"of max_context_len plus the draft tokens ({need})",
        )

    def memory_plan(self, model_top_k: int) -> MemoryPlan:
        """Pool sizes for this config and a model whose indexer selects ``model_top_k`` positions.

        Call ``check_against_model`` first: the plan assumes the config passed it.
        """
        hs = self.hisparse
        hot = 0 if hs is None else hs.hot_for(model_top_k, self.page_size)
        ratio = 1 if hs is None else hs.host_to_device_ratio
        return MemoryPlan(
            page_size=self.page_size,
            hot=hot,
            buffer_columns=hot + self.page_size if hs is not None else 0,
            top_k=model_top_k,
            device_tokens=self.device_pool_tokens,
            logical_tokens=self.device_pool_tokens * ratio,
            host_tokens=self.device_pool_tokens * ratio if hs is not None else 0,
            max_context_len=self.max_context_len,
            max_running_requests=self.max_running_requests,
            draft_tokens=self._draft_tokens(),
            hisparse=hs is not None,
            prefill_chunk=_prefill_chunk(self.chunked_prefill_tokens, self.max_context_len),
            prefix_cache=self.prefix_cache,
            policy=DEFAULT_POLICY if hs is None else hs.policy_for(self.device),
            near_margin=None if hs is None else hs.near_margin,
        )


def check_against_model(
    config: EngineConfig, *, index_topk: int | None, has_mtp: bool, max_positions: int | None
) -> None:
    """The rules that need the loaded model; raises ``ConfigError`` naming the field."""
    hs = config.hisparse
    if hs is not None:
        _require(
            index_topk is not None,
            "hisparse",
            hs,
            "HiSparse needs a model with a DSA indexer (index_topk)",
        )
        if hs.top_k is not None:
            _require(
                hs.top_k == index_topk,
                "hisparse.top_k",
                hs.top_k,
                f"must equal the model's index_topk ({index_topk}); another value would change the answer",
            )
        if hs.device_buffer_size is not None:  # None: resolved to hold it (auto_hot)
            _require(
                hs.device_buffer_size >= index_topk,
                "hisparse.device_buffer_size",
                hs.device_buffer_size,
                f"must be >= the model's index_topk ({index_topk})",
            )
    if isinstance(config.speculative, SpeculativeConfig):
        _require(has_mtp, "speculative", config.speculative, NO_MTP_RULE)  # resolve_for_model says why first
    if max_positions is not None and config.max_context_len is not None:
        _require(
            config.max_context_len <= max_positions,
            "max_context_len",
            config.max_context_len,
            f"must be <= the model's max_position_embeddings ({max_positions})",
        )


def _prefill_chunk(chunk: int | None, max_context_len: int | None) -> int:
    """Tokens of one request one prefill forward computes at most (0 while the context is unknown)."""
    if max_context_len is None:
        return chunk or 0
    return max_context_len if chunk is None else min(chunk, max_context_len)


ON_EXIT = ("abort", "finish")


def check_engine_options(
    config: object,
    *,
    max_prefill_tokens: object,
    max_undelivered_tokens: object,
    on_exit: object,
    trace_path: object,
    queue_size: object,
    prefill_pacing: object = False,
) -> None:
    """The keyword arguments of ``Engine(config, ...)``; raises ``ConfigError`` naming the first bad one.

    ``trace_path`` must name a file that can be created: its directory exists and it is not itself a
    directory (the file is opened when the engine starts).
    """
    _require(isinstance(config, EngineConfig), "config", type(config).__name__, "must be an EngineConfig")
    _require_int("max_prefill_tokens", max_prefill_tokens, 1)
    _require(isinstance(prefill_pacing, bool), "prefill_pacing", prefill_pacing, "must be True or False")
    if max_undelivered_tokens is not None:
        _require_int("max_undelivered_tokens", max_undelivered_tokens, 1)
    _require(isinstance(on_exit, str) and on_exit in ON_EXIT, "on_exit", on_exit, f"must be one of {ON_EXIT}")
    if trace_path is not None:
        _require(
            isinstance(trace_path, (str, os.PathLike)) and os.fspath(trace_path) != "",
            "trace_path",
            trace_path,
            "must be a file path or None",
        )
        path = Path(trace_path)
        _require(not path.is_dir(), "trace_path", trace_path, "is a directory: name a file to write")
        where = str(path.parent)
        _require(path.parent.is_dir(), "trace_path", trace_path, f"its directory {where!r} does not exist")
    _require_int("queue_size", queue_size, 1)


NO_MTP_RULE = (
    "speculative decoding needs a model with an MTP layer (num_nextn_predict_layers >= 1) and this one has "
    "none: pass speculative=None (--no-spec on the command line), or keep the default 'auto'"
)
ABSENT_MTP_RULE = (
    "speculative decoding needs the model's MTP layer: config.json names one (num_nextn_predict_layers) "
    "but the checkpoint holds none of its tensors (layer {layer}; a copy re-saved by HF save_pretrained "
    "drops them): pass speculative=None (--no-spec on the command line), or keep the default 'auto'"
)


def no_mtp_rule(model_cfg: Any) -> str:
    """Why ``model_cfg`` cannot speculate: no MTP layer, or one config.json names and the weights lack."""
    if getattr(model_cfg, "absent_mtp_layers", 0):
        return ABSENT_MTP_RULE.format(layer=model_cfg.num_hidden_layers)
    return NO_MTP_RULE


def resolve_for_model(config: EngineConfig, model_cfg: Any, *, log_choices: bool = True) -> EngineConfig:
    """``config`` with its model-dependent defaults filled in (call it where the model is loaded).

    * ``speculative="auto"`` -> ``SpeculativeConfig()`` if the model has an MTP layer, else ``None``;
      an explicit ``SpeculativeConfig`` for a model without one is a ``ConfigError`` naming
      ``speculative``. An MTP layer config.json names but the weights lack (``absent_mtp_layers``)
      counts as none: "auto" then also logs the warning ``model.mtp_missing``;
    * ``max_context_len=None`` -> the model's ``max_position_embeddings``, lowered to what the pools
      hold (``EngineConfig.context_capacity``);
    * ``hisparse.device_buffer_size=None`` -> ``auto_hot``: 128, or the model's ``index_topk`` in
      whole pages when that is more (the config's rules on HOT are checked again with it).

    Each choice is logged. ``model_cfg`` is the model's ``ModelConfig`` (``num_nextn_predict_layers``,
    ``max_position_embeddings``).
    """
    has_mtp = model_cfg.num_nextn_predict_layers > 0
    absent = getattr(model_cfg, "absent_mtp_layers", 0)
    spec = config.speculative
    if spec == "auto":
        spec = SpeculativeConfig() if has_mtp else None
        if log_choices:
            reason = "the model has an MTP layer" if has_mtp else "the model has no MTP layer"
            if absent:
                reason = "config.json names an MTP layer but the checkpoint holds none of its tensors"
                log.warning("model.mtp_missing", model=config.model, layer=model_cfg.num_hidden_layers,
                            num_nextn_predict_layers=absent, speculative="off")
            log.info("config.speculative", speculative="on" if has_mtp else "off", reason=reason)
    elif spec is not None:
        _require(has_mtp, "speculative", spec, no_mtp_rule(model_cfg))
    config = _resolve_hot(config, model_cfg, log_choices)
    changes: dict[str, Any] = {"speculative": spec}
    if config.has_budget:
        return _resolve_budget(config, model_cfg, spec, log_choices)
    if config.max_context_len is None:
        positions = model_cfg.max_position_embeddings
        capacity = attrs.evolve(config, speculative=spec).context_capacity()
        context = min(positions, capacity)
        if log_choices:
            log.info(
                "config.max_context_len",
                max_context_len=context,
                max_position_embeddings=positions,
                pool_capacity=capacity,
                lowered_to_fit_the_pools=context < positions,
            )
        changes["max_context_len"] = context
    return attrs.evolve(config, **changes)


def _resolve_hot(config: EngineConfig, model_cfg: Any, log_choices: bool) -> EngineConfig:
    """``config`` with HOT set (``auto_hot``) when ``hisparse.device_buffer_size`` is None."""
    hs = config.hisparse
    if hs is None or hs.device_buffer_size is not None:
        return config
    top_k = getattr(model_cfg, "index_topk", None)
    hot = auto_hot(top_k, config.page_size)
    if log_choices:
        log.info("config.hisparse.device_buffer_size", device_buffer_size=hot, index_topk=top_k,
                 page_size=config.page_size, raised_to_hold_the_top_k=hot > auto_hot(0, config.page_size))
    return attrs.evolve(config, hisparse=attrs.evolve(hs, device_buffer_size=hot))


def _resolve_budget(
    config: EngineConfig, model_cfg: Any, spec: SpeculativeConfig | None, log_choices: bool
) -> EngineConfig:
    """A budgeted config's pools: ``max_context_len`` (None: the model's positions, lowered to what
    the budget holds), ``host_to_device_ratio`` (None: the one that seats the most requests of
    max_context_len, the smallest of equals), then the device pool and request rows the budget pays
    for."""
    config = attrs.evolve(config, speculative=spec)
    dims = ModelDims.of_config(model_cfg, config)
    budget = device_budget(config.device_memory_bytes, config.device_memory_fraction, config.device)
    hs = config.hisparse
    context = config.max_context_len
    if context is None:
        positions = model_cfg.max_position_embeddings
        widest = None if hs is None or hs.host_to_device_ratio is not None else MAX_RATIO
        context = longest_context(budget, config.shape(context=positions, ratio=widest), dims, positions) or positions
        if log_choices:
            log.info("config.max_context_len", max_context_len=context, max_position_embeddings=positions,
                     lowered_to_fit_the_budget=context < positions)
    overrides = dict(slots=config.device_pool_tokens, rows=config.max_running_requests)
    changes: dict[str, Any] = {}
    if hs is not None and hs.host_to_device_ratio is None:
        ratio = _best_ratio(budget, config, context, dims, overrides)
        changes["hisparse"] = hs = attrs.evolve(hs, host_to_device_ratio=ratio)
    slots, rows = size_for_budget(budget, attrs.evolve(config, **changes).shape(context=context), dims, **overrides)
    if log_choices:
        log.info("config.device_budget", device_memory_bytes=budget, device_pool_tokens=slots,
                 max_running_requests=rows, max_context_len=context,
                 host_to_device_ratio=None if hs is None else hs.host_to_device_ratio)
    return attrs.evolve(
        config, max_context_len=context, device_pool_tokens=slots, max_running_requests=rows,
        device_memory_bytes=budget, device_memory_fraction=None, **changes,  # the budget measured, kept
    )


def _best_ratio(budget: int, config: EngineConfig, context: int, dims: ModelDims, overrides: dict[str, Any]) -> int:
    """The host_to_device_ratio whose pools seat the most requests of ``context`` in ``budget``."""
    best, best_seats = DEFAULT_RATIO, -1
    for ratio in range(1, MAX_RATIO + 1):
        shape = config.shape(context=context, ratio=ratio)
        try:
            slots, rows = size_for_budget(budget, shape, dims, **overrides)
        except ConfigError:
            continue
        seats = min(rows, held_requests(shape, slots))
        if seats > best_seats:
            best, best_seats = ratio, seats
    return best
