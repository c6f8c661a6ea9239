"""The admin paths behind ``listen.admin`` and ``admin.keys`` (issue 20): real sockets on
127.0.0.1, a fake upstream behind."""

from __future__ import annotations

import base64
import hashlib

import httpx
import pytest

from gateway.core.settings import Settings
from tests.conftest import cluster
from tests.gateway.live import FileGateway

ADMIN_PATHS = ["/metrics", "/debug/latency", "/dashboard"]
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def file_gateways(tmp_path):
    started = []

    def start(config: dict, **kwargs) -> FileGateway:
        folder = tmp_path / f"gw{len(started)}"
        folder.mkdir()
        gw = FileGateway({"reload": {"watch": False}, **config}, folder, **kwargs).start()
        started.append(gw)
        return gw

    yield start
    for gw in started:
        gw.stop()


def test_without_either_the_public_paths_stay_open_and_admin_is_refused(upstreams, file_gateways):
    gw = file_gateways({"clusters": [cluster(upstreams())]})
    for path in ADMIN_PATHS:
        assert httpx.get(gw.url + path, timeout=5).status_code == 200, path
    for method, path in (("POST", "/admin/reload"), ("GET", "/admin/usage")):
        refused = httpx.request(method, gw.url + path, timeout=5)
        assert refused.status_code == 403, (path, refused.text)
        assert refused.json()["error"]["code"] == "admin_not_configured"


def test_listen_admin_moves_the_admin_paths_to_their_own_port(upstreams, file_gateways):
    gw = file_gateways({"clusters": [cluster(upstreams())]}, admin=True)
    for path in [*ADMIN_PATHS, "/admin/usage", "/dashboard/feed?once=1"]:
        assert httpx.get(gw.url + path, timeout=5).status_code == 404, path  # the public port has no such path
    for path in [*ADMIN_PATHS, "/admin/usage"]:
        assert httpx.get(gw.admin_url + path, timeout=5).status_code == 200, path
    assert httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=10).status_code == 200  # the API stays public
    assert "edgegw_requests_total" in httpx.get(gw.admin_url + "/metrics", timeout=5).text


def test_admin_keys_protect_every_admin_path_bearer_header_or_basic_auth(upstreams, file_gateways):
    digest = "sha256:" + hashlib.sha256(b"adm-2").hexdigest()
    gw = file_gateways({"clusters": [cluster(upstreams())], "admin": {"keys": ["adm-1", digest]}})
    for path in [*ADMIN_PATHS, "/admin/usage"]:
        refused = httpx.get(gw.url + path, timeout=5)
        assert refused.status_code == 401, path
        assert refused.headers["www-authenticate"].startswith("Basic")  # a browser asks for it (the dashboard)
        assert httpx.get(gw.url + path, headers={"authorization": "Bearer wrong"}, timeout=5).status_code == 401
        assert httpx.get(gw.url + path, headers={"authorization": "Bearer adm-1"}, timeout=5).status_code == 200, path
        assert httpx.get(gw.url + path, headers={"x-api-key": "adm-2"}, timeout=5).status_code == 200, path
        basic = base64.b64encode(b"anyone:adm-1").decode()
        assert httpx.get(gw.url + path, headers={"authorization": f"Basic {basic}"}, timeout=5).status_code == 200
    assert httpx.get(gw.url + "/healthz", timeout=5).status_code == 200  # probes need no key
    assert httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=10).status_code == 200


def test_listen_admin_with_keys_needs_the_key_there_too(upstreams, file_gateways):
    gw = file_gateways({"clusters": [cluster(upstreams())], "admin": {"keys": ["adm-1"]}}, admin=True)
    assert httpx.get(gw.admin_url + "/metrics", timeout=5).status_code == 401
    assert httpx.get(gw.admin_url + "/metrics", headers={"authorization": "Bearer adm-1"}, timeout=5).status_code == 200
    assert httpx.get(gw.url + "/metrics", headers={"authorization": "Bearer adm-1"}, timeout=5).status_code == 404


def test_the_admin_port_must_be_its_own():
    with pytest.raises(ValueError, match="listen.admin.port 8080 is listen.port"):
        Settings.model_validate({"listen": {"port": 8080, "admin": {"port": 8080}}})
