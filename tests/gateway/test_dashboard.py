"""The dashboard: its feed against a running gateway, the feed's lifecycle as a plain ASGI
app (first event at once, nothing left running when the client leaves or the gateway
drains), and the page in a real headless Chromium driven by Selenium.

A missing Chromium, chromedriver or selenium fails the browser test, naming what to
install (``.ci/run`` installs the browser; selenium is in the ``dev`` extra).
The browser test takes the README's screenshot too, but writes a tracked file only when
asked: ``make dashboard-png`` runs it with ``EDGEGW_DASHBOARD_PNG=docs/dashboard.png``; a
plain test run saves it under the test's temporary directory.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import os
import re
import threading
import time
import uuid

import httpx
import orjson
import pytest
import uvicorn

from gateway.observe.dashboard import DashboardApp, live_snapshot
from tests.conftest import ROOT, cluster
from tests.fakes import free_port

try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # the browser test fails, naming what to install
    webdriver = None

CHAT_PATH = "/v1/chat/completions"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
# where ``make dashboard-png`` wants the README's screenshot (relative to the project); unset: a
# test run, which writes no tracked file
SCREENSHOT = os.environ.get("EDGEGW_DASHBOARD_PNG")


def chat(content: str, **fields) -> dict:
    return {"model": "fake-model", "messages": [{"role": "user", "content": content}], **fields}


def feed_events(gw, count: int, timeout: float = 10) -> list[dict]:
    """The first ``count`` snapshots of a fresh ``/dashboard/feed`` connection."""
    events = []
    with httpx.stream("GET", gw.url + "/dashboard/feed", timeout=timeout) as response:
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/event-stream"
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(orjson.loads(line[6:]))
                if len(events) == count:
                    return events
    raise AssertionError(f"the feed ended after {len(events)} events")


class Feed:
    """A ``/dashboard/feed`` connection read on a thread, so a test can act while it runs."""

    def __init__(self, gw) -> None:
        self.events: list[dict] = []
        self._stream = httpx.stream("GET", gw.url + "/dashboard/feed", timeout=10)
        self._response = self._stream.__enter__()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for line in self._response.iter_lines():
                if line.startswith("data: "):
                    self.events.append(orjson.loads(line[6:]))
        except httpx.HTTPError:
            pass  # closed by the test

    def next(self, after: int, timeout: float = 5) -> dict:
        deadline = time.monotonic() + timeout
        while len(self.events) <= after:
            assert time.monotonic() < deadline, "no snapshot came"
            time.sleep(0.02)
        return self.events[after]

    def close(self) -> None:
        self._stream.__exit__(None, None, None)
        self._thread.join(5)


# -- the feed against a running gateway -------------------------------------------------------


def test_the_page_is_one_response_that_fetches_nothing_from_elsewhere(upstreams, gateways):
    gw = gateways({"clusters": [cluster(upstreams())]})
    response = httpx.get(gw.url + "/dashboard")
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/html; charset=utf-8"
    html = response.text
    policy = dict(part.strip().split(" ", 1) for part in response.headers["content-security-policy"].split(";"))
    assert policy["default-src"] == "'none'" and policy["connect-src"] == "'self'"
    for tag, directive in (("style", "style-src"), ("script", "script-src")):
        (block,) = re.findall(rf"<{tag}>(.*?)</{tag}>", html, re.S)  # one inline block each, CSS and JS inlined
        digest = base64.b64encode(hashlib.sha256(block.encode()).digest()).decode()
        assert policy[directive] == f"'sha256-{digest}'"  # exactly the inlined block may run
    assert not re.search(r"""(src|href)=["'](?!data:)""", html)  # no file fetched, not even a favicon
    assert httpx.head(gw.url + "/dashboard").status_code == 200


def test_the_feed_reports_each_endpoint_and_what_it_measured(upstreams, gateways):
    fake = upstreams(ttft=0.05, delay=0.01, tokens=6)
    gw = gateways({"clusters": [cluster(fake, name="central")]})
    feed = Feed(gw)
    try:
        first = feed.next(0)
        assert first["slo"] == [] and first["engine"] is None
        assert first["gateway"]["in_flight"] == 0 and first["gateway"]["shedding"] is False
        assert first["gateway"]["cache_hit_rate"] is None  # the cache is off
        (target,) = first["targets"]
        assert {k: target[k] for k in ("name", "kind", "cluster", "breaker")} == {
            "name": fake.url,
            "kind": "endpoint",
            "cluster": "central",
            "breaker": "closed",
        }
        assert target["diagnosis"]["verdict"] == "unknown"
        assert {k: target["queue"][k] for k in ("waiting", "active", "limit")} == {"waiting": 0, "active": 0, "limit": None}
        for _ in range(10):
            assert httpx.post(gw.url + CHAT_PATH, json=chat("hi", stream=True), timeout=10).status_code == 200
        seen = len(feed.events)
        later = feed.next(seen)
    finally:
        feed.close()
    assert later["time"] > first["time"]
    assert later["gateway"]["requests_per_s"] > 0
    (target,) = later["targets"]
    assert target["requests_per_s"] > 0
    # the fake answers its first token after 50 ms and the next ones 10 ms apart (a busy
    # machine blurs that, but not by an order of magnitude)
    assert 45 <= target["ttft_ms"]["p50"] <= target["ttft_ms"]["p99"] <= 1000
    assert 5 <= target["itl_ms"]["p50"] <= target["itl_ms"]["p99"] <= 250
    stages = {name: stage["p50"] for name, stage in target["stages_ms"].items()}
    assert {"admit", "route", "queue", "pool", "upstream", "first_token", "decode"} <= stages.keys()
    assert stages["queue"] < 5  # nothing waited: no concurrency limit
    assert stages["upstream"] + stages["first_token"] >= 45  # the fake's 50 ms to its first token
    assert stages["decode"] >= 40  # five more tokens 10 ms apart
    assert target["diagnosis"]["verdict"] == "healthy"


def test_rates_fall_back_to_zero_when_traffic_stops(upstreams, gateways):
    gw = gateways({"clusters": [cluster(upstreams())]})
    # read from this thread while the gateway idles: a snapshot only reads counters and state
    snapshot = live_snapshot(gw.state, rate_window_s=1.0, min_gap_s=0)
    for _ in range(3):
        httpx.post(gw.url + CHAT_PATH, json=chat("hi", stream=True), timeout=10).read()
    busy = snapshot()
    assert busy["gateway"]["requests_per_s"] > 0
    assert busy["targets"][0]["ttft_ms"] is not None
    time.sleep(1.2)
    quiet = snapshot()
    assert quiet["gateway"]["requests_per_s"] == 0
    assert quiet["targets"][0]["requests_per_s"] == 0
    assert quiet["targets"][0]["ttft_ms"] is not None  # the last minute's percentiles stay


def test_the_cache_hit_rate_counts_lookups_answered_from_the_cache(upstreams, gateways):
    fake = upstreams()
    gw = gateways({"clusters": [cluster(fake)], "cache": {"backend": "memory"}})
    feed = Feed(gw)
    try:
        feed.next(0)
        ask = chat(uuid.uuid4().hex, temperature=0)
        for _ in range(4):  # one miss, three hits
            assert httpx.post(gw.url + CHAT_PATH, json=ask, timeout=10).status_code == 200
        later = feed.next(len(feed.events))
    finally:
        feed.close()
    assert len(fake.requests) == 1
    assert later["gateway"]["cache_hit_rate"] == pytest.approx(0.75)
    assert [t["name"] for t in later["targets"]] == [fake.url]  # the cache is not a target card


def test_the_edge_engine_is_a_target_and_its_kv_use_is_reported(gateways, tiny_model):
    edge = {"enabled": True, "model": tiny_model, "num_kv_blocks": 64, "block_size": 4, "max_num_batched_tokens": 64, "max_num_seqs": 4}
    gw = gateways({"edge": edge})
    (snapshot,) = feed_events(gw, 1)
    (target,) = snapshot["targets"]
    assert (target["name"], target["kind"], target["cluster"], target["breaker"]) == ("edge", "edge", None, None)
    assert target["queue"]["limit"] == 4
    engine = snapshot["engine"]
    assert engine["kv_blocks_total"] == 64
    assert engine["kv_blocks_used"] == 0 and engine["waiting"] == 0 and engine["running"] == 0


# -- the feed as an ASGI app: lifecycle ------------------------------------------------------


class Client:
    """An ASGI HTTP client for one GET, which can leave (``http.disconnect``) at any time."""

    def __init__(self, path: str = "/dashboard/feed") -> None:
        self.scope = {"type": "http", "method": "GET", "path": path, "headers": []}
        self.sent: list[dict] = []
        self.left = asyncio.Event()
        self.told = False  # the app has received the http.disconnect
        self._asked = False

    async def receive(self) -> dict:
        if not self._asked:
            self._asked = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await self.left.wait()
        self.told = True
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        # what was under way as the client left may still go (a server drops it); nothing
        # once the app has been told
        assert not self.told, "sent after the app was told the client left"
        self.sent.append(dict(message))  # the app may reuse its message dict

    def snapshots(self) -> list[dict]:
        bodies = b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")
        return [orjson.loads(line[6:]) for line in bodies.split(b"\n") if line.startswith(b"data: ")]

    async def wait_for(self, count: int, timeout: float = 10) -> None:
        async with asyncio.timeout(timeout):
            while len(self.snapshots()) < count:
                await asyncio.sleep(0.005)


def counting():
    n = 0

    def snapshot() -> dict:
        nonlocal n
        n += 1
        return {"n": n}

    return snapshot


async def test_the_first_snapshot_comes_at_once_then_one_per_interval():
    client = Client()
    task = asyncio.create_task(DashboardApp(counting(), interval_s=30)(client.scope, client.receive, client.send))
    await client.wait_for(1, timeout=10)  # not after the 30 s interval
    assert client.sent[0]["status"] == 200
    assert dict(client.sent[0]["headers"])[b"content-type"] == b"text/event-stream"
    await asyncio.sleep(0.1)
    assert client.snapshots() == [{"n": 1}]
    client.left.set()
    await asyncio.wait_for(task, 10)


async def test_nothing_is_left_running_when_the_client_leaves():
    client = Client()
    task = asyncio.create_task(DashboardApp(counting(), interval_s=0.01)(client.scope, client.receive, client.send))
    await client.wait_for(3)
    client.left.set()
    await asyncio.wait_for(task, 10)  # it returns (it does not hang, nor raise)
    assert asyncio.all_tasks() == {asyncio.current_task()}  # the disconnect watcher is gone too


async def test_a_draining_gateway_ends_the_feed_and_refuses_new_ones():
    draining = False
    app = DashboardApp(counting(), interval_s=0.01, stop=lambda: draining)
    client = Client()
    task = asyncio.create_task(app(client.scope, client.receive, client.send))
    await client.wait_for(2)
    draining = True
    await asyncio.wait_for(task, 10)  # ended by the gateway, the client still there
    assert client.sent[-1] == {"type": "http.response.body", "body": b""}
    assert asyncio.all_tasks() == {asyncio.current_task()}
    late = Client()
    await asyncio.wait_for(app(late.scope, late.receive, late.send), 1)
    assert late.sent[0]["status"] == 503


async def test_a_failing_snapshot_is_logged_once_and_skipped(caplog):
    calls = 0

    def flaky() -> dict:
        nonlocal calls
        calls += 1
        if calls in (2, 3, 4):
            raise RuntimeError("no reading")
        return {"n": calls}

    client = Client()
    with caplog.at_level(logging.ERROR, logger="edgegw.dashboard"):
        task = asyncio.create_task(DashboardApp(flaky, interval_s=0.01)(client.scope, client.receive, client.send))
        await client.wait_for(2)
        client.left.set()
        await asyncio.wait_for(task, 10)
    assert client.snapshots()[:2] == [{"n": 1}, {"n": 5}]
    assert len([r for r in caplog.records if "dashboard snapshot failed" in r.getMessage()]) == 1


# -- the page in a real browser --------------------------------------------------------------

# the snapshot as the observability work will fill it (every field known)
FULL = {
    "time": 1764540000.1,
    "gateway": {"requests_per_s": 12.3, "in_flight": 4, "shedding": True, "cache_hit_rate": 0.41},
    "targets": [
        {
            "name": "edge", "kind": "edge", "cluster": None, "requests_per_s": 3.2,
            "ttft_ms": {"p50": 120.0, "p99": 480.0}, "itl_ms": {"p50": 30.0, "p99": 90.0},
            "stages_ms": {
                "queue": {"p50": 1.0, "p99": 40.0}, "pool": {"p50": 0.1, "p99": 0.4}, "upstream": {"p50": 80.0, "p99": 300.0},
                "prefill": {"p50": 60.0, "p99": 200.0}, "decode": {"p50": 900.0, "p99": 2400.0},
            },
            "queue": {"waiting": 2, "active": 4, "limit": 4, "service_rate_per_s": 3.1},
            "breaker": None,
            "diagnosis": {"verdict": "queue_saturated", "evidence": "arrivals 5.1/s > service 3.1/s; wait p99 40 ms and growing"},
        },
        {"name": "http://10.0.1.10:8000/v1", "kind": "endpoint", "cluster": "central", "breaker": "half_open",
         "diagnosis": {"verdict": "network_bound", "evidence": "connect p99 210 ms"}},
        {"name": "http://10.0.1.11:8000/v1", "kind": "endpoint", "cluster": "central", "breaker": "open"},
    ],
    "slo": [{"name": "interactive-ttft", "metric": "ttft", "target": 0.99, "burn": {"5m": 14.4, "1h": 2.0, "30m": 0.3, "6h": 0.1},
             "error_budget_remaining": 0.93, "alert": True}],
    "engine": {"waiting": 1, "running": 4, "kv_blocks_used": 120, "kv_blocks_total": 2048, "prefix_cache_hit_rate": 0.55},
}
# what a page must survive: nulls and absences everywhere, and things that are not what they say
SPARSE = {
    "gateway": None,
    "targets": [
        {"name": "bare"},
        {"name": "nulls", "kind": None, "cluster": None, "requests_per_s": None, "ttft_ms": None, "itl_ms": {"p50": None},
         "stages_ms": {"queue": None, "decode": {"p99": 3.0}}, "queue": None, "breaker": None, "diagnosis": None},
        None,
        {"no": "name"},
    ],
    "slo": [{"name": "half-known", "burn": None}, None],
    "engine": {"kv_blocks_used": None},
}


class Scripted:
    """A ``DashboardApp`` under uvicorn on a thread, serving whatever ``snapshot`` is set to
    (an exception instance: raised, so the feed sends nothing)."""

    def __init__(self, snapshot) -> None:
        self.snapshot = snapshot
        self.stopping = False
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        app = DashboardApp(self._read, interval_s=0.2, stop=lambda: self.stopping)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def _read(self) -> dict:
        if isinstance(self.snapshot, Exception):
            raise self.snapshot
        return self.snapshot

    def __enter__(self) -> Scripted:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the scripted dashboard did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.stopping = True  # as a draining gateway: open feeds end, so the server can stop
        self.server.should_exit = True
        self.thread.join(10)



@pytest.fixture
def browser(tmp_path):
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]
    if webdriver is None:
        missing.append("the selenium package (pip install -e '.[dev]')")
    if missing:
        pytest.fail(f"no headless browser: {', '.join(missing)} missing (apt-get install -y chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'chromium'}",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def send_traffic(gw, stop: threading.Event) -> None:
    """Streaming chats until ``stop``: every other one the same greedy ask (a cache hit
    after the first), the others new (to an endpoint; the first ones, sent at once by
    several threads, reach both endpoints, and the balancer has measured each)."""
    with httpx.Client(base_url=gw.url, timeout=10) as client:
        n = 0
        while not stop.is_set():
            n += 1
            ask = chat("what is edgegw?", temperature=0) if n % 2 == 0 else chat(f"question {uuid.uuid4().hex}")
            client.post(CHAT_PATH, json={**ask, "stream": True}).raise_for_status()
            time.sleep(0.05)


def viewport(driver, width: int, height: int, mobile: bool = False) -> None:
    scale = 2 if mobile else 1
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": scale, "mobile": mobile}
    )


def text(driver, css: str) -> str | None:
    """The rendered text of the first element ``css`` selects, read in one step (the page
    rebuilds parts of itself with every snapshot: a found element may be gone a moment later)."""
    return driver.execute_script("const e = document.querySelector(arguments[0]); return e && e.innerText", css)


def texts(driver, css: str) -> list[str]:
    return driver.execute_script("return [...document.querySelectorAll(arguments[0])].map((e) => e.innerText)", css)


def attributes(driver, css: str, name: str) -> list[str | None]:
    return driver.execute_script("return [...document.querySelectorAll(arguments[0])].map((e) => e.getAttribute(arguments[1]))", css, name)


