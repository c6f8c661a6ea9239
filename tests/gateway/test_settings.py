"""Configuration: YAML read once, every key documented in configs/default.yaml, one set of
defaults for the engine, the words users write where the documented values are words."""

from __future__ import annotations

import re
import typing

import pydantic
import pytest

from edge_engine.config import EngineConfig
from gateway.core import cpus as module
from gateway.core.settings import ConfigError, EdgeSettings, Settings, load_settings
from tests.conftest import ROOT


def test_unquoted_off_on_yes_no_are_the_words_they_look_like(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("cache:\n  backend: off\n  singleflight: no\nlisten:\n  access_log: yes\n")
    settings = load_settings(path)
    assert settings.cache.backend == "off"
    assert settings.cache.singleflight is False and settings.listen.access_log is True


def test_listen_workers_is_read_and_a_bad_value_is_named_with_its_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("listen:\n  workers: 4\n")
    assert load_settings(path).listen.workers == 4
    path.write_text("listen:\n  workers: 0\n")
    with pytest.raises(ConfigError, match=r"c.yaml:2: listen.workers: Value error, must be at least 1, or auto"):
        load_settings(path)


def _leaves(model: type[pydantic.BaseModel], prefix: str = "") -> list[str]:
    """Every setting's dotted name, sections left out."""
    keys = []
    for name, field in model.model_fields.items():
        inner = _models(field.annotation)
        if not inner:
            keys.append(prefix + name)
        for section in inner:
            keys += _leaves(section, prefix + name + ".")
    return keys


def _models(annotation) -> list[type[pydantic.BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def test_every_key_is_in_the_default_config_with_its_comment():
    text = (ROOT / "configs" / "default.yaml").read_text()
    missing = []
    for key in _leaves(Settings):
        leaf = key.rsplit(".", 1)[-1]
        if not re.search(rf"^\s*#?\s*(- )?{re.escape(leaf)}:.*#", text, re.MULTILINE):
            missing.append(key)
    assert not missing, f"keys not documented (with a comment) in configs/default.yaml: {missing}"


def test_the_edge_section_takes_the_engines_defaults_and_checks():
    engine = EngineConfig()
    edge = EdgeSettings()
    for name in ("dtype", "device", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_queue_len", "kv_cache_memory_fraction", "max_kv_cache_tokens"):
        assert getattr(edge, name) == getattr(engine, name), name
    with pytest.raises(pydantic.ValidationError, match="dtype must be"):
        EdgeSettings(dtype="fp8")
    assert EdgeSettings(name="tiny").engine_config().model_name == "tiny"


def test_tracing_endpoint_still_works_under_its_old_name_with_a_warning(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("tracing:\n  endpoint: http://127.0.0.1:4318/v1/traces\n")
    with pytest.warns(FutureWarning, match="tracing.otlp_url"):
        settings = load_settings(path)
    assert settings.tracing.otlp_url == "http://127.0.0.1:4318/v1/traces"
    path.write_text("tracing:\n  otlp_url: http://127.0.0.1:4318/v1/traces\n")
    assert load_settings(path).tracing.otlp_url == "http://127.0.0.1:4318/v1/traces"


def test_environment_variables_in_values(tmp_path, monkeypatch):
    monkeypatch.setenv("REDIS_PASSWORD", "pw-1")
    path = tmp_path / "env.yaml"
    path.write_text("rate_limits:\n  backend: redis\n  redis_url: redis://:${REDIS_PASSWORD}@10.0.0.20:6379/0\n  namespace: a$${b}\n")
    settings = load_settings(path)
    assert settings.rate_limits.redis_url == "redis://:pw-1@10.0.0.20:6379/0"
    assert settings.rate_limits.namespace == "a${b}"
    monkeypatch.delenv("REDIS_PASSWORD")
    with pytest.raises(ConfigError) as caught:
        load_settings(path)
    assert str(caught.value) == f"{path}:3: rate_limits.redis_url: the environment variable REDIS_PASSWORD is not set"


def test_listen_workers_auto_counts_a_containers_cpu_quota(tmp_path, monkeypatch):
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs
    assert module._cgroup_cpu_quota(str(tmp_path)) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert module._cgroup_cpu_quota(str(tmp_path)) is None
    monkeypatch.setattr(module, "_cgroup_cpu_quota", lambda root="/sys/fs/cgroup": 1.5)
    monkeypatch.setattr(module.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert module.usable_cpus() == 2 and Settings.model_validate({"listen": {"workers": "auto"}}).listen.workers == 2
