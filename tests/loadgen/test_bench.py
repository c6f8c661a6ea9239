"""``edgegw bench`` end to end against the scripted fake upstream (``tests.fakes``) and a
real edgegw in front of it: the figures it reports, the result file, the plots, and the
exit status.

Timing checks allow for a 2-core machine whose cores are busy with other work: a measured
latency is never below what the fake was scripted to wait (minus a clock tick), and above
it by what a busy machine may add (``SLACK``, ``LATE``): the lower bounds are what they
check, the upper ones catch a client that adds its own waits.
"""

from __future__ import annotations

import html.parser
import itertools
import random
import socket

import orjson
import pytest

from gateway.node.cli import main as edgegw_main
from loadgen.arrivals import arrival_times
from loadgen.result import load_result, save_result
from tests.conftest import cluster

TICK = 0.002  # seconds: a timer may fire this early
SLACK = 0.15  # seconds: how late a busy machine may make the fake or the client
LATE = 1.0  # seconds: how late a busy machine may make a request of a schedule


def within(value_ms: float, scripted_s: float, slack: float = SLACK) -> bool:
    return (scripted_s - TICK) * 1e3 <= value_ms <= (scripted_s + slack) * 1e3


def test_percentiles_follow_a_scripted_ttft_and_itl(upstreams, bench, dataset):
    fake = upstreams(delay=0.02, tokens=6)
    fast, slow = {"extra_body": {"fake": {"ttft": 0.04}}}, {"extra_body": {"fake": {"ttft": 0.16}}}
    lines = [{"prompt": f"question {i}", **(slow if i % 4 == 3 else fast)} for i in range(24)]  # 18 fast, 6 slow
    out = bench("--base-url", fake.url + "/v1", "--dataset", dataset(lines), "--num-prompts", "24", "--max-concurrency", "4")
    assert out.code == 0, out.err
    run = out.result.runs[0]
    assert (run.completed, run.failed, run.total_output_tokens) == (24, 0, 24 * 6)
    ttft, itl, tpot, e2e = run.ttft_ms, run.itl_ms, run.tpot_ms, run.e2e_ms
    assert within(ttft.p50, 0.04) and within(ttft.p90, 0.16) and within(ttft.max, 0.16)
    assert ttft.p90 - ttft.p50 > 80  # the two modes of the script, not a blur
    assert itl.count == 24 * 5 and within(itl.p50, 0.02, 0.025) and within(tpot.p50, 0.02, 0.025)
    assert within(e2e.p50, 0.04 + 5 * 0.02) and within(e2e.max, 0.16 + 5 * 0.02, 2 * SLACK)
    assert run.gateway is None  # a plain server: no Server-Timing


def test_request_rate_releases_requests_on_a_poisson_schedule(upstreams, bench):
    fake = upstreams(tokens=2)
    out = bench("--base-url", fake.url + "/v1", "--num-prompts", "60", "--request-rate", "40", "--seed", "3", "--input-len", "8")
    assert out.code == 0, out.err
    run = out.result.runs[0]
    schedule = list(itertools.islice(arrival_times(40.0, random.Random("3:0:arrivals")), 60))
    starts = run.samples.start_s
    assert all(due <= start <= due + LATE for due, start in zip(schedule, starts))  # each sent at its time, not before
    assert run.send_rate == pytest.approx(40, rel=0.35)
    assert run.duration_s == pytest.approx(schedule[-1], abs=LATE)


def test_duration_keeps_sending_until_the_time_is_up(upstreams, bench):
    fake = upstreams(tokens=2)
    out = bench("--base-url", fake.url + "/v1", "--duration", "0.6", "--request-rate", "50", "--input-len", "8")
    assert out.code == 0, out.err
    run = out.result.runs[0]
    assert 10 <= run.requests <= 60 and max(run.samples.start_s) < 0.6
    assert out.result.parameters.num_prompts is None and out.result.parameters.duration_s == 0.6


GATE_ARGS = ("--num-prompts", "8", "--max-concurrency", "4", "--repeat", "3", "--input-len", "8")


def test_the_gate_fails_a_slower_server_and_passes_the_same_one(upstreams, bench, tmp_path):
    # 70 % slower against a gate allowing 30 %: the same server, measured again on a machine
    # whose load changed meanwhile, must still pass, and the slower one still fail
    fast = upstreams(ttft=0.15, delay=0.03, tokens=4)
    slower = upstreams(ttft=0.15 * 1.7, delay=0.03 * 1.7, tokens=4)
    baseline = str(tmp_path / "last.json")
    first = bench("--base-url", fast.url + "/v1", *GATE_ARGS, "--save-result", baseline)
    assert first.code == 0, first.err
    assert len(first.result.runs) == 3 and first.result.gate is None

    regressed = bench("--base-url", slower.url + "/v1", *GATE_ARGS, "--baseline", baseline, "--max-regression", "0.3")
    assert regressed.code == 1, regressed.err
    rows = {row.metric: row for row in regressed.result.gate.rows}
    assert not rows["p95_ttft_ms"].passed and not rows["p95_e2e_ms"].passed
    assert rows["p95_e2e_ms"].change > 0.3
    assert "REGRESSED" in regressed.err and "FAIL" in regressed.err

    same = bench("--base-url", fast.url + "/v1", *GATE_ARGS, "--baseline", baseline, "--max-regression", "0.3")
    assert same.code == 0, same.err
    assert same.result.gate.passed and "PASS" in same.err
    # the gate compares medians over the repetitions
    p95s = sorted(run.e2e_ms.p95 for run in same.result.runs)
    assert same.result.median["p95_e2e_ms"] == p95s[1]


