"""Live configuration reload (issue 23): SIGHUP, ``POST /admin/reload``, ``edgegw reload``
and a changed file, on real processes and sockets on 127.0.0.1; the stream that must not be
cut comes from a real streaming server (the project's engine server on a tiny model)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import orjson
import pytest
import yaml

from tests.conftest import ROOT, GatewayProcess, cluster
from tests.fakes import free_port
from tests.gateway.live import FileGateway, wait_for
from tests.gateway.test_workers import worker_pids

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


def tenants(*keys: str) -> list[dict]:
    return [{"name": "acme", "keys": list(keys)}]


def status(url: str, key: str) -> int:
    with httpx.Client(timeout=10) as client:  # a new connection each time: any worker may take it
        return client.post(url + "/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {key}"}).status_code


def rewrite(gw: GatewayProcess, tmp_path: Path, config: dict) -> None:
    """Replace the configuration file a ``GatewayProcess`` serves (as it wrote it: its port,
    the cache off) at once."""
    port = int(gw.url.rsplit(":", 1)[1])
    path = tmp_path / f"gateway-{port}.yaml"
    config = {"cache": {"backend": "off"}, **config, "listen": {**config.get("listen", {}), "host": "127.0.0.1", "port": port}}
    tmp = path.with_suffix(".new")
    tmp.write_text(yaml.safe_dump(config))
    tmp.replace(path)


@pytest.fixture
def file_gateways(tmp_path):
    started = []

    def start(config: dict, **kwargs) -> FileGateway:
        folder = tmp_path / f"gw{len(started)}"
        folder.mkdir()
        gw = FileGateway(config, folder, **kwargs).start()
        started.append(gw)
        return gw

    yield start
    for gw in started:
        gw.stop()


def test_sighup_rotates_keys_at_once_and_edgegw_reload_signals_by_pid_file(upstreams, gateway_processes, tmp_path):
    fake = upstreams()
    pid_file = tmp_path / "edgegw.pid"
    base = {"auth": {"mode": "required"}, "clusters": [cluster(fake)], "reload": {"watch": False}, "listen": {"pid_file": str(pid_file)}}
    gw = gateway_processes({**base, "tenants": tenants("k-old")})
    assert status(gw.url, "k-old") == 200 and status(gw.url, "k-new") == 401
    assert int(pid_file.read_text()) == gw.proc.pid

    rewrite(gw, tmp_path, {**base, "tenants": tenants("k-new")})
    gw.proc.send_signal(signal.SIGHUP)  # before: the default action, the process gone at once
    wait_for(lambda: status(gw.url, "k-old") == 401, 10, "the revoked key refused")
    assert status(gw.url, "k-new") == 200 and gw.proc.poll() is None
    assert "reload (SIGHUP)" in gw.log.read_text() and "applied tenants" in gw.log.read_text()

    rewrite(gw, tmp_path, {**base, "tenants": tenants("k-newer")})
    done = subprocess.run([sys.executable, "-m", "gateway", "reload", "--pid-file", str(pid_file)], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    wait_for(lambda: status(gw.url, "k-newer") == 200, 10, "the new key accepted")
    assert status(gw.url, "k-new") == 401
    gw.proc.send_signal(signal.SIGTERM)
    assert gw.proc.wait(30) == 0 and not pid_file.exists()


def test_an_invalid_configuration_is_refused_naming_the_key_and_the_running_one_stays(upstreams, gateway_processes, tmp_path):
    fake = upstreams()
    base = {"auth": {"mode": "required"}, "clusters": [cluster(fake)], "reload": {"watch": False}}
    gw = gateway_processes({**base, "tenants": tenants("k-1")})
    rewrite(gw, tmp_path, {**base, "tenants": [{"name": "acme", "keys": ["k-2"], "priority": "urgent"}]})
    gw.proc.send_signal(signal.SIGHUP)
    port = gw.url.rsplit(":", 1)[1]
    wait_for(lambda: "refused" in gw.log.read_text(), 10, "the refusal logged")
    log = gw.log.read_text()
    assert f"gateway-{port}.yaml:" in log and "tenants.0.priority" in log and "the running configuration stays" in log
    assert status(gw.url, "k-1") == 200 and status(gw.url, "k-2") == 401


def test_a_changed_file_is_reloaded_as_a_configmap_changes_by_symlink_swap(upstreams, gateway_processes, tmp_path):
    """A mounted ConfigMap: config.yaml -> ..data/config.yaml, ..data -> ..<timestamp>; an
    update writes a new folder and swaps the ..data link (atomic rename)."""
    fake = upstreams()
    mount = tmp_path / "mount"
    mount.mkdir()

    def publish(version: int, keys: list[str]) -> None:
        folder = mount / f"..v{version}"
        folder.mkdir()
        config = {"auth": {"mode": "required"}, "clusters": [cluster(fake)], "tenants": tenants(*keys), "cache": {"backend": "off"}, "reload": {"interval_s": 0.2}}
        (folder / "config.yaml").write_text(yaml.safe_dump(config))
        link = mount / "..data_tmp"
        link.symlink_to(folder.name)
        link.replace(mount / "..data")

    publish(1, ["k-1"])
    (mount / "config.yaml").symlink_to("..data/config.yaml")
    gw = GatewayProcess(None, tmp_path, ["--config", str(mount / "config.yaml")]).start()
    try:
        assert status(gw.url, "k-1") == 200
        publish(2, ["k-2"])
        wait_for(lambda: status(gw.url, "k-2") == 200, 15, "the new file read")
        assert status(gw.url, "k-1") == 401 and "reload (file changed)" in gw.log.read_text()
    finally:
        gw.stop()


def test_two_workers_both_take_the_reload_and_what_needs_a_restart_is_named(upstreams, gateway_processes, tmp_path):
    fake = upstreams()
    base = {"auth": {"mode": "required"}, "clusters": [cluster(fake)], "reload": {"watch": False}}
    gw = gateway_processes({**base, "listen": {"workers": 2}, "tenants": tenants("k-1")})
    worker_pids(gw, 2)
    assert [status(gw.url, "k-1") for _ in range(6)] == [200] * 6
    rewrite(gw, tmp_path, {**base, "listen": {"workers": 2, "worker_timeout_s": 45}, "tenants": tenants("k-2")})
    gw.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: gw.log.read_text().count("applied tenants") >= 2, 15, "both workers reloaded")
    assert [status(gw.url, "k-2") for _ in range(8)] == [200] * 8  # new connections, spread over both workers
    assert [status(gw.url, "k-1") for _ in range(8)] == [401] * 8
    assert "not applied until a restart: listen.worker_timeout_s" in gw.log.read_text()


ENGINE_CHAT = {
    "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 120, "ignore_eos": True, "stream": True,
    "stream_options": {"include_usage": True},
}


@pytest.fixture
def engine_server(tiny_model, tmp_path):
    """The project's engine server (``python -m edge_engine.server``) on the tiny model: a
    real OpenAI-compatible server that streams."""
    port = free_port()
    log = (tmp_path / "engine.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "edge_engine.server", "--model", tiny_model, "--model-name", "tiny", "--dtype", "float32",
         "--port", str(port), "--num-kv-blocks", "256", "--block-size", "4", "--threads", "1"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, (tmp_path / "engine.log").read_text()
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(up, 120, "the engine server")
        yield url
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()


def test_endpoints_added_and_removed_live_and_a_stream_in_flight_is_never_cut(engine_server, upstreams, file_gateways):
    fake = upstreams(models=["tiny"])
    central = {"name": "central", "models": ["tiny"], "endpoints": [{"url": engine_server}]}
    base = {"reload": {"watch": False}, "admin": {"keys": ["adm"]}}
    gw = file_gateways({**base, "clusters": [central]})
    admin = {"authorization": "Bearer adm"}
    with httpx.Client(timeout=60) as client, client.stream("POST", gw.url + "/v1/chat/completions", json=ENGINE_CHAT) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # in flight from the engine server
        gw.write({**base, "clusters": [{**central, "endpoints": [{"url": fake.url}]}]})  # it is removed, the fake added
        reloaded = httpx.post(gw.url + "/admin/reload", headers=admin, timeout=30)
        assert reloaded.status_code == 200 and "clusters" in str(reloaded.json()["applied"]), reloaded.text
        served = httpx.post(gw.url + "/v1/chat/completions", json={**ENGINE_CHAT, "stream": False}, timeout=30)
        assert served.status_code == 200 and fake.url in served.headers["x-edgegw-route"]  # new requests: the new endpoint
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-3]
    assert orjson.loads(rest[-2][6:])["usage"]["completion_tokens"] == 120  # every token came through
    wait_for(lambda: engine_server not in gw.state.fleet.retired_upstreams, 10, "the drained pool closed")
    assert [u.url for u in gw.state.fleet.upstreams.values()] == [fake.url]


def test_a_removed_endpoint_is_drained_its_pool_closed_when_its_last_stream_ends(upstreams, file_gateways):
    """A stream paced by its upstream (30 tokens, 0.1 s apart) outlives the reload that
    removes its endpoint: it finishes, and only then is the endpoint's pool closed."""
    old, new = upstreams(), upstreams()
    base = {"reload": {"watch": False}, "admin": {"keys": ["adm"]}}
    gw = file_gateways({**base, "clusters": [cluster(old)]})
    body = {**CHAT, "stream": True, "fake": {"tokens": 30, "delay": 0.1}}
    with httpx.Client(timeout=60) as client, client.stream("POST", gw.url + "/v1/chat/completions", json=body) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        gw.write({**base, "clusters": [cluster(new)]})
        assert httpx.post(gw.url + "/admin/reload", headers={"x-api-key": "adm"}, timeout=30).status_code == 200
        assert old.url in gw.state.fleet.retired_upstreams and gw.state.fleet.retired_queues[old.url].active == 1
        assert httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=10).status_code == 200
        assert len(new.requests) == 1
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and sum('"content"' in line for line in rest) == 29  # all 30 came through
    wait_for(lambda: old.url not in gw.state.fleet.retired_upstreams, 10, "the drained pool closed")
    assert old.url not in gw.state.fleet.health.endpoints() and len(old.requests) == 1


