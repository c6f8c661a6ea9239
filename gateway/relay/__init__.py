"""relay/: moving an answer from its ``Reply`` to the client.

Owns: the writers (``respond.py``: JSON, SSE with keep-alives and error events, WebSocket
messages; the send timeout), the event pipeline every transport shares (``meter.py``:
TTFT, gaps, usage, the cache's recorder, the reply's first token and end) and the splice
(``splice.py``: events from the upstream's read callback straight to the client's socket).
The framing itself is ``gateway.core.sse``.

May import: ``gateway.replies`` (the ``Answer`` and ``Reply`` it relays), ``gateway.observe``,
``gateway.core``, ``cache``.
"""

from gateway.relay.meter import Meter, measured, usage_tokens
from gateway.relay.respond import KeepAlive, Stall, fail_sse, open_sse, openai_error, respond_json, respond_sse, respond_websocket
from gateway.relay.splice import Splice

__all__ = [
    "KeepAlive",
    "Meter",
    "Splice",
    "Stall",
    "fail_sse",
    "measured",
    "open_sse",
    "openai_error",
    "respond_json",
    "respond_sse",
    "respond_websocket",
    "usage_tokens",
]
