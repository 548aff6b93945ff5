"""Holds the Ray cluster of the worker-partition test in a process of its own: a head with no GPU in this
machine's network namespace and three worker nodes of 1 logical GPU, each in a network namespace of its own
(`ip netns`) joined to the head's by a bridge, so that the route between two worker nodes can be cut while
both still reach the head: a network partition between worker nodes on one machine. Needs root (or
CAP_NET_ADMIN) and `ip`; without them the first line out is {"error": why}.

Commands, one a line on stdin, each answered by one JSON line on stdout: `partition-training` (the two worker
nodes that hold the training pool's placement group stop reaching each other: what each sends the other is
lost on the way, as in a partition: {"partitioned": [their addresses]}), `partition-lender` (the one worker node of the
training pool and the first other worker node the same way: {"partitioned": [...], "lender": its address}),
`partition-workers` (every pair of worker nodes the same way), `heal` (the routes back: {"healed": [...]}),
`gpus` ({"gpus": the GPUs Ray counts alive}). The first line out is {"address": ...}. The cluster, the
namespaces and the bridge go when stdin closes (and a run that died before is cleaned up at the next start)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, TextIO

import psutil
import ray

WORKER_NODES = 3
GPUS_PER_NODE = 1
SUBNET = "10.213.7"  # the head is .1, worker node i is .(i + 2)
BRIDGE = "lbrpart0"
NAMESPACE = "libra-part-{}"
VETH = "lvpart{}"  # the root namespace's end; the node's end is eth0 in its namespace
OBJECT_STORE_BYTES = 128 * 1024**2
NOWHERE = "02:00:00:00:de:ad"  # a locally administered link-layer address that no interface has
CUT: list[tuple[str, str]] = []  # (namespace, address it no longer reaches)


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), check=check, capture_output=True, text=True)


def in_namespace(index: int, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return sh("ip", "netns", "exec", NAMESPACE.format(index), *args, check=check)


def tear_down_network() -> None:
    """Remove the namespaces, their links and the bridge (what exists of them)."""
    for index in range(WORKER_NODES):
        sh("ip", "netns", "del", NAMESPACE.format(index), check=False)
        sh("ip", "link", "del", VETH.format(index), check=False)
    sh("ip", "link", "del", BRIDGE, check=False)


def set_up_network() -> None:
    tear_down_network()
    sh("ip", "link", "add", BRIDGE, "type", "bridge")
    sh("ip", "addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE)
    sh("ip", "link", "set", BRIDGE, "up")
    for index in range(WORKER_NODES):
        ns, veth = NAMESPACE.format(index), VETH.format(index)
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "link", "set", veth, "master", BRIDGE, "up")
        in_namespace(index, "ip", "addr", "add", f"{node_address(index)}/24", "dev", "eth0")
        in_namespace(index, "ip", "link", "set", "eth0", "up")
        in_namespace(index, "ip", "link", "set", "lo", "up")


def node_address(index: int) -> str:
    return f"{SUBNET}.{index + 2}"


def start_worker_node(index: int, head: str, tmp: str) -> subprocess.Popen[bytes]:
    """`ray start --block` of worker node `index` inside its namespace (gloo there uses its eth0, as a real
    node's gloo uses the interface its hostname resolves to)."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", RAY_AUTH_MODE="disabled")
    return subprocess.Popen(
        ["ip", "netns", "exec", NAMESPACE.format(index), sys.executable, "-m", "ray.scripts.scripts", "start",
         "--address", head, "--node-ip-address", node_address(index), "--num-gpus", str(GPUS_PER_NODE),
         "--num-cpus", str(max(2 * GPUS_PER_NODE, 2)), "--object-store-memory", str(OBJECT_STORE_BYTES),
         "--temp-dir", os.path.join(tmp, f"n{index}"), "--disable-usage-stats", "--block"],
        env=env, stdout=sys.stderr, stderr=sys.stderr, start_new_session=True)


def training_addresses() -> list[str]:
    """The addresses of the worker nodes that hold the training pool's placement group."""
    address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    for table in ray.util.placement_group_table().values():
        if table.get("state") == "CREATED" and "train" in (table.get("name") or ""):
            return sorted({address[n] for n in (table.get("bundles_to_node_id") or {}).values() if n in address})
    return []


def cut(nodes: list[str]) -> None:
    """Every pair of `nodes` (addresses) stops reaching each other; both still reach the head. Each node sends
    what is meant for the other to a link-layer address no one has, so the bridge delivers it nowhere: packets
    vanish on the way, as in a partition (a connection attempt times out, an open connection's sends go
    unanswered), where a blackhole route would fail them at once with an error."""
    index = {node_address(i): i for i in range(WORKER_NODES)}
    for here in nodes:
        for there in nodes:
            if here != there:
                in_namespace(index[here], "ip", "neigh", "replace", there, "lladdr", NOWHERE, "dev", "eth0",
                             "nud", "permanent")
                CUT.append((here, there))


def partition_training() -> dict[str, Any]:
    nodes = training_addresses()
    if len(nodes) != 2:
        return {"error": f"the training pool is on {nodes}, not on two worker nodes"}
    cut(nodes)
    return {"partitioned": nodes}


def partition_lender() -> dict[str, Any]:
    training = training_addresses()
    if len(training) != 1:
        return {"error": f"the training pool is on {training}, not on one worker node"}
    lender = min(node_address(i) for i in range(WORKER_NODES) if node_address(i) != training[0])
    cut([training[0], lender])
    return {"partitioned": [training[0], lender], "lender": lender}


def heal() -> dict[str, Any]:
    index = {node_address(i): i for i in range(WORKER_NODES)}
    healed = []
    while CUT:
        here, there = CUT.pop()
        in_namespace(index[here], "ip", "neigh", "del", there, "dev", "eth0", check=False)
        healed.append(here)
    return {"healed": healed}


def answer(command: str) -> dict[str, Any]:
    if command == "partition-training":
        return partition_training()
    if command == "partition-lender":
        return partition_lender()
    if command == "partition-workers":
        nodes = [node_address(i) for i in range(WORKER_NODES)]
        cut(nodes)
        return {"partitioned": nodes}
    if command == "heal":
        return heal()
    if command == "gpus":
        return {"gpus": sum(int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n["Alive"])}
    return {"error": f"unknown command {command!r}"}


def stop_tree(proc: subprocess.Popen[bytes]) -> None:
    """Stop a `ray start --block` and everything it started (its raylet's workers and what they started)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        proc.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs(tree, timeout=20)
        for left in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                left.kill()


def main() -> None:
    replies: TextIO = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    if os.geteuid() != 0 or shutil.which("ip") is None:
        print(json.dumps({"error": "needs root and the ip command to make network namespaces"}), file=replies,
              flush=True)
        return
    try:
        set_up_network()
    except subprocess.CalledProcessError as exc:
        tear_down_network()
        print(json.dumps({"error": f"network namespaces: {exc.stderr.strip() or exc}"}), file=replies, flush=True)
        return
    from ray.cluster_utils import Cluster

    tmp = tempfile.mkdtemp(prefix="lp-", dir="/tmp")  # short: Ray's socket paths must fit AF_UNIX
    os.environ["RAY_TMPDIR"] = tmp
    nodes: list[subprocess.Popen[bytes]] = []
    cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_gpus": 0, "num_cpus": 2, "node_ip_address": f"{SUBNET}.1", "temp_dir": os.path.join(tmp, "ray"),
            "include_dashboard": False, "object_store_memory": OBJECT_STORE_BYTES})
        nodes = [start_worker_node(i, cluster.address, tmp) for i in range(WORKER_NODES)]
        ray.init(address=cluster.address, log_to_driver=False)
        deadline = time.monotonic() + 120
        while answer("gpus")["gpus"] < WORKER_NODES * GPUS_PER_NODE and time.monotonic() < deadline:
            time.sleep(1)
        print(json.dumps({"address": cluster.address, "gpus": answer("gpus")["gpus"]}), file=replies, flush=True)
        for line in sys.stdin:
            if line.strip():
                print(json.dumps(answer(line.strip())), file=replies, flush=True)
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()
        for node in nodes:
            stop_tree(node)
        if cluster is not None:
            cluster.shutdown()
        tear_down_network()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
