"""Frozen, validated engine configuration: what the user wrote, never changed afterwards.

Every rule that can be checked without the model is checked when the object is built; the rules
that need the model (``top_k`` against ``index_topk``, an MTP layer for speculative decoding, the
context limit against the model's positions) are checked by ``check_against_model`` at start-up,
and those that need the machine (device, memory) by ``pipeline.preflight``.
``check_engine_options`` checks the engine's keyword arguments. A violation raises ``ConfigError``
naming the field, the value and the rule.

Three defaults come from the model: ``speculative="auto"`` (on exactly when it has an MTP layer),
``max_context_len=None`` (its positions, as far as the pools hold) and
``hisparse.device_buffer_size=None`` (HOT: 128, or the indexer's top-k in whole pages when that is
more). Those and every size derived from the config (pools, rows, the ratio a budget chooses) are
resolved once at start-up into an ``EnginePlan`` (``pipeline.startup``), never written back here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, TypeGuard

import attrs
import structlog

from kernels.kv_fp8 import KV_CACHE_DTYPES
from kernels.swap_in_policy import DEFAULT_POLICY, POLICIES
from pipeline.errors import ConfigError
from pipeline.pool_sizes import DEFAULT_RATIO, check_pools

log = structlog.get_logger("hispec.config")

DEFAULT_CHUNK = 512  # chunked_prefill_tokens
DEFAULT_PREFILL_BATCH = 2048  # prefill_batch_tokens="auto" (the least of it, with a chunk of 512 or less)
DEFAULT_POOL_TOKENS, DEFAULT_ROWS = 16384, 16  # without a device memory budget (and DEFAULT_RATIO)
# SpeculativeConfig's "auto" limits: requests stepped together (CPU, CUDA), tokens a request holds (CPU)
CPU_SPEC_MAX_BATCH, CUDA_SPEC_MAX_BATCH = 1, 8
CPU_SPEC_MAX_CONTEXT = 1024
CPU_DEFAULT_POLICY = "adaptive"  # HiSparseConfig.policy="auto" on a CPU
DEFAULT_HOT = 128  # HiSparseConfig.device_buffer_size=None: at least this many hot columns (auto_hot)
RESIDENCIES = ("always", "dynamic")  # HiSparseConfig.residency
DTYPES = ("float32", "bfloat16", "float16", "float64")
DEVICES = ("cpu", "cuda")


def _require(ok: bool, field: str, value: object, rule: str) -> None:
    if not ok:
        raise ConfigError(field, value, rule)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _require_int(field: str, value: object, minimum: int) -> None:
    if not _is_int(value):
        raise ConfigError(field, value, "must be an integer")
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
    # larger of 128 and the model's index_topk, in whole pages (``auto_hot``, at start-up)
    device_buffer_size: int | None = None
    # logical (and host) pool = device pool * ratio. None: with a device memory budget, the ratio
    # that seats the most requests of max_context_len; without one, 4
    host_to_device_ratio: int | None = None
    # None = the model's index_topk; when given it must equal it (HiSparse never changes the answer)
    top_k: int | None = None
    # the hot region's replacement policy (kernels.swap_in_policy; docs/cache-policy.md). "auto":
    # "adaptive" on a CPU (fewer misses than LRU on the bundled model's traces at the same decode
    # speed), "lru" on CUDA (where the Triton swap-in has not been timed against it yet)
    # (``policy_for``; figures: docs/performance-notes.md)
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
    # where a decoding request's KV lives. "always": every request decodes through its hot buffer
    # over the host copy. "dynamic": a request keeps its whole context on the device while the
    # device pool holds it (no swap-in), and is demoted to the hot buffer only under memory pressure
    # (a request that cannot be admitted or cannot grow), promoted back when memory returns
    # (docs/residency.md)
    residency: str = "always"

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
        _require(self.residency in RESIDENCIES, "hisparse.residency", self.residency,
                 f"must be one of {RESIDENCIES}")
        for name in ("draft_rows_on_host", "draft_keys_on_host"):
            value = getattr(self, name)
            _require(isinstance(value, bool), f"hisparse.{name}", value, "must be a bool")
        _require(self.draft_rows_on_host or not self.draft_keys_on_host, "hisparse.draft_keys_on_host",
                 self.draft_keys_on_host,
                 "needs hisparse.draft_rows_on_host (the keys go to the host with the rows)")
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
    # adds. "auto": None on CUDA; 1024 on a CPU, about where a round of the bundled model served
    # alone stops paying (``for_device``; figures: docs/performance-notes.md).
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
            value = getattr(self, name)
            _require(isinstance(value, bool), f"speculative.{name}", value, "must be a bool")
        _require_int("speculative.eagle_topk", self.eagle_topk, 1)
        if self.min_accept_length is not None:
            value = self.min_accept_length
            _require(
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and 1 <= value <= self.num_steps + 1,
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
        auto_batch = CPU_SPEC_MAX_BATCH if cpu else CUDA_SPEC_MAX_BATCH
        batch = auto_batch if self.max_batch_size == "auto" else self.max_batch_size
        context = (CPU_SPEC_MAX_CONTEXT if cpu else None) if self.max_context == "auto" else self.max_context
        return attrs.evolve(self, max_batch_size=batch, max_context=context)


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
    # how KV rows and indexer keys are stored: "auto" in ``dtype``; "fp8_e4m3" ("fp8") in
    # DeepSeek-V3.2's FP8 layouts (an MLA row of 512 + 64 in 656 bytes, an indexer key of 128 in
    # 132), quantized as they are written and dequantized inside attention and the indexer
    kv_cache_dtype: str = "auto"
    page_size: int = 16
    # None: the model's max_position_embeddings, lowered to what the pools hold (at start-up)
    max_context_len: int | None = None
    # request rows. None: with a device memory budget, the requests of max_context_len the plan
    # holds at once; without one, 16
    max_running_requests: int | None = None
    # physical device KV slots (excluding the reserved sink page). None: with a device memory
    # budget, what it has left once the request rows are paid; without one, 16384
    device_pool_tokens: int | None = None
    # device memory budget of the memory layer in bytes (KV rows, indexer keys, HiSparse buffers,
    # the draft layer's KV, the tables; not the weights): the pools and rows are derived from it
    # (``pipeline.pool_sizes``), device_pool_tokens / max_running_requests given stay as overrides
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
    # None: no bound. Resolved at start-up (``EnginePlan.prefill_budget``)
    prefill_batch_tokens: int | Literal["auto"] | None = "auto"
    # mixed steps: while requests decode, the next prefill chunk runs in the same forward as their
    # decode step (the step pays its fixed cost once); False runs the two as separate forwards
    mixed_steps: bool = True
    # prefix caching: a finished (or retracted) request's full pages stay cached, and a prompt that
    # starts with the same tokens shares them and prefills only the rest
    prefix_cache: bool = True
    hisparse: HiSparseConfig | None = attrs.field(factory=HiSparseConfig)
    # "auto": SpeculativeConfig() exactly when the model has an MTP layer, else None (at start-up)
    speculative: SpeculativeConfig | Literal["auto"] | None = "auto"
    seed: int = 0
    # torch intra-op threads the executor runs with (None: leave torch's setting). On a shared or
    # small machine an oversubscribed CPU runs many times slower: 1 is best for small models.
    num_threads: int | None = None
    # where the executor's commands run: None (the default) and True in the executor actor's own
    # thread on every device (the event loop, the application's too, stays free while a forward
    # runs: its ops and compiled loops let go of the GIL), False on the event loop itself, between
    # its other work (each command holds the loop for its whole length; no hand-off to the thread)
    executor_thread: bool | None = None
    # plain decode steps replayed from CUDA graphs, one per padded batch size (all-resident) or per
    # batch size (HiSparse; a batch with a FULL row runs eagerly): pipeline/graphs.py, docs/cuda.md,
    # "CUDA graphs". Off by default until a device has run the capture; on a CPU the same fixed-size
    # inputs run eagerly
    cuda_graphs: bool = False
    # ranks of tensor parallelism: the engine's process is rank 0 and spawns the others
    # (pipeline/distributed/); 1 runs the model in this process alone
    tensor_parallel_size: int = 1
    # HiSparse under tensor parallelism: the ranks of a node hold one host pool between them, in
    # shared memory, written once per node (pipeline/distributed/shared_pool.py); False gives each
    # rank its own. Nothing changes with one rank on a node or without HiSparse
    shared_host_pool: bool = True
    # the engine, once started, moves every object then alive out of Python's cyclic garbage
    # collector (``gc.freeze``, as SGLang and vLLM do after start-up): the model, torch's and the
    # application's modules are never scanned again, so a full collection during decoding no longer
    # pauses it to scan the hundreds of thousands of objects a process with transformers imported
    # tracks (docs/performance-notes.md). The first engine to freeze after another has closed
    # collects first (what a closed engine left behind is not frozen for good). Process-wide; False
    # leaves the collector alone
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
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", self.kv_cache_dtype,
                 f"must be one of {KV_CACHE_DTYPES}")
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
        _require(
            isinstance(self.prefix_cache, bool), "prefix_cache", self.prefix_cache, "must be True or False"
        )
        _require(isinstance(self.mixed_steps, bool), "mixed_steps", self.mixed_steps, "must be True or False")
        if self.num_threads is not None:
            _require_int("num_threads", self.num_threads, 1)
        _require(isinstance(self.freeze_gc, bool), "freeze_gc", self.freeze_gc, "must be True or False")
        _require(self.executor_thread is None or isinstance(self.executor_thread, bool), "executor_thread",
                 self.executor_thread, "must be True, False or None (the default: the executor's thread)")
        _require_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        _require(isinstance(self.cuda_graphs, bool), "cuda_graphs", self.cuda_graphs, "must be True or False")
        if self.cuda_graphs:
            _require(self.tensor_parallel_size == 1, "cuda_graphs", self.cuda_graphs,
                     "runs in one process only: set tensor_parallel_size=1")
        _require(isinstance(self.shared_host_pool, bool), "shared_host_pool", self.shared_host_pool,
                 "must be True or False")
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
        self._check_pools()

    def _check_tokenizer_files(self) -> None:
        if self.tokenizer is not None:
            value = self.tokenizer
            _require(
                isinstance(value, str) and bool(value), "tokenizer", value, "must be a directory path or None"
            )
            _require(Path(value).is_dir(), "tokenizer", value,
                     "no such directory (give one holding tokenizer files)")
        if self.chat_template is not None:
            value = self.chat_template
            _require(
                isinstance(value, str) and bool(value), "chat_template", value, "must be a file path or None"
            )
            _require(
                Path(value).is_file(), "chat_template", value, "no such file (give a Jinja template file)"
            )
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
        if chunk is None:
            raise ConfigError("prefill_batch_tokens", batch, "bounds the chunks of a forward: with whole "
                              "prompts (chunked_prefill_tokens None) use None")
        _require(batch >= chunk, "prefill_batch_tokens", batch,
                 f"must be at least chunked_prefill_tokens ({chunk}): a forward carries one whole chunk")

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
                "must be a number in (0, 1): the fraction of the device memory free once the weights are "
                "loaded",
            )
            _require(
                self.device == "cuda",
                "device_memory_fraction",
                value,
                "is a fraction of CUDA memory: on a CPU give device_memory_bytes",
            )

    def _draft_tokens(self) -> int:
        spec = self.speculative
        return spec.draft_tokens if isinstance(spec, SpeculativeConfig) else 0

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
        if isinstance(self.speculative, SpeculativeConfig):  # "auto": checked once start-up resolves it
            check_draft_zone(self.speculative, page)

    def _check_pools(self) -> None:
        """The pools hold one request, on the sizes given; a None a budget or the model decides is
        checked by start-up once it is known."""
        hs = self.hisparse

        def given(value: int | None, default: int) -> int | None:  # without a budget the defaults apply
            return default if value is None and not self.has_budget else value

        check_pools(
            hisparse=hs is not None,
            page_size=self.page_size,
            # HOT None is resolved from the model: here the least it can become (the pool grows with HOT)
            hot=0 if hs is None else hs.hot_for(hs.top_k, self.page_size),
            draft_tokens=self._draft_tokens(),
            device_pool_tokens=given(self.device_pool_tokens, DEFAULT_POOL_TOKENS),
            max_context_len=self.max_context_len,
            host_to_device_ratio=None if hs is None else given(hs.host_to_device_ratio, DEFAULT_RATIO),
            chunked_prefill_tokens=self.chunked_prefill_tokens,
        )


def check_draft_zone(spec: SpeculativeConfig, page_size: int) -> None:
    """HiSparse: a round's verify tokens fit the draft zone of the device buffer (page_size - 1 columns)."""
    draft = spec.draft_tokens
    given = spec.num_draft_tokens is not None  # else D is num_steps + 1: name what the user set
    _require(
        draft <= page_size - 1,
        "speculative.num_draft_tokens" if given else "speculative.num_steps",
        draft if given else spec.num_steps,
        f"{'' if given else f'num_steps + 1 = {draft} '}verify tokens live in the draft zone of "
        f"page_size - 1 = {page_size - 1} columns",
    )


