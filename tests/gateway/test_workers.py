"""``listen.workers``: ``edgegw serve`` as a supervising parent of relay worker processes
on one port (real processes, real sockets on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import time
from urllib.parse import urlsplit

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.core.settings import ListenSettings, Settings, cpu_set
from gateway.node.workers import bind_slots, split_cpus
from tests.conftest import GatewayProcess, cluster
from tests.fakes import free_port
from tests.fakes_h3 import client_pool, fetch, free_udp_port

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


def worker_pids(gw, count: int, timeout: float = 30, exclude: frozenset[int] = frozenset()) -> dict[int, int]:
    """Worker number -> pid of its latest process, from the parent's log, once ``count``
    workers (none of them ``exclude``d) have started."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids: dict[int, int] = {}
        for index, pid in re.findall(r"worker (\d+) started \(pid (\d+)\)", gw.log.read_text()):
            pids[int(index)] = int(pid)
        if len(pids) == count and not exclude & set(pids.values()):
            return pids
        assert gw.proc.poll() is None, gw.log.read_text()
        time.sleep(0.05)
    raise AssertionError(f"workers did not start: {gw.log.read_text()}")


def is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def ask(url: str, count: int) -> list[int]:
    """``count`` completions, each on a new connection (spread over the workers by the kernel)."""
    statuses = []
    for _ in range(count):
        with httpx.Client(timeout=10) as client:
            statuses.append(client.post(url + "/v1/chat/completions", json=CHAT).status_code)
    return statuses


@pytest.mark.parametrize(
    "value, expected",
    [
        pytest.param(1, 1, id="default"),
        pytest.param(3, 3, id="number"),
        pytest.param("auto", len(os.sched_getaffinity(0)), id="auto"),
    ],
)
def test_listen_workers_is_a_number_or_auto(value, expected):
    assert ListenSettings(workers=value).workers == expected


@pytest.mark.parametrize("value", [pytest.param(0, id="zero"), pytest.param("many", id="word")])
def test_listen_workers_refuses_anything_else(value):
    with pytest.raises(ValueError, match="workers"):
        ListenSettings(workers=value)


def test_edge_cpus_is_a_cpu_list_for_an_engine_in_its_own_process():
    assert cpu_set("0-3,8, 10-11") == {0, 1, 2, 3, 8, 10, 11}
    for bad in ("", "a", "3-1", "1-", "-2"):
        with pytest.raises(ValueError, match="not a CPU list"):
            cpu_set(bad)
    with pytest.raises(ValueError, match="CPU list"):
        Settings.model_validate({"edge": {"enabled": True, "process": True, "cpus": "one"}})
    with pytest.raises(ValueError, match="edge.cpus pins the engine's own process"):
        Settings.model_validate({"edge": {"enabled": True, "cpus": "0"}})  # the engine in-process: nothing to pin
    allowed = sorted(os.sched_getaffinity(0))
    pinned = Settings.model_validate({"listen": {"workers": 2}, "edge": {"enabled": True, "cpus": str(allowed[0])}})
    engine, relay = split_cpus(pinned)
    assert engine == {allowed[0]} and relay == (set(allowed[1:]) or None)
    elsewhere = Settings.model_validate({"edge": {"enabled": True, "process": True, "cpus": "4096"}})
    with pytest.raises(ValueError, match="may run on CPUs"):
        split_cpus(elsewhere)


def test_the_slots_share_one_port():
    slots = bind_slots("127.0.0.1", 0, 3)
    try:
        ports = {sock.getsockname()[1] for sock in slots}
        assert len(ports) == 1 and ports != {0}
    finally:
        for sock in slots:
            sock.close()


def test_two_workers_serve_one_port_a_killed_worker_is_replaced_and_sigterm_drains_them(upstreams, gateway_processes):
    fake = upstreams()
    gw = gateway_processes({"listen": {"workers": 2}, "clusters": [cluster(fake)]})
    pids = worker_pids(gw, 2)
    assert len(set(pids.values())) == 2 and gw.proc.pid not in pids.values()
    assert ask(gw.url, 10) == [200] * 10

    os.kill(pids[1], signal.SIGKILL)  # a worker of ours, by its pid
    replaced = worker_pids(gw, 2, exclude=frozenset({pids[1]}))
    assert replaced[0] == pids[0] and replaced[1] != pids[1]
    assert "worker 1 (pid %d) ended (killed by signal 9)" % pids[1] in gw.log.read_text()
    assert ask(gw.url, 10) == [200] * 10  # connections the kernel gave to slot 1 waited for its new worker
    assert all(is_running(pid) for pid in replaced.values())

    gw.proc.send_signal(signal.SIGTERM)
    assert gw.proc.wait(30) == 0
    assert not any(is_running(pid) for pid in replaced.values())


