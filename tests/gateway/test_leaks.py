"""Nothing secret leaves the gateway: credentials in an endpoint's URL are taken out when the
configuration is read, sent as the endpoint's Basic auth, and appear in no header, metric,
page or log line."""

from __future__ import annotations

import base64
import logging

import httpx
import pytest

from gateway.core.settings import EndpointSettings, Settings
from tests.conftest import cluster

PASSWORD = "s3cr3t-p@ss"
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def test_userinfo_is_moved_out_of_the_url_when_the_configuration_is_read():
    endpoint = EndpointSettings(url="http://alice:s3cr3t-p%40ss@10.0.0.5:8000/v1")
    assert endpoint.url == "http://10.0.0.5:8000/v1"
    assert endpoint.basic_auth.get_secret_value() == f"alice:{PASSWORD}"
    assert PASSWORD not in repr(endpoint) and PASSWORD not in str(Settings(clusters=[{"name": "c", "models": ["m"], "endpoints": [endpoint]}]))
    with pytest.raises(ValueError, match="not both"):
        EndpointSettings(url="http://alice:pw@10.0.0.5:8000/v1", api_key="sk-1")


def test_a_url_with_credentials_leaks_nowhere(upstreams, gateways, caplog):
    fake = upstreams()
    spec = cluster(fake)
    spec["endpoints"][0]["url"] = fake.url.replace("http://", "http://alice:s3cr3t-p%40ss@") + "/v1"
    with caplog.at_level(logging.DEBUG):
        gw = gateways({"clusters": [spec], "listen": {"access_log": True}})
        response = httpx.post(gw.url + "/v1/chat/completions", json=CHAT)
        assert response.status_code == 200
        seen = [
            str(response.headers),
            response.text,
            httpx.get(gw.url + "/metrics").text,
            httpx.get(gw.url + "/debug/latency").text,
            httpx.get(gw.url + "/v1/models").text,
        ]
    assert fake.requests[-1].headers["authorization"] == "Basic " + base64.b64encode(f"alice:{PASSWORD}".encode()).decode()
    assert fake.url + "/v1" in response.headers["x-edgegw-route"]  # the endpoint is named, without its userinfo
    for text in [*seen, caplog.text]:
        assert PASSWORD not in text and "s3cr3t" not in text and "alice" not in text
