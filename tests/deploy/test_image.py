"""The container image, built and run with podman as a user would: `podman build`, `podman run
-p 127.0.0.1:PORT:8000`, curl, `podman stop`.

What it shows: the image's configuration and entrypoint; torch's CPU build; the engine's
kernels compiled at build time and loaded in the image without a compiler; a chat
completion answered by the edge model through a published port; /metrics; the HEALTHCHECK;
tenant keys from the environment; SIGTERM draining an in-flight stream before the container
exits 0 within its stop timeout.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import httpx
import pytest
import yaml

from tests.deploy.conftest import ROOT, free_port, run, unique, wait_ready

KEY = "sk-container-test-1"  # a test key, passed to the container in an environment variable


def test_image_config(podman, image):
    inspected = json.loads(run(podman, "image", "inspect", image).stdout)[0]
    config = inspected["Config"]
    assert config["User"] == "10001:10001"  # not root
    assert config["Entrypoint"] == ["/usr/bin/tini", "--", "edgegw", "serve", "--config", "/etc/edgegw/config.yaml"]
    assert "8000/tcp" in config["ExposedPorts"]
    health = inspected["Healthcheck"]["Test"]  # podman's inspect: beside Config (docker format images)
    assert health[0] == "CMD" and "http://127.0.0.1:8000/healthz" in " ".join(health)
    # the image's own configuration is valid and listens where the image says it does
    out = run(podman, "run", "--rm", "--entrypoint", "edgegw", image, "check-config", "/etc/edgegw/config.yaml")
    assert "ok" in out.stdout
    built_in = yaml.safe_load((ROOT / "deploy" / "container" / "config.yaml").read_text())
    assert built_in["listen"]["host"] == "0.0.0.0" and built_in["listen"]["port"] == 8000
    assert built_in["edge"]["enabled"] is True


def test_torch_is_the_cpu_build_and_kernels_load_without_a_compiler(podman, image):
    probe = (
        "import shutil, torch, edge_engine.kernels as k\n"
        "print(torch.__version__, torch.version.cuda)\n"
        "print('compiler', shutil.which('g++') or shutil.which('c++') or shutil.which('cc'))\n"
        "print('kernels', k.available(), k.build_directory())\n"
    )
    out = run(podman, "run", "--rm", "--entrypoint", "python", image, "-c", probe).stdout.splitlines()
    version, cuda = out[0].split()
    assert version.endswith("+cpu") and cuda == "None", out[0]
    assert out[1] == "compiler None"  # the runtime stage has no compiler: nothing can compile at start
    assert out[2].startswith("kernels True /opt/edgegw/torch_extensions/"), out[2]


@pytest.fixture
def container(podman, image, tmp_path: Path):
    """The image running with a published port on 127.0.0.1. Its configuration is the image's
    own (deploy/container/config.yaml) with two changes: a tenant whose keys come from the
    environment (keys_env), and a drain time long enough that the drain test never depends on
    this machine's speed."""
    config = yaml.safe_load((ROOT / "deploy" / "container" / "config.yaml").read_text())
    config["limits"]["drain_timeout_s"] = 600
    config["auth"] = {"mode": "required"}
    config["tenants"] = [{"name": "ci", "keys_env": "EDGEGW_KEYS_CI"}]
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o644)
    tmp_path.chmod(0o755)
    name, port = unique("edgegw-test"), free_port()
    run(
        podman, "run", "--detach", "--name", name,
        "--publish", f"127.0.0.1:{port}:8000",
        "--env", f"EDGEGW_KEYS_CI={KEY}",
        "--volume", f"{path}:/etc/edgegw/config.yaml:ro",
        image,
    )

    def alive() -> str | None:
        state = run(podman, "inspect", "--format", "{{.State.Status}}", name).stdout.strip()
        if state != "running":
            logs = run(podman, "logs", name, check=False)
            return f"container {name} is {state}:\n{(logs.stdout + logs.stderr)[-4000:]}"
        return None

    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, alive)
        yield name, base
    finally:
        run(podman, "rm", "--force", "--time", "0", name, check=False)


def curl(*args: str) -> tuple[int, str]:
    out = run("curl", "--silent", "--show-error", "--max-time", "600", "--write-out", "\n%{http_code}", *args).stdout
    body, _, status = out.rpartition("\n")
    return int(status), body


def test_serves_the_edge_model_metrics_health_and_drains(podman, container):
    name, base = container
    chat = json.dumps({
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 24,
        "temperature": 0,
    })
    url = f"{base}/v1/chat/completions"
    status, body = curl(url, "-H", "content-type: application/json", "--data", chat)
    assert status == 401, body  # auth required, and no key
    assert json.loads(body)["error"]["type"]
    status, body = curl(url, "-H", "content-type: application/json", "-H", "authorization: Bearer sk-wrong", "--data", chat)
    assert status == 401, body
    status, body = curl(url, "-H", "content-type: application/json", "-H", f"authorization: Bearer {KEY}", "--data", chat)
    assert status == 200, body
    answer = json.loads(body)
    assert answer["model"] == "smollm2-135m-instruct"
    assert "Paris" in answer["choices"][0]["message"]["content"]  # the greedy answer of SmolLM2-135M-Instruct

    status, metrics = curl(f"{base}/metrics")
    assert status == 200
    assert 'edgegw_requests_total{api="chat",status="200",tenant="ci"} 1.0' in metrics
    assert re.search(r'^edgegw_requests_total\{api="chat",status="401",tenant="[^"]*"\} 2\.0$', metrics, re.M), metrics
    assert KEY not in metrics

    # the image's HEALTHCHECK, run by podman inside the container
    assert run(podman, "healthcheck", "run", name, check=False).returncode == 0

    # SIGTERM with a stream in flight: the stream finishes, the container exits 0
    stream_body = {
        "model": "smollm2-135m-instruct",
        # long enough to be still under way when the SIGTERM lands: `podman stop` itself takes
        # a second to start, in which the engine of a fast CPU writes a hundred tokens
        "messages": [{"role": "user", "content": "Count from 1 to 400, one number per line."}],
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }
    stopped: dict[str, object] = {}

    def stop() -> None:
        stopped["result"] = run(podman, "stop", "--time", "700", name, check=False)

    events: list[str] = []
    stopper = threading.Thread(target=stop)
    headers = {"authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=httpx.Timeout(600.0)) as client:
        with client.stream("POST", url, json=stream_body, headers=headers) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 2 and not stopper.is_alive():
                    stopper.start()  # the stream is under way: SIGTERM now
    stopper.join(timeout=900)
    assert not stopper.is_alive()
    assert stopped["result"].returncode == 0, stopped["result"].stderr
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), chunks[-1]
    assert any(choice.get("finish_reason") for c in chunks for choice in c.get("choices", []))
    text = "".join(choice["delta"].get("content") or "" for c in chunks for choice in c.get("choices", []))
    assert "1" in text and "2" in text

    state = json.loads(run(podman, "inspect", name).stdout)[0]["State"]
    assert state["ExitCode"] == 0  # drained and exited, not killed (137) at the stop timeout
    logs = run(podman, "logs", name)
    log = logs.stdout + logs.stderr
    shutting = log.index("Shutting down")
    waiting = log.index("Waiting for connections to close", shutting)  # the stream held the drain open
    assert log.index("Finished server process", waiting)
    assert KEY not in log
