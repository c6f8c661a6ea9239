"""admission/: everything between a request's arrival and the pipeline.

Owns: CORS (``cors.py``: preflights answered before anything else, the headers on every
answer to an allowed origin), the request id, draining, the body limits, tenants and their keys
(``tenants.py``), the rate limits (``ratelimit.py``), the monthly token quotas
(``quota.py``), who may reach the admin paths (``admin.py``), the headers that go upstream
(``forwarding.py``), the request's ``Deadline``, and ``AdmissionApp``: one middleware for
HTTP requests and WebSockets (``gate.py``).

May import: ``gateway.core``, ``gateway.observe``, ``routing``, ``cache`` (its Redis circuit).
Nothing of the pipeline, the relay or the handlers: it wraps a handler it is given.
"""

from gateway.admission.cors import CORSMiddleware
from gateway.admission.forwarding import NEVER_FORWARDED, HeaderPolicy
from gateway.admission.admin import AdminGuard, AdminKeys, is_admin_path
from gateway.admission.gate import SOCKET, AdmissionApp, Gate, Generation, Socket, read_body, request_id_of
from gateway.admission.ratelimit import Quota, RateLimiter
from gateway.admission.tenants import Tenants, api_key_of

__all__ = [
    "CORSMiddleware",
    "NEVER_FORWARDED",
    "SOCKET",
    "AdminGuard",
    "AdminKeys",
    "AdmissionApp",
    "Gate",
    "Generation",
    "HeaderPolicy",
    "Quota",
    "RateLimiter",
    "Socket",
    "Tenants",
    "api_key_of",
    "is_admin_path",
    "read_body",
    "request_id_of",
]
