"""LiteLLM as a client of an edgegw, in a process of its own (LiteLLM keeps clients, event
loops and sockets that outlive its calls, and its modules make pydantic warn as they load):

    python litellm_client.py BASE_URL MODEL

asks a whole answer (twice: llama.cpp's greedy text depends on what it was asked last), a
stream, two async requests at once and a prompt over the server's context, and prints what
it saw as one JSON object (tests/realworld/test_client_litellm.py checks it).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import warnings

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of its price list
warnings.simplefilter("ignore")
import litellm  # noqa: E402


def main(base: str, model: str) -> dict:
    options = {"model": f"openai/{model}", "api_base": base, "api_key": "unused", "num_retries": 0, "timeout": 120}
    ask = {**options, "messages": [{"role": "user", "content": "Name a colour."}], "temperature": 0, "max_tokens": 6}
    seen: dict = {}
    litellm.completion(**ask)
    whole = litellm.completion(**ask)
    seen["whole"] = {"text": whole.choices[0].message.content, "completion_tokens": whole.usage.completion_tokens}
    pieces = [c.choices[0].delta.content or "" for c in litellm.completion(**ask, stream=True) if c.choices]
    seen["stream"] = "".join(pieces)

    async def both():
        return await asyncio.gather(*(
            litellm.acompletion(**options, messages=[{"role": "user", "content": f"Name a {topic}."}], max_tokens=4)
            for topic in ("colour", "fruit")
        ))  # fmt: skip

    seen["async"] = [a.choices[0].message.content for a in asyncio.run(both())]
    try:
        litellm.completion(**options, messages=[{"role": "user", "content": "word " * 700}], max_tokens=2)
        seen["refused"] = None
    except Exception as exc:  # noqa: BLE001 - which class LiteLLM raises is what is checked
        seen["refused"] = {"class": type(exc).__name__, "status": getattr(exc, "status_code", None), "message": str(exc)}
    return seen


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
