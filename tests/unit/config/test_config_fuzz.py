"""Fuzzed configuration files and `--set` values: loading reports every problem as a `ConfigError` (or
loads) and never raises anything else, whatever the YAML holds."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from libra.config import Config, ConfigError, load
from libra.config.schema import Config as ConfigClass
from libra.config.typecheck import all_option_paths

REPO = Path(__file__).resolve().parents[3]
DEV = yaml.safe_load((REPO / "configs" / "dev.yaml").read_text())
PATHS = all_option_paths(ConfigClass)
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20), st.sampled_from(["", "auto", "8", "-1", "0.5", "1e400", "nan", "~", "[]", "{}"]),
)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=6)
keys = st.one_of(st.sampled_from(PATHS), st.text(min_size=0, max_size=15))


def _nest(flat: dict[str, object]) -> dict[str, object]:
    """{"a.b": 1} -> {"a": {"b": 1}} (a later key that clashes with a value replaces it)."""
    out: dict[str, object] = {}
    for dotted, value in flat.items():
        node = out
        parts = dotted.split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]  # type: ignore[assignment]
        node[parts[-1]] = value
    return out


def _load_reports_or_loads(path: Path, overrides: list[str]) -> None:
    try:
        cfg = load(str(path), overrides)
    except ConfigError as err:
        assert err.report()  # every error can be printed
    else:
        assert isinstance(cfg, Config)


@FUZZ
@given(flat=st.dictionaries(keys, values, max_size=6), base=st.booleans())
def test_fuzzed_options_are_reported_not_raised(tmp_path_factory: pytest.TempPathFactory,
                                                flat: dict[str, object], base: bool) -> None:
    data = dict(DEV) if base else {}
    data.update(_nest(flat))
    path = tmp_path_factory.mktemp("fuzz") / "job.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    _load_reports_or_loads(path, [])


@FUZZ
@given(text=st.text(max_size=200))
@example(text="a: *x")
@example(text="!!python/object:os.system {}")
@example(text="a: [")
@example(text="\x00")
@example(text="- 1\n- 2")
@example(text="cluster: 3")
@example(text="? [a, b]\n: 1")  # regression: an unhashable key raised TypeError
@example(text="[" * 5000 + "]" * 5000)  # regression: RecursionError
def test_fuzzed_yaml_text_is_reported_not_raised(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "job.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    _load_reports_or_loads(path, [])


def test_a_file_that_is_not_utf8_is_reported(tmp_path: Path) -> None:
    """Regression: a Latin-1 file raised UnicodeDecodeError."""
    path = tmp_path / "job.yaml"
    path.write_bytes("name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="cannot read the configuration file"):
        load(str(path))


overrides = st.lists(
    st.one_of(
        st.builds(lambda k, v: f"{k}={v}", keys, st.text(max_size=20)),
        st.builds(lambda k, v: f"{k}={yaml.safe_dump(v, default_flow_style=True).strip()}", st.sampled_from(PATHS),
                  values),
        st.text(max_size=30),
    ),
    max_size=4,
)


@FUZZ
@given(sets=overrides)
@example(sets=["cluster=3"])
@example(sets=["cluster.num_nodes.x=1"])
@example(sets=["=1"])
@example(sets=["task.params.a.b=1"])
@example(sets=["optimizer=[1, 2]"])
def test_fuzzed_set_values_are_reported_not_raised(tmp_path_factory: pytest.TempPathFactory,
                                                   sets: list[str]) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "job.yaml"
    path.write_text(yaml.safe_dump(DEV))
    _load_reports_or_loads(path, sets)
