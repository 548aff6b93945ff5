"""The Ray runtime: start or join a cluster, placement groups, actor creation and shutdown.

Only `libra/cluster/` imports Ray. A local cluster on a CPU machine gets logical GPUs (Ray treats them as
real resources: distinct `ray.get_gpu_ids()` and `CUDA_VISIBLE_DEVICES` per actor), its own temp dir
(so it never picks up another cluster's address file) and token auth disabled.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import psutil
import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from libra.cluster.node_fence import FENCE, avoid_fenced

log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 60.0
PLACEMENT_POLL_S = 1.0  # how often a placement wait checks whether the cluster lost GPUs meanwhile
# Ray gives a starting node 30 s (not configurable) to register with its GCS; on a loaded machine that can
# run out (three attempts in a row did, when a test suite's lanes, its type checker and the first job all
# started at once). A failed start leaves its processes behind, so they are stopped before the next attempt,
# which waits a little longer each time for the load to pass.
STARTUP_ATTEMPTS = 4
STARTUP_RETRY_PAUSE_S = 10.0  # before the second attempt; twice that before the third, and so on
# Ray's startup timeouts on a loaded machine: a node that did not register with its GCS in time, and the GCS
# that did not write its port file in time
_STARTUP_TIMEOUT_TEXTS = ("timed out during startup", "Timed out waiting for file")

# Ray puts Unix sockets at TMP/session_<date>_<time>_<usec>_<pid>/sockets/plasma_store and refuses a path
# over 107 bytes (the AF_UNIX limit), so a deep temp dir (a run directory, a test's tmp path) cannot hold
# them; such a dir is reached through a short link instead.
AF_UNIX_PATH_MAX = 107
_RAY_SOCKET_SUFFIX_BYTES = len("/session_2026-12-01_22-54-30_984217_4194304/sockets/plasma_store")

T = TypeVar("T")


def socket_safe_dir(tmp_dir: str, reserve: str = "") -> tuple[str, str | None]:
    """`tmp_dir`, or (when Ray's socket paths under `tmp_dir + reserve` would pass the AF_UNIX limit) a short
    link to it in the system's temp dir; second item: the folder holding the link, to remove at shutdown."""
    if len(os.fsencode(tmp_dir + reserve)) + _RAY_SOCKET_SUFFIX_BYTES <= AF_UNIX_PATH_MAX:
        return tmp_dir, None
    base = "/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir()
    link_dir = tempfile.mkdtemp(prefix="lr-", dir=base)
    link = os.path.join(link_dir, "r")
    os.symlink(os.path.abspath(tmp_dir), link)
    if len(os.fsencode(link + reserve)) + _RAY_SOCKET_SUFFIX_BYTES > AF_UNIX_PATH_MAX:
        shutil.rmtree(link_dir, ignore_errors=True)
        raise OSError(f"Ray's socket paths under {tmp_dir} (and under a link to it in {base}) would be longer "
                      f"than {AF_UNIX_PATH_MAX} bytes; set TMPDIR to a short directory")
    log.info("Ray's temp dir %s is too deep for its sockets; reached through %s", tmp_dir, link)
    return link, link_dir


def is_startup_timeout(exc: BaseException) -> bool:
    """Whether `exc` is one of Ray's startup timeouts ("the current node timed out during startup", "Timed out
    waiting for file .../gcs_server_port_..."): worth another attempt."""
    return any(text in str(exc) for text in _STARTUP_TIMEOUT_TEXTS)


def stop_processes_under(tmp_dir: str) -> list[int]:
    """Kill this process's descendants whose command line names `tmp_dir` (the processes of a local Ray
    start that failed half-way); the pids killed."""
    killed: list[int] = []
    for child in psutil.Process().children(recursive=True):
        try:
            if any(tmp_dir in arg for arg in child.cmdline()):
                child.kill()
                killed.append(child.pid)
        except psutil.Error:
            continue
    psutil.wait_procs([psutil.Process(pid) for pid in killed if psutil.pid_exists(pid)], timeout=10)
    return killed


def start_with_retries(start: Callable[[], T], tmp_dir: str, attempts: int = STARTUP_ATTEMPTS,
                       pause_s: float = STARTUP_RETRY_PAUSE_S, sleep: Callable[[float], None] = time.sleep) -> T:
    """`start()`, again (after stopping what the failed attempt left under `tmp_dir`, and `pause_s` times the
    attempt's number later) when Ray reports a startup timeout; any other error, or the last timeout, is
    raised."""
    for attempt in range(1, attempts + 1):
        try:
            return start()
        except Exception as exc:
            if not is_startup_timeout(exc) or attempt == attempts:
                raise
            killed = stop_processes_under(tmp_dir)
            log.warning("Ray did not start in time (attempt %d of %d: %s); stopped %d leftover process(es), "
                        "starting again in %.0f s", attempt, attempts, exc, len(killed), pause_s * attempt)
            sleep(pause_s * attempt)
    raise AssertionError("unreachable")


@dataclass
class RayRuntime:
    """A handle on the Ray cluster Libra runs on; `owned` says whether Libra started it (and must stop it)."""

    address: str
    owned: bool
    namespace: str
    _placement_groups: list[PlacementGroup] = field(default_factory=list)
    _local_nodes: Any = None  # the `ray.cluster_utils.Cluster` of `start_nodes`, stopped by `shutdown`
    # while set (`placement_guard`): why a placement wait should give up now ("" = keep waiting)
    _placement_check: Callable[[], str] | None = None
    _link_dir: str | None = None  # the short link's folder of `socket_safe_dir`, removed by `shutdown`

    @classmethod
    def start(
        cls,
        *,
        address: str = "",
        num_gpus: int = 0,
        num_cpus: int | None = None,
        namespace: str = "libra",
        tmp_dir: str | None = None,
        object_store_bytes: int = 256 * 1024**2,
    ) -> RayRuntime:
        """Join `address` when given, else start a local cluster with `num_gpus` (logical) GPUs."""
        if ray.is_initialized():
            runtime_ctx = ray.get_runtime_context()
            return cls(address=runtime_ctx.gcs_address, owned=False, namespace=runtime_ctx.namespace or namespace)
        if address:
            ray.init(address=address, namespace=namespace, log_to_driver=False)
            return cls(address=address, owned=False, namespace=namespace)
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        if tmp_dir:
            os.makedirs(tmp_dir, exist_ok=True)
        tmp, link_dir = socket_safe_dir(tmp_dir or tempfile.mkdtemp(prefix="libra-ray-"))
        os.environ["RAY_TMPDIR"] = tmp
        try:
            ctx: Any = start_with_retries(lambda: ray.init(
                num_gpus=num_gpus,
                num_cpus=num_cpus if num_cpus is not None else max(2 * num_gpus, 4),
                namespace=namespace,
                include_dashboard=False,
                log_to_driver=False,
                object_store_memory=object_store_bytes,
                _temp_dir=tmp,
            ), tmp)
        except BaseException:
            if link_dir is not None:
                shutil.rmtree(link_dir, ignore_errors=True)
            raise
        log.info("started local Ray with %d logical GPUs at %s", num_gpus, ctx.address_info["gcs_address"])
        return cls(address=ctx.address_info["gcs_address"], owned=True, namespace=namespace,
                   _link_dir=link_dir)

    @classmethod
    def start_nodes(
        cls,
        *,
        num_nodes: int,
        gpus_per_node: int,
        cpus_per_node: int | None = None,
        namespace: str = "libra",
        tmp_dir: str | None = None,
        object_store_bytes: int = 128 * 1024**2,
        head_gpus: int | None = None,
    ) -> RayRuntime:
        """Start a local cluster of `num_nodes` Ray nodes (a head and workers, each its own raylet) with
        `gpus_per_node` logical GPUs each (the head `head_gpus`, when given: 0 makes a head that only
        coordinates, so that every GPU is on a node that can be removed), and join it: on one machine,
        placement groups and actors spread over nodes as on a real multi-node cluster. Stopped by `shutdown`;
        the `ray.cluster_utils.Cluster` is `local_nodes`."""
        if num_nodes < 1 or gpus_per_node < 0:
            raise ValueError(f"num_nodes={num_nodes}, gpus_per_node={gpus_per_node}: need at least one node "
                             "and a non-negative GPU count")
        if ray.is_initialized():
            raise RuntimeError("this process is already connected to Ray; call shutdown() on that runtime first")
        from ray.cluster_utils import Cluster

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        if tmp_dir:
            os.makedirs(tmp_dir, exist_ok=True)
        tmp, link_dir = socket_safe_dir(tmp_dir or tempfile.mkdtemp(prefix="libra-ray-"), reserve="/ray")
        os.environ["RAY_TMPDIR"] = tmp
        cpus = cpus_per_node if cpus_per_node is not None else max(2 * gpus_per_node, 4)
        node_args: dict[str, Any] = {"num_gpus": gpus_per_node, "num_cpus": cpus,
                                     "object_store_memory": object_store_bytes}
        # the cluster's files go where Ray looks for them under RAY_TMPDIR (its address file among them)
        session_root = os.path.join(tmp, "ray")
        os.makedirs(session_root, exist_ok=True)
        nodes = None
        try:
            head_args = {**node_args, "temp_dir": session_root, "include_dashboard": False}
            if head_gpus is not None:
                head_args["num_gpus"] = head_gpus
            nodes = start_with_retries(lambda: Cluster(initialize_head=True, head_node_args=head_args), tmp)
            for _ in range(num_nodes - 1):
                nodes.add_node(**node_args)
            nodes.wait_for_nodes()
            ray.init(address=nodes.address, namespace=namespace, log_to_driver=False)
        except BaseException:
            if nodes is not None:
                nodes.shutdown()
            if link_dir is not None:
                shutil.rmtree(link_dir, ignore_errors=True)
            raise
        log.info("started a local Ray cluster of %d nodes x %d logical GPUs at %s", num_nodes, gpus_per_node,
                 nodes.address)
        return cls(address=nodes.address, owned=True, namespace=namespace, _local_nodes=nodes,
                   _link_dir=link_dir)

    @property
    def local_nodes(self) -> Any:
        """The `ray.cluster_utils.Cluster` a `start_nodes` runtime owns (tests remove its nodes); None otherwise."""
        return self._local_nodes

    @staticmethod
    def live_gpus() -> int:
        """The logical GPUs of the nodes Ray counts alive now (a node that died or was removed drops out once
        Ray's health checks have marked it dead), less those of nodes the job fenced off (`node_fence`)."""
        return sum(_job_node_gpus().values())

    @staticmethod
    def node_gpus() -> dict[str, tuple[int, int]]:
        """Per alive node (by node id): (logical GPUs, GPUs in use)."""
        totals = _job_node_gpus()
        used = dict.fromkeys(totals, 0.0)
        for pg in ray.util.placement_group_table().values():
            if pg.get("state") != "CREATED":
                continue
            for index, node in (pg.get("bundles_to_node_id") or {}).items():
                if node in used:
                    used[node] += float(pg["bundles"][index].get("GPU", 0))
        return {node: (total, int(used[node])) for node, total in totals.items()}

    def placement_group(
        self, bundles: Sequence[dict[str, float]], strategy: str = "PACK", name: str = ""
    ) -> PlacementGroup:
        """Reserve `bundles` (e.g. `[{"GPU": 1, "CPU": 1}] * 4`) and wait until they are placed, at most
        `PLACEMENT_TIMEOUT_S`. The wait ends early when the cluster loses GPUs meanwhile (a node that died without
        a word is declared dead by Ray's health checks, and a group waiting for it would wait out the timeout):
        the caller re-plans on what is left instead; so does one whose `placement_guard` check gives a reason.
        Its bundles avoid the nodes the job fenced off (`node_fence`)."""
        pg = placement_group(list(bundles), strategy=strategy, name=name,
                             bundle_label_selector=avoid_fenced(len(bundles)))
        self.wait_placed(pg, f"placement group '{name}' ({len(bundles)} bundles {bundles[0] if bundles else {}}, "
                             f"{strategy})")
        self._placement_groups.append(pg)
        return pg

    def wait_placed(self, pg: PlacementGroup, what: str) -> None:
        """Wait until `pg` (described as `what` in the error) is placed, at most `PLACEMENT_TIMEOUT_S`, giving up
        early as `placement_group` says; a group that was not placed is removed and TimeoutError says "`what` was
        not placed within". Also the wait of a group its caller owns (a rollout host's)."""
        started, gpus_before, lost = time.monotonic(), self.live_gpus(), ""
        while True:
            left = PLACEMENT_TIMEOUT_S - (time.monotonic() - started)
            ready, _ = ray.wait([pg.ready()], timeout=max(0.0, min(PLACEMENT_POLL_S, left)))
            if ready or left <= PLACEMENT_POLL_S:
                break
            why = self._placement_give_up(gpus_before)
            if why:
                lost = f" ({why})"
                break
        if not ready:
            remove_placement_group(pg)
            raise TimeoutError(
                f"{what} was not placed within {time.monotonic() - started:.0f}s{lost}; cluster resources: "
                f"{ray.cluster_resources()}, free: {ray.available_resources()}"
            )

    def _placement_give_up(self, gpus_before: int) -> str:
        """Why a placement wait that began with `gpus_before` GPUs alive should give up now ("" = go on)."""
        gpus_now = self.live_gpus()
        if gpus_now < gpus_before:
            return f"the cluster lost GPUs while it waited: {gpus_before} -> {gpus_now} alive"
        check = self._placement_check
        return check() if check is not None else ""

    @contextlib.contextmanager
    def placement_guard(self, check: Callable[[], str]) -> Iterator[None]:
        """While inside: a placement wait (of any thread) gives up as soon as `check()` gives a reason (say, the
        cluster no longer has the GPUs the caller planned with: a node that died was declared dead before the
        wait began)."""
        self._placement_check = check
        try:
            yield
        finally:
            self._placement_check = None

    def release(self, pg: PlacementGroup) -> None:
        if pg in self._placement_groups:
            self._placement_groups.remove(pg)
        remove_placement_group(pg)

    def spawn(
        self,
        actor_cls: type,
        *args: Any,
        pg: PlacementGroup | None = None,
        bundle_index: int = -1,
        num_gpus: float = 0,
        num_cpus: float = 1,
        env: dict[str, str] | None = None,
        name: str | None = None,
        lifetime: str | None = None,
        max_concurrency: int = 1,
        **kwargs: Any,
    ) -> Any:
        """Create an actor of the plain class `actor_cls`, optionally pinned to one bundle of `pg`."""
        options: dict[str, Any] = {"num_gpus": num_gpus, "num_cpus": num_cpus, "max_concurrency": max_concurrency}
        if pg is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=bundle_index
            )
        if env:
            options["runtime_env"] = {"env_vars": dict(env)}
        if name:
            options["name"] = name
            options["namespace"] = self.namespace
        if lifetime:
            options["lifetime"] = lifetime
        return ray.remote(actor_cls).options(**options).remote(*args, **kwargs)

    @staticmethod
    def get(refs: Any, timeout: float | None = None) -> Any:
        return ray.get(refs, timeout=timeout)

    @staticmethod
    def kill(actor: Any) -> None:
        try:
            ray.kill(actor, no_restart=True)
        except Exception as exc:  # an actor that is already gone is what we wanted
            log.debug("kill actor: %s", exc)

    @staticmethod
    def cluster_gpus() -> int:
        return int(ray.cluster_resources().get("GPU", 0))

    def shutdown(self, *, disconnect: bool = False) -> None:
        """Release placement groups; stop Ray only when Libra started it. `disconnect`: also leave a cluster
        Libra joined (it keeps running), so that this process can join another one."""
        for pg in list(self._placement_groups):
            try:
                remove_placement_group(pg)
            except Exception as exc:
                log.debug("remove placement group: %s", exc)
        self._placement_groups.clear()
        if (self.owned or disconnect) and ray.is_initialized():
            ray.shutdown()
        if self._local_nodes is not None:
            self._local_nodes.shutdown()
            self._local_nodes = None
        if self._link_dir is not None:
            shutil.rmtree(self._link_dir, ignore_errors=True)
            self._link_dir = None


def _job_node_gpus() -> dict[str, int]:
    """The logical GPUs of each node Ray counts alive, by node id, leaving out the nodes the job fenced off."""
    fenced = FENCE.node_ids()
    return {n["NodeID"]: int(n["Resources"].get("GPU", 0)) for n in ray.nodes()
            if n["Alive"] and n["NodeID"] not in fenced}
