"""The operator service: each gRPC call of `operator.proto` carried out on a running job (`JobControl`).

Every call is authenticated first (a missing or wrong token: UNAUTHENTICATED, and an `api_unauthenticated`
event naming the caller's address). Every operator action (Reconfigure, Pause, Resume, Drain) lands in the
event log as an `operator` event with the call, the caller's address, the outcome and the details. A call
never raises into gRPC: an unexpected error becomes an INTERNAL status and an `operator_error` event, so a
malformed request never reaches the controller's own threads.
"""

from __future__ import annotations

import json
import queue
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from libra.api.auth import token_ok
from libra.api.dry_run import DryRunResult, dry_run
from libra.api.generated import operator_pb2 as pb
from libra.api.generated import operator_pb2_grpc as pb_grpc
from libra.api.job import JobControl
from libra.api.requests import InvalidRequest, validate_request
from libra.api.status import StatusDigest, pool_fields
from libra.config.errors import format_value
from libra.controller.reconfigure import ReconfigureRefused, plan_reconfigure
from libra.run_dir import read_json, read_jsonl

Reply = TypeVar("Reply")
MAX_REPLAY = 10_000
ENDED_STATES = ("stopping", "finished", "interrupted", "failed", "drained")
FOLLOW_POLL_S = 0.5


def _peer(context: grpc.ServicerContext) -> str:
    try:
        return str(context.peer())
    except Exception:
        return "unknown"


