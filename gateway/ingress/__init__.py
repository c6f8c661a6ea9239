"""The gateway's listeners: uvicorn's HTTP/1.1 one hardened, and beside it HTTPS (HTTP/1.1 +
HTTP/2 by ALPN) and HTTP/3.

The plain listener (and HTTP/1.1 over TLS) runs ``http1.py``'s ``H1Protocol``: uvicorn's
httptools protocol with a header timeout, header count and size limits, and JSON answers
for what the parser refuses.

For gateway-to-gateway traffic (an edge edgegw talking to a central one), where TLS is
needed and HTTP/2 or HTTP/3 multiplexing pays. Each serves any ASGI app, keeps
backpressure (a slow client blocks the app's ``send``) and cancellation (a client that
resets its stream is an ``http.disconnect``):

- ``asgi.py``: one request stream as the app sees it (shared by HTTP/2 and HTTP/3);
- ``h2.py``: HTTP/2 on h2; ``h3.py``: an HTTP/3 connection on aioquic, ``h3_listener.py``
  the UDP listener that routes datagrams to them (and its session tickets);
- ``guard.py``: what one connection may cost (``FloodGuard``: resets, PINGs, SETTINGS,
  empty and control frames per interval) and the answers every listener gives of its own
  (header limits, 431, 503 ``too_many_connections``);
- ``server.py``: ``Server``, ``uvicorn.Server`` plus ``listen.tls`` and ``listen.http3``,
  and the ``Alt-Svc`` advertisement; ``limits.max_connections`` counts the connections of
  every listener together.

The gateway is one event loop per worker, so every listener bounds the work one
connection's bytes may do per loop turn (HTTP/2: ``limits.max_frames_per_turn``; HTTP/3:
datagrams per client address; HTTP/1.1: uvicorn reads one request at a time): a flood on
one port must not freeze the others.
"""

from gateway.ingress.asgi import RequestStream
from gateway.ingress.h2 import H2ServerProtocol
from gateway.ingress.h3_listener import H3Listener, TicketStore, serve_http3
from gateway.ingress.http1 import H1Protocol
from gateway.ingress.server import AltSvcApp, Server, tls_context
from gateway.ingress.websocket import DrainingWebSocketProtocol

__all__ = [
    "AltSvcApp",
    "DrainingWebSocketProtocol",
    "H1Protocol",
    "H2ServerProtocol",
    "H3Listener",
    "RequestStream",
    "Server",
    "TicketStore",
    "serve_http3",
    "tls_context",
]
