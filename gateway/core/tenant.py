"""A tenant at run time: whoever an API key names, its policy and its requests in flight.

Made by admission (``gateway.admission.tenants.Tenants`` from the configuration), carried
by the request, read by the fair queue (its class and weight), the rate limiter and the
metrics (its name: never a key).
"""

from __future__ import annotations

from gateway.core.errors import PermissionDenied
from gateway.core.settings import TenantPolicy

__all__ = ["PRIORITY_CLASSES", "Tenant"]

PRIORITY_CLASSES = {"interactive": 0, "standard": 1, "batch": 2}  # lower is served first


class Tenant:
    """A tenant at run time: its policy, and how many of its requests are in flight."""

    __slots__ = ("name", "policy", "priority", "rank", "weight", "in_flight")

    def __init__(self, name: str, policy: TenantPolicy) -> None:
        self.name = name
        self.in_flight = 0
        self.update(policy)

    def update(self, policy: TenantPolicy) -> None:
        """A new policy (a configuration reload); its requests in flight stay counted."""
        self.policy = policy
        self.priority = policy.priority
        self.rank = PRIORITY_CLASSES[policy.priority]
        self.weight = policy.weight

    def check_model(self, model: str) -> None:
        """Raise ``PermissionDenied`` (403) for a model this tenant may not use."""
        models = self.policy.models
        if models and model not in models:
            raise PermissionDenied(f"this API key may not use the model '{model}'", param="model", code="model_not_allowed")

    def __repr__(self) -> str:
        return f"<Tenant {self.name} {self.priority} in_flight={self.in_flight}>"
