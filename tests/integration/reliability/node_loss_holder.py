"""Holds the Ray cluster of the node-loss test in a process of its own (the test process may already be joined to
another cluster, and a process joins one): a head with no GPU and two nodes of 2 logical GPUs.

Commands, one a line on stdin, each answered by one JSON line on stdout: `remove-training-node` (removes the
worker node that holds the training pool's placement group with `Cluster.remove_node`: {"removed": node id}),
`kill-training-node` (the same node killed without a word to the cluster, as a node that crashes: its
processes get SIGKILL, `remove_node(allow_graceful=False)`, and Ray's health checks find it dead later),
`add-node` (a new worker node of 2 logical GPUs, as the lost one came back: {"added": node id}), `gpus`
({"gpus": the GPUs Ray counts alive}). The first line out is {"address": ...}. The cluster stops when stdin
closes."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from typing import Any, TextIO

import ray

from libra.cluster.ray_runtime import RayRuntime

GPUS_PER_NODE = 2  # on each worker node (start_nodes' own CPU and object-store sizes for a node added later)


def training_node(runtime: RayRuntime) -> Any:
    """The worker node (`ray._private.node.Node`) that holds the training pool's placement group."""
    for table in ray.util.placement_group_table().values():
        if table.get("state") == "CREATED" and "train" in (table.get("name") or ""):
            node_ids = set((table.get("bundles_to_node_id") or {}).values())
            for node in runtime.local_nodes.worker_nodes:
                if node.node_id in node_ids:
                    return node
    return None


def answer(command: str, runtime: RayRuntime) -> dict[str, Any]:
    if command in ("remove-training-node", "kill-training-node"):
        node = training_node(runtime)
        if node is None:
            return {"error": f"no worker node holds the training pool: {ray.util.placement_group_table()}"}
        runtime.local_nodes.remove_node(node, allow_graceful=command == "remove-training-node")
        return {"removed": node.node_id}
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
        runtime.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
