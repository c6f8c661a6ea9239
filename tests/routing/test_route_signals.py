"""routing.signals: the servers' /metrics text -> ServerLoad, against their real formats
(tests/routing/metrics/, each file's origin in its README)."""

from __future__ import annotations

from pathlib import Path

import pytest

from routing.signals import MetricsError, ServerLoad, detect_source, parse_prometheus, read_load

METRICS = Path(__file__).parent / "metrics"


def text(name: str) -> str:
    return (METRICS / name).read_text()


@pytest.mark.parametrize(
    "source, fixture, running, waiting, kv, capacity",
    [
        pytest.param("vllm", "vllm.txt", 7, 3, 0.41, 8192 * 16, id="vllm-v1"),
        pytest.param("vllm", "vllm_old.txt", 2, 0, 0.25, None, id="vllm-gpu_cache_usage_perc"),
        pytest.param("vllm", "vllm_dp2.txt", 10, 1, 0.4, 2 * 1000 * 16, id="vllm-two-engines-summed"),
        pytest.param("sglang", "sglang.txt", 162, 2826, 0.28, None, id="sglang-docs"),
        pytest.param("sglang", "sglang_tp2.txt", 12, 5, 0.93, 500000, id="sglang-tp2-counted-once"),
        pytest.param("llamacpp", "llamacpp.txt", 2, 1, None, None, id="llamacpp-current-no-kv"),
        pytest.param("llamacpp", "llamacpp_old.txt", 1, 0, 0.1875, None, id="llamacpp-with-kv"),
    ],
)
def test_read_load_from_real_text(source, fixture, running, waiting, kv, capacity):
    load = read_load(source, text(fixture), 10.0, inflight=4)
    assert load.source == source
    assert load.running == running
    assert load.waiting == waiting
    assert load.kv_usage == (None if kv is None else pytest.approx(kv))
    assert load.kv_capacity_tokens == capacity
    assert load.at == 10.0 and load.inflight_at == 4


def test_sglang_hit_rate_is_its_gauge():
    assert read_load("sglang", text("sglang_tp2.txt"), 0.0).prefix_hit_rate == pytest.approx(0.62)


def test_vllm_hit_rate_is_the_counters_change_between_polls():
    first = read_load("vllm", text("vllm.txt"), 1.0)
    assert first.prefix_hit_rate is None  # one reading of two counters is no rate
    assert first.hit_counters == (120000.0, 90000.0)
    later = text("vllm.txt").replace("} 120000.0", "} 130000.0").replace("} 90000.0", "} 92000.0")
    second = read_load("vllm", later, 2.0, previous=first)
    assert second.prefix_hit_rate == pytest.approx(2000 / 10000)
    # nothing queried since: the last rate stands; a restarted server (counters back near
    # zero) gives no rate rather than a negative one
    assert read_load("vllm", later, 3.0, previous=second).prefix_hit_rate == pytest.approx(0.2)
    restarted = later.replace("} 130000.0", "} 50.0").replace("} 92000.0", "} 10.0")
    assert read_load("vllm", restarted, 4.0, previous=second).prefix_hit_rate is None


def test_vllm_old_counters_give_a_rate_too():
    first = read_load("vllm", text("vllm_old.txt"), 0.0)
    later = text("vllm_old.txt").replace("} 400.0", "} 500.0").replace("} 100.0", "} 150.0")
    assert read_load("vllm", later, 1.0, previous=first).prefix_hit_rate == pytest.approx(0.5)


@pytest.mark.parametrize(
    "source, fixture",
    [
        pytest.param("vllm", "sglang.txt", id="sglang-text-read-as-vllm"),
        pytest.param("sglang", "vllm.txt", id="vllm-text-read-as-sglang"),
        pytest.param("llamacpp", "vllm.txt", id="vllm-text-read-as-llamacpp"),
    ],
)
def test_the_wrong_source_is_an_error_not_an_idle_server(source, fixture):
    with pytest.raises(MetricsError, match=f"no {source} load metrics"):
        read_load(source, text(fixture), 0.0)


def test_unknown_source_is_refused():
    with pytest.raises(ValueError, match="unknown load source"):
        read_load("tgi", text("vllm.txt"), 0.0)


def test_parser_labels_with_commas_braces_and_escapes():
    samples = parse_prometheus(
        'm{a="x,y",b="}",c="say \\"hi\\"\\n"} 1.5 1712345678000\n'
        "bare 2\n"
        "# a comment\n"
        'inf{le="+Inf"} +Inf\n'
    )
    assert samples["m"] == [((("a", "x,y"), ("b", "}"), ("c", 'say "hi"\n')), 1.5)]
    assert samples["bare"] == [((), 2.0)]
    assert samples["inf"][0][1] == float("inf")


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param('m{a="x" 1\n', id="unterminated-labels"),
        pytest.param("m\n", id="no-value"),
        pytest.param("m one\n", id="not-a-number"),
        pytest.param('m{a=x} 1\n', id="unquoted-label"),
    ],
)
def test_parser_rejects_what_is_not_the_format(bad):
    with pytest.raises(MetricsError):
        parse_prometheus(bad)


def test_html_instead_of_metrics_is_an_error():
    with pytest.raises(MetricsError):
        read_load("vllm", "<html><body>Not Found</body></html>", 0.0)


def test_merged_load_counts_other_clients_once_and_ours_now():
    load = ServerLoad("vllm", running=7, waiting=3, at=0.0, inflight_at=4)
    # the server saw 10 requests, 4 of them ours: 6 are someone else's; we now have 1
    assert load.merged_load(1) == 7
    assert load.merged_load(9) == 15
    # a server that reports fewer than we have in flight (it has not seen them yet)
    assert ServerLoad("vllm", running=1, waiting=0, inflight_at=4).merged_load(4) == 4


@pytest.mark.parametrize(
    "owned_by, expected",
    [
        pytest.param("vllm", "vllm", id="vllm"),
        pytest.param("sglang", "sglang", id="sglang"),
        pytest.param("llamacpp", "llamacpp", id="llama.cpp-server"),
        pytest.param("me", None, id="llama-cpp-python-never-polled"),
        pytest.param("openai", None, id="hosted"),
        pytest.param("edgegw", None, id="another-gateway"),
    ],
)
def test_detect_source_from_owned_by(owned_by, expected):
    models = {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": owned_by}]}
    assert detect_source(models) == expected


def test_detect_source_needs_one_answer():
    mixed = {"data": [{"id": "a", "owned_by": "vllm"}, {"id": "b", "owned_by": "sglang"}]}
    assert detect_source(mixed) is None
    assert detect_source({"data": "nope"}) is None
    assert detect_source([]) is None
