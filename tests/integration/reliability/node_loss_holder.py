"""Holds the Ray cluster of the node-loss test in a process of its own (the test process may already be joined to
another cluster, and a process joins one): a head with no GPU and two nodes of 2 logical GPUs.

Commands, one a line on stdin, each answered by one JSON line on stdout: `remove-training-node` (removes the
worker node that holds the training pool's placement group with `Cluster.remove_node`: {"removed": node id}),
`kill-training-node` (the same node killed without a word to the cluster, as a node that crashes: its
processes get SIGKILL, `remove_node(allow_graceful=False)`, and Ray's health checks find it dead later),
`freeze-training-node` (every process of that node stopped by SIGSTOP, its Ray processes and all they started,
Libra's servers included: a node alive but unreachable, as behind a network partition or a machine that hangs;
Ray's health checks find it dead later: {"frozen": node id, "processes": how many}), `freeze-training-raylet`
(only that node's raylet stopped, as a Ray daemon that hangs while the node's workers and servers run on; the
same answer), `thaw` (the frozen node's
processes continued, as the partition heals; waits up to THAW_WAIT_S for them to end by themselves, then removes
what is left with the node: {"thawed": node id, "ended_within_s": seconds until the last ended or None,
"left": [command names of those still running]}), `add-node` (a new worker node of 2 logical GPUs, as the
lost one came back: {"added": node id}), `gpus`
({"gpus": the GPUs Ray counts alive}). The first line out is {"address": ...}. The cluster stops when stdin
closes."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any, TextIO

import psutil
import ray

from libra.cluster.ray_runtime import RayRuntime

GPUS_PER_NODE = 2  # on each worker node (start_nodes' own CPU and object-store sizes for a node added later)
THAW_WAIT_S = 120.0
FROZEN: dict[str, tuple[Any, list[psutil.Process]]] = {}  # node id: (the node, its stopped processes)


def training_node(runtime: RayRuntime) -> Any:
    """The worker node (`ray._private.node.Node`) that holds the training pool's placement group."""
    for table in ray.util.placement_group_table().values():
        if table.get("state") == "CREATED" and "train" in (table.get("name") or ""):
            node_ids = set((table.get("bundles_to_node_id") or {}).values())
            for node in runtime.local_nodes.worker_nodes:
                if node.node_id in node_ids:
                    return node
    return None


def node_processes(node: Any) -> list[psutil.Process]:
    """Every live process of `node`: its Ray processes and what they started (workers, and the servers and
    their guards that Libra's host actors started, in sessions of their own but still their descendants)."""
    found: dict[int, psutil.Process] = {}
    for _, popen in node.live_processes():
        try:
            root = psutil.Process(popen.pid)
            found.update({p.pid: p for p in [root, *root.children(recursive=True)]})
        except psutil.NoSuchProcess:
            pass
    return list(found.values())


def freeze(node: Any, raylet_only: bool = False) -> dict[str, Any]:
    """Stop every process of `node`, or (`raylet_only`) its raylet alone; either way every process of the node
    is watched after the thaw."""
    processes = node_processes(node)
    stopped = processes
    if raylet_only:
        stopped = [psutil.Process(popen.pid) for name, popen in node.live_processes() if name == "raylet"]
    for proc in stopped:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.suspend()
    FROZEN[node.node_id] = (node, processes)
    return {"frozen": node.node_id, "processes": len(stopped)}


def running(proc: psutil.Process) -> bool:
    """Alive and not a zombie (a process that ends between the two checks is not running)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def thaw(runtime: RayRuntime, within_s: float = THAW_WAIT_S) -> dict[str, Any]:
    """Continue the frozen node's processes; how long they took to end by themselves, and which did not."""
    if not FROZEN:
        return {"error": "no node is frozen"}
    node_id, (node, processes) = FROZEN.popitem()
    for proc in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.resume()
    began = time.monotonic()
    left = processes
    while left and time.monotonic() - began < within_s:
        _, left = psutil.wait_procs(left, timeout=0.5)
        left = [p for p in left if running(p)]
    ended_within_s = None if left else round(time.monotonic() - began, 1)
    names = []
    for proc in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            names.append(" ".join(proc.cmdline()[:3])[:120])
    runtime.local_nodes.remove_node(node, allow_graceful=False)  # what is left, and the node from the list
    for proc in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    return {"thawed": node_id, "ended_within_s": ended_within_s, "left": names}


def answer(command: str, runtime: RayRuntime) -> dict[str, Any]:
    if command in ("remove-training-node", "kill-training-node", "freeze-training-node", "freeze-training-raylet"):
        node = training_node(runtime)
        if node is None:
            return {"error": f"no worker node holds the training pool: {ray.util.placement_group_table()}"}
        if command.startswith("freeze-"):
            return freeze(node, raylet_only=command == "freeze-training-raylet")
        runtime.local_nodes.remove_node(node, allow_graceful=command == "remove-training-node")
        return {"removed": node.node_id}
    if command == "thaw":
        return thaw(runtime)
    if command == "add-node":
        node = runtime.local_nodes.add_node(num_gpus=GPUS_PER_NODE, num_cpus=max(2 * GPUS_PER_NODE, 4),
                                            object_store_memory=128 * 1024**2)
        runtime.local_nodes.wait_for_nodes()
        return {"added": node.node_id}
    if command == "gpus":
        return {"gpus": runtime.live_gpus()}
    return {"error": f"unknown command {command!r}"}


def main() -> None:
    # replies go to the real stdout; whatever Ray or a library prints goes to stderr
    replies: TextIO = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    tmp = tempfile.mkdtemp(prefix="libra-loss-")  # short: Ray's socket paths must fit AF_UNIX
    runtime = RayRuntime.start_nodes(num_nodes=3, gpus_per_node=GPUS_PER_NODE, head_gpus=0, tmp_dir=tmp,
                                     namespace="libra-itest-loss")
    try:
        print(json.dumps({"address": runtime.address}), file=replies, flush=True)
        for line in sys.stdin:
            if line.strip():
                print(json.dumps(answer(line.strip(), runtime)), file=replies, flush=True)
    finally:
        for _, processes in FROZEN.values():  # a run that failed before its thaw: stopped processes die slowly
            for proc in processes:
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.resume()
        runtime.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
