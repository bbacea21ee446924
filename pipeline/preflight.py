"""Start-up's checks of the model's files and of the machine; each mistake a ``ConfigError`` naming its field.

``EngineConfig`` checks its own values when it is built; start-up (``pipeline.startup``) checks here
what needs the model's files or the machine, before any weight is loaded or memory allocated:

* ``model``: an injected model is a ``DeepseekV32`` on the configured device (``check_model``, the
  engine's); a model to load is ``"tiny"`` or an existing directory with a ``config.json`` that
  reads strictly (every field of its type and in its range), whose end ids (``config.json``'s and
  ``generation_config.json``'s ``eos_token_id``) are ids of the model's vocabulary;
* ``device``: ``"cuda"`` needs a CUDA build of torch and a visible device;
* memory: the bytes the memory layer will allocate for the plan (``estimate_memory``) must fit in
  the memory available now (host RAM, and the CUDA device's free memory on CUDA); the error names
  the field whose allocations dominate, ``device_pool_tokens`` (the pools) or
  ``max_running_requests`` (the per-request tables and buffers).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from pipeline.capacity import REQUEST, DevicePlan, format_bytes
from pipeline.config import EngineConfig
from pipeline.errors import ConfigError

if TYPE_CHECKING:
    from pipeline.model import ModelConfig

INT64, INT32 = 8, 4
# Python bookkeeping of one page in a paged allocator: a free-list entry (pointer and int object)
# and an owner entry.
PAGE_BOOKKEEPING_BYTES = 48
POOL_FIELD, ROWS_FIELD = "device_pool_tokens", "max_running_requests"


def model_config(config: EngineConfig, model: Any = None) -> ModelConfig:
    """The model's dimensions, checked before any weight is read: the device (a budget may measure
    it), the injected model's ``cfg`` or else ``config.json`` and its end ids, then the ranks.
    Whether an injected object is a model at all is the engine's check (``check_model``)."""
    check_device(config)
    if model is not None:
        model_cfg = model.cfg
    else:
        model_cfg = read_model_config(config.model)
        check_end_ids(config.model, model_cfg)
    check_tensor_parallel(config, model_cfg)
    return model_cfg


def check_tensor_parallel(config: EngineConfig, model_cfg: Any) -> None:
    """Every rank needs at least one attention head, and on CUDA a device of its own."""
    size = config.tensor_parallel_size
    if size == 1:
        return
    heads = model_cfg.num_attention_heads
    if size > heads:
        raise ConfigError("tensor_parallel_size", size, f"exceeds the model's {heads} attention heads")
    if config.device == "cuda":
        import torch

        from pipeline.distributed.environment import launch_env

        launched = launch_env()  # launched over several machines: this one's ranks
        here = size if launched is None else launched.local_world_size or launched.local_rank + 1
        visible = torch.cuda.device_count()
        if here > visible:
            on = "" if launched is None else f" on this machine ({here})"
            raise ConfigError(
                "tensor_parallel_size", size, f"needs a CUDA device per rank{on}; {visible} visible"
            )


def check_device(config: EngineConfig) -> None:
    if config.device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        why = (
            "this torch build has no CUDA support"
            if torch.version.cuda is None
            else "no CUDA device is visible"
        )
        raise ConfigError("device", config.device, f"CUDA is not available ({why}); use device='cpu'")


def check_model(config: EngineConfig, model: Any) -> None:
    """An injected model: a built model (a ``DeepseekV32``, or anything serving as one: it carries a
    ``ModelConfig`` as ``cfg``), on the configured device (its dtype is checked on use)."""
    from pipeline.model import ModelConfig

    if not isinstance(getattr(model, "cfg", None), ModelConfig):
        raise ConfigError(
            "model",
            type(model).__name__,
            "must be a built DeepseekV32 (a path or name goes in EngineConfig.model)",
        )
    device = getattr(model, "device", None)
    if device is not None and getattr(device, "type", device) != config.device:
        raise ConfigError(
            "model", f"<model on {device}>", f"must be on the configured device ({config.device})"
        )


