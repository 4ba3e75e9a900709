"""MFS configuration: one dataclass tree, loaded from YAML in one place and validated with clear errors.

Every policy knob an operator sets lives here (docs/CONFIG.md); `developer` holds the local engine's implementation
toggles. What eval's compared systems change beyond these is composed in eval from the core's objects, never read
here. Nothing else reads the environment or parses YAML for settings.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration problem; the message names the offending key path."""


@dataclass(slots=True)
class MemberLimit:
    floor_pages: int = 0                 # pages always kept available to this member (reserved from others)
    ceiling_pages: int | None = None     # at most this many pages in use by this member


@dataclass(slots=True)
class PoolConfig:
    page_bytes: int = 16384              # one page = one layer's K and V for one block of tokens
    kv_memory_mb: float = 64.0           # arena size, used when num_pages is not set
    num_pages: int | None = None
    host_tier_mb: float = 256.0          # 0 disables the host tier
    disk_tier_mb: float = 0.0            # 0 disables the disk tier
    disk_dir: str = ".cache/mfs/kv"
    disk_key_file: str | None = None     # a file holding a secret: disk pages carry a keyed checksum (a MAC) too
    member_limits: dict[str, MemberLimit] = field(default_factory=dict)
    session_ttl_s: float | None = None   # cached pages of an idle session become first to evict after this


@dataclass(slots=True)
class SchedulerConfig:
    max_running_requests: int = 64
    max_batch_tokens: int = 2048         # tokens per step over all prefill chunks and decodes
    prefill_chunk_tokens: int = 512
    max_queue: int = 512                 # waiting requests beyond this are refused (HTTP 429)
    request_timeout_s: float | None = 600.0
    # admission against demand, aging, preemption, stall-aware batching (docs/CONFIG.md)
    new_token_ratio_init: float = 0.7     # share of max_tokens reserved when the length is not fixed
    new_token_ratio_min: float = 0.1      # floor of that share as it decays
    new_token_ratio_decay: float = 0.001  # per step while no request runs short
    aging_steps: int | None = 64          # a request waiting this long gets its pages held; None = off
    decode_step_token_budget: int | None = 512  # tokens per step while requests decode (None = max_batch_tokens)
    # what admission leaves free for the running requests' decode (reservation.py): peak | block | guaranteed_no_evict
    decode_reservation: str = "peak"
    decode_reserve_blocks: int = 1
    victim_order: str = "priority_progress"   # priority_progress | youngest (the most recently admitted)
    swap_preempted: bool = True           # save a victim's blocks to the host tier when it has room
    # member turns on a shared device (member_turns.py): 0 = off; None: 2 for independent families, 0 for nested
    member_turns: float | None = None


@dataclass(slots=True)
class RouterWeights:
    complexity: float = 1.0
    affinity: float = 1.0
    load: float = 0.5
    allow_downgrade: bool = True         # a saturated target may be downgraded to a smaller idle member


def _default_profiles() -> dict[str, RouterWeights]:
    return {
        "latency": RouterWeights(complexity=1.0, affinity=1.0, load=0.6, allow_downgrade=True),
        "quality": RouterWeights(complexity=1.5, affinity=0.5, load=0.2, allow_downgrade=False),
    }


@dataclass(slots=True)
class RouterConfig:
    profile: str = "latency"
    profiles: dict[str, RouterWeights] = field(default_factory=_default_profiles)
    complexity_thresholds: list[float] = field(default_factory=lambda: [0.4, 0.7])  # boundaries between members
    affinity_min_tokens: int = 32         # matches shorter than this earn no affinity
    session_bonus: float | None = None    # added to the session's last member; None = 0 nested, 0.2 otherwise
    # later turns of a session stay on its first turn's member while it holds them; None: on for independent
    # families, off for nested ones (docs/CONFIG.md)
    sticky_sessions: bool | None = None
    # the score's load part; None: on for nested families, off for independent ones (docs/CONFIG.md, Routing)
    load_in_score: bool | None = None
    load_saturation_tokens: int = 4096    # queued+running tokens at which a member counts as saturated
    # whole-device routing (docs/CONFIG.md)
    delay_saturation_s: float = 1.0       # expected wait at which a member's load term is full
    pressure_weight: float = 0.3          # global pool pressure x the member's pages per token
    downgrade_delay_s: float = 0.25       # the winner's expected wait that triggers a downgrade
    downgrade_max_gap: float = 0.15       # quality guard: complexity at most this far above the smaller band
    downgrade_running: int | None = 2     # also trigger when the winner already runs this many requests (CPU-sized)
    downgrade_max_escalation_rate: float | None = None  # no downgrade into a member escalating more of its requests