def test_limits_routing_policy_and_cache_settings_change_live(upstreams, file_gateways):
    fake = upstreams()
    base = {"reload": {"watch": False}, "admin": {"keys": ["adm"]}, "clusters": [cluster(fake)]}
    gw = file_gateways(base)
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 6000}], "temperature": 0}
    assert httpx.post(gw.url + "/v1/chat/completions", json=big, timeout=10).status_code == 200
    assert httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "model": "fast"}, timeout=10).status_code == 404
    gw.write({
        **base,
        "limits": {"max_body_bytes": 4096},
        "routing": {"aliases": {"auto": "auto", "fast": "fake-model"}},
        "cache": {"backend": "memory", "default_greedy": True},
    })
    reloaded = httpx.post(gw.url + "/admin/reload", headers={"x-api-key": "adm"}, timeout=30)
    assert reloaded.status_code == 200, reloaded.text
    assert {"limits.max_body_bytes", "cache.backend"} <= set(reloaded.json()["applied"])
    assert httpx.post(gw.url + "/v1/chat/completions", json=big, timeout=10).status_code == 413
    assert httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "model": "fast"}, timeout=10).status_code == 200
    first = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "temperature": 0}, timeout=10)
    again = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "temperature": 0}, timeout=10)
    assert first.headers["x-cache"] == "MISS" and again.headers["x-cache"] == "HIT"


