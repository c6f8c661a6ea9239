"""Browsers on other origins (``cors:``, issue 22): preflights answered before the keys and
the rate limits, the CORS headers on every answer to an allowed origin (streams, errors,
``/v1/models``, the dashboard's feed), none for another origin, none at all unless
configured; and a real headless Chromium on a second origin streaming a chat completion
with ``fetch`` and reading ``Server-Timing``.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import uvicorn

from tests.conftest import cluster
from tests.fakes import free_port
from tests.gateway.test_dashboard import browser  # noqa: F401  (the headless Chromium fixture)

try:
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # the browser fixture fails, naming what to install
    WebDriverWait = None

CHAT = "/v1/chat/completions"
PAGE_PORT = free_port()
PAGE = f"http://127.0.0.1:{PAGE_PORT}"  # the page's origin: another port is another origin
ELSEWHERE = "http://127.0.0.1:1"
KEYS = {"auth": {"mode": "required"}, "tenants": [{"name": "web", "keys": ["sk-web"], "requests_per_minute": 1}]}


def ask(**fields) -> dict:
    return {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], **fields}


@pytest.fixture
def cors_gw(upstreams, gateways):
    def start(cors: dict | None = None, **config):
        fake = upstreams(tokens=4)
        cors = {"allow_origins": [PAGE]} if cors is None else cors
        return gateways({"clusters": [cluster(fake)], "cors": cors, **KEYS, **config})

    return start


def preflight(gw, origin: str, method: str = "POST", headers: str = "authorization, content-type, x-stainless-os") -> httpx.Response:
    return httpx.options(
        gw.url + CHAT,
        headers={"origin": origin, "access-control-request-method": method, "access-control-request-headers": headers},
    )


def test_a_preflight_is_answered_before_the_keys_and_limits(cors_gw):
    gw = cors_gw()
    response = preflight(gw, PAGE)
    assert response.status_code == 204  # no key, yet no 401: a preflight carries none
    assert response.headers["access-control-allow-origin"] == PAGE
    assert "POST" in response.headers["access-control-allow-methods"]
    assert response.headers["access-control-allow-headers"] == "authorization, content-type, x-stainless-os"
    assert response.headers["access-control-max-age"] == "600"
    assert "origin" in response.headers["vary"].lower()
    for _ in range(3):  # preflights are no requests of the tenant's: never rate limited
        assert preflight(gw, PAGE).status_code == 204


def test_answers_to_an_allowed_origin_carry_the_headers_errors_streams_and_gets_too(cors_gw):
    gw = cors_gw()
    origin = {"origin": PAGE}
    key = {**origin, "authorization": "Bearer sk-web"}

    def check(response: httpx.Response) -> None:
        assert response.headers["access-control-allow-origin"] == PAGE, (response.status_code, dict(response.headers))
        exposed = {h.strip().lower() for h in response.headers["access-control-expose-headers"].split(",")}
        assert {"server-timing", "x-request-id", "x-edgegw-route", "x-ratelimit-remaining-requests", "retry-after"} <= exposed

    unauthorised = httpx.post(gw.url + CHAT, json=ask(), headers=origin)
    assert unauthorised.status_code == 401
    check(unauthorised)
    with httpx.stream("POST", gw.url + CHAT, json=ask(stream=True), headers=key) as stream:
        assert stream.status_code == 200
        check(stream)
        assert b"[DONE]" in stream.read()
    limited = httpx.post(gw.url + CHAT, json=ask(), headers=key)
    assert limited.status_code == 429
    check(limited)
    models = httpx.get(gw.url + "/v1/models", headers=key)
    assert models.status_code == 200
    check(models)
    with httpx.stream("GET", gw.url + "/dashboard/feed", headers=origin, timeout=10) as feed:
        assert feed.status_code == 200
        check(feed)


def test_a_disallowed_origin_gets_no_cors_headers(cors_gw):
    gw = cors_gw()
    refused = preflight(gw, ELSEWHERE)
    assert refused.status_code == 403 and not any(h.startswith("access-control-") for h in refused.headers)
    answer = httpx.post(gw.url + CHAT, json=ask(), headers={"origin": ELSEWHERE, "authorization": "Bearer sk-web"})
    assert answer.status_code == 200 and not any(h.startswith("access-control-") for h in answer.headers)


def test_any_origin_and_credentials(cors_gw):
    gw = cors_gw({"allow_origins": ["*"]})
    assert preflight(gw, ELSEWHERE).headers["access-control-allow-origin"] == "*"
    gw = cors_gw({"allow_origins": ["*"], "allow_credentials": True})  # a browser refuses "*" with credentials
    response = preflight(gw, ELSEWHERE)
    assert response.headers["access-control-allow-origin"] == ELSEWHERE
    assert response.headers["access-control-allow-credentials"] == "true"


def test_cors_is_off_unless_configured(upstreams, gateways):
    fake = upstreams()
    gw = gateways({"clusters": [cluster(fake)]})
    assert preflight(gw, PAGE).status_code == 405
    answer = httpx.post(gw.url + CHAT, json=ask(), headers={"origin": PAGE})
    assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers


PAGE_HTML = """<!doctype html><meta charset="utf-8"><title>cors</title><pre id="out">waiting</pre>
<script>
async function run() {
  const out = {};
  try {
    const response = await fetch(GATEWAY + "/v1/chat/completions", {
      method: "POST",
      headers: {"content-type": "application/json", "authorization": "Bearer sk-web", "x-stainless-os": "Linux"},
      body: JSON.stringify({model: "fake-model", stream: true, messages: [{role: "user", content: "hi"}]}),
    });
    out.status = response.status;
    out.serverTiming = response.headers.get("server-timing");
    out.route = response.headers.get("x-edgegw-route");
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let text = "";
    out.reads = 0;
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      out.reads += 1;
      text += decoder.decode(value, {stream: true});
    }
    out.events = text.split("\\n\\n").filter(e => e.startsWith("data: ")).map(e => e.slice(6));
  } catch (error) {
    out.error = String(error);
  }
  document.getElementById("out").textContent = JSON.stringify(out);
}
run();
</script>"""


class PageServer:
    """Serves the page from its own origin (a port of its own on 127.0.0.1)."""

    def __init__(self, html: str) -> None:
        self.html = html.encode()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=PAGE_PORT, log_level="error", lifespan="off", interface="asgi3"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    async def app(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/html; charset=utf-8")]})
        await send({"type": "http.response.body", "body": self.html})

    def __enter__(self) -> PageServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "page server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def run_page(driver, gw_url: str) -> dict:
    with PageServer(PAGE_HTML.replace("GATEWAY", json.dumps(gw_url))):
        driver.get(PAGE + "/")
        WebDriverWait(driver, 30).until(lambda d: d.find_element("id", "out").text != "waiting")
        return json.loads(driver.find_element("id", "out").text)


def test_a_page_on_another_origin_streams_a_chat_completion_and_reads_server_timing(cors_gw, browser):  # noqa: F811
    gw = cors_gw()
    result = run_page(browser, gw.url)
    assert result.get("error") is None, result
    assert result["status"] == 200
    assert "total;dur=" in result["serverTiming"] or "admit;dur=" in result["serverTiming"]
    assert result["route"].startswith("target=endpoint")
    assert result["events"][-1] == "[DONE]" and len(result["events"]) >= 5  # 4 tokens, the finish, [DONE]


def test_a_page_on_a_disallowed_origin_is_blocked_by_the_browser(cors_gw, browser):  # noqa: F811
    gw = cors_gw({"allow_origins": ["http://127.0.0.1:1"]})
    result = run_page(browser, gw.url)
    assert "status" not in result and "Failed to fetch" in result["error"], result
