"""Session fixtures for tests/realworld/: one process of each real upstream for the whole run
(llama.cpp's server, the project's engine server, an edgegw tier in front of the engine
server), and an edgegw in front of each, probing it and discovering its models every 0.2 s
so that every test also checks that the gateway's own traffic never disturbs a request.

``target`` is parametrised over the three: the conformance suite runs once against each.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import pytest

from gateway.core.settings import Settings
from tests.conftest import GatewayProcess, GatewayThread
from tests.realworld.servers import MODEL, EngineServer, LlamaServer

GATEWAY_EVERY_S = 0.2  # the front gateways' probe and discovery interval: busy on purpose


def wait_until(condition: Callable[[], bool], seconds: float, what: str) -> None:
    """Poll ``condition`` up to ``seconds`` (a bound, not a speed: generous on purpose)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {seconds} s for {what}")
        time.sleep(0.05)


def front_config(base: str, **endpoint) -> dict:
    """An edgegw in front of ``base``: its models discovered and the endpoint probed (on
    ``/v1/models``, which every one of the three serves) every ``GATEWAY_EVERY_S``."""
    return {
        "cache": {"backend": "off"},
        "clusters": [{"name": "central", "discovery_interval_s": GATEWAY_EVERY_S, "endpoints": [{"url": base, **endpoint}]}],
        "routing": {
            "health": {"probe_path": "/v1/models", "probe_interval_s": GATEWAY_EVERY_S},
            # the tests' clients send no budget and wait as long as it takes (the machine is
            # shared): the default budget guides admission by predicted wait, and 2 s in front
            # of a server taking one request at a time would turn concurrent ones away with 503
            "policy": {"default_budget_ms": 120_000},
        },
    }


def front_gateway(base: str, **endpoint) -> GatewayThread:
    gw = GatewayThread(Settings.model_validate(front_config(base, **endpoint))).start()
    try:
        wait_until(lambda: MODEL in {m["id"] for m in httpx.get(gw.url + "/v1/models").json()["data"]}, 60, "discovery")
    except BaseException:
        gw.stop()
        raise
    return gw


@dataclass
class Target:
    """One real upstream and the edgegw in front of it."""

    name: str
    direct: str  # the upstream's own base URL (…/v1), or (llama.cpp) its twin's that no gateway probes
    gateway: GatewayThread
    long: dict  # request fields that keep a generation going (no end of sequence)
    # the upstream's own evidence that a generation stopped: a mark taken before, then a
    # check that it has stopped since
    mark: Callable[[], object]
    stopped_since: Callable[[object], bool]
    errors: dict[str, tuple[int, str | None]] = field(default_factory=dict)  # case -> (status, code) the client gets

    @property
    def base(self) -> str:
        return self.gateway.url + "/v1"

    def probed_at(self) -> float | None:
        """When the front gateway's last probe of this upstream was answered."""
        health = self.gateway.state.fleet.health
        return health.endpoint(next(iter(self.gateway.state.fleet.upstreams))).last_probe_at


@pytest.fixture(scope="session")
def llama_server(tmp_path_factory):
    server = LlamaServer(tmp_path_factory.mktemp("llama")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def llama_reference(tmp_path_factory):
    """A second llama.cpp server, same model and flags, that the suite's gateway does not
    probe: the one the tests ask directly, and the one a test's own gateway goes in front
    of. A gateway cannot know of requests sent around it, so the suite's gateway's probes
    would cut such a stream on ``llama_server``."""
    server = LlamaServer(tmp_path_factory.mktemp("llama-reference")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def engine_server(tmp_path_factory):
    server = EngineServer(tmp_path_factory.mktemp("engine")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def inner_gateway(engine_server, tmp_path_factory):
    """The central tier: an edgegw process in front of the engine server."""
    config = {"cache": {"backend": "off"}, "clusters": [{"name": "engine", "endpoints": [{"url": engine_server.base}]}]}
    gw = GatewayProcess(config, tmp_path_factory.mktemp("tier")).start()
    try:
        wait_until(lambda: MODEL in {m["id"] for m in httpx.get(gw.url + "/v1/models").json()["data"]}, 60, "the tier's discovery")
    except BaseException:
        gw.stop()
        raise
    yield gw
    gw.stop()


def _engine_finished(engine: EngineServer) -> Callable[[], object]:
    return lambda: engine.stats()["num_requests_finished"]


def _engine_dropped(engine: EngineServer) -> Callable[[object], bool]:
    """Nothing runs or waits in the engine, and nothing finished since ``mark``: the sequence
    was dropped (an aborted one is not counted as finished), not run to its end."""

    def stopped(mark) -> bool:
        stats = engine.stats()
        assert stats["num_requests_finished"] == mark, "the generation ran to its end"
        return stats["num_running"] == 0 and stats["num_waiting"] == 0

    return stopped


OVER_CONTEXT_ENGINE = {"json": (400, "context_length_exceeded"), "stream": (400, "context_length_exceeded")}


def _llama(server: LlamaServer, reference: LlamaServer) -> Target:
    # llama.cpp's server interrupts its generation for any new request: the gateway queues
    # what it sends there, one at a time (README, "Known upstreams")
    gw = front_gateway(server.base, max_concurrency=1)
    return Target(
        "llama.cpp", reference.base, gw, {"logit_bias": {"2": -100}},  # token 2: <|im_end|>
        server.disconnects, lambda mark: server.disconnects() > mark,
        errors={
            "over_context_json": (400, "context_length_exceeded"),  # its own OpenAI error
            "over_context_stream": (200, "upstream_empty_stream"),  # it sends 200 and no event
            "bad_parameter": (500, None),  # it answers many client mistakes with 500
        },
    )  # fmt: skip


def _engine(server: EngineServer) -> Target:
    gw = front_gateway(server.base)
    return Target(
        "engine", server.base, gw, {"ignore_eos": True}, _engine_finished(server), _engine_dropped(server),
        errors={
            "over_context_json": OVER_CONTEXT_ENGINE["json"],
            "over_context_stream": OVER_CONTEXT_ENGINE["stream"],
            "bad_parameter": (400, "unsupported"),
        },
    )  # fmt: skip


def _tier(inner: GatewayProcess, server: EngineServer) -> Target:
    gw = front_gateway(inner.url + "/v1")
    return Target(
        "edgegw-tier", inner.url + "/v1", gw, {"ignore_eos": True}, _engine_finished(server), _engine_dropped(server),
        errors={
            "over_context_json": OVER_CONTEXT_ENGINE["json"],
            "over_context_stream": OVER_CONTEXT_ENGINE["stream"],
            "bad_parameter": (400, "unsupported"),
        },
    )  # fmt: skip


@pytest.fixture(scope="session")
def llama_target(llama_server, llama_reference):
    target = _llama(llama_server, llama_reference)
    yield target
    target.gateway.stop()


@pytest.fixture(scope="session")
def engine_target(engine_server):
    target = _engine(engine_server)
    yield target
    target.gateway.stop()


@pytest.fixture(scope="session")
def tier_target(inner_gateway, engine_server):
    target = _tier(inner_gateway, engine_server)
    yield target
    target.gateway.stop()


@pytest.fixture(scope="session", params=["llama.cpp", "engine", "edgegw-tier"])
def target(request) -> Target:
    return request.getfixturevalue({"llama.cpp": "llama_target", "engine": "engine_target", "edgegw-tier": "tier_target"}[request.param])