def read_model_config(name: str) -> ModelConfig:
    """The model's dimensions from its ``config.json``, without loading any weights."""
    from pipeline.model import ModelConfig
    from pipeline.model.config import BUNDLED_MODELS

    if name not in BUNDLED_MODELS:
        path = Path(name)
        if not path.is_dir():
            raise ConfigError(
                "model",
                name,
                f"no such directory (give an HF-format model directory, or one of {sorted(BUNDLED_MODELS)})",
            )
        if not (path / "config.json").is_file():
            raise ConfigError("model", name, "has no config.json: not an HF-format model directory")
    try:
        return ModelConfig.from_dir(name)
    except ConfigError:
        raise  # already names the model and the problem
    except (
        OSError,
        ValueError,
        KeyError,
        TypeError,
    ) as exc:  # JSON errors and unsupported values are ValueErrors
        raise ConfigError("model", name, f"config.json cannot be used: {type(exc).__name__}: {exc}") from None


def check_end_ids(name: str, model_cfg: ModelConfig) -> None:
    """Every ``eos_token_id`` of the model's ``config.json`` and ``generation_config.json`` is an id
    of its vocabulary (``ConfigError`` on ``model`` naming the file and the id)."""
    from pipeline.model.config import resolve_model_dir
    from pipeline.model.tokenizer import end_token_ids

    end_token_ids(resolve_model_dir(name), vocab_size=model_cfg.vocab_size)


# --- memory -----------------------------------------------------------------------------------------


@attrs.frozen
class Allocation:
    name: str
    num_bytes: int
    on_device: bool  # False: host memory (the same RAM as the device on a CPU machine)
    field: str  # the config field it grows with


@attrs.frozen
class MemoryEstimate:
    allocations: tuple[Allocation, ...]

    @property
    def device_bytes(self) -> int:
        return sum(a.num_bytes for a in self.allocations if a.on_device)

    @property
    def host_bytes(self) -> int:
        return sum(a.num_bytes for a in self.allocations if not a.on_device)

    @property
    def total_bytes(self) -> int:
        return self.device_bytes + self.host_bytes

    def dominant_field(self, *, on_device: bool | None = None) -> str:
        """The config field whose allocations weigh most (among the device or host ones if given)."""
        weights: dict[str, int] = {}
        for a in self.allocations:
            if on_device is None or a.on_device == on_device:
                weights[a.field] = weights.get(a.field, 0) + a.num_bytes
        return max(weights, key=weights.__getitem__)

    def summary(self, *, on_device: bool | None = None, limit: int = 3) -> str:
        chosen = [a for a in self.allocations if on_device is None or a.on_device == on_device]
        chosen.sort(key=lambda a: -a.num_bytes)
        return ", ".join(f"{a.name} {format_bytes(a.num_bytes)}" for a in chosen[:limit])


def estimate_memory(config: EngineConfig, device_plan: DevicePlan) -> MemoryEstimate:
    """The tensors (and page lists) the memory layer allocates for ``device_plan`` (an
    ``EnginePlan.device``): the device structures of the plan (``pipeline.capacity``: KV rows,
    indexer keys, device buffers, the draft layer's pool, the device copies of the tables), and on
    the host the host pool, the tables of record (the device copies are those very tensors on a
    CPU) and the logical-to-physical map."""
    plan, dims = device_plan.plan, device_plan.dims
    p, rows, max_len = plan.page_size, plan.max_running_requests, plan.max_request_len
    table = rows * max_len * INT64
    out = [
        Allocation(s.name, s.num_bytes, True, ROWS_FIELD if s.unit == REQUEST else POOL_FIELD)
        for s in device_plan.structures
    ]

    def add(name: str, num_bytes: int, field: str) -> None:
        out.append(Allocation(name, num_bytes, False, field))

    physical_pages = plan.device_tokens // p + 1  # page 0, the sink, is extra
    separate = config.device != "cpu"  # on a CPU the device copies of the tables are the tables
    if plan.hisparse:
        logical_pages = plan.logical_tokens // p + 1
        add("host pool", dims.num_layers * plan.host_tokens * dims.row_bytes, POOL_FIELD)
        if dims.mtp_layers and dims.draft_rows_on_host:
            draft_rows = (plan.logical_tokens + p) * dims.row_bytes
            add("draft layer KV rows (host)", draft_rows, POOL_FIELD)
        if dims.mtp_layers and dims.draft_keys_on_host:
            draft_keys = (plan.logical_tokens + p) * dims.key_bytes
            add("draft layer indexer keys (host)", draft_keys, POOL_FIELD)
        if separate:
            add("token and host tables", 2 * table, ROWS_FIELD)
        add("logical-to-physical map", (logical_pages * p + 1) * INT64, POOL_FIELD)
        page_lists = logical_pages + physical_pages + plan.host_pages
        add("page lists", page_lists * PAGE_BOOKKEEPING_BYTES, POOL_FIELD)
    else:
        if separate:
            add("token table", table, ROWS_FIELD)
        add("page lists", physical_pages * PAGE_BOOKKEEPING_BYTES, POOL_FIELD)
    return MemoryEstimate(tuple(out))


