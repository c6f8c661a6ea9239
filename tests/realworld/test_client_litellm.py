"""LiteLLM (pinned in the ``dev`` extra) as a client of edgegw in front of llama.cpp's server:
its ``completion`` and ``acompletion`` with an ``openai/`` model and ``api_base``, whole and
streamed, and an error raised as LiteLLM's own exception class. It runs in a process of its
own (tests/clients/python/litellm_client.py): LiteLLM leaves clients and event loops open
after its calls, which this suite's warnings-as-errors would blame on the test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.realworld.servers import MODEL

SCRIPT = Path(__file__).resolve().parent.parent / "clients" / "python" / "litellm_client.py"


def test_litellm_through_the_gateway(llama_target):
    done = subprocess.run([sys.executable, str(SCRIPT), llama_target.base, MODEL], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["whole"]["text"] and seen["whole"]["completion_tokens"] <= 6
    assert seen["stream"] == seen["whole"]["text"]
    assert all(seen["async"]) and len(seen["async"]) == 2
    # the server's 400 context_length_exceeded, relayed by the gateway, as LiteLLM's own class
    refused = seen["refused"]
    assert refused["class"] == "ContextWindowExceededError" and refused["status"] == 400, refused
