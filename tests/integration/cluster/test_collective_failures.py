"""How a collective call of the training pool's worker group fails, on real Ray actors joined by a real gloo
process group (two small ranks, no model): a peer that stalls past the collective's own timeout and one that
stalls past the call's deadline are hung (`WorkerHungError`, what the job recovers from by replacing the pool),
a peer whose process ends is lost (`WorkerLostError`), and a peer that raises is a plain error that names it."""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable, Iterator

import pytest

from libra.cluster.ray_runtime import RayRuntime
from libra.cluster.training_workers import (
    CollectiveCallError,
    TrainingWorkerGroup,
    WorkerHungError,
    WorkerLostError,
)


def gloo_peer_class() -> type:
    """The rank class, defined in a function so that Ray ships it by value (a test module is not importable on
    Ray's workers)."""

    class GlooPeer:
        """One rank of a two-rank gloo group whose collective timeout is `collective_timeout_s`. The ranks meet
        first at a barrier of a group with a long timeout, so that the seconds between Ray's delivery of a call to
        one rank and to the other (many, on a loaded machine) never count against the short timeout."""

        def __init__(self, collective_timeout_s: float, rank: int, world: int) -> None:
            self.timeout_s, self.rank, self.world = collective_timeout_s, rank, world
            self.timed_group: object = None

        def rendezvous_port(self, host: str) -> int:
            from libra.training.worker import free_port

            return free_port(host)

        def setup(self, addr: str, port: int) -> int:
            import torch.distributed as dist

            dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=self.rank, world_size=self.world,
                                    timeout=datetime.timedelta(seconds=120))
            self.timed_group = dist.new_group(timeout=datetime.timedelta(seconds=self.timeout_s))
            return self.rank

        def all_reduce(self, odd_rank: int, odd: str) -> float:
            """Every rank joins an all-reduce, except `odd_rank`, which does `odd`: stall, exit or raise."""
            import torch
            import torch.distributed as dist

            dist.barrier()
            if self.rank == odd_rank:
                if odd == "stall":
                    time.sleep(120)
                elif odd == "exit":
                    os._exit(1)
                elif odd == "raise":
                    raise ValueError("a bug on this rank")
            value = torch.ones(2)
            dist.all_reduce(value, group=self.timed_group)
            return float(value.sum())

    return GlooPeer


@pytest.fixture
def peers(ray_runtime: RayRuntime) -> Iterator[Callable[[float], TrainingWorkerGroup]]:
    groups: list[TrainingWorkerGroup] = []

    def start(collective_timeout_s: float) -> TrainingWorkerGroup:
        group = TrainingWorkerGroup(ray_runtime, gloo_peer_class(), (collective_timeout_s,), 2, f"peers-{len(groups)}")
        groups.append(group)
        group.start()
        addr = group.rendezvous_host()
        port = group.call_rank(0, "rendezvous_port", addr, timeout=60)
        assert group.call("setup", addr, port, timeout=60) == [0, 1]
        assert group.call("all_reduce", -1, "", timeout=60) == [4.0, 4.0]
        return group

    try:
        yield start
    finally:
        for group in groups:
            group.shutdown()


@pytest.mark.parametrize(
    ("collective_timeout_s", "deadline_s", "odd", "error", "ranks", "says"),
    [
        pytest.param(3.0, 60.0, "stall", WorkerHungError, [1], "a collective timed out waiting for a peer",
                     id="stalls-past-the-collective-timeout"),
        pytest.param(60.0, 3.0, "stall", WorkerHungError, [0, 1], "did not finish within 3s",
                     id="stalls-past-the-call-deadline"),
        pytest.param(60.0, 60.0, "exit", WorkerLostError, [1], "the process of rank(s) [1] died", id="exits"),
        pytest.param(60.0, 60.0, "raise", CollectiveCallError, None, "a bug on this rank", id="raises"),
    ],
)
def test_how_a_peer_fails_the_call(peers: Callable[[float], TrainingWorkerGroup], collective_timeout_s: float,
                                   deadline_s: float, odd: str, error: type, ranks: list[int] | None,
                                   says: str) -> None:
    group = peers(collective_timeout_s)
    started = time.monotonic()
    with pytest.raises(CollectiveCallError) as failed:
        group.call("all_reduce", 1, odd, timeout=deadline_s)
    assert type(failed.value) is error, repr(failed.value)
    assert says in str(failed.value)
    if ranks is not None:
        assert isinstance(failed.value, WorkerLostError) and failed.value.ranks == ranks
    assert time.monotonic() - started < 45, "found long before the stalled rank would have woken"
