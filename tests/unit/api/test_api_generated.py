"""The checked-in gRPC modules are what grpcio-tools makes of libra/api/operator.proto today."""

from __future__ import annotations

import importlib.util
import re
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_api", REPO / "scripts" / "gen_api.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stamped_generator_version(module: Path) -> str:
    found = re.search(r"^GRPC_GENERATED_VERSION = '([^']+)'$", module.read_text(), re.MULTILINE)
    assert found, f"{module} has no GRPC_GENERATED_VERSION line"
    return found.group(1)


def test_generated_modules_are_fresh(tmp_path: Path) -> None:
    gen = _generator()
    stamped = _stamped_generator_version(gen.OUT_DIR / "operator_pb2_grpc.py")
    installed = metadata.version("grpcio-tools")
    assert installed == stamped, (f"grpcio-tools {installed} is installed but {stamped} made the checked-in modules "
                                  f"(setup.cfg pins it): run ./scripts/setup_env.sh")
    fresh = gen.generate(tmp_path)
    assert set(fresh) == set(gen.NAMES)
    stale = [name for name, data in fresh.items() if (gen.OUT_DIR / name).read_bytes() != data]
    assert stale == [], f"{stale} differ from libra/api/operator.proto: run python scripts/gen_api.py"


def test_setup_pins_the_generator_that_made_the_modules() -> None:
    pins = re.findall(r"^\s*grpcio-tools==(\S+)$", (REPO / "setup.cfg").read_text(), re.MULTILINE)
    assert pins == [_stamped_generator_version(_generator().OUT_DIR / "operator_pb2_grpc.py")]


def test_generated_service_has_every_call() -> None:
    from libra.api.generated import operator_pb2

    service = operator_pb2.DESCRIPTOR.services_by_name["Operator"]
    assert {m.name for m in service.methods} == {"Status", "GetPlan", "Reconfigure", "Pause", "Resume", "Drain",
                                                 "StreamEvents"}