def test_a_hung_worker_is_killed_and_replaced(upstreams, gateway_processes):
    """A worker whose event loop stops (here: the process stopped, SIGSTOP) beats no more:
    past ``listen.worker_timeout_s`` the parent kills it and starts another on its slot."""
    fake = upstreams()
    gw = gateway_processes({"listen": {"workers": 2, "worker_timeout_s": 1.0}, "clusters": [cluster(fake)]})
    pids = worker_pids(gw, 2)
    assert ask(gw.url, 6) == [200] * 6
    time.sleep(2.5)  # beating workers outlive the timeout
    assert worker_pids(gw, 2) == pids
    os.kill(pids[0], signal.SIGSTOP)  # a worker of ours, by its pid
    try:
        replaced = worker_pids(gw, 2, timeout=15, exclude=frozenset({pids[0]}))
    finally:
        if is_running(pids[0]):
            os.kill(pids[0], signal.SIGKILL)
    assert replaced[1] == pids[1] and replaced[0] != pids[0]
    log = gw.log.read_text()
    assert f"worker 0 (pid {pids[0]}) is hung: its event loop has not run for" in log
    assert f"worker 0 (pid {pids[0]}) ended (killed by signal 9)" in log
    wait_for(lambda: not is_running(pids[0]))
    assert ask(gw.url, 10) == [200] * 10


def test_sigterm_lets_a_stream_in_flight_finish(upstreams, gateway_processes):
    fake = upstreams(tokens=10, delay=0.1)
    gw = gateway_processes({"listen": {"workers": 2}, "clusters": [cluster(fake)]})
    worker_pids(gw, 2)
    with httpx.Client(timeout=20) as client:
        with client.stream("POST", gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            gw.proc.send_signal(signal.SIGTERM)  # the stream is in flight
            rest = list(lines)
    assert "data: [DONE]" in rest
    assert gw.proc.wait(30) == 0


EDGE = {"enabled": True, "name": "tiny", "num_kv_blocks": 128, "block_size": 4, "max_num_batched_tokens": 64,
        "max_num_seqs": 1, "max_concurrency": 4, "dtype": "float32"}
LONG = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 300, "ignore_eos": True, "stream": True}


def gauge(url: str, name: str) -> float:
    """The largest sample of ``name`` on the node's /metrics (the engine's gauges are the
    same from every worker)."""
    values = [
        sample.value
        for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=5).text)
        for sample in family.samples
        if sample.name == name
    ]
    assert values, f"{name} not in /metrics"
    return max(values)


def engine_ready(gw) -> None:
    """Wait until the node's engine has loaded (the workers serve before it has) and the
    workers have seen it: each learns it at its next stats poll (50 ms, later on a busy
    machine), and ``/readyz`` of a node with nothing else to serve says 200 only then. Ten
    new connections in a row answered 200 (the kernel spreads them over the workers)."""
    wait_for(lambda: "edge engine ready" in gw.log.read_text(), 60)
    in_a_row = 0

    def ready() -> bool:
        nonlocal in_a_row
        with httpx.Client(timeout=10) as client:  # a new connection: any worker
            in_a_row = in_a_row + 1 if client.get(gw.url + "/readyz").status_code == 200 else 0
        return in_a_row >= 10

    wait_for(ready, 30)


def loads_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as maps:
        return "libtorch" in maps.read()


