from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("state", "step", "rollout_gpus", "rollout_instances", "rollout_tp_size", "train_gpus", "train_layout", "reconfiguring", "status_json")
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_GPUS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRAIN_GPUS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    RECONFIGURING_FIELD_NUMBER: _ClassVar[int]
    STATUS_JSON_FIELD_NUMBER: _ClassVar[int]
    state: str
    step: int
    rollout_gpus: int
    rollout_instances: int
    rollout_tp_size: int
    train_gpus: int
    train_layout: str
    reconfiguring: str
    status_json: str
    def __init__(self, state: _Optional[str] = ..., step: _Optional[int] = ..., rollout_gpus: _Optional[int] = ..., rollout_instances: _Optional[int] = ..., rollout_tp_size: _Optional[int] = ..., train_gpus: _Optional[int] = ..., train_layout: _Optional[str] = ..., reconfiguring: _Optional[str] = ..., status_json: _Optional[str] = ...) -> None: ...

class GetPlanRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PlanReply(_message.Message):
    __slots__ = ("plan_json", "desired_json")
    PLAN_JSON_FIELD_NUMBER: _ClassVar[int]
    DESIRED_JSON_FIELD_NUMBER: _ClassVar[int]
    plan_json: str
    desired_json: str
    def __init__(self, plan_json: _Optional[str] = ..., desired_json: _Optional[str] = ...) -> None: ...

class ReconfigureRequest(_message.Message):
    __slots__ = ("set", "strategy", "dry_run")
    SET_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    set: _containers.RepeatedScalarFieldContainer[str]
    strategy: str
    dry_run: bool
    def __init__(self, set: _Optional[_Iterable[str]] = ..., strategy: _Optional[str] = ..., dry_run: _Optional[bool] = ...) -> None: ...

class FieldError(_message.Message):
    __slots__ = ("field", "value", "rule", "fix", "kind", "rule_id")
    FIELD_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    FIX_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    RULE_ID_FIELD_NUMBER: _ClassVar[int]
    field: str
    value: str
    rule: str
    fix: str
    kind: str
    rule_id: str
    def __init__(self, field: _Optional[str] = ..., value: _Optional[str] = ..., rule: _Optional[str] = ..., fix: _Optional[str] = ..., kind: _Optional[str] = ..., rule_id: _Optional[str] = ...) -> None: ...

class PlannedAction(_message.Message):
    __slots__ = ("tick", "kind", "member", "detail", "reason")
    TICK_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    tick: int
    kind: str
    member: str
    detail: str
    reason: str
    def __init__(self, tick: _Optional[int] = ..., kind: _Optional[str] = ..., member: _Optional[str] = ..., detail: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class DryRun(_message.Message):
    __slots__ = ("actions", "rollout_before", "rollout_after", "train_layout_before", "train_layout_after", "step_s_before", "step_s_after", "samples_per_s_before", "samples_per_s_after", "switch_cost_s", "serving_gap_s", "notes")
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_BEFORE_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_AFTER_FIELD_NUMBER: _ClassVar[int]
    TRAIN_LAYOUT_BEFORE_FIELD_NUMBER: _ClassVar[int]
    TRAIN_LAYOUT_AFTER_FIELD_NUMBER: _ClassVar[int]
    STEP_S_BEFORE_FIELD_NUMBER: _ClassVar[int]
    STEP_S_AFTER_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_S_BEFORE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_S_AFTER_FIELD_NUMBER: _ClassVar[int]
    SWITCH_COST_S_FIELD_NUMBER: _ClassVar[int]
    SERVING_GAP_S_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    actions: _containers.RepeatedCompositeFieldContainer[PlannedAction]
    rollout_before: str
    rollout_after: str
    train_layout_before: str
    train_layout_after: str
    step_s_before: float
    step_s_after: float
    samples_per_s_before: float
    samples_per_s_after: float
    switch_cost_s: float
    serving_gap_s: float
    notes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, actions: _Optional[_Iterable[_Union[PlannedAction, _Mapping]]] = ..., rollout_before: _Optional[str] = ..., rollout_after: _Optional[str] = ..., train_layout_before: _Optional[str] = ..., train_layout_after: _Optional[str] = ..., step_s_before: _Optional[float] = ..., step_s_after: _Optional[float] = ..., samples_per_s_before: _Optional[float] = ..., samples_per_s_after: _Optional[float] = ..., switch_cost_s: _Optional[float] = ..., serving_gap_s: _Optional[float] = ..., notes: _Optional[_Iterable[str]] = ...) -> None: ...

class ReconfigureReply(_message.Message):
    __slots__ = ("outcome", "reason", "errors", "plan", "reconfiguring", "generation", "strategy")
    class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OUTCOME_UNSPECIFIED: _ClassVar[ReconfigureReply.Outcome]
        ACCEPTED: _ClassVar[ReconfigureReply.Outcome]
        INVALID: _ClassVar[ReconfigureReply.Outcome]
        REFUSED: _ClassVar[ReconfigureReply.Outcome]
        PLANNED: _ClassVar[ReconfigureReply.Outcome]
    OUTCOME_UNSPECIFIED: ReconfigureReply.Outcome
    ACCEPTED: ReconfigureReply.Outcome
    INVALID: ReconfigureReply.Outcome
    REFUSED: ReconfigureReply.Outcome
    PLANNED: ReconfigureReply.Outcome
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    RECONFIGURING_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    outcome: ReconfigureReply.Outcome
    reason: str
    errors: _containers.RepeatedCompositeFieldContainer[FieldError]
    plan: DryRun
    reconfiguring: str
    generation: int
    strategy: str
    def __init__(self, outcome: _Optional[_Union[ReconfigureReply.Outcome, str]] = ..., reason: _Optional[str] = ..., errors: _Optional[_Iterable[_Union[FieldError, _Mapping]]] = ..., plan: _Optional[_Union[DryRun, _Mapping]] = ..., reconfiguring: _Optional[str] = ..., generation: _Optional[int] = ..., strategy: _Optional[str] = ...) -> None: ...

class ControlRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class ControlReply(_message.Message):
    __slots__ = ("ok", "state", "message")
    OK_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    state: str
    message: str
    def __init__(self, ok: _Optional[bool] = ..., state: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class StreamEventsRequest(_message.Message):
    __slots__ = ("replay", "follow")
    REPLAY_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    replay: int
    follow: bool
    def __init__(self, replay: _Optional[int] = ..., follow: _Optional[bool] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("ts", "kind", "message", "json")
    TS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    ts: float
    kind: str
    message: str
    json: str
    def __init__(self, ts: _Optional[float] = ..., kind: _Optional[str] = ..., message: _Optional[str] = ..., json: _Optional[str] = ...) -> None: ...