def test_save_result_round_trips(upstreams, bench, tmp_path):
    fake = upstreams(tokens=3)
    path = tmp_path / "result.json"
    out = bench("--base-url", fake.url + "/v1", "--num-prompts", "10", "--input-len", "8", "--goodput", "ttft:1000", "e2e:2000", "--save-result", str(path))
    assert out.code == 0, out.err
    loaded = load_result(str(path))
    assert loaded == out.result  # the same document as --json printed
    again = tmp_path / "again.json"
    save_result(loaded, str(again))
    assert again.read_bytes() == path.read_bytes()
    document = orjson.loads(path.read_bytes())
    assert document["format"] == "edgegw-bench/1"
    assert document["environment"]["cpus"] >= 1 and document["environment"]["edgegw_version"]
    assert document["parameters"]["goodput_ms"] == {"ttft": 1000.0, "e2e": 2000.0}
    assert document["runs"][0]["goodput"]["requests"] == 10
    assert document["median"]["p99_ttft_ms"] == document["runs"][0]["ttft_ms"]["p99"]


class _Resources(html.parser.HTMLParser):
    """Every tag, and every attribute that could fetch something."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.fetching: list[tuple[str, str, str]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        for name, value in attrs:
            if name in ("src", "href", "xlink:href", "srcset", "action", "data", "poster") or "url(" in (value or ""):
                self.fetching.append((tag, name, value or ""))


def test_plots_html_is_one_self_contained_file_and_png_is_an_image(upstreams, bench, tmp_path):
    fake = upstreams(tokens=3)
    page, image = tmp_path / "plot.html", tmp_path / "plot.png"
    out = bench("--base-url", fake.url + "/v1", "--num-prompts", "12", "--input-len", "8", "--plot", str(page), "--plot", str(image))
    assert out.code == 0, out.err
    text = page.read_text()
    parser = _Resources()
    parser.feed(text)
    assert parser.tags.count("svg") == 3  # TTFT, E2E, latency over time
    assert "script" not in parser.tags and "link" not in parser.tags and "img" not in parser.tags
    assert parser.fetching == []
    assert "@import" not in text and "url(" not in text
    assert [f.name for f in tmp_path.iterdir()] and len(list(tmp_path.iterdir())) == 2  # nothing written beside it
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and image.stat().st_size > 10_000


def test_errors_are_counted_by_kind_with_the_servers_message(upstreams, bench, dataset):
    fake = upstreams(tokens=3)
    lines = [{"prompt": "fine"}] * 4 + [
        {"prompt": "busy", "extra_body": {"fake": {"status": 503}}},
        {"prompt": "busy", "extra_body": {"fake": {"status": 503}}},
        {"prompt": "broken", "extra_body": {"fake": {"fail_after": 1}}},
        {"prompt": "slow", "extra_body": {"fake": {"ttft": 5}}},
    ]
    out = bench("--base-url", fake.url + "/v1", "--dataset", dataset(lines), "--num-prompts", "8", "--timeout", "1", "--goodput", "e2e:5000")
    assert out.code == 0, out.err
    run = out.result.runs[0]
    assert run.errors == {"http_503": 2, "connection": 1, "timeout": 1}
    assert run.error_examples["http_503"] == "scripted 503"
    assert (run.completed, run.failed) == (4, 4)
    assert run.goodput.requests == 4 and run.goodput.share == pytest.approx(0.5)
    assert "http_503" in out.err and "scripted 503" in out.err


def test_whole_answers_from_the_completions_endpoint(upstreams, bench):
    fake = upstreams(tokens=5, ttft=0.02)
    out = bench("--base-url", fake.url + "/v1", "--endpoint", "completions", "--no-stream", "--num-prompts", "5", "--input-len", "8")
    assert out.code == 0, out.err
    seen = fake.requests[-1]
    assert seen.path == "/v1/completions" and seen.body["stream"] is False and "stream_options" not in seen.body
    assert isinstance(seen.body["prompt"], str)
    run = out.result.runs[0]
    assert run.samples.ttft_ms == run.samples.e2e_ms  # the first token comes with the whole answer
    assert run.tpot_ms.count == 0 and run.itl_ms.count == 0
    assert run.total_output_tokens == 25


def test_model_from_the_server_and_headers_sent_but_never_saved(upstreams, bench, tmp_path):
    fake = upstreams(tokens=2)
    fake.app.models[:] = ["first-model", "second-model"]
    path = tmp_path / "r.json"
    out = bench(
        "--base-url", fake.url + "/v1", "--num-prompts", "3", "--input-len", "8",
        "--api-key", "sk-secret", "--header", "X-Tenant: t-secret", "--save-result", str(path),
    )  # fmt: skip
    assert out.code == 0, out.err
    seen = fake.requests[-1]
    assert seen.body["model"] == "first-model" and out.result.parameters.model == "first-model"
    assert seen.headers["authorization"] == "Bearer sk-secret" and seen.headers["x-tenant"] == "t-secret"
    assert seen.headers["user-agent"].startswith("edgegw-bench/")
    assert out.result.parameters.header_names == ["authorization", "x-tenant"]
    saved = path.read_text()
    assert "secret" not in saved
    assert "--api-key" in saved and "X-Tenant: ***" in saved


def test_a_base_url_without_a_path_gets_v1(upstreams, bench):
    fake = upstreams(tokens=2)
    out = bench("--base-url", fake.url, "--num-prompts", "2", "--input-len", "4")
    assert out.code == 0, out.err
    assert "using " + fake.url + "/v1" in out.err
    assert {r.path for r in fake.requests} == {"/v1/chat/completions"}  # the fake records POSTs only
    assert out.result.parameters.model == "fake-model"  # from GET /v1/models under the same prefix


def test_set_up_failures_stop_before_the_run(upstreams, bench, tmp_path):
    refusing = upstreams(status=401)
    out = bench("--base-url", refusing.url + "/v1", "--model", "m", "--num-prompts", "50")
    assert out.code == 2 and out.result is None
    assert "warm-up request" in out.err and "http_401: scripted 401" in out.err
    assert len(refusing.requests) == 1

    fake = upstreams()
    baseline_without_goodput = str(tmp_path / "base.json")
    assert bench("--base-url", fake.url + "/v1", "--model", "m", "--num-prompts", "2", "--save-result", baseline_without_goodput).code == 0
    fake.requests.clear()
    for args, message in [
        (("--baseline", str(tmp_path / "missing.json")), "cannot read"),
        (("--plot", str(tmp_path / "p.svg")), ".png or .html"),
        (("--goodput", "ttft"), "NAME:MILLISECONDS"),
        (("--goodput", "latency:5"), "ttft, tpot and e2e"),
        (("--metric", "p95_latency"), "unknown metric"),
        (("--extra-body", "[1]"), "JSON object"),
        (("--duration", "3"), "needs --max-concurrency"),
        (("--header", "bad name: v"), "not a valid HTTP token"),
        (("--dataset", str(tmp_path / "missing.jsonl")), "cannot read"),
        (("--base-url", fake.url.replace("http:", "https:") + "/v1", "--ca-cert", str(tmp_path / "no-ca.pem")), "No such file"),
        (("--baseline", baseline_without_goodput, "--metric", "goodput"), "has no figure for goodput"),
    ]:
        out = bench("--base-url", fake.url + "/v1", "--model", "m", *args)
        assert (out.code, out.result) == (2, None), args
        assert message in out.err, (args, out.err)
    assert fake.requests == []  # nothing was sent


def test_a_closed_port_is_reported_at_once(bench):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = bench("--base-url", f"http://127.0.0.1:{port}/v1", "--model", "m")
    assert out.code == 2 and "Connection refused" in out.err


def test_against_edgegw_the_report_has_its_stages_routes_and_cache(upstreams, gateways, bench, dataset):
    fake = upstreams(tokens=3)
    gw = gateways({"clusters": [cluster(fake)], "cache": {"backend": "memory"}})
    lines = [{"prompt": "alpha"}, {"prompt": "beta"}, {"prompt": "alpha"}, {"prompt": "beta"}]
    out = bench(
        "--base-url", gw.url + "/v1", "--model", "fake-model", "--dataset", dataset(lines), "--num-prompts", "8",
        "--max-concurrency", "1", "--warmup", "0", "--extra-body", '{"temperature": 0}',
    )  # fmt: skip
    assert out.code == 0, out.err
    g = out.result.runs[0].gateway
    assert g is not None and g.responses == 8
    assert g.routes == {"cache": 6, "cluster:central": 2}
    assert g.cache == {"HIT": 6, "MISS": 2} and g.cache_hit_share == pytest.approx(0.75)
    assert {"admit", "cache", "route", "pool", "upstream", "total"} <= set(g.stages_ms)
    assert g.stages_ms["upstream"].count == 2 and g.own_ms.count == 8
    assert out.result.median["p50_gateway_ms"] == g.own_ms.p50
    assert "edgegw Server-Timing (ms)" in out.err and "Cache (x-cache): HIT 75.0 %" in out.err
    assert len(fake.requests) == 2  # the other six came from the cache


def test_edgegw_bench_is_a_subcommand(upstreams, capsys):
    fake = upstreams(tokens=2)
    code = edgegw_main(["bench", "--base-url", fake.url + "/v1", "--num-prompts", "3", "--input-len", "4", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith(f"edgegw bench: {fake.url}/v1 (chat), model fake-model, streaming")
    assert "Latency (ms)" in out and "TTFT" in out