def wait_for(check, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_two_workers_share_one_engine_process_and_a_client_gone_aborts_its_sequence(gateway_processes, tiny_model):
    gw = gateway_processes({"listen": {"workers": 2}, "edge": {**EDGE, "model": tiny_model}})
    pids = worker_pids(gw, 2)
    engine_ready(gw)
    engines = re.findall(r"edge engine started \(pid (\d+)\)", gw.log.read_text())
    assert len(engines) == 1 and int(engines[0]) not in pids.values()
    assert not any(loads_torch(pid) for pid in pids.values())  # the model and torch live in the engine only
    assert loads_torch(int(engines[0]))
    for _ in range(4):  # new connections: both workers, one engine
        with httpx.Client(timeout=30) as client:
            answer = client.post(gw.url + "/v1/chat/completions", json={**LONG, "stream": False, "max_tokens": 4})
            assert answer.status_code == 200 and answer.json()["model"] == "tiny", answer.text
    wait_for(lambda: gauge(gw.url, "edgegw_edge_finished") == 4, 5)  # the engine's stats reach a worker every 50 ms
    asked = httpx.post(gw.url + "/v1/chat/completions", json={**LONG, "stream": False, "max_tokens": 2}, headers={"x-request-id": "req-42"}, timeout=30)
    assert asked.json()["id"] == "chatcmpl-req-42"  # the gateway's request id in OpenAI's form, as in-process
    for body, param in [({"temperature": -1}, "temperature"), ({"model": "auto", "max_tokens": 10**9}, "max_tokens")]:
        refused = httpx.post(gw.url + "/v1/chat/completions", json={**LONG, **body}, timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text

    with httpx.Client(timeout=60) as client, client.stream("POST", gw.url + "/v1/chat/completions", json=LONG) as first:
        lines = first.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # the engine's only slot is taken
        with socket.create_connection(("127.0.0.1", urlsplit(gw.url).port)) as leaving:
            body = orjson.dumps(LONG)
            leaving.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
            wait_for(lambda: gauge(gw.url, "edgegw_edge_waiting") + gauge(gw.url, "edgegw_edge_running") == 2)
        # the client left: the engine drops its sequence (from the queue, or mid-stream)
        wait_for(lambda: gauge(gw.url, "edgegw_edge_waiting") + gauge(gw.url, "edgegw_edge_running") <= 1)
        rest = list(lines)
        tail = [line for line in rest if line.startswith("data: ")][-2:]
    assert '"finish_reason":"length"' in tail[0] and tail[1] == "data: [DONE]"
    assert not any("x-engine-stages" in line for line in rest)  # the engine's stages stay in the gateway
    node = httpx.get(gw.url + "/metrics", timeout=5).text
    for stage in ("engine_queue", "engine_prefill", "engine_decode"):  # from whole answers and the stream
        counted = [s.value for s in samples(node, "edgegw_stage_seconds_count") if s.labels == {"stage": stage, "target_kind": "edge"}]
        assert counted and counted[0] >= 6, (stage, counted)
    wait_for(lambda: gauge(gw.url, "edgegw_edge_running") == 0)
    assert gauge(gw.url, "edgegw_edge_finished") == 6  # the stream read to its end; not the one that left


def samples(text: str, name: str) -> list:
    return [s for family in text_string_to_metric_families(text) for s in family.samples if s.name == name]


def test_edge_cpus_pins_the_engine_and_gives_the_workers_the_other_cpus(gateway_processes, tiny_model):
    allowed = sorted(os.sched_getaffinity(0))
    relay = set(allowed[:-1]) or set(allowed)  # on one CPU the workers share it
    gw = gateway_processes({"listen": {"workers": 2}, "edge": {**EDGE, "model": tiny_model, "cpus": str(allowed[-1])}})
    pids = worker_pids(gw, 2)
    engine_ready(gw)
    [engine] = re.findall(r"edge engine started \(pid (\d+)\)", gw.log.read_text())
    assert os.sched_getaffinity(int(engine)) == {allowed[-1]}
    wait_for(lambda: all(os.sched_getaffinity(pid) == relay for pid in pids.values()), 10)  # once each has started
    assert os.sched_getaffinity(gw.proc.pid) == set(allowed)  # the parent stays as it was
    answer = httpx.post(gw.url + "/v1/chat/completions", json={**LONG, "stream": False, "max_tokens": 2}, timeout=30)
    assert answer.status_code == 200, answer.text


def test_metrics_counts_the_requests_of_every_worker(upstreams, gateway_processes):
    fake = upstreams()
    gw = gateway_processes({"listen": {"workers": 2}, "clusters": [cluster(fake)]})
    pids = worker_pids(gw, 2)
    assert ask(gw.url, 20) == [200] * 20  # each on a new connection: the kernel spreads them
    # each worker's own counts, asked for on new connections until both have answered
    own: dict[int, float] = {}
    for _ in range(200):
        if len(own) == 2:
            break
        text = httpx.get(gw.url + "/metrics", headers={"x-edgegw-metrics": "worker"}, timeout=5).text
        [pid] = samples(text, "edgegw_worker_pid")
        own[int(pid.value)] = sum(s.value for s in samples(text, "edgegw_requests_total") if s.labels["api"] == "chat")
    assert set(own) == set(pids.values())
    assert all(count > 0 for count in own.values()) and sum(own.values()) == 20  # both served some
    node = httpx.get(gw.url + "/metrics", timeout=5).text  # from whichever worker: the node's totals
    assert sum(s.value for s in samples(node, "edgegw_requests_total") if s.labels == {"api": "chat", "status": "200", "tenant": "anonymous"}) == 20
    assert {int(s.value) for s in samples(node, "edgegw_worker_pid")} == set(pids.values())
    assert {s.labels["worker"] for s in samples(node, "edgegw_in_flight_requests")} == {"0", "1"}
    assert samples(node, "edgegw_workers_scraped")[0].value == 2
    e2e = samples(node, "edgegw_e2e_seconds_count")  # histograms are summed too
    assert sum(s.value for s in e2e) == 20 and all("worker" not in s.labels for s in e2e)


def test_a_killed_engine_process_is_replaced_and_the_workers_reach_the_new_one(gateway_processes, tiny_model):
    gw = gateway_processes({"listen": {"workers": 2}, "edge": {**EDGE, "model": tiny_model}})
    worker_pids(gw, 2)
    engine_ready(gw)  # killed while loading for the first time, it would stop the node
    [engine] = re.findall(r"edge engine started \(pid (\d+)\)", gw.log.read_text())
    os.kill(int(engine), signal.SIGKILL)  # our engine process, by its pid
    wait_for(lambda: len(re.findall(r"edge engine started \(pid (\d+)\)", gw.log.read_text())) == 2, timeout=60)
    statuses = []

    def answered() -> bool:
        with httpx.Client(timeout=30) as client:  # a new connection: either worker
            statuses.append(client.post(gw.url + "/v1/chat/completions", json={**LONG, "stream": False, "max_tokens": 2}).status_code)
        return statuses[-3:] == [200] * 3

    wait_for(answered, timeout=60)
    assert set(statuses) <= {200, 503}  # while it reloads: 503 with Retry-After, never a hang or a 500


def test_workers_that_cannot_start_stop_the_node_instead_of_restarting_for_ever(tmp_path):
    """A lifespan that fails (a configured GeoIP database that is not there) fails the same
    way in every worker: the parent exits with uvicorn's start-up failure status."""
    gw = GatewayProcess({"listen": {"workers": 2}, "cache": {"backend": "off"}, "routing": {"geoip_db": str(tmp_path / "none.mmdb")}}, tmp_path)
    try:
        assert gw.proc.wait(60) == 3
    finally:
        gw.stop()
    assert "could not start (see above): stopping the node" in gw.log.read_text()


def test_the_workers_start_with_the_engine_and_an_engine_that_cannot_load_stops_the_node(gateway_processes, tiny_model, tmp_path):
    """The workers do not wait for the model to load (they answer health checks meanwhile);
    a model that cannot load stops the node instead of being restarted for ever."""
    gw = gateway_processes({"listen": {"workers": 2}, "edge": {**EDGE, "model": tiny_model}})
    worker_pids(gw, 2)
    engine_ready(gw)
    log = gw.log.read_text()
    assert log.index("worker 1 started") < log.index("edge engine ready")


    def served() -> bool:  # a worker sees the engine at its next stats poll (50 ms; later on a busy machine)
        answer = httpx.post(gw.url + "/v1/chat/completions", json={**LONG, "stream": False, "max_tokens": 2}, timeout=30)
        assert answer.status_code == 200 or "edge engine unhealthy" in answer.text, answer.text
        return answer.status_code == 200

    wait_for(served, 30)

    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)  # a GGUF header and nothing of a model
    gw = GatewayProcess({"listen": {"workers": 2}, "cache": {"backend": "off"}, "edge": {**EDGE, "model": str(broken)}}, tmp_path)
    try:
        assert gw.proc.wait(120) == 1
    finally:
        gw.stop()
    log = gw.log.read_text()
    assert "the edge engine exited while starting" in log and "stopping the node" in log
    assert log.count("edge engine started") == 1  # not restarted


async def test_every_worker_serves_https_and_http3_on_the_shared_ports(upstreams, gateway_processes, certificate):
    fake = upstreams()
    certfile, keyfile = certificate
    tls_port, h3_port = free_port(), free_udp_port()
    gw = gateway_processes({
        "listen": {
            "workers": 2,
            "tls": {"port": tls_port, "certfile": certfile, "keyfile": keyfile},
            "http3": {"port": h3_port, "certfile": certfile, "keyfile": keyfile},
        },
        "clusters": [cluster(fake)],
    })
    worker_pids(gw, 2)
    for _ in range(100):  # both workers have their listeners up once both are scraped
        if "edgegw_workers_scraped 2.0" in httpx.get(gw.url + "/metrics", timeout=5).text:
            break
        await asyncio.sleep(0.05)
    for kind, port in (("h2", tls_port), ("h3", h3_port)):
        for _ in range(6):  # a new connection each time (and a new source port): both workers' listeners
            pool = client_pool(kind, port, certfile)
            try:
                status, _, body = await fetch(pool, "/v1/chat/completions", orjson.dumps(CHAT))
            finally:
                await pool.aclose()
            assert status == 200 and orjson.loads(body)["choices"], (kind, body)
    assert "address already in use" not in gw.log.read_text().lower()
