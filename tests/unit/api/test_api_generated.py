"""The checked-in gRPC modules are what grpcio-tools makes of libra/api/operator.proto today."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_api", REPO / "scripts" / "gen_api.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_modules_are_fresh(tmp_path: Path) -> None:
    gen = _generator()
    fresh = gen.generate(tmp_path)
    assert set(fresh) == set(gen.NAMES)
    stale = [name for name, data in fresh.items() if (gen.OUT_DIR / name).read_bytes() != data]
    assert stale == [], f"{stale} differ from libra/api/operator.proto: run python scripts/gen_api.py"


def test_generated_service_has_every_call() -> None:
    from libra.api.generated import operator_pb2

    service = operator_pb2.DESCRIPTOR.services_by_name["Operator"]
    assert {m.name for m in service.methods} == {"Status", "GetPlan", "Reconfigure", "Pause", "Resume", "Drain",
                                                 "StreamEvents"}