class OperatorService(pb_grpc.OperatorServicer):
    def __init__(self, job: JobControl, token: str) -> None:
        self.job = job
        self._token = token
        self.digest, self._stop_digest = StatusDigest.follow(job.events.subscribe, job.run.events_jsonl)

    def close(self) -> None:
        """Stop following the job's events (the server has stopped)."""
        self._stop_digest()

    # ---- guards ----------------------------------------------------------------------------------------
    def _authorized(self, call: str, context: grpc.ServicerContext) -> bool:
        if token_ok(self._token, context.invocation_metadata()):
            return True
        peer = _peer(context)
        self.job.events.emit("api_unauthenticated", f"{call} from {peer}: missing or wrong token", call=call,
                             peer=peer)
        self.job.events.emit("operator", f"{call} refused: missing or wrong token", call=call, peer=peer,
                             outcome="unauthenticated")
        context.set_code(grpc.StatusCode.UNAUTHENTICATED)
        context.set_details("missing or wrong token: send the contents of <run_dir>/api_token as "
                            "'authorization: Bearer <token>'")
        return False

    def _run(self, call: str, context: grpc.ServicerContext, empty: Callable[[], Reply],
             body: Callable[[], Reply]) -> Reply:
        if not self._authorized(call, context):
            return empty()
        try:
            return body()
        except Exception as exc:
            peer = _peer(context)
            self.job.events.emit("operator_error", f"{call} from {peer}: {type(exc).__name__}: {exc}", call=call,
                                 peer=peer)
            context.set_code(grpc.StatusCode.INTERNAL)
            context.set_details(f"{type(exc).__name__}: {exc}")
            return empty()

    def _record(self, call: str, context: grpc.ServicerContext, outcome: str, message: str, **details: Any) -> None:
        self.job.events.emit("operator", f"{call}: {outcome}: {message}", call=call, peer=_peer(context),
                             outcome=outcome, **details)

    def _ending(self) -> str:
        """Why the job takes no more changes ("" = it does)."""
        if self.job.step_gate.drain_requested:
            return "the job is draining (it stops after the step in flight)"
        if self.job.stop.requested:
            return f"the job is stopping ({self.job.stop.reason or 'stop requested'})"
        state = (read_json(self.job.run.status_json) or {}).get("state")
        if state in ENDED_STATES:
            return f"the job has ended ({state})"
        return ""

    # ---- read-outs -------------------------------------------------------------------------------------
    def state(self) -> str:
        gate = self.job.step_gate
        if gate.drain_requested:
            return "draining"
        if self.job.stop.requested:
            return "stopping"
        if gate.paused:
            return "paused" if gate.holding else "pausing"
        state = str((read_json(self.job.run.status_json) or {}).get("state") or "starting")
        return "running" if state == "paused" else state  # resumed: the loop has not written it yet

    def status_object(self) -> dict[str, Any]:
        return {"state": self.state(), "step": self.job.step, **pool_fields(self.job.desired),
                "paused": self.job.step_gate.paused, **self.digest.fields()}

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        def body() -> pb.StatusReply:
            info = self.status_object()
            return pb.StatusReply(state=info["state"], step=info["step"], rollout_gpus=info["rollout_gpus"] or 0,
                                  rollout_instances=info["rollout_instances"] or 0,
                                  rollout_tp_size=info["rollout_tp_size"] or 0, train_gpus=info["train_gpus"] or 0,
                                  train_layout=info["train_layout"] or "", reconfiguring=info["reconfiguring"],
                                  status_json=json.dumps(info, default=str))

        return self._run("Status", context, pb.StatusReply, body)

    def GetPlan(self, request: pb.GetPlanRequest, context: grpc.ServicerContext) -> pb.PlanReply:
        def body() -> pb.PlanReply:
            desired = self.job.desired
            plan = read_json(self.job.run.plan_json) or {}
            return pb.PlanReply(plan_json=json.dumps(plan, default=str),
                                desired_json=json.dumps(desired.to_dict() if desired else {}, default=str))

        return self._run("GetPlan", context, pb.PlanReply, body)

    # ---- changes ---------------------------------------------------------------------------------------
    def Reconfigure(self, request: pb.ReconfigureRequest, context: grpc.ServicerContext) -> pb.ReconfigureReply:
        return self._run("Reconfigure", context, pb.ReconfigureReply, lambda: self._reconfigure(request, context))

    def _reconfigure(self, request: pb.ReconfigureRequest, context: grpc.ServicerContext) -> pb.ReconfigureReply:
        overrides, strategy, dry = list(request.set), request.strategy, request.dry_run
        details: dict[str, Any] = {"request": overrides, "strategy": strategy, "dry_run": dry}
        Outcome = pb.ReconfigureReply.Outcome

        def refuse(reason: str) -> pb.ReconfigureReply:
            self._record("Reconfigure", context, "refused", reason, **details)
            return pb.ReconfigureReply(outcome=Outcome.REFUSED, reason=reason, strategy=strategy)

        desired, observed = self.job.desired, self.job.observed_state()
        ending = self._ending()
        if ending:
            return refuse(ending)
        if desired is None or observed is None:
            return refuse("the job is still starting (its pools are not up yet); ask again once it runs")
        try:
            change = validate_request(self.job.cfg, desired, overrides, strategy)
        except InvalidRequest as err:
            errors = [pb.FieldError(field=i.path, value=format_value(i.value), rule=i.rule, fix=i.fix, kind=i.kind,
                                    rule_id=i.rule_id) for i in err.issues]
            reason = f"{len(errors)} problem{'s' if len(errors) != 1 else ''}: " + "; ".join(
                f"{e.field}: {e.rule}" for e in errors)
            self._record("Reconfigure", context, "invalid", reason, errors=[str(i) for i in err.issues], **details)
            return pb.ReconfigureReply(outcome=Outcome.INVALID, reason=reason, errors=errors, strategy=strategy)
        details["change"] = change.describe()
        if dry:
            try:
                target = plan_reconfigure(desired, change.target, change.strategy, self.job.reconfigure_limits(),
                                          observed)
            except ReconfigureRefused as exc:
                return refuse(str(exc))
            result = dry_run(change.config, desired, target, observed)
            reason = (f"dry run of {target.reconfiguring}: {len(result.actions)} actions, nothing changed")
            self._record("Reconfigure", context, "planned", reason, **details)
            return pb.ReconfigureReply(outcome=Outcome.PLANNED, reason=reason, plan=_plan_message(result),
                                       reconfiguring=target.reconfiguring, strategy=target.reconfigure_strategy)
        try:
            accepted = self.job.request_reconfigure(change.target, change.strategy)
        except ValueError as exc:
            return refuse(str(exc))
        # runtime_training_pool_plan_only: the decision is recorded, nothing changes
        reason = f"accepted: {accepted.reconfiguring}" if accepted.reconfiguring else f"recorded: {accepted.reason}"
        self._record("Reconfigure", context, "accepted", reason, generation=accepted.generation, **details)
        return pb.ReconfigureReply(outcome=Outcome.ACCEPTED, reason=reason, reconfiguring=accepted.reconfiguring,
                                   generation=accepted.generation, strategy=accepted.reconfigure_strategy)

    def _control(self, call: str, request: pb.ControlRequest, context: grpc.ServicerContext) -> pb.ControlReply:
        def body() -> pb.ControlReply:
            reason = request.reason[:200]
            gate, step = self.job.step_gate, self.job.step
            ending = self._ending()
            if ending and call != "Drain":
                ok, message = False, ending
            elif call == "Pause":
                ok = gate.pause(reason or "paused by the operator")
                message = (f"the RL loop holds once the step in flight (step {step + 1}) is done" if ok
                           else "already paused")
            elif call == "Resume":
                ok = gate.resume()
                message = "the RL loop continues" if ok else "not paused"
            else:
                ok = gate.drain()
                message = (f"the job stops once the step in flight (step {step + 1}) is done, saves a checkpoint "
                           "and exits 0" if ok else "already draining")
            self._record(call, context, "ok" if ok else "refused", message, reason=reason, step=step)
            return pb.ControlReply(ok=ok, state=self.state(), message=message)

        return self._run(call, context, pb.ControlReply, body)

    def Pause(self, request: pb.ControlRequest, context: grpc.ServicerContext) -> pb.ControlReply:
        return self._control("Pause", request, context)

    def Resume(self, request: pb.ControlRequest, context: grpc.ServicerContext) -> pb.ControlReply:
        return self._control("Resume", request, context)

    def Drain(self, request: pb.ControlRequest, context: grpc.ServicerContext) -> pb.ControlReply:
        return self._control("Drain", request, context)

    # ---- events ----------------------------------------------------------------------------------------
    def StreamEvents(self, request: pb.StreamEventsRequest, context: grpc.ServicerContext) -> Iterator[pb.Event]:
        if not self._authorized("StreamEvents", context):
            return
        waiting: queue.Queue[dict[str, Any]] = queue.Queue(maxsize=10_000)

        def listen(event: dict[str, Any]) -> None:
            try:
                waiting.put_nowait(event)
            except queue.Full:
                pass  # a stalled reader loses events rather than slowing the controller

        unsubscribe = self.job.events.subscribe(listen) if request.follow else (lambda: None)
        try:
            replay = max(0, min(int(request.replay), MAX_REPLAY))
            sent: list[dict[str, Any]] = []
            if replay:
                sent = list(read_jsonl(self.job.run.events_jsonl))[-replay:]
                for event in sent:
                    yield _event_message(event)
            while request.follow and context.is_active():
                try:
                    event = waiting.get(timeout=FOLLOW_POLL_S)
                except queue.Empty:
                    continue
                if event in sent:  # emitted between the subscription and the replay
                    continue
                sent = []
                yield _event_message(event)
        except Exception as exc:
            self.job.events.emit("operator_error", f"StreamEvents: {type(exc).__name__}: {exc}", call="StreamEvents",
                                 peer=_peer(context))
            context.set_code(grpc.StatusCode.INTERNAL)
            context.set_details(f"{type(exc).__name__}: {exc}")
        finally:
            unsubscribe()


def _event_message(event: dict[str, Any]) -> pb.Event:
    ts = event.get("ts")
    return pb.Event(ts=float(ts) if isinstance(ts, int | float) else time.time(), kind=str(event.get("kind", "")),
                    message=str(event.get("message", "")), json=json.dumps(event, default=str))


def _plan_message(result: DryRunResult) -> pb.DryRun:
    return pb.DryRun(
        actions=[pb.PlannedAction(tick=s.tick, kind=s.kind, member=s.member, detail=s.detail, reason=s.reason)
                 for s in result.actions],
        rollout_before=result.rollout_before, rollout_after=result.rollout_after,
        train_layout_before=result.train_layout_before, train_layout_after=result.train_layout_after,
        step_s_before=result.step_s_before, step_s_after=result.step_s_after,
        samples_per_s_before=result.samples_per_s_before, samples_per_s_after=result.samples_per_s_after,
        switch_cost_s=result.switch_cost_s, serving_gap_s=result.serving_gap_s, notes=result.notes,
    )
