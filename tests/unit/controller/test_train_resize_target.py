"""Training targets of a reconfiguration request: checked by the job's switches, the planner's layout rules,
the platform and the cluster size (refused with the field, the value and the fix); accepted ones become the
desired state; in plan-only mode the decision is recorded and nothing changes; a cluster swap derives the
training side from what the rollout pool leaves. Also the layout fitting a swap uses, and the training half
of the reconciler as a table."""

from __future__ import annotations

import dataclasses

import pytest

from libra.controller.actions import ResizeTrainingPool, ShrinkTrainingPool, StartRolloutInstance
from libra.controller.members import Member, MemberState
from libra.controller.reconfigure import (
    ReconfigureLimits,
    ReconfigureRefused,
    ReconfigureTarget,
    plan_reconfigure,
)
from libra.controller.state import DesiredState, ObservedState, PoolObservation, RolloutSpec
from libra.controller.train_plan import fit_layout, training_actions, training_converged
from planner.layout import TrainLayout
from planner.model_spec import model_spec_from_dict

S = MemberState
MODEL = model_spec_from_dict({"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                              "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100})
MOE = model_spec_from_dict({"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                            "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100,
                            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32})
FOUR_LAYERS = model_spec_from_dict({"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                                    "num_hidden_layers": 4, "intermediate_size": 128, "vocab_size": 100})
BASE = DesiredState(rollout_instances=2, rollout_tp=1, train_gpus=2, train_layout=TrainLayout(), cluster_gpus=8,
                    rollout_fingerprint="fp-tp1", generation=4)
EMPTY = ObservedState(now=0.0)


def limits(training: bool = True, plan_only: bool = False, swap: bool = False, gpus_per_node: int = 4,
           problems: list[str] | None = None, model=MODEL) -> ReconfigureLimits:  # type: ignore[no-untyped-def]
    return ReconfigureLimits(enabled=True, cluster_swap_enabled=swap, gpus_per_node=gpus_per_node, model=model,
                             drain_before_stop=True, fingerprint_for=lambda tp: f"fp-tp{tp}",
                             reconfigure_training=training, training_plan_only=plan_only,
                             train_problems=(lambda gpus, layout: list(problems)) if problems else None)


T = ReconfigureTarget


@pytest.mark.parametrize(
    ("target", "strategy", "limit_args", "message"),
    [
        pytest.param(T(train_gpus=3), None, {"training": False},
                     r"runtime_reconfigure_training is false: the training pool cannot change \(training 3 GPUs\)",
                     id="training-switch-off"),
        pytest.param(T(rollout_instances=1), "cluster_swap", {"training": False, "swap": True},
                     "runtime_reconfigure_training is false: a cluster swap changes the training pool",
                     id="swap-needs-training-switch"),
        pytest.param(T(train_tp=3), None, {}, r"train_tp=3: TP 3 does not divide the 4 attention heads \(rule "
                     r"tp_heads\)", id="tp-not-dividing-heads"),
        pytest.param(T(train_gpus=3, train_tp=2), None, {}, r"train_gpus=3: TP x PP x CP = 2 x 1 x 1 = 2 does not "
                     r"divide the 3 training GPUs", id="tp-not-dividing-gpus"),
        pytest.param(T(train_pp=3, train_gpus=3), None, {}, "train_pp=3: PP 3 x virtual stages 1 = 3 does not "
                     "divide the 2 layers", id="pp-not-dividing-layers"),
        pytest.param(T(train_ep=2), None, {}, "train_ep=2: EP 2 needs a mixture-of-experts model", id="ep-dense"),
        pytest.param(T(train_ep=3, train_gpus=3), None, {"model": MOE}, "train_ep=3: EP 3 does not divide the 4 "
                     "experts", id="ep-not-dividing-experts"),
        pytest.param(T(train_gpus=4, train_tp=4), None, {"gpus_per_node": 2}, "train_tp=4: TP 4 would span nodes of "
                     "2 GPUs", id="tp-across-nodes"),
        pytest.param(T(train_gpus=0), None, {}, "train_gpus=0: a running job needs at least one training GPU",
                     id="zero-gpus"),
        pytest.param(T(train_gpus=7), None, {}, r"training uses 7, leaving 1: ask for at most 1 instances, or use "
                     "cluster_swap", id="not-enough-gpus"),
        pytest.param(T(train_cp=2), None, {"problems": ["training.cp=2: context parallelism needs CUDA attention "
                                                        "kernels; use cp=1 on CPU"]},
                     "cannot run: training.cp=2: context parallelism needs CUDA", id="platform-refuses"),
        pytest.param(T(train_gpus=2, train_tp=1), None, {}, "nothing to change", id="no-change"),
        pytest.param(T(rollout_instances=3), "cluster_swap", {"swap": True},
                     "leaving no GPU to training; ask for fewer instances, or use diff", id="swap-peak-too-large"),
    ],
)
def test_refused_training_targets(target: ReconfigureTarget, strategy: str | None, limit_args: dict,
                                  message: str) -> None:
    desired = BASE if "swap" not in str(limit_args) else dataclasses.replace(BASE, cluster_gpus=4)
    with pytest.raises(ReconfigureRefused, match=message):
        plan_reconfigure(desired, target, strategy, limits(**limit_args), EMPTY)


def test_accepted_training_target_becomes_the_desired_state() -> None:
    new = plan_reconfigure(BASE, T(train_gpus=4, train_tp=2), None, limits(), EMPTY)
    assert (new.train_gpus, new.train_layout) == (4, TrainLayout(tp=2))
    assert (new.rollout_instances, new.rollout_tp) == (2, 1) and new.generation == 5
    assert new.reconfiguring == ("generation 5: training 2 GPUs TP1 PP1 CP1 EP1 DP2 -> 4 GPUs TP2 PP1 CP1 EP1 DP2 "
                                 "by a checkpoint resize")


def test_rollout_and_training_change_together() -> None:
    new = plan_reconfigure(BASE, T(rollout_instances=3, train_gpus=3), None, limits(), EMPTY)
    assert (new.rollout_instances, new.train_gpus) == (3, 3)
    assert "rollout 2 x TP1 -> 3 x TP1; training 2 GPUs" in new.reconfiguring


def test_plan_only_records_the_decision_and_changes_nothing() -> None:
    new = plan_reconfigure(BASE, T(train_gpus=4, train_tp=2), None, limits(plan_only=True), EMPTY)
    assert (new.train_gpus, new.train_layout, new.generation, new.reconfiguring) == (2, TrainLayout(), 4, "")
    assert new.planned_training == "plan only: training 2 GPUs TP1 PP1 CP1 EP1 DP2 -> 4 GPUs TP2 PP1 CP1 EP1 DP2"


@pytest.mark.parametrize(("rollout", "train_gpus", "layout"), [
    (1, 3, TrainLayout()),  # 2 + 2 -> 3 + 1: training takes the GPU the rollout pool gives up
    (3, 1, TrainLayout()),
], ids=["rollout-shrinks", "rollout-grows"])
def test_cluster_swap_gives_training_what_rollout_leaves(rollout: int, train_gpus: int, layout: TrainLayout) -> None:
    desired = dataclasses.replace(BASE, cluster_gpus=4) if rollout < 2 else dataclasses.replace(
        BASE, cluster_gpus=6, train_gpus=3, rollout_instances=2)
    new = plan_reconfigure(desired, T(rollout_instances=rollout), "cluster_swap", limits(swap=True), EMPTY)
    expected = desired.cluster_gpus - rollout
    assert (new.train_gpus, new.train_layout, new.reconfigure_strategy) == (expected, layout, "cluster_swap")


@pytest.mark.parametrize(("layout", "gpus", "expected"), [
    (TrainLayout(tp=2), 4, TrainLayout(tp=2)),  # fits: kept
    (TrainLayout(tp=2), 3, TrainLayout(tp=1)),
    (TrainLayout(tp=2, pp=2), 2, TrainLayout(tp=2)),  # PP is given up before TP
    (TrainLayout(pp=2, vpp=2), 1, TrainLayout()),
    (TrainLayout(ep=4), 2, TrainLayout(ep=2)),
], ids=["fits", "tp-lowered", "pp-first", "vpp-dropped", "ep-lowered"])
def test_fit_layout(layout: TrainLayout, gpus: int, expected: TrainLayout) -> None:
    assert fit_layout(layout, gpus, MOE if layout.ep > 1 else FOUR_LAYERS) == expected


# ---- the training half of the reconciler -------------------------------------------------------------------
NOW = 1000.0


def rank(index: int, layout: TrainLayout = TrainLayout(), state: MemberState = S.READY, busy: bool = False) -> Member:
    return Member(id=f"train-{index}", pool="train", state=state, since=NOW, key=f"rank-{index}", busy=busy,
                  fingerprint=layout.label())


def server(index: int, state: MemberState = S.READY, serving: bool = True, fingerprint: str = "fp-tp1") -> Member:
    return Member(id=f"rollout-{index}", pool="rollout", state=state, since=NOW, key=f"rollout-{index}", tp=1,
                  fingerprint=fingerprint, serving=serving)


def observed(*members: Member, busy: bool = False) -> ObservedState:
    return ObservedState(now=NOW, rollout=PoolObservation(created=True), train=PoolObservation(created=True, busy=busy),
                         members=members)


def want(train: int, layout: TrainLayout = TrainLayout(), cluster: int = 4, swap: bool = False,
         instances: int = 2) -> DesiredState:
    return DesiredState(rollout_instances=instances, rollout_tp=1, train_gpus=train, train_layout=layout, cluster_gpus=cluster,
                        rollout_fingerprint="fp-tp1", generation=7, reconfiguring="test" if swap else "",
                        reconfigure_strategy="cluster_swap" if swap else "diff")


START = StartRolloutInstance("test", "rollout-9", RolloutSpec(1, "fp-tp1"))


@pytest.mark.parametrize(("members", "desired", "planned", "expected"), [
    pytest.param((rank(0), rank(1), server(0), server(1)), want(2), [], [], id="converged"),
    pytest.param((rank(0), rank(1), server(0), server(1)), want(2, TrainLayout(tp=2)), [],
                 [(2, TrainLayout(tp=2))], id="relayout-same-gpus"),
    pytest.param((rank(0), rank(1), rank(2), server(0)), want(2, cluster=8), [], [(2, TrainLayout())], id="shrink"),
    pytest.param((rank(0), rank(1), server(0), server(1)), want(3), [], [], id="grow-waits-for-rollout-gpus"),
    pytest.param((rank(0), rank(1), server(0)), want(3), [], [(3, TrainLayout())], id="grow-when-free"),
    pytest.param((rank(0), rank(1), server(0)), want(3), [START], [], id="grow-waits-for-planned-starts"),
    pytest.param((rank(0), rank(1, busy=True), server(0)), want(3), [], [], id="busy-rank"),
    pytest.param((rank(0), rank(1), rank(2), server(0)), want(2, swap=True),
                 [ShrinkTrainingPool("swap", 2)], [(1, TrainLayout())], id="lend-for-a-swap"),
    pytest.param((rank(0), server(0)), want(2, swap=True), [ShrinkTrainingPool("swap", 1)], [],
                 id="never-lends-the-last-gpu"),
    # the rollout pool shrinks 2 -> 1 while its instances reload weights (LOADING): a strategy asking for GPUs
    # then reads a passing state; nothing is lent (training 2 -> 3 waits for the freed GPU instead)
    pytest.param((rank(0), rank(1), server(0, S.LOADING), server(1, S.LOADING)), want(3, swap=True, instances=1),
                 [ShrinkTrainingPool("swap", 1)], [], id="no-lend-while-rollout-shrinks"),
    # a swap 1 -> 2 instances found a spare GPU for one green instance and asks for the other: the serving (blue)
    # instance is not part of the green set, so training lends one GPU (before, blue + green counted as the 2
    # wanted and nothing was lent: the swap never ended)
    pytest.param((rank(0), rank(1), server(0), server(1, serving=False)), want(2, swap=True),
                 [ShrinkTrainingPool("swap", 1)], [(1, TrainLayout())], id="lend-for-the-rest-of-a-green-set"),
    pytest.param((rank(0), rank(1), server(0), server(1, serving=False), server(2, serving=False)),
                 want(2, swap=True, cluster=5), [ShrinkTrainingPool("swap", 1)], [], id="no-lend-with-the-green-set-whole"),
    pytest.param((rank(0), rank(1), server(0, fingerprint="fp-old"), server(1, serving=False)), want(2, swap=True),
                 [ShrinkTrainingPool("swap", 1)], [(1, TrainLayout())], id="lend-for-a-new-spec"),
])
def test_training_actions(members: tuple[Member, ...], desired: DesiredState, planned: list, expected: list) -> None:
    actions = training_actions(observed(*members), desired, list(planned))
    resizes = [(a.gpus, a.layout) for a in actions if isinstance(a, ResizeTrainingPool)]
    assert resizes == expected
    assert not any(isinstance(a, ShrinkTrainingPool) for a in actions)  # asks become resizes (or wait)
    for action in actions:
        if isinstance(action, ResizeTrainingPool):
            assert len(action.member_ids) == action.gpus and action.generation == 7
            assert not set(action.member_ids) & {m.id for m in members}


def test_nothing_while_the_pool_is_busy() -> None:
    assert training_actions(observed(rank(0), busy=True), want(3, cluster=8), []) == []
    assert not training_converged(observed(rank(0), busy=True), want(1))


def test_converged_needs_the_layout() -> None:
    assert training_converged(observed(rank(0), rank(1)), want(2))
    assert not training_converged(observed(rank(0), rank(1)), want(2, TrainLayout(tp=2)))
    assert not training_converged(observed(rank(0), rank(1), rank(2, state=S.DRAINING)), want(2))