def test_admin_reload_answers_the_refusal_and_a_restart_only_change(upstreams, file_gateways):
    fake = upstreams()
    base = {"reload": {"watch": False}, "clusters": [cluster(fake)]}
    gw = file_gateways(base, admin=True)
    gw.path.write_text(gw.path.read_text() + "limits:\n  max_in_flight: 0\n")
    refused = httpx.post(gw.admin_url + "/admin/reload", timeout=30)
    assert refused.status_code == 400 and "limits.max_in_flight" in refused.json()["error"]["message"], refused.text
    assert "config.yaml:" in refused.json()["error"]["message"]
    gw.write({**base, "edge": {"max_num_seqs": 8}})
    later = httpx.post(gw.admin_url + "/admin/reload", timeout=30).json()
    assert later["status"] == "reloaded" and later["restart_needed"] == ["edge.max_num_seqs"] and later["applied"] == []
    assert httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=10).status_code == 200


def test_edgegw_reload_calls_the_admin_listener(upstreams, file_gateways):
    fake = upstreams()
    base = {"reload": {"watch": False}, "admin": {"keys": ["adm"]}, "clusters": [cluster(fake)], "auth": {"mode": "required"}}
    gw = file_gateways({**base, "tenants": tenants("k-1")}, admin=True)
    gw.write({**base, "tenants": tenants("k-2")})
    env = {**os.environ, "EDGEGW_ADMIN_KEY": "adm"}
    done = subprocess.run([sys.executable, "-m", "gateway", "reload", "--config", str(gw.path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    assert '"status":"reloaded"' in done.stdout
    assert status(gw.url, "k-2") == 200 and status(gw.url, "k-1") == 401
    bare = {k: v for k, v in os.environ.items() if k != "EDGEGW_ADMIN_KEY"}
    wrong = subprocess.run([sys.executable, "-m", "gateway", "reload", "--url", gw.admin_url], cwd=ROOT, env=bare, capture_output=True, text=True, timeout=30)
    assert wrong.returncode == 1 and "invalid_admin_key" in wrong.stdout  # no key: refused
