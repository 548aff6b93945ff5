"""Every Prometheus metric of Libra, named in one place, and the exporter that serves them.

Names follow Prometheus conventions (`libra_` prefix, base units, `_total` for counters). The controller
updates them once per training step and on pool changes; `serve(port)` exposes them on
`http://<tracking.prometheus_bind_address>:<port>/metrics` (loopback by default) when
`tracking.prometheus_port > 0`.
Each `LibraMetrics` has its own registry, so several controllers (e.g. in tests) never collide.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


class MetricsExporterError(RuntimeError):
    """The exporter could not start (its port taken, its address not on this machine)."""


@dataclass(frozen=True)
class MetricName:
    name: str
    help: str
    labels: tuple[str, ...] = ()


# ---- the catalogue --------------------------------------------------------------------------------------
STEP = MetricName("libra_step", "Last completed training step.")
TOTAL_STEPS = MetricName("libra_total_steps", "Training steps of the job.")
REWARD_MEAN = MetricName("libra_reward_mean", "Mean reward of the last training batch.")
EVAL_ACCURACY = MetricName("libra_eval_accuracy", "Accuracy of the last evaluation on held-out prompts.")
TOKENS_PER_SECOND = MetricName(
    "libra_tokens_per_second", "Throughput of the last step by pool (rollout: generated, train: trained).", ("pool",)
)
POOL_GPUS = MetricName("libra_pool_gpus", "GPUs assigned to each pool.", ("pool",))
POOL_MEMBERS = MetricName("libra_pool_members", "Pool members by state.", ("pool", "state"))
QUEUE_DEPTH = MetricName("libra_queue_depth", "Prompt groups waiting: running or buffered.", ("queue",))
POLICY_LAG = MetricName("libra_policy_lag", "Largest policy-version lag of a trained sample in the last step.")
POLICY_VERSION = MetricName("libra_policy_version", "Policy version by holder (trainer, rollout).", ("holder",))
STEP_PHASE_SECONDS = MetricName(
    "libra_step_phase_seconds", "Wall time of each phase of a training step.", ("phase",)
)
WEIGHT_RELOAD_SECONDS = MetricName(
    "libra_weight_reload_seconds", "Weight publish to validated ACK batch (whole instance set)."
)
WEIGHT_RELOAD_SLOWEST_SECONDS = MetricName(
    "libra_weight_reload_slowest_instance_seconds", "Reload time of the slowest instance in the last sync."
)
DISCARDED_SAMPLES = MetricName(
    "libra_discarded_samples_total", "Samples discarded because their policy lag exceeded max_head_offpolicyness."
)
ROLLOUT_FAILURES = MetricName("libra_rollout_failures_total", "Failed group generations (retried with new prompts).")
ACTIONS = MetricName("libra_actions_total", "Reconciler actions by kind and result.", ("action", "result"))
TICK_ERRORS = MetricName("libra_tick_errors_total", "Control ticks that ended in an error (the loop continued).")
RECONFIGURATIONS = MetricName(
    "libra_reconfigurations_total", "Rollout reconfigurations by strategy and outcome (requested, done, refused).",
    ("strategy", "outcome"),
)
RECONFIGURATION_SECONDS = MetricName(
    "libra_reconfiguration_seconds", "Request to convergence of each finished reconfiguration.", ("strategy",)
)
OPERATOR_REQUESTS = MetricName(
    "libra_operator_requests_total", "Operator API actions by call and outcome (unauthenticated included).",
    ("call", "outcome"),
)

ALL: tuple[MetricName, ...] = (
    STEP, TOTAL_STEPS, REWARD_MEAN, EVAL_ACCURACY, TOKENS_PER_SECOND, POOL_GPUS, POOL_MEMBERS, QUEUE_DEPTH,
    POLICY_LAG, POLICY_VERSION, STEP_PHASE_SECONDS, WEIGHT_RELOAD_SECONDS, WEIGHT_RELOAD_SLOWEST_SECONDS,
    DISCARDED_SAMPLES, ROLLOUT_FAILURES, ACTIONS, TICK_ERRORS, RECONFIGURATIONS, RECONFIGURATION_SECONDS,
    OPERATOR_REQUESTS,
)

_HISTOGRAMS = {STEP_PHASE_SECONDS.name, WEIGHT_RELOAD_SECONDS.name, RECONFIGURATION_SECONDS.name}
_COUNTERS = {DISCARDED_SAMPLES.name, ROLLOUT_FAILURES.name, ACTIONS.name, TICK_ERRORS.name, RECONFIGURATIONS.name,
             OPERATOR_REQUESTS.name}
_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class LibraMetrics:
    """The metrics of one controller, on a private registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._m: dict[str, Any] = {}
        for metric in ALL:
            # prometheus_client appends `_total` to counter names itself
            if metric.name in _COUNTERS:
                self._m[metric.name] = Counter(metric.name.removesuffix("_total"), metric.help, metric.labels,
                                               registry=self.registry)
            elif metric.name in _HISTOGRAMS:
                self._m[metric.name] = Histogram(metric.name, metric.help, metric.labels, buckets=_BUCKETS,
                                                 registry=self.registry)
            else:
                self._m[metric.name] = Gauge(metric.name, metric.help, metric.labels, registry=self.registry)
        self.port = 0
        self._server: Any = None

    def get(self, metric: MetricName, **labels: str) -> Any:
        m = self._m[metric.name]
        return m.labels(**labels) if labels else m

    def serve(self, port: int, address: str = "127.0.0.1") -> int:
        """Start the HTTP exporter on `address`:`port` (tracking.prometheus_bind_address); returns the port.
        A port or address it cannot listen on is a MetricsExporterError naming both options."""
        try:
            server, _thread = start_http_server(port, addr=address, registry=self.registry)
        except OSError as exc:
            raise MetricsExporterError(
                f"the Prometheus exporter cannot listen on {address}:{port} (tracking.prometheus_bind_address, "
                f"tracking.prometheus_port): {exc.strerror or exc}; choose a free tracking.prometheus_port, or 0 "
                "to serve no metrics") from exc
        self._server = server
        self.port = int(server.server_port)
        return self.port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # ---- updates ----------------------------------------------------------------------------------------
    def record_step(self, row: Mapping[str, Any]) -> None:
        """Update from one metrics.jsonl row (keys as the controller writes them)."""
        self.get(STEP).set(row["step"])
        self.get(REWARD_MEAN).set(row.get("reward_mean", 0.0))
        if "eval_accuracy" in row:
            self.get(EVAL_ACCURACY).set(row["eval_accuracy"])
        self.get(TOKENS_PER_SECOND, pool="rollout").set(row.get("rollout_tokens_per_s", 0.0))
        self.get(TOKENS_PER_SECOND, pool="train").set(row.get("train_tokens_per_s", 0.0))
        self.get(POLICY_LAG).set(row.get("policy_lag_max", 0.0))
        self.get(POLICY_VERSION, holder="trainer").set(row.get("policy_version", 0))
        self.get(POLICY_VERSION, holder="rollout").set(row.get("rollout_version", 0))
        for phase in ("rollout", "train", "sync", "checkpoint", "eval", "step"):
            key = f"time_{phase}_s"
            if key in row:
                self.get(STEP_PHASE_SECONDS, phase=phase).observe(row[key])
        if row.get("sync_reload_s") is not None:
            self.get(WEIGHT_RELOAD_SECONDS).observe(row["sync_reload_s"])
        if row.get("sync_slowest_instance_s") is not None:
            self.get(WEIGHT_RELOAD_SLOWEST_SECONDS).set(row["sync_slowest_instance_s"])
        if row.get("discarded_samples"):
            self.get(DISCARDED_SAMPLES).inc(row["discarded_samples"])

    def set_pools(self, gpus: Mapping[str, int], members: Mapping[str, Mapping[str, int]]) -> None:
        for pool, count in gpus.items():
            self.get(POOL_GPUS, pool=pool).set(count)
        for pool, states in members.items():
            for state in ("PENDING", "STARTING", "LOADING", "READY", "DRAINING", "STOPPED", "FAILED"):
                self.get(POOL_MEMBERS, pool=pool, state=state).set(states.get(state, 0))

    def set_queue(self, depth: Mapping[str, int]) -> None:
        for queue, value in depth.items():
            self.get(QUEUE_DEPTH, queue=queue).set(value)

    def count_action(self, action: str, ok: bool) -> None:
        self.get(ACTIONS, action=action, result="ok" if ok else "error").inc()

    def record_event(self, event: Mapping[str, Any]) -> None:
        """Count what the controller's event log reports: finished and failed actions, reconfigurations
        (requested, done with their duration, refused) and operator API actions."""
        kind = event.get("kind")
        if kind in ("action_done", "action_error"):
            self.count_action(str(event.get("action", "?")), kind == "action_done")
        elif kind in ("reconfigure_requested", "reconfigure_done", "reconfigure_refused"):
            strategy = str(event.get("strategy") or "?")
            self.get(RECONFIGURATIONS, strategy=strategy, outcome=kind.removeprefix("reconfigure_")).inc()
            if kind == "reconfigure_done" and isinstance(event.get("seconds"), int | float):
                self.get(RECONFIGURATION_SECONDS, strategy=strategy).observe(event["seconds"])
        elif kind == "operator":
            self.get(OPERATOR_REQUESTS, call=str(event.get("call", "?")), outcome=str(event.get("outcome", "?"))).inc()

    def raise_counter(self, metric: MetricName, total: float) -> None:
        """Bring a counter up to `total` (the controller keeps its own running totals)."""
        counter = self.get(metric)
        current = counter._value.get()
        if total > current:
            counter.inc(total - current)
