"""A new instance's host frees what an earlier controller left under its name: a controller killed while an
instance was starting leaves a detached host actor and placement group that never reached the registry;
the next start of that id must remove them (a Ray name is taken until then), or say clearly that it cannot."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import libra.cluster
from libra.config.mapping import config_with, rollout_pool_spec
from libra.rollout import lifecycle
from libra.rollout.lifecycle import InstanceManager
from libra.rollout.spec import ServerStartError


class FakeRayHosts:
    """The rollout_hosts module over an in-memory set of named actors and placement groups."""

    def __init__(self, actors: set[str], groups: set[str], killable: bool = True, answers: bool = True) -> None:
        self.actors, self.groups, self.killable, self.answers = actors, groups, killable, answers
        self.calls: list[str] = []

    def find_host(self, name: str, namespace: str) -> Any:
        if name not in self.actors:
            return None

        async def acall(method: str) -> int:
            self.calls.append(f"{method} {name}")
            if not self.answers:
                raise RuntimeError("the actor died")
            return 4242

        def kill() -> None:
            self.calls.append(f"kill {name}")
            if self.killable:
                self.actors.discard(name)
                self.groups.discard(name)

        return SimpleNamespace(kill=kill, acall=acall)

    def find_group(self, name: str) -> Any:
        return object() if name in self.groups else None

    def remove_group(self, name: str) -> None:
        self.calls.append(f"remove_group {name}")
        self.groups.discard(name)

    def spawn_host(self, host_cls: type, *args: Any, name: str, namespace: str, tp_size: int,
                   detached: bool, runtime: Any) -> Any:
        if name in self.actors or name in self.groups:
            raise RuntimeError(f"name {name!r} already exists")
        self.calls.append(f"spawn {name}")
        self.actors.add(name)
        self.groups.add(name)
        return SimpleNamespace(name=name)


@pytest.mark.parametrize(
    ("actors", "groups", "expected"),
    [
        ((), (), ["spawn"]),
        (("rollout-1",), ("rollout-1",), ["abandon", "kill", "spawn"]),
        ((), ("rollout-1",), ["remove_group", "spawn"]),
        (("rollout-0",), ("rollout-0",), ["spawn"]),  # another instance's host is left alone
    ],
    ids=["nothing-left", "actor-and-group-left", "group-left", "other-instance"],
)
def test_a_start_frees_its_name_first(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, actors: tuple[str, ...],
                                       groups: tuple[str, ...], expected: list[str]) -> None:
    manager = manager_with(monkeypatch, tmp_path)
    fake = install(monkeypatch, {manager.actor_name(a) for a in actors}, {manager.actor_name(g) for g in groups})
    handle = asyncio.run(manager._new_host("rollout-1", 1))
    assert handle.name == manager.actor_name("rollout-1")
    assert [c.split()[0] for c in fake.calls] == expected
    assert manager.actor_name("rollout-0") in fake.actors or "rollout-0" not in actors


def test_a_leftover_host_that_cannot_answer_is_killed_all_the_same(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    manager = manager_with(monkeypatch, tmp_path)
    name = manager.actor_name("rollout-1")
    fake = install(monkeypatch, {name}, {name}, answers=False)
    asyncio.run(manager._new_host("rollout-1", 1))
    assert fake.calls == [f"abandon {name}", f"kill {name}", f"spawn {name}"]


def test_a_leftover_that_does_not_go_away_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    manager = manager_with(monkeypatch, tmp_path)
    name = manager.actor_name("rollout-1")
    install(monkeypatch, {name}, {name}, killable=False)
    monkeypatch.setattr(lifecycle, "LEFTOVER_RELEASE_S", 0.2)
    with pytest.raises(ServerStartError, match=f"{name}: the host left by an earlier controller did not go away"):
        asyncio.run(manager._new_host("rollout-1", 1))


def manager_with(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> InstanceManager:
    spec = rollout_pool_spec(config_with("/m"), num_instances=1, kv_cache_bytes=64 * 2**20)
    return InstanceManager(spec, SimpleNamespace(namespace="ns"), str(tmp_path), session=None)  # type: ignore[arg-type]


def install(monkeypatch: pytest.MonkeyPatch, actors: set[str], groups: set[str], killable: bool = True,
            answers: bool = True) -> FakeRayHosts:
    fake = FakeRayHosts(actors, groups, killable, answers)
    monkeypatch.setitem(sys.modules, "libra.cluster.rollout_hosts", fake)
    monkeypatch.setattr(libra.cluster, "rollout_hosts", fake, raising=False)
    return fake


@pytest.mark.parametrize("server_left", [True, False], ids=["server-still-here-is-killed", "server-already-gone"])
def test_stopping_an_instance_whose_host_is_gone_is_done_not_failed(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, server_left: bool) -> None:
    """Its node died with the host actor (Ray's ActorDiedError, as `HostGoneError`): the stop ends, the slot
    leaves the pool's records, and a server process of it still on this machine is killed."""
    import socket
    import subprocess

    from libra.rollout.router import InstanceSlot
    from libra.rollout.server import process_start_ticks
    from libra.rollout.spec import HostGoneError

    manager = manager_with(monkeypatch, tmp_path)
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        if not server_left:
            server.kill()
            server.wait()
        calls: list[str] = []

        async def acall(method: str, *args: Any) -> Any:
            calls.append(method)
            raise HostGoneError("the host actor rollout-1 is gone (ActorDiedError)")

        handle = SimpleNamespace(acall=acall, kill=lambda: calls.append("kill"), name="rollout-1")
        slot = InstanceSlot(id="rollout-1", client=None, host="127.0.0.1", port=1, weight_version=0,  # type: ignore[arg-type]
                            pid=server.pid, start_ticks=process_start_ticks(server.pid) if server_left else 1,
                            hostname=socket.gethostname(), handle=handle)
        manager.tracked["rollout-1"] = slot
        assert asyncio.run(manager.stop(slot)) == 0.0
        assert calls == ["stop", "kill"] and "rollout-1" not in manager.tracked
        if server_left:  # killed by the stop (a server already gone has nothing left to kill)
            assert server.wait(timeout=10) == -9
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


@pytest.mark.parametrize(("answers", "outcome"), [
    (["unreachable", "unreachable", "gone"], "done"),
    (["unreachable", 2.5], "done"),
    (["unreachable"] * 50, "unreachable"),
], ids=["declared-gone-after-two-tries", "answers-on-the-second-try", "never-answers-within-the-stop-timeout"])
def test_a_stop_asks_an_unreachable_host_again_until_it_answers_or_is_gone(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, answers: list[Any], outcome: str) -> None:
    """A host on a node that died without a word does not answer (Ray's ActorUnavailableError) until Ray
    declares the node dead (ActorDiedError); the stop waits for that, up to `stop_timeout_s`."""
    from dataclasses import replace

    from libra.rollout.router import InstanceSlot
    from libra.rollout.spec import HostGoneError, HostUnreachableError

    manager = manager_with(monkeypatch, tmp_path)
    manager.spec = replace(manager.spec, stop_timeout_s=0.3)
    monkeypatch.setattr(lifecycle, "UNREACHABLE_HOST_RETRY_S", 0.01)
    replies = iter(answers)
    calls: list[str] = []

    async def acall(method: str, *args: Any) -> Any:
        calls.append(method)
        reply = next(replies)
        if reply == "unreachable":
            raise HostUnreachableError("the host actor rollout-1 does not answer (ActorUnavailableError)")
        if reply == "gone":
            raise HostGoneError("the host actor rollout-1 is gone (ActorDiedError)")
        return reply

    handle = SimpleNamespace(acall=acall, kill=lambda: calls.append("kill"), name="rollout-1")
    slot = InstanceSlot(id="rollout-1", client=None, host="127.0.0.1", port=1, weight_version=0,  # type: ignore[arg-type]
                        handle=handle)
    manager.tracked["rollout-1"] = slot
    if outcome == "done":
        assert asyncio.run(manager.stop(slot)) == (2.5 if 2.5 in answers else 0.0)
        assert calls == ["stop"] * len(answers) + ["kill"]
    else:
        with pytest.raises(HostUnreachableError):
            asyncio.run(manager.stop(slot))
        assert calls[-1] == "kill" and 2 < calls.count("stop") < len(answers)
    assert "rollout-1" not in manager.tracked
