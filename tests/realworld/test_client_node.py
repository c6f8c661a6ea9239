"""The official ``openai`` npm package under node as a client of edgegw in front of llama.cpp's
server (tests/clients/node: package.json and its lock file; ``npm ci`` in the Makefile's test
set-up). The node script asks; this test checks what it saw."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from tests.realworld.servers import MODEL

NODE_CLIENT = Path(__file__).resolve().parent.parent / "clients" / "node"


def test_the_npm_sdk_through_the_gateway(llama_target):
    node = shutil.which("node")
    assert node, "node is needed (Debian's nodejs)"
    assert (NODE_CLIENT / "node_modules" / "openai").is_dir(), "run `make test` (npm ci --prefix tests/clients/node)"
    done = subprocess.run(
        [node, "client.mjs", llama_target.base, MODEL], cwd=NODE_CLIENT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["whole"]["text"] and seen["whole"]["usage"]["completion_tokens"] <= 6
    assert seen["stream"]["text"] and seen["stream"]["finish"] in ("length", "stop")
    assert MODEL in seen["models"]
    raw = seen["raw"]
    assert raw["status"] == 200 and raw["text"] and "target=" in raw["route"] and "total;dur=" in raw["serverTiming"]
    assert len(raw["requestId"]) == 32
    # a prompt over the server's context: an APIError with the server's status and message
    refused = seen["refused"]
    assert refused["isAPIError"] and refused["status"] == 400 and refused["code"] == "context_length_exceeded"
    # the same as a stream, which llama.cpp's server answers with 200 and no event: the SDK
    # raises on the gateway's error event instead of ending with nothing
    assert seen["emptyStream"]["raised"] and seen["emptyStream"]["isAPIError"], seen["emptyStream"]