@dataclass(slots=True)
class EscalationConfig:
    enabled: bool = True
    signal: str = "top1_prob"             # top1_prob | entropy (entropy is derived from top logprobs)
    window_tokens: int = 8
    # escalate when the rolling mean top-1 probability falls below; 0.12 is calibrated for the shipped tiny
    # family (python -m eval.calibrate_escalation: about a third of tiny-s's ShareGPT replies dip below it)
    threshold: float = 0.12
    min_tokens: int = 8                   # never escalate before this many generated tokens
    on_escalate: str = "keep"             # keep | rollback (drop the last low-confidence window)
    warmup_band: list[float] = field(default_factory=lambda: [0.3, 0.4])  # complexity band that warms up
    warmup_max_running: int = 4           # warm up only while the whole engine runs at most this many requests


@dataclass(slots=True)
class SpeculationConfig:
    """Draft-target speculation inside the family: a smaller member drafts tokens that the request's own member
    verifies in the same step (orchestrator/core/speculation.py)."""

    enabled: bool = False
    max_k: int = 4                        # most tokens drafted per request per step
    fixed_k: int = 3                      # drafted tokens per step when the executor prices no step (no step_costs)
    drafts_ride: bool = True              # the draft member's own batch runs in its drafts' forward (one device)
    # prior per-token acceptance of each "draft->target" pair, before any verify is observed
    acceptance: dict[str, float] = field(default_factory=dict)
    default_acceptance: float = 0.7       # the prior of a pair the table does not name


@dataclass(slots=True)
class EngineConfig:
    kind: str = "local"                   # local | triton
    device: str = "auto"                  # auto | cpu | cuda
    dtype: str = "float32"                # float32 | float16 | bfloat16
    triton_url: str = "127.0.0.1:8101"      # `mfs triton-up`'s default gRPC port (8000 is `mfs serve`'s)
    triton_metrics_url: str | None = None
    num_threads: int | None = None
    process: str = "separate"             # separate | thread: where the orchestrator core runs
    stall_timeout_s: float = 60.0         # /health turns 503 when the engine has work and its loop stood still


@dataclass(slots=True)
class DeveloperFlags:
    """The local engine's implementation toggles, for A/B measurements of the engine itself (docs/CONFIG.md)."""

    malloc_mmap_threshold_mb: int = 32    # engines/local/malloc_tuning.py; 0 = glibc default
    native_attention: bool = True         # engines/local/paged_decode.py; false: gather + SDPA
    native_layer_ops: bool = True         # engines/local/layer_kernels.py; false: the torch operators
    parallel_forwards: int | None = None  # 1 or 2 threads per CPU forward; None: auto (serve/serving.py)


