"""admission/: everything between a request's arrival and the pipeline.

Owns: CORS (``cors.py``: preflights answered before anything else, the headers on every
answer to an allowed origin), the request id, draining, the body limits, tenants and their keys
(``tenants.py``), the rate limits (``ratelimit.py``), the headers that go upstream
(``forwarding.py``), the request's ``Deadline``, and ``AdmissionApp``: one middleware for
HTTP requests and WebSockets (``gate.py``).

May import: ``gateway.core``, ``gateway.observe``, ``routing``, ``cache`` (its Redis circuit).
Nothing of the pipeline, the relay or the handlers: it wraps a handler it is given.
"""

from gateway.admission.cors import CORSMiddleware
from gateway.admission.forwarding import NEVER_FORWARDED, HeaderPolicy
from gateway.admission.gate import SOCKET, AdmissionApp, Gate, Socket, read_body, request_id_of
from gateway.admission.ratelimit import Quota, RateLimiter
from gateway.admission.tenants import Tenants, api_key_of

__all__ = [
    "CORSMiddleware",
    "NEVER_FORWARDED",
    "SOCKET",
    "AdmissionApp",
    "Gate",
    "HeaderPolicy",
    "Quota",
    "RateLimiter",
    "Socket",
    "Tenants",
    "api_key_of",
    "read_body",
    "request_id_of",
]
