"""WebSockets that drain like streams: uvicorn's WebSocket protocol, except at shutdown.

uvicorn answers a graceful shutdown by closing every open WebSocket at once (1012),
cutting an answer in the middle, where HTTP streams are let finish. Here an open socket is
left to the app, which finishes the answer under way and then closes with 1001 (or, when
the drain time runs out, sends an error message first: ``gateway.handlers.websocket``); a
handshake still in progress is refused as before.
"""

from __future__ import annotations

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

__all__ = ["DrainingWebSocketProtocol"]


class DrainingWebSocketProtocol(WebSocketsSansIOProtocol):
    def shutdown(self) -> None:
        if not self.handshake_complete or self.close_sent:
            super().shutdown()
        # else: the app closes it once its answer is done; the server waits for it
