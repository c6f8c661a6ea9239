"""``edgegw explain``: routing's decision for a request, printed without sending anything.

Run as the CLI runs it (``gateway.node.cli.main``, its stdout, stderr and exit status) in
this process, and once as a subprocess (``python -m gateway explain``), the way an operator
meets it; against the shipped multi-region example and against copies of it pointed at a
small .mmdb fixture (TEST-NET addresses placed in known cities). A subprocess per case
would spend a second or more starting Python for a decision that takes microseconds.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gateway.node.cli import main
from tests.conftest import ROOT

EXAMPLE = ROOT / "configs" / "multi-region.example.yaml"
CENTRAL = "llama-3.1-70b-instruct"
EDGE_MODEL = "smollm2-135m-instruct"

FRANKFURT_IP = "198.51.100.7"  # TEST-NET-2 -> Frankfurt in the fixture
SAN_JOSE_IP = "192.0.2.10"  # TEST-NET-1 -> San Jose
SINGAPORE_IP = "203.0.113.9"  # TEST-NET-3 -> Singapore
UNKNOWN_IP = "100.64.0.1"  # shared address space: in no database
PROXY = "10.0.0.5"  # inside the example's trusted 10.0.0.0/8


@pytest.fixture(scope="module")
def config(geo_db, tmp_path_factory) -> Path:
    """The shipped example, its GeoIP database replaced by the fixture."""
    data = yaml.safe_load(EXAMPLE.read_text())
    data["routing"]["geoip_db"] = geo_db
    path = tmp_path_factory.mktemp("cfg") / "multi.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run_cli(args: list[str], *, subprocess_: bool = False) -> subprocess.CompletedProcess:
    """``edgegw ARGS``: in this process (``main``), or as ``python -m gateway ARGS``."""
    if subprocess_:
        return subprocess.run([sys.executable, "-m", "gateway", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(args)
        except SystemExit as exc:  # argparse's own refusals
            code = exc.code
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def explain(
    config: Path, ip: str, body: dict | str, *headers: str, json_out: bool = True, tmp: Path, subprocess_: bool = False
) -> subprocess.CompletedProcess:
    body_path = tmp / "body.json"
    body_path.write_text(body if isinstance(body, str) else json.dumps(body))
    args = ["explain", "--config", str(config), "--ip", ip, "--body", str(body_path)]
    for h in headers:
        args += ["--header", h]
    if json_out:
        args.append("--json")
    return run_cli(args, subprocess_=subprocess_)


def decision(config: Path, ip: str, body: dict, *headers: str, tmp: Path) -> dict:
    result = explain(config, ip, body, *headers, tmp=tmp)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def chat(text: str = "hello", model: str = "auto", **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], **extra}


def test_json_has_the_documented_keys_and_the_target_of_an_eu_client(config, tmp_path):
    d = decision(config, PROXY, chat(model=CENTRAL), f"X-Forwarded-For: {FRANKFURT_IP}", tmp=tmp_path)
    for key in ("client_ip", "location", "region", "target", "fallbacks", "reasons", "budget_ms", "hedge_target"):
        assert key in d
    assert d["client_ip"] == FRANKFURT_IP
    assert d["location"]["city"] == "Frankfurt" and d["location"]["country"] == "DE"
    assert d["region"] == "eu-central"
    assert d["target"]["kind"] == "endpoint"
    assert d["target"]["cluster"] == "eu-central-central"
    assert d["target"]["endpoint"] in ("http://10.1.1.10:8000", "http://10.1.1.11:8000")
    assert d["fallbacks"], "other replicas / regions listed as fallbacks"
    assert d["reasons"][0] == f"{CENTRAL} is a central model"


def test_a_trusted_proxys_forwarded_for_is_honoured(config, tmp_path):
    # the chain's right-most untrusted hop is the client; trusted hops (10/8) are skipped
    d = decision(config, PROXY, chat(), f"X-Forwarded-For: {SAN_JOSE_IP}, {SINGAPORE_IP}, 10.0.0.9", tmp=tmp_path)
    assert d["client_ip"] == SINGAPORE_IP
    assert d["region"] == "ap-southeast"


def test_a_spoofed_forwarded_for_from_an_untrusted_peer_is_ignored(config, tmp_path):
    d = decision(config, SAN_JOSE_IP, chat(model=CENTRAL), f"X-Forwarded-For: {FRANKFURT_IP}", tmp=tmp_path)
    assert d["client_ip"] == SAN_JOSE_IP
    assert d["location"]["city"] == "San Jose"
    assert d["region"] == "us-west"
    assert d["target"]["cluster"] == "us-west-central"


def test_an_unknown_address_gets_the_default_region(config, tmp_path):
    d = decision(config, UNKNOWN_IP, chat(model=CENTRAL), tmp=tmp_path)
    assert d["client_ip"] == UNKNOWN_IP
    assert d["location"] is None
    assert d["region"] == "us-west"  # the example's default_region
    assert "location unknown -> default region us-west" in d["reasons"]


def test_the_embedded_database_places_a_european_address_in_eu_central(tmp_path):
    # the shipped config as is: geoip_db null -> the bundled DB-IP City Lite
    d = decision(EXAMPLE, PROXY, chat(model=CENTRAL), "X-Forwarded-For: 81.169.145.1", tmp=tmp_path)
    assert d["location"]["country"] == "DE"
    assert d["region"] == "eu-central"
    assert d["target"]["cluster"] == "eu-central-central"


def test_auto_short_prompt_stays_at_the_edge(config, tmp_path):
    d = decision(config, PROXY, chat("what is 2+2?"), f"X-Forwarded-For: {FRANKFURT_IP}", tmp=tmp_path)
    assert d["target"]["kind"] == "edge"
    assert d["model"] == EDGE_MODEL
    assert d["reasons"][0].startswith("auto: short simple request stays at the edge")
    # non-streaming auto at the edge carries the example's cascade threshold, central fallback first
    assert d["cascade_threshold"] == -1.2
    assert d["fallbacks"][0]["cluster"] == "eu-central-central"


@pytest.mark.parametrize(
    "body, why",
    [
        pytest.param(chat("word " * 2000), "prompt ~", id="long-prompt"),
        pytest.param(chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools requested", id="tools"),
        pytest.param(chat(max_tokens=4096), "max_tokens 4096 > edge limit 512", id="max-tokens"),
    ],
)
def test_auto_escalates_to_a_cluster_endpoint(config, tmp_path, body, why):
    d = decision(config, PROXY, body, f"X-Forwarded-For: {FRANKFURT_IP}", tmp=tmp_path)
    assert d["target"]["kind"] == "endpoint"
    assert d["target"]["cluster"] == "eu-central-central"
    assert d["model"] == CENTRAL
    assert d["reasons"][0].startswith("auto: escalate (") and why in d["reasons"][0]


def test_aliases_resolve_to_the_model_sent_upstream(config, tmp_path):
    d = decision(config, PROXY, chat(model="large"), f"X-Forwarded-For: {SAN_JOSE_IP}", tmp=tmp_path)
    # mixtral is served only in eu-central: a US client still goes there
    assert d["requested_model"] == "large" and d["model"] == "mixtral-8x22b-instruct"
    assert d["target"]["cluster"] == "eu-central-central"
    assert d["region"] == "us-west"
    fast = decision(config, PROXY, chat(model="fast"), tmp=tmp_path)
    assert fast["target"]["kind"] == "edge" and fast["model"] == EDGE_MODEL


def test_without_an_edge_engine_auto_goes_to_a_cluster(tmp_path, geo_db):
    data = yaml.safe_load(EXAMPLE.read_text())
    data["edge"] = {"enabled": False}
    data["routing"]["geoip_db"] = geo_db
    for region in data["routing"]["regions"]:
        region["edge"] = False
    del data["routing"]["aliases"]["fast"]
    path = tmp_path / "no-edge.yaml"
    path.write_text(yaml.safe_dump(data))
    d = decision(path, PROXY, chat("hi"), f"X-Forwarded-For: {FRANKFURT_IP}", tmp=tmp_path)
    assert d["target"]["kind"] == "endpoint"
    assert "no edge engine here" in d["reasons"][0]
    assert all(f["kind"] == "endpoint" for f in d["fallbacks"])


def test_human_readable_output_names_every_part(config, tmp_path):
    result = explain(config, PROXY, chat(), f"X-Forwarded-For: {FRANKFURT_IP}", json_out=False, tmp=tmp_path, subprocess_=True)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"client ip:  {FRANKFURT_IP}" in out
    assert "location:   Frankfurt, DE (50.11, 8.68)" in out
    assert "region:     eu-central" in out
    assert f"target:     edge (region us-west, model {EDGE_MODEL}" in out
    assert "fallbacks:\n  1. eu-central-central @ http://10.1.1.1" in out
    assert "hedge:      eu-central-central@" in out
    assert "cascade:    escalate if the edge answer's mean logprob < -1.2" in out
    assert "budget:     2000 ms" in out
    assert "reasons:\n  - auto: short simple request stays at the edge" in out
    assert "x-edgegw-route: target=edge;" in out


def test_the_budget_header_is_read(config, tmp_path):
    d = decision(config, PROXY, chat(model=CENTRAL), f"X-Forwarded-For: {FRANKFURT_IP}", "X-Latency-Budget-Ms: 300", tmp=tmp_path)
    assert d["budget_ms"] == 300
    assert d["hedge_after_ms"] == 150  # the example's budget_fraction 0.5


@pytest.mark.parametrize(
    "case",
    ["unknown-model", "not-json", "missing-body", "bad-header", "bad-config", "bad-geoip-db"],
)
def test_errors_are_reported_on_stderr_with_a_non_zero_exit(config, tmp_path, case):
    cfg, body, headers = config, chat(), []
    if case == "unknown-model":
        body = chat(model="gpt-17")
    elif case == "not-json":
        body = "{not json"
    elif case == "bad-header":
        headers = ["no colon here"]
    elif case == "bad-config":
        cfg = tmp_path / "bad.yaml"
        cfg.write_text("routing:\n  regions:\n    - {name: x, lat: 91, lon: 0}\n")
    elif case == "bad-geoip-db":
        cfg = tmp_path / "geo.yaml"
        cfg.write_text(yaml.safe_dump({"routing": {"geoip_db": str(tmp_path / "nowhere.mmdb")}}))
    if case == "missing-body":
        result = run_cli(["explain", "--config", str(cfg), "--ip", PROXY, "--body", str(tmp_path / "none.json")])
    else:
        result = explain(cfg, PROXY, body, *headers, tmp=tmp_path)
    assert result.returncode != 0
    assert result.stdout == ""
    expected = {
        "unknown-model": "UnknownModel",
        "not-json": "not valid JSON",
        "missing-body": "cannot read",
        "bad-header": "expected 'Name: value'",
        "bad-config": "routing.regions.0.lat",
        "bad-geoip-db": "nowhere.mmdb",
    }[case]
    assert result.stderr.startswith("error:") and expected in result.stderr, result.stderr