def check_against_model(
    config: EngineConfig, *, index_topk: int | None, has_mtp: bool, max_positions: int | None
) -> None:
    """The rules that need the loaded model; raises ``ConfigError`` naming the field."""
    hs = config.hisparse
    if hs is not None:
        if index_topk is None:
            raise ConfigError("hisparse", hs, "HiSparse needs a model with a DSA indexer (index_topk)")
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
        _require(has_mtp, "speculative", config.speculative, NO_MTP_RULE)  # start-up says why first
    if max_positions is not None and config.max_context_len is not None:
        _require(
            config.max_context_len <= max_positions,
            "max_context_len",
            config.max_context_len,
            f"must be <= the model's max_position_embeddings ({max_positions})",
        )


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
        if not (isinstance(trace_path, (str, os.PathLike)) and os.fspath(trace_path) != ""):
            raise ConfigError("trace_path", trace_path, "must be a file path or None")
        path = Path(trace_path)
        _require(not path.is_dir(), "trace_path", trace_path, "is a directory: name a file to write")
        where = str(path.parent)
        _require(path.parent.is_dir(), "trace_path", trace_path, f"its directory {where!r} does not exist")
    _require_int("queue_size", queue_size, 1)


def speculative_for(
    config: EngineConfig, model_cfg: Any, *, log_choice: bool = False
) -> SpeculativeConfig | None:
    """The speculative decoding a model of ``model_cfg`` (its ``ModelConfig``) runs: ``"auto"`` is
    ``SpeculativeConfig()`` when it has an MTP layer, else None (an MTP layer config.json names but
    the weights lack, ``absent_mtp_layers``, counts as none: with ``log_choice`` that is the warning
    ``model.mtp_missing``); an explicit ``SpeculativeConfig`` for a model without one is a
    ``ConfigError`` naming ``speculative`` and saying why."""
    has_mtp = model_cfg.num_nextn_predict_layers > 0
    spec = config.speculative
    if spec != "auto":
        if spec is not None and not has_mtp:
            raise ConfigError("speculative", spec, no_mtp_rule(model_cfg))
        return spec
    if log_choice:
        reason = "the model has an MTP layer" if has_mtp else "the model has no MTP layer"
        absent = getattr(model_cfg, "absent_mtp_layers", 0)
        if absent:
            reason = "config.json names an MTP layer but the checkpoint holds none of its tensors"
            log.warning("model.mtp_missing", model=config.model, layer=model_cfg.num_hidden_layers,
                        num_nextn_predict_layers=absent, speculative="off")
        log.info("config.speculative", speculative="on" if has_mtp else "off", reason=reason)
    return SpeculativeConfig() if has_mtp else None


def hot_for(config: EngineConfig, model_cfg: Any, *, log_choice: bool = False) -> int:
    """HOT for a model of ``model_cfg``: ``hisparse.device_buffer_size``, or when it is None
    ``auto_hot`` of the model's ``index_topk`` (logged with ``log_choice``); 0 without HiSparse."""
    hs = config.hisparse
    if hs is None:
        return 0
    hot = hs.hot_for(model_cfg.index_topk, config.page_size)
    if log_choice and hs.device_buffer_size is None:
        log.info("config.hisparse.device_buffer_size", device_buffer_size=hot,
                 index_topk=model_cfg.index_topk, page_size=config.page_size,
                 raised_to_hold_the_top_k=hot > auto_hot(0, config.page_size))
    return hot


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
