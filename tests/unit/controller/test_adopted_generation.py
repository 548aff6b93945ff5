"""An instance adopted by a restarted controller keeps the generation it was started for (read back from the
run's event log), so `restart_all` finishes a change without restarting the instances already started for
it, and still restarts the ones of the earlier generation."""

from __future__ import annotations

from pathlib import Path

import pytest

from libra.controller.events import EventLog, started_generations
from libra.controller.members import MemberState
from libra.controller.state import ROLLOUT, DesiredState, PoolObservation, TrainLayout
from libra.controller.strategies import restart_all_strategy
from libra.controller.tracker import MemberTracker, MemberView

S = MemberState


def earlier_run(path: Path) -> None:
    """What a first controller wrote: rollout-0 and rollout-1 at generation 1, then a restart_all from 2 to 3
    instances (generation 2) that started rollout-2 and rollout-1 again (the newer event of an id wins)
    before it was killed."""
    log = EventLog(path)
    log.emit("member_added", member="rollout-0", pool=ROLLOUT, generation=1)
    log.emit("member_added", member="rollout-1", pool=ROLLOUT, generation=1)
    log.emit("member_added", member="rank-0", pool="train", generation=0)
    log.emit("member_added", member="rollout-2", pool=ROLLOUT, generation=2)
    log.emit("member_added", member="rollout-1", pool=ROLLOUT, generation=2)
    with open(path, "a", encoding="utf-8") as fh:
        fh.write('{"kind": "member_added", "member": "rollout-3"')  # cut off by a crash mid-write


def test_started_generations_reads_the_latest_per_member(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    earlier_run(path)
    assert started_generations(path, ROLLOUT) == {"rollout-0": 1, "rollout-1": 2, "rollout-2": 2}
    assert started_generations(tmp_path / "missing.jsonl", ROLLOUT) == {}


def view(key: str) -> MemberView:
    return MemberView(key=key, state=S.READY, info={"adopted": True}, tp=1, fingerprint="fp", serving=True,
                      weight_version=0)


@pytest.mark.parametrize("how", ["bound-at-create", "adopted-while-observing"])
def test_restart_all_after_a_restart_keeps_what_the_change_started(tmp_path: Path, how: str) -> None:
    path = tmp_path / "events.jsonl"
    earlier_run(path)
    tracker = MemberTracker(EventLog(None), started_for=started_generations(path, ROLLOUT))
    if how == "bound-at-create":
        for key in ("rollout-0", "rollout-2"):
            tracker.add_member(key, ROLLOUT, 100.0, "create", generation=2)
            tracker.bind_view(key, view(key))
            tracker.move(key, S.READY, 100.0, "pool created")
    else:
        tracker.observe(ROLLOUT, [view("rollout-0"), view("rollout-2")], 100.0)
    generations = {m.id: m.generation for m in tracker.members(ROLLOUT)}
    assert generations == {"rollout-0": 1, "rollout-2": 2}

    desired = DesiredState(rollout_instances=3, rollout_tp=1, train_gpus=1, train_layout=TrainLayout(),
                           reconfigure_strategy="restart_all", rollout_fingerprint="fp", cluster_gpus=4,
                           generation=2, reconfiguring="generation 2 by restart_all")
    observed = tracker.snapshot(101.0)
    observed = type(observed)(now=101.0, rollout=PoolObservation(created=True), train=PoolObservation(created=True),
                              members=observed.members)
    stops = [a.member_id for a in restart_all_strategy(observed, desired, set()) if a.kind == "StopRolloutInstance"]
    assert stops == ["rollout-0"]
