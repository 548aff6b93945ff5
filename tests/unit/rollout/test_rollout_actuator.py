"""The pool as an actuator, without servers: instance specs and their fingerprints, id checks, the serving-set
rule (ready and on the current weights), publish targets, requeue classification, and `Membership` carrying
out starts, adoptions, stops and flips over a fake instance manager."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

from libra.config.mapping import config_with, rollout_pool_spec
from libra.rollout.client import InstanceFailure, ServerClient
from libra.rollout.membership import Membership, serving_problems, start_problems
from libra.rollout.publisher import CurrentWeights, publish_targets
from libra.rollout.router import DRAINING, FAILED, READY, STARTING, STOPPED, InstanceSlot, Router
from libra.rollout.spec import (
    GenerationAborted,
    InstanceIdError,
    InstanceSpec,
    InstanceStoppedError,
    NoHealthyInstanceError,
    RequestRejectedError,
    RolloutPoolSpec,
    RolloutSpecError,
    ServingSetError,
    instance_id_problem,
    is_requeueable,
)


def pool_spec(**fields: object) -> RolloutPoolSpec:
    spec = rollout_pool_spec(config_with("/m"), num_instances=2, kv_cache_bytes=64 * 2**20)
    return replace(spec, **fields)  # type: ignore[arg-type]


# ---- instance specs ---------------------------------------------------------------------------------------


def test_instance_spec_takes_the_pool_settings_and_its_own_tp() -> None:
    pool = pool_spec(tp_size=1, max_model_len=512, dtype="float32")
    tp1, tp2 = pool.instance_spec(), pool.instance_spec(tp_size=2)
    assert (tp1.tp_size, tp2.tp_size) == (1, 2)
    assert (tp1.model_path, tp1.max_model_len, tp1.dtype) == ("/m", 512, "float32")
    assert replace(tp2, tp_size=1) == tp1, "only the TP differs"


@pytest.mark.parametrize(
    ("change", "same"),
    [
        ({}, True),
        ({"tp_size": 2}, False),
        ({"model_path": "/other"}, False),
        ({"max_model_len": 1024}, False),
        ({"kv_cache_bytes": 1}, False),
        ({"dtype": "bfloat16"}, False),
        ({"enforce_eager": False}, False),
        ({"seed": 9}, False),
        ({"served_model_name": "x"}, False),
    ],
    ids=["equal", "tp", "model", "max-len", "kv-cache", "dtype", "eager", "seed", "served-name"],
)
def test_fingerprint_changes_with_every_launch_field(change: dict[str, Any], same: bool) -> None:
    base = pool_spec(enforce_eager=True).instance_spec()
    assert (replace(base, **change).fingerprint() == base.fingerprint()) is same


def test_fingerprint_is_stable_and_round_trips() -> None:
    spec = pool_spec().instance_spec()
    again = InstanceSpec.from_dict(spec.to_dict())
    assert again == spec and again.fingerprint() == spec.fingerprint()
    assert spec.fingerprint().startswith("is-") and len(spec.fingerprint()) == 19
    # stable across processes: a hash of the sorted fields, not Python's salted hash()
    assert spec.fingerprint() == pool_spec().instance_spec().fingerprint()
    with pytest.raises(RolloutSpecError, match="lacks fields"):
        InstanceSpec.from_dict({"tp_size": 1})


# ---- ids and start checks ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("instance_id", "ok"),
    [("rollout-3", True), ("green.0", True), ("a", True), ("", False), ("-x", False), ("a/b", False),
     ("x" * 64, False), (3, False)],
    ids=["numbered", "dotted", "short", "empty", "leading-dash", "slash", "too-long", "not-a-string"],
)  # fmt: skip
def test_instance_id_rule(instance_id: object, ok: bool) -> None:
    assert (instance_id_problem(instance_id) == "") is ok


@pytest.mark.parametrize(
    ("instance_id", "tp", "known", "managed", "expect"),
    [
        ("rollout-2", 1, ["rollout-0", "rollout-1"], True, []),
        ("rollout-1", 1, ["rollout-0", "rollout-1"], True, ["'rollout-1' is already in use"]),
        ("bad id", 1, [], True, ["instance id 'bad id'"]),
        ("rollout-0", 0, [], True, ["tp_size=0"]),
        ("rollout-0", 1, [], False, ["needs manage_processes=True"]),
    ],
    ids=["fresh", "duplicate", "malformed", "bad-tp", "unmanaged"],
)
def test_start_problems(
    instance_id: str, tp: int, known: list[str], managed: bool, expect: list[str]
) -> None:
    problems = start_problems(instance_id, pool_spec().instance_spec(tp_size=tp), known, managed)
    assert len(problems) == len(expect)
    for problem, fragment in zip(problems, expect, strict=True):
        assert fragment in problem


# ---- serving set and publish targets -------------------------------------------------------------------


def slot(iid: str, state: str = READY, version: int = 3, outstanding: int = 0) -> InstanceSlot:
    client = ServerClient(None, f"http://127.0.0.1/{iid}", iid)  # type: ignore[arg-type]  # never called here
    return InstanceSlot(
        id=iid, client=client, host="h", port=1, weight_version=version, state=state, outstanding=outstanding,
        spec=pool_spec().instance_spec(),
    )  # fmt: skip


SLOTS = {
    "ready": slot("ready"),
    "stale": slot("stale", version=2),
    "starting": slot("starting", state=STARTING),
    "failed": slot("failed", state=FAILED),
    "draining": slot("draining", state=DRAINING),
}


@pytest.mark.parametrize(
    ("ids", "fragments"),
    [
        (["ready"], []),
        ([], []),
        (["ready", "ready"], []),
        (["stale"], ["holds weight version 2, the pool serves 3"]),
        (["starting"], ["is starting"]),
        (["failed", "draining"], ["is draining", "is failed"]),
        (["ready", "ghost"], ["'ghost': no such instance"]),
    ],
    ids=[
        "ready-current",
        "empty",
        "repeated",
        "stale-weights",
        "not-ready",
        "failed-and-draining",
        "unknown",
    ],
)
def test_serving_problems(ids: list[str], fragments: list[str]) -> None:
    problems = serving_problems(ids, SLOTS, version=3)
    assert len(problems) == len(fragments), problems
    for problem, fragment in zip(problems, fragments, strict=True):
        assert fragment in problem


@pytest.mark.parametrize(
    ("ids", "expect"),
    [
        (None, ["failed", "ready", "stale", "starting"]),
        (["stale"], ["stale"]),
        (["stale", "ready", "stale"], ["ready", "stale"]),
        (["ghost"], "unknown instance"),
        (["draining"], "stopping"),
        ([], "empty list"),
    ],
    ids=["default-every-live-one", "one", "deduplicated", "unknown", "stopping", "empty"],
)
def test_publish_targets(ids: list[str] | None, expect: list[str] | str) -> None:
    if isinstance(expect, str):
        with pytest.raises(InstanceIdError, match=expect):
            publish_targets(SLOTS, ids)
    else:
        assert [s.id for s in publish_targets(SLOTS, ids)] == expect


@pytest.mark.parametrize(
    ("error", "requeue"),
    [
        (InstanceStoppedError("x"), True),
        (GenerationAborted("x"), True),
        (RequestRejectedError("x"), False),
        (InstanceFailure("x"), False),
        (NoHealthyInstanceError("x"), False),
        (ValueError("x"), False),
    ],
    ids=["instance-stopped", "step-boundary-abort", "rejected", "instance-failure", "no-instance", "other"],
)
def test_requeue_classification(error: BaseException, requeue: bool) -> None:
    assert is_requeueable(error) is requeue


# ---- Membership over a fake instance manager ------------------------------------------------------------


class FakeManager:
    """Launches and stops instances instantly; `unclaimed` holds one live server a previous pool left."""

    def __init__(self, unclaimed_fingerprint: str) -> None:
        self.launched: list[str] = []
        self.stopped: list[str] = []
        self.unclaimed: dict[str, str] = {"rollout-7": unclaimed_fingerprint}
        self.release = asyncio.Event()

    async def adopt(self, instance_id: str, spec: InstanceSpec) -> InstanceSlot | None:
        fingerprint = self.unclaimed.get(instance_id)
        if fingerprint is None:
            return None
        if fingerprint != spec.fingerprint():
            raise InstanceIdError(f"a live server named {instance_id!r} runs with another spec")
        del self.unclaimed[instance_id]
        adopted = replace(slot(instance_id, version=0), adopted=True, spec=spec)
        return adopted

    async def launch(self, instance_id: str, spec: InstanceSpec) -> InstanceSlot:
        await self.release.wait()
        self.launched.append(instance_id)
        return replace(slot(instance_id, version=0), spec=spec)

    async def stop(self, s: InstanceSlot) -> float:
        self.stopped.append(s.id)
        return 0.0

    async def stop_unclaimed(self, instance_id: str) -> bool:
        self.stopped.append(instance_id)
        return self.unclaimed.pop(instance_id, None) is not None


def membership(manager: FakeManager) -> tuple[Membership, Router]:
    router = Router(max_concurrent=4, request_timeout_s=1, wait_for_instance_s=0.1)
    return Membership(pool_spec(), router, manager, CurrentWeights(version=0)), router  # type: ignore[arg-type]


def test_start_serve_flip_and_stop_with_caller_chosen_ids() -> None:
    spec = pool_spec().instance_spec()

    async def scenario() -> None:
        manager = FakeManager(spec.fingerprint())
        members, router = membership(manager)
        manager.release.set()
        await members.start_instance("blue-0", spec)
        assert router.serving == frozenset(), "a started instance does not serve until the caller says so"
        await members.start_instance("rollout-7", spec)  # a live server of that id and spec: adopted
        assert manager.launched == ["blue-0"] and router.slots["rollout-7"].adopted
        await members.set_serving(["blue-0"])
        await members.start_instance("green-0", pool_spec().instance_spec(tp_size=2))
        await members.set_serving(["green-0", "rollout-7"])
        views = {i.id: i for i in members.instances()}
        assert {i: (v.serving, v.tp_size) for i, v in views.items()} == {
            "blue-0": (False, 1), "green-0": (True, 2), "rollout-7": (True, 1),
        }  # fmt: skip
        assert views["green-0"].fingerprint == pool_spec().instance_spec(tp_size=2).fingerprint()
        await members.stop_instance("blue-0", drain=True)
        assert "blue-0" not in router.slots and manager.stopped == ["blue-0"]
        await members.stop_instance("rollout-7", drain=False)
        assert router.serving == frozenset({"green-0"}), "a stopped instance leaves the serving set"

    asyncio.run(scenario())


def test_duplicate_and_unknown_ids_are_refused_with_the_id() -> None:
    spec = pool_spec().instance_spec()

    async def scenario() -> list[str]:
        manager = FakeManager("is-other")
        members, router = membership(manager)
        errors = []
        pending = asyncio.create_task(members.start_instance("rollout-0", spec))
        await asyncio.sleep(0.01)
        for call in (
            members.start_instance("rollout-0", spec),  # the same id while its start runs
            members.start_instance("rollout-7", spec),  # a live server of that id with another spec
            members.stop_instance("ghost", drain=True),
        ):
            try:
                await call
            except InstanceIdError as exc:
                errors.append(str(exc))
        manager.release.set()
        await pending
        try:
            await members.start_instance("rollout-0", spec)  # the same id once it runs
        except InstanceIdError as exc:
            errors.append(str(exc))
        return errors

    errors = asyncio.run(scenario())
    assert len(errors) == 4
    assert "'rollout-0' is already in use" in errors[0] and "'rollout-0' is already in use" in errors[3]
    assert "another spec" in errors[1] and "unknown rollout instance 'ghost'" in errors[2]


def test_serving_refusal_changes_nothing() -> None:
    spec = pool_spec().instance_spec()

    async def scenario() -> tuple[str, frozenset[str]]:
        manager = FakeManager("is-other")
        manager.release.set()
        members, router = membership(manager)
        await members.start_instance("old", spec)
        await members.set_serving(["old"])
        await members.start_instance("new", spec)
        router.slots["new"].weight_version = 5  # e.g. started during a publish the pool has not validated
        try:
            await members.set_serving(["new"])
        except ServingSetError as exc:
            return str(exc), router.serving
        return "", router.serving

    message, serving = asyncio.run(scenario())
    assert "holds weight version 5, the pool serves 0" in message and "publish the current weights" in message
    assert serving == frozenset({"old"})


def test_stop_without_drain_aborts_only_that_instances_requests() -> None:
    spec = pool_spec().instance_spec()

    class Hanging:
        def __init__(self) -> None:
            self.release = asyncio.Event()

        async def complete(self, payload: dict[str, Any], timeout_s: float) -> dict[str, Any]:
            await self.release.wait()
            return {}

    async def scenario() -> tuple[list[object], list[str]]:
        manager = FakeManager("is-other")
        manager.release.set()
        members, router = membership(manager)
        for iid in ("a", "b"):
            await members.start_instance(iid, spec)
            router.slots[iid].client = Hanging()  # type: ignore[assignment]
        await members.set_serving(["a", "b"])
        requests = [asyncio.create_task(router.send({})) for _ in range(4)]
        await asyncio.sleep(0.05)
        await members.stop_instance("a", drain=False)
        router.slots["b"].client.release.set()  # type: ignore[attr-defined]
        results: list[object] = list(await asyncio.gather(*requests, return_exceptions=True))
        return results, sorted(router.slots)

    results, left = asyncio.run(scenario())
    assert left == ["b"]
    assert sum(isinstance(r, InstanceStoppedError) for r in results) == 2
    assert sum(isinstance(r, tuple) and r[1].id == "b" for r in results) == 2


def test_stopped_slots_are_not_publish_targets() -> None:
    slots = {"a": slot("a"), "gone": slot("gone", state=STOPPED)}
    assert [s.id for s in publish_targets(slots, None)] == ["a"]