def check_memory(
    config: EngineConfig,
    device_plan: DevicePlan,
    *,
    host_available: int | None = None,
    device_available: int | None = None,
    replicas: int = 1,
) -> MemoryEstimate:
    """Refuse a plan whose memory layer would not fit in the memory available now.

    ``host_available`` / ``device_available`` default to what the machine reports (None when it
    reports nothing: that check is skipped). On a CPU machine the device pools are host memory too.
    Under tensor parallelism every rank allocates the whole memory layer (the latent KV is
    replicated): once in host memory for each rank on this machine, once on each rank's device; but
    the host pool once, when the machine's ranks share it (``shared_host_pool``). ``replicas``:
    data-parallel engines of that many ranks each on this machine, all starting at once (each on
    devices of its own, all in its host memory).
    """
    estimate = estimate_memory(config, device_plan)
    sizes = {POOL_FIELD: device_plan.plan.device_tokens, ROWS_FIELD: device_plan.plan.max_running_requests}
    ranks = _ranks_on_this_machine(config)
    per = f" ({ranks} ranks)" if ranks > 1 else ""
    if replicas > 1:
        per = f" ({replicas} replicas" + (f" of {ranks} ranks)" if ranks > 1 else ")")
    pool = sum(a.num_bytes for a in estimate.allocations if a.name == "host pool")
    once = (ranks - 1) * pool if ranks > 1 and config.shared_host_pool else 0  # the others' copies, not made
    host = available_host_memory() if host_available is None else host_available
    if config.device == "cpu":
        need = replicas * (ranks * estimate.total_bytes - once)
        _refuse_if_short(sizes, estimate, need, host, None, f"memory{per}")
        return estimate
    device = available_device_memory() if device_available is None else device_available
    _refuse_if_short(sizes, estimate, estimate.device_bytes, device, True, f"{config.device} memory")
    need = replicas * (ranks * estimate.host_bytes - once)
    _refuse_if_short(sizes, estimate, need, host, False, f"host memory{per}")
    return estimate


def _ranks_on_this_machine(config: EngineConfig) -> int:
    """The tensor-parallel ranks whose memory this machine holds: all of them when the engine spawns
    them, this machine's share when a launcher placed them over several (its ``LOCAL_WORLD_SIZE``;
    every rank when it does not say)."""
    from pipeline.distributed.environment import launch_env

    launched = launch_env()
    if launched is None or launched.local_world_size is None:
        return config.tensor_parallel_size
    return launched.local_world_size


def _refuse_if_short(
    sizes: dict[str, int],
    estimate: MemoryEstimate,
    need: int,
    available: int | None,
    on_device: bool | None,
    where: str,
) -> None:
    if available is None or need <= available:
        return
    field = estimate.dominant_field(on_device=on_device)
    raise ConfigError(
        field,
        sizes[field],  # the plan's size, which the config may have left to a budget or a default
        f"the memory layer would allocate {format_bytes(need)} of {where} "
        f"({estimate.summary(on_device=on_device)}), more than the {format_bytes(available)} available now",
    )


def available_host_memory() -> int | None:
    """Bytes of RAM that can be allocated now: the least of the kernel's MemAvailable and the room
    left under this process's cgroup limit (None if the machine reports neither)."""
    found: list[int] = []
    meminfo = _read("/proc/meminfo")
    for line in (meminfo or "").splitlines():
        if line.startswith("MemAvailable:"):
            found.append(int(line.split()[1]) * 1024)
    if not found:
        with contextlib.suppress(AttributeError, ValueError, OSError):  # no such sysconf name here
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    limit, current = _read("/sys/fs/cgroup/memory.max"), _read("/sys/fs/cgroup/memory.current")
    if limit and current and limit.strip().isdigit() and current.strip().isdigit():
        reclaimable = 0
        for line in (_read("/sys/fs/cgroup/memory.stat") or "").splitlines():
            key, _, value = line.partition(" ")
            if key == "inactive_file" and value.strip().isdigit():
                reclaimable = int(value)
        found.append(max(0, int(limit) - int(current) + reclaimable))
    return min(found) if found else None


def available_device_memory() -> int | None:
    """Free bytes on the current CUDA device (None without one)."""
    import torch

    if not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info()
    return int(free)




def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None
