"""handlers/: the ASGI apps serving the gateway's paths.

Owns: the completion handlers (``completions.py``: ``POST /v1/chat/completions`` and
``/v1/completions``), the WebSocket handler's per-message loop (``websocket.py``), and the
small GETs (``small.py``: models, health, readiness, metrics, JSON views), and the admin API
(``admin.py``: reload, usage). Each sequences
the rooms below it: an admitted request, the pipeline's answer, the relay's writer.

May import: ``gateway.admission``, ``gateway.pipeline``, ``gateway.relay``,
``gateway.replies``, ``gateway.observe``, ``gateway.core``.
"""

from gateway.handlers.admin import ReloadApp, UsageApp
from gateway.handlers.completions import CompletionsApp
from gateway.handlers.small import HealthzApp, JSONApp, MetricsApp, ModelsApp, ReadyzApp
from gateway.handlers.websocket import WebSocketApp

__all__ = ["CompletionsApp", "HealthzApp", "JSONApp", "MetricsApp", "ModelsApp", "ReadyzApp", "ReloadApp", "UsageApp", "WebSocketApp"]
