"""Config loading: defaults, YAML, dotted overrides, and clear errors naming the key."""
from __future__ import annotations

import pytest

from orchestrator.core.config import ConfigError, load_config


def test_defaults_validate():
    config = load_config()
    assert config.family == "tiny" and config.engine.kind == "local"
    assert config.num_arena_pages() == int(64 * 2**20) // 16384


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "mfs.yaml"
    path.write_text("pool:\n  num_pages: 300\nrouter:\n  profile: quality\n")
    config = load_config(path, overrides={"escalation.threshold": 0.5})
    assert config.pool.num_pages == 300 and config.router.profile == "quality" and config.escalation.threshold == 0.5


@pytest.mark.parametrize("text, message", [
    ("pool:\n  nmu_pages: 3\n", "pool.nmu_pages': unknown key"),
    ("pool:\n  num_pages: many\n", "pool.num_pages': expected an integer"),
    ("router:\n  profile: fastest\n", "router.profile"),
    ("escalation:\n  enabled: 3\n", "escalation.enabled': expected true or false"),
    ("comparison:\n  static_split: {tiny-s: 0.5, tiny-l: 0.2}\n", "'comparison': unknown key"),   # eval's, not MFS's
    ("- a list\n", "mapping"),
    ("pool: [\n", "not valid YAML"),
])
def test_errors_name_the_key(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("{", r"\{")):
        load_config(path)


def test_missing_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config("/nonexistent/mfs.yaml")


def test_engine_threads_leave_a_core_for_the_event_loop(monkeypatch):
    import os

    from orchestrator.serve.local_engine import engine_threads
    assert engine_threads(3) == 3                       # an explicit setting wins
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    assert engine_threads(None) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0}, raising=False)
    assert engine_threads(None) == 1                    # never zero
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)), raising=False)
    assert engine_threads(None) == 15


def test_config_md_yaml_loads_and_lists_every_knob(tmp_path):
    # Every knob documented. The YAML block of docs/CONFIG.md must load as it stands and name
    # every field of the scheduler and router sections.
    import dataclasses
    import re
    from pathlib import Path

    import yaml

    from orchestrator.core.config import RouterConfig, SchedulerConfig
    text = (Path(__file__).resolve().parents[1] / "docs" / "CONFIG.md").read_text()
    block = re.search(r"```yaml\n(.*?)```", text, re.S).group(1)
    path = tmp_path / "doc.yaml"
    path.write_text(block)
    load_config(path)
    data = yaml.safe_load(block)
    for section, cls in (("scheduler", SchedulerConfig), ("router", RouterConfig)):
        missing = {f.name for f in dataclasses.fields(cls)} - set(data[section])
        assert not missing, f"docs/CONFIG.md {section} lacks {sorted(missing)}"
    from eval.composition import ComparisonSwitches
    from orchestrator.core.config import DeveloperFlags
    for cls in (ComparisonSwitches, DeveloperFlags):     # their tables
        missing = {f.name for f in dataclasses.fields(cls)} - set(re.findall(r"^\| `(\w+)` \|", text, re.M))
        assert not missing, f"docs/CONFIG.md lacks {sorted(missing)}"


def test_a_compared_systems_switches_are_eval_settings_validated_there():
    """`comparison.*` is no MFS setting: eval's SystemConfig carries it and validates its static split."""
    from eval.composition import core_parts, load_system_config

    with pytest.raises(ConfigError, match="comparison.static_split.*sum to 1"):
        load_system_config({"comparison.static_split": {"tiny-s": 0.5, "tiny-l": 0.2}})
    config = load_system_config({"comparison.static_split": {"tiny-s": 0.5, "tiny-l": 0.5}, "comparison.warmup": False})
    parts = core_parts(config)
    assert parts["pool"].args == ({"tiny-s": 0.5, "tiny-l": 0.5},) and parts["scheduler_factory"] is not None
    assert core_parts(load_system_config())["pool"] is None      # MFS: one pool every member shares
    assert core_parts(load_system_config())["scheduler_factory"] is None      # MFS: the core's own scheduler


def test_speculation_on_the_triton_path_is_refused_by_name():
    with pytest.raises(ConfigError, match="speculation.enabled.*local engine"):
        load_config(overrides={"engine.kind": "triton", "speculation.enabled": True})
    assert load_config(overrides={"engine.kind": "triton"}).speculation.enabled is False
