"""replies/: what answers a request, whatever produced it: the ``Reply`` contract, every kind
of reply, and the ``Answer`` the pipeline hands the relay (``base.py`` says more).

May import: ``gateway.upstream`` (an upstream reply reads a pool's response),
``gateway.core``, ``cache`` (single-flight), ``edge_engine.errors`` (the engine's error table).
"""

from gateway.replies.base import JSON, SSE, Answer, HealthSink, Paced, Recording, Reply, SlotHolder
from gateway.replies.cached import FollowerReply, ReplayReply
from gateway.replies.engine import (
    ENGINE_ERRORS,
    STAGES_HEADER,
    EngineReply,
    EngineStreamReply,
    engine_error,
    engine_error_of,
)
from gateway.replies.hedged import HedgedReply
from gateway.replies.upstream import UpstreamReply

__all__ = [
    "ENGINE_ERRORS",
    "JSON",
    "SSE",
    "STAGES_HEADER",
    "Answer",
    "EngineReply",
    "EngineStreamReply",
    "FollowerReply",
    "HealthSink",
    "HedgedReply",
    "Paced",
    "Recording",
    "ReplayReply",
    "Reply",
    "SlotHolder",
    "UpstreamReply",
    "engine_error",
    "engine_error_of",
]
