"""The instance registry: a JSON file in the run directory listing every managed vLLM server.

A restarted controller reads it to adopt live servers (same pid, verified by the kernel start time, healthy,
same launch fingerprint) instead of starting new ones, and to clean up entries whose server is gone. Writes
are atomic (temp file + rename), so a crash leaves either the old or the new registry, never a torn one.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from dataclasses import asdict, dataclass, field
from typing import Any

SCHEMA = 1
REGISTRY_FILE = os.path.join("rollout", "registry.json")


class RegistryError(RuntimeError):
    """The registry file exists but cannot be used."""


@dataclass
class RegistryEntry:
    instance_id: str
    host: str
    hostname: str
    port: int
    pid: int
    start_ticks: int
    gpu_ids: list[str]
    weight_version: int
    checksum: str
    model_path: str
    actor_name: str
    fingerprint: dict[str, Any]  # the server launch's (ServerLaunch.fingerprint)
    log_path: str
    started_at: float
    spec: dict[str, Any] = field(default_factory=dict)  # the InstanceSpec it was started with
    spec_fingerprint: str = ""  # InstanceSpec.fingerprint(); "" = written before instance specs existed

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RegistryEntry:
        names = set(cls.__dataclass_fields__)
        optional = {"spec", "spec_fingerprint"}
        missing = sorted(names - optional - set(data))
        if missing:
            raise RegistryError(f"registry entry {data.get('instance_id', '?')} lacks fields {missing}")
        # a wrong number here would make adoption signal or probe the wrong process
        numbers = {k: data[k] for k in ("port", "pid", "start_ticks", "weight_version")}
        wrong = {k: v for k, v in numbers.items() if not isinstance(v, int) or isinstance(v, bool) or v < 0}
        if wrong:
            raise RegistryError(f"registry entry {data.get('instance_id', '?')} has invalid {wrong} "
                                "(each must be an integer >= 0)")
        return cls(**{k: data[k] for k in names if k in data})


@dataclass
class PoolRecord:
    """The weights new instances must load: the last version published to the whole pool."""

    weight_version: int = 0
    model_path: str = ""
    checksum: str = ""
    entries: dict[str, RegistryEntry] = field(default_factory=dict)


class InstanceRegistry:
    """Reads and writes `<run_dir>/rollout/registry.json`."""

    def __init__(self, run_dir: str) -> None:
        self.path = os.path.join(run_dir, REGISTRY_FILE)
        self._lock = threading.Lock()

    def load(self) -> PoolRecord:
        if not os.path.exists(self.path):
            return PoolRecord()
        try:
            with open(self.path, encoding="utf-8") as fh:
                data = json.load(fh)
        except (OSError, ValueError) as exc:
            raise RegistryError(
                f"rollout registry {self.path} is unreadable ({exc}); servers it lists may still run: stop them "
                f"(their pids are in the file) and remove the file"
            ) from exc
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise RegistryError(
                f"rollout registry {self.path} has schema {data.get('schema') if isinstance(data, dict) else '?'}, "
                f"expected {SCHEMA}; stop the servers it lists and remove the file"
            )
        try:
            pool = data.get("pool", {})
            return PoolRecord(
                weight_version=int(pool.get("weight_version", 0)),
                model_path=str(pool.get("model_path", "")),
                checksum=str(pool.get("checksum", "")),
                entries={k: RegistryEntry.from_dict(v) for k, v in data.get("instances", {}).items()},
            )
        except RegistryError as exc:
            raise RegistryError(f"rollout registry {self.path}: {exc}; stop the servers it lists (their pids are "
                                "in the file) and remove the file") from exc
        except (AttributeError, TypeError, ValueError) as exc:
            raise RegistryError(
                f"rollout registry {self.path} is damaged ({type(exc).__name__}: {exc}); servers it lists may "
                "still run: stop them (their pids are in the file) and remove the file"
            ) from exc

    def save(self, record: PoolRecord) -> None:
        data = {
            "schema": SCHEMA,
            "pool": {
                "weight_version": record.weight_version,
                "model_path": record.model_path,
                "checksum": record.checksum,
            },
            "instances": {k: asdict(v) for k, v in sorted(record.entries.items())},
        }
        with self._lock:
            directory = os.path.dirname(self.path)
            os.makedirs(directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".registry-", dir=directory)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as fh:
                    json.dump(data, fh, indent=2)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise
