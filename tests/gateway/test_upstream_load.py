"""gateway/upstream/load.py: the poller against a real HTTP server on 127.0.0.1 serving the
servers' real metrics text (tests/routing/metrics/), through the endpoint's own control
client. Timing is driven by events, never by the clock."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from gateway.core.settings import EndpointSettings
from gateway.upstream import Upstream
from gateway.upstream.load import LoadPoller, pool_fetch
from routing import HealthState, LoadConfig, detect_source

METRICS = Path(__file__).parent.parent / "routing" / "metrics"


class MetricsServer:
    """A server publishing ``text`` on /metrics (and an owned_by on /v1/models); it
    counts what it is asked and signals each /metrics GET."""

    def __init__(self, text: str, owned_by: str = "vllm", status: int = 200) -> None:
        self.text = text
        self.owned_by = owned_by
        self.status = status
        self.paths: list[str] = []
        self.polled = asyncio.Event()
        app = Starlette(routes=[Route("/metrics", self.metrics), Route("/v1/models", self.models)])
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error", lifespan="off"))

    async def metrics(self, request: Request) -> PlainTextResponse:
        self.paths.append(request.url.path)
        self.polled.set()
        return PlainTextResponse(self.text, self.status, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self, request: Request) -> JSONResponse:
        self.paths.append(request.url.path)
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model", "owned_by": self.owned_by}]})

    async def __aenter__(self) -> MetricsServer:
        self.task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.should_exit = True
        await self.task


def poller(**config) -> tuple[LoadPoller, HealthState]:
    health = HealthState(load=LoadConfig(**config))
    return LoadPoller(health, health.load_config), health


async def test_a_vllm_endpoint_is_polled_and_its_load_recorded():
    async with MetricsServer((METRICS / "vllm.txt").read_text()) as srv:
        p, health = poller()
        async with httpx.AsyncClient(base_url=srv.url) as client:
            p.add(srv.url, client, "vllm")
            health.record_start(srv.url, 0.0)  # one of ours in flight while it is read
            [load] = await p.poll_all()
        assert srv.paths == ["/metrics"]
        h = health.endpoint(srv.url)
        assert h.load is load
        assert (load.running, load.waiting, load.kv_usage) == (7, 3, pytest.approx(0.41))
        assert load.inflight_at == 1 and load.kv_capacity_tokens == 8192 * 16


async def test_through_the_endpoints_own_control_pool():
    async with MetricsServer((METRICS / "sglang_tp2.txt").read_text(), owned_by="sglang") as srv:
        upstream = Upstream(EndpointSettings(url=srv.url + "/v1", load_source="sglang"), "c", high_water=1 << 16)
        try:
            p, health = poller()
            fetch = pool_fetch(upstream.control, [], 2.0)  # as the fleet wires it
            p.add(upstream.url, fetch, upstream.settings.load_source, upstream.settings.metrics_path)
            [load] = await p.poll_all()
            [again] = await p.poll_all()  # the control connection is reused
        finally:
            await upstream.aclose()
        assert (load.running, load.waiting, load.prefix_hit_rate) == (12, 5, pytest.approx(0.62))
        assert srv.paths == ["/metrics", "/metrics"]  # on the origin, not under the /v1 base
        assert again.at >= load.at


@pytest.mark.parametrize(
    "owned_by, polled",
    [
        pytest.param("vllm", True, id="vllm-detected"),
        pytest.param("me", False, id="llama-cpp-python-never-disturbed"),
    ],
)
async def test_auto_polls_only_what_the_model_list_names(owned_by, polled):
    async with MetricsServer((METRICS / "vllm.txt").read_text(), owned_by=owned_by) as srv:
        p, health = poller()
        async with httpx.AsyncClient(base_url=srv.url) as client:
            p.add(srv.url, client, "auto")
            assert await p.poll_all() == []  # not detected yet: nothing is sent
            assert srv.paths == []
            listing = (await client.get("/v1/models")).json()  # what discovery fetches anyway
            p.detected(srv.url, detect_source(listing))
            await p.poll_all()
        assert srv.paths == ["/v1/models", "/metrics"] if polled else ["/v1/models"]
        assert (health.endpoint(srv.url).load is not None) is polled


async def test_none_is_never_polled_even_if_detected():
    async with MetricsServer((METRICS / "vllm.txt").read_text()) as srv:
        p, _ = poller()
        async with httpx.AsyncClient(base_url=srv.url) as client:
            p.add(srv.url, client, "none")
            p.detected(srv.url, "vllm")
            assert await p.poll_all() == []
        assert srv.paths == []


@pytest.mark.parametrize(
    "text, status",
    [
        pytest.param("<html>not here</html>", 404, id="404"),
        pytest.param("<html>a login page</html>", 200, id="not-metrics"),
        pytest.param((METRICS / "sglang.txt").read_text(), 200, id="another-servers-metrics"),
    ],
)
async def test_a_failed_poll_records_nothing_and_keeps_the_last_reading(text, status):
    async with MetricsServer((METRICS / "vllm.txt").read_text()) as srv:
        p, health = poller()
        async with httpx.AsyncClient(base_url=srv.url) as client:
            p.add(srv.url, client, "vllm")
            [good] = await p.poll_all()
            srv.text, srv.status = text, status
            assert await p.poll_all() == [None]
        assert health.endpoint(srv.url).load is good
        assert p.endpoints[srv.url].failures == 1


async def test_a_dead_endpoint_is_a_failed_poll():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    p, health = poller(poll_timeout_s=2.0)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        p.add("dead", client, "vllm")
        assert await p.poll_all() == [None]
    assert health.endpoint("dead").load is None


async def test_run_polls_on_its_interval_until_cancelled():
    async with MetricsServer((METRICS / "llamacpp.txt").read_text(), owned_by="llamacpp") as srv:
        p, health = poller(poll_interval_s=0.05)
        async with httpx.AsyncClient(base_url=srv.url) as client:
            p.add(srv.url, client, "auto")
            task = asyncio.create_task(p.run())
            await asyncio.sleep(0)  # it waits for a source: nothing to poll
            assert srv.paths == []
            p.detected(srv.url, "llamacpp")
            for _ in range(3):
                srv.polled.clear()
                await asyncio.wait_for(srv.polled.wait(), 10)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        load = health.endpoint(srv.url).load
        assert (load.running, load.waiting, load.kv_usage) == (2, 1, None)
        assert p.endpoints[srv.url].polls >= 2


def test_a_bad_load_source_is_refused():
    p, _ = poller()
    with pytest.raises(ValueError, match="load_source"):
        p.add("x", None, "tgi")  # type: ignore[arg-type]


def test_the_gateway_polls_a_named_source_and_never_an_unknown_server(upstreams, gateways):
    """Through a whole gateway: an endpoint with ``load_source: vllm`` is polled on its
    origin; one left at ``auto`` whose model list says ``owned_by: fake`` (as
    llama-cpp-python's says ``me``) is never sent a poll, though both are polled in the
    same rounds."""
    import time as clock

    named, unknown = upstreams(), upstreams()
    gateways(
        {
            "clusters": [
                {"name": "a", "endpoints": [{"url": named.url + "/v1", "load_source": "vllm"}]},
                {"name": "b", "endpoints": [{"url": unknown.url + "/v1"}]},
            ],
            "routing": {"load": {"poll_interval_s": 0.05}},
        }
    )
    deadline = clock.monotonic() + 30  # a bound on a hung gateway, not a speed assertion
    while named.gets.count("/metrics") < 3 or "/v1/models" not in unknown.gets:
        assert clock.monotonic() < deadline, (named.gets, unknown.gets)
        clock.sleep(0.02)
    seen = named.gets.count("/metrics")
    while named.gets.count("/metrics") < seen + 3:  # three more rounds after discovery answered
        assert clock.monotonic() < deadline, named.gets
        clock.sleep(0.02)
    assert "/metrics" not in unknown.gets