@dataclass(slots=True)
class MFSConfig:
    family: str = "tiny"                  # a shipped family name or a path to a family directory
    pool: PoolConfig = field(default_factory=PoolConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    escalation: EscalationConfig = field(default_factory=EscalationConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    developer: DeveloperFlags = field(default_factory=DeveloperFlags)

    def validate(self) -> None:
        _check(self.pool.page_bytes > 0, "pool.page_bytes", "must be positive")
        _check(self.pool.num_pages is None or self.pool.num_pages > 0, "pool.num_pages", "must be positive")
        _check(self.pool.kv_memory_mb > 0, "pool.kv_memory_mb", "must be positive")
        _check(self.pool.host_tier_mb >= 0 and self.pool.disk_tier_mb >= 0, "pool.*_tier_mb", "must be >= 0")
        _check(self.scheduler.max_running_requests > 0, "scheduler.max_running_requests", "must be positive")
        _check(self.scheduler.prefill_chunk_tokens > 0, "scheduler.prefill_chunk_tokens", "must be positive")
        _check(self.scheduler.max_batch_tokens > 0, "scheduler.max_batch_tokens", "must be positive")
        sched = self.scheduler
        _check(sched.member_turns is None or sched.member_turns == 0 or sched.member_turns >= 1,
               "scheduler.member_turns", f"must be 0 (off), at least 1, or null (got {sched.member_turns})")
        _one_of(sched.decode_reservation, "scheduler.decode_reservation", ("peak", "block", "guaranteed_no_evict"))
        _check(0 < sched.new_token_ratio_min <= sched.new_token_ratio_init <= 1, "scheduler.new_token_ratio_init",
               "needs 0 < new_token_ratio_min <= new_token_ratio_init <= 1")
        _check(sched.new_token_ratio_decay >= 0, "scheduler.new_token_ratio_decay", "must be >= 0")
        _check(sched.aging_steps is None or sched.aging_steps > 0, "scheduler.aging_steps", "must be positive or null")
        _one_of(sched.victim_order, "scheduler.victim_order", ("priority_progress", "youngest"))
        _check(sched.decode_step_token_budget is None or sched.decode_step_token_budget > 0,
               "scheduler.decode_step_token_budget", "must be positive or null")
        _check(self.router.delay_saturation_s > 0, "router.delay_saturation_s", "must be positive")
        _check(self.router.downgrade_max_gap >= 0, "router.downgrade_max_gap", "must be >= 0")
        _check(self.router.downgrade_max_escalation_rate is None or 0 <= self.router.downgrade_max_escalation_rate <= 1,
               "router.downgrade_max_escalation_rate", "must be in [0, 1] or null")
        _check(self.router.downgrade_running is None or self.router.downgrade_running >= 1,
               "router.downgrade_running", "must be >= 1 or null")
        _check(self.router.profile in self.router.profiles, "router.profile",
               f"{self.router.profile!r} is not one of {sorted(self.router.profiles)}")
        thresholds = self.router.complexity_thresholds
        _check(all(0 <= t <= 1 for t in thresholds) and thresholds == sorted(thresholds),
               "router.complexity_thresholds", "must be ascending values in [0, 1]")
        _one_of(self.escalation.signal, "escalation.signal", ("top1_prob", "entropy"))
        _one_of(self.escalation.on_escalate, "escalation.on_escalate", ("keep", "rollback"))
        _check(self.escalation.window_tokens > 0, "escalation.window_tokens", "must be positive")
        _check(len(self.escalation.warmup_band) == 2, "escalation.warmup_band", "must be [low, high]")
        _one_of(self.engine.kind, "engine.kind", ("local", "triton"))
        _check(not (self.engine.kind == "triton" and self.speculation.enabled), "speculation.enabled",
               "in-family speculation runs on the local engine only (engine.kind: local); the Triton path keeps "
               "one TensorRT-LLM executor per member and never drafts")
        _one_of(self.engine.process, "engine.process", ("separate", "thread"))
        _check(self.engine.stall_timeout_s > 0, "engine.stall_timeout_s", "must be positive")
        _check(0 <= self.developer.malloc_mmap_threshold_mb <= 32, "developer.malloc_mmap_threshold_mb",
               "must be in [0, 32] (glibc's ceiling on 64-bit)")
        _check(self.developer.parallel_forwards in (None, 1, 2), "developer.parallel_forwards",
               f"must be 1, 2 or null (auto), got {self.developer.parallel_forwards!r}")
        spec = self.speculation
        _check(spec.max_k >= 1, "speculation.max_k", "must be >= 1")
        _check(1 <= spec.fixed_k <= spec.max_k, "speculation.fixed_k", "must be in [1, max_k]")
        _check(all(0 <= a < 1 for a in (*spec.acceptance.values(), spec.default_acceptance)),
               "speculation.acceptance", "per-token acceptances must be in [0, 1)")
        _check(all("->" in pair for pair in spec.acceptance), "speculation.acceptance",
               "keys name a pair as DRAFT->TARGET")
        _one_of(self.engine.dtype, "engine.dtype", ("float32", "float16", "bfloat16"))

    def num_arena_pages(self) -> int:
        if self.pool.num_pages is not None:
            return self.pool.num_pages
        return max(1, int(self.pool.kv_memory_mb * 2**20) // self.pool.page_bytes)


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"config key '{key}': {message}")


def _one_of(value: str, key: str, choices: tuple[str, ...]) -> None:
    _check(value in choices, key, f"must be {', '.join(choices[:-1])} or {choices[-1]}, got {value!r}")


# ----------------------------------------------------------------------------- loading
def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None,
                cls: type[MFSConfig] = MFSConfig) -> MFSConfig:
    """Reads YAML (or nothing: defaults), applies dotted overrides ({"pool.num_pages": 512}), validates. cls: the
    dataclass to build (a subclass that adds sections of its own: eval's compared systems)."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at top level")
        data = loaded or {}
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    config = from_dict(cls, data, "")
    config.validate()
    return config


def from_dict(cls: type, data: Any, where: str) -> Any:
    """Builds dataclass `cls` from plain data, rejecting unknown keys and wrong types by key path."""
    if not isinstance(data, dict):
        raise ConfigError(f"config key '{where or '<root>'}': expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"config key '{_join(where, unknown[0])}': unknown key (known: {', '.join(sorted(names))})")
    kwargs = {name: _coerce(hints[name], value, _join(where, name)) for name, value in data.items()}
    return cls(**kwargs)


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


_SCALARS = {float: "a number", int: "an integer", bool: "true or false", str: "a string"}


def _coerce(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(option, value, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"config key '{where}': invalid value {value!r}")
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, where)
    if origin is dict:
        key_type, value_type = typing.get_args(hint)
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{where}': expected a mapping, got {type(value).__name__}")
        return {_coerce(key_type, k, where): _coerce(value_type, v, f"{where}.{k}") for k, v in value.items()}
    if origin is list:
        (item_type,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"config key '{where}': expected a list, got {type(value).__name__}")
        return [_coerce(item_type, v, f"{where}[{i}]") for i, v in enumerate(value)]
    expected = _SCALARS.get(hint)
    if expected is None:
        return value
    # bool is an int to Python: only a bool field takes true or false
    if not isinstance(value, (int, float) if hint is float else hint) or (isinstance(value, bool) and hint is not bool):
        raise ConfigError(f"config key '{where}': expected {expected}, got {value!r}")
    return float(value) if hint is float else value