def test_the_page_shows_the_targets_and_live_numbers_in_a_real_browser(upstreams, gateways, browser, tmp_path):
    # ``browser`` after ``gateways``: the browser closes (and its feed with it) before the
    # gateway stops, which would otherwise wait for that open stream
    near, far = upstreams(ttft=0.05, delay=0.012, tokens=12), upstreams(ttft=0.08, delay=0.02, tokens=12)
    gw = gateways({"clusters": [cluster(near, far, name="central")], "cache": {"backend": "memory"}})
    driver = browser
    viewport(driver, 1100, 900)
    driver.get(gw.url + "/dashboard")
    wait = WebDriverWait(driver, 10, poll_frequency=0.05)
    cards = {fake.url: f'.card[data-target="{fake.url}"]' for fake in (near, far)}
    wait.until(lambda d: sorted(attributes(d, ".card", "data-target")) == sorted(cards))
    wait.until(lambda d: text(d, "#feed") == "live")
    for css in cards.values():
        card = text(driver, css)
        assert "central" in card and "endpoint" in card and "closed" in card.lower()
    before = text(driver, "#gw-rps")

    stop = threading.Event()
    traffic = [threading.Thread(target=send_traffic, args=(gw, stop), daemon=True) for _ in range(3)]
    for thread in traffic:
        thread.start()
    try:
        wait.until(lambda d: text(d, "#gw-rps") not in (before, "—") and float(text(d, "#gw-rps")) > 0)
        # the balancer favours the faster endpoint: the cards together show the traffic
        wait.until(lambda d: sum(float(t) for t in texts(d, '.card [data-field="rps"]')) > 0)
        wait.until(lambda d: any(t.endswith("ms") for t in texts(d, '.card [data-field="ttft50"]')))
        wait.until(lambda d: text(d, "#gw-cache") not in ("—", "0%"))
        if SCREENSHOT:
            time.sleep(5)  # a few more points on the charts for the README's screenshot
    finally:
        stop.set()
        for thread in traffic:
            thread.join(10)

    assert driver.execute_script("return document.documentElement.scrollWidth <= innerWidth")
    height = driver.execute_script("return Math.ceil(document.querySelector('footer').getBoundingClientRect().bottom)")
    viewport(driver, 1100, height)
    screenshot = ROOT / SCREENSHOT if SCREENSHOT else tmp_path / "dashboard.png"
    screenshot.parent.mkdir(exist_ok=True)
    assert driver.save_screenshot(str(screenshot))

    viewport(driver, 375, 812, mobile=True)  # a phone: one column, nothing wider than the screen
    wait.until(lambda d: d.execute_script("return innerWidth") == 375)
    assert driver.execute_script("return document.documentElement.scrollWidth <= innerWidth")
    driver.save_screenshot(str(tmp_path / "phone.png"))

    severe = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
    assert severe == []


def test_the_page_shows_every_field_copes_with_none_and_says_when_the_feed_is_stale(browser):
    driver = browser
    viewport(driver, 1100, 900)
    wait = WebDriverWait(driver, 10, poll_frequency=0.05)
    with Scripted(FULL) as dashboard:
        driver.get(dashboard.url + "/dashboard")
        wait.until(lambda d: len(texts(d, ".card")) == 3)
        assert [text(driver, f"#gw-{name}") for name in ("rps", "inflight", "cache", "shedding")] == ["12.3", "4", "41.0%", "yes"]
        edge = '.card[data-target="edge"]'
        assert "queue saturated" in text(driver, f"{edge} .diagnosis").lower()
        assert "arrivals 5.1/s > service 3.1/s" in text(driver, f"{edge} .diagnosis")
        assert text(driver, f'{edge} [data-field="active"]') == "4/4"
        assert text(driver, f'{edge} [data-field="ttft99"]') == "480 ms"
        assert text(driver, f"{edge} .legend").split("\n")[-1] == "decode 900 ms"
        assert attributes(driver, f"{edge} .breaker", "hidden") == [""]  # the engine has none
        for url, state in (("http://10.0.1.10:8000/v1", "half_open"), ("http://10.0.1.11:8000/v1", "open")):
            (badge,) = attributes(driver, f'.card[data-target="{url}"] .breaker', "class")
            assert f"breaker-{state}" in badge.split()
        slo = '#slo [data-slo="interactive-ttft"]'
        assert text(driver, f'{slo} [data-field="burn-5m"]') == "14.40×"
        assert attributes(driver, f'{slo} [data-field="burn-5m"]', "class") == ["burn-high"]
        assert text(driver, f'{slo} [data-field="budget"]') == "93.0%"
        assert text(driver, f"{slo} .alert-on").upper() == "ALERT"
        assert "120 / 2048 blocks (5.9%)" in text(driver, "#engine")

        dashboard.snapshot = SPARSE
        wait.until(lambda d: attributes(d, ".card", "data-target") == ["bare", "nulls"])
        assert [text(driver, f"#gw-{name}") for name in ("rps", "inflight", "cache", "shedding")] == ["—"] * 4
        assert text(driver, '.card[data-target="nulls"] [data-field="ttft50"]') == "—"
        assert "half-known" in text(driver, "#slo")

        dashboard.snapshot = RuntimeError("no reading")
        wait.until(lambda d: text(d, "#feed").startswith("stale"))
        assert attributes(driver, "body", "class") == ["stale"]

        dashboard.snapshot = FULL
        wait.until(lambda d: text(d, "#feed") == "live")
        assert [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"] == []
