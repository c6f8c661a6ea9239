"""``slo`` (objectives and the burn rates that page) and ``tracing`` (OpenTelemetry over
OTLP/HTTP, with the standard environment variables)."""

from __future__ import annotations

import os
import warnings
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from gateway.core.settings_base import ConfigModel, seconds
from gateway.core.settings_tenants import Priority

__all__ = ["BurnWindowSettings", "ObjectiveSettings", "SLOSettings", "TracingSettings"]


class ObjectiveSettings(ConfigModel):
    name: str = Field(min_length=1)  # shown in metrics
    metric: Literal["ttft", "tpot", "e2e", "availability"]  # what is measured
    threshold_ms: float | None = Field(None, gt=0)  # a request is good at or under it (not for availability)
    target: float = Field(gt=0, lt=1)  # the share of good requests promised, e.g. 0.99
    priority: Priority | None = None  # only requests of this priority class
    tenant: str | None = None  # only this tenant's requests
    model: str | None = None  # only requests for this model (as asked)
    target_kind: Literal["edge", "endpoint", "cache"] | None = None  # only requests served there

    @model_validator(mode="after")
    def _threshold(self) -> ObjectiveSettings:
        if (self.metric == "availability") != (self.threshold_ms is None):
            raise ValueError("threshold_ms is required for ttft, tpot and e2e, and meaningless for availability")
        return self


class BurnWindowSettings(ConfigModel):
    long: float  # the long window, e.g. 1h
    short: float  # the short window, e.g. 5m
    burn: float = Field(gt=0)  # alert while both windows burn the error budget this many times too fast

    @field_validator("long", "short", mode="before")
    @classmethod
    def _duration(cls, value) -> float:
        return seconds(value)


class SLOSettings(ConfigModel):
    objectives: tuple[ObjectiveSettings, ...] = ()  # none by default
    # the multiwindow, multi-burn-rate pairs of the SRE workbook
    windows: tuple[BurnWindowSettings, ...] = (
        BurnWindowSettings(long=3600, short=300, burn=14.4),
        BurnWindowSettings(long=21600, short=1800, burn=6),
    )
    redis_url: str | None = None  # count across replicas in this Redis (null: this process alone)
    namespace: str = Field("edgegw", min_length=1)  # Redis key prefix


class TracingSettings(ConfigModel):
    """OpenTelemetry traces over OTLP/HTTP. The standard environment variables win over the
    keys here: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_ENDPOINT`` +
    ``/v1/traces``), ``OTEL_SERVICE_NAME``, ``OTEL_TRACES_SAMPLER`` / ``_ARG``."""

    otlp_url: str | None = None  # OTLP/HTTP traces URL, e.g. http://collector:4318/v1/traces (null: no traces)
    service_name: str = "edgegw"  # the service.name resource attribute
    sample_ratio: float = Field(1.0, ge=0, le=1)  # share of new traces recorded (a sampled parent is followed)

    @model_validator(mode="before")
    @classmethod
    def _old_name(cls, data: Any) -> Any:
        """``tracing.endpoint`` (the key's first name) still works, with a warning: in this
        project an endpoint is an upstream server."""
        if isinstance(data, dict) and "endpoint" in data:
            warnings.warn("tracing.endpoint is deprecated: use tracing.otlp_url", FutureWarning, stacklevel=2)
            data = dict(data)
            value = data.pop("endpoint")
            data.setdefault("otlp_url", value)
        return data

    @model_validator(mode="after")
    def _environment(self) -> TracingSettings:
        env = os.environ
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        if not endpoint and env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            endpoint = env["OTEL_EXPORTER_OTLP_ENDPOINT"].rstrip("/") + "/v1/traces"
        ratio = self.sample_ratio
        sampler = env.get("OTEL_TRACES_SAMPLER", "")
        if sampler in ("always_off", "parentbased_always_off"):
            ratio = 0.0
        elif sampler in ("always_on", "parentbased_always_on"):
            ratio = 1.0
        elif sampler in ("traceidratio", "parentbased_traceidratio"):
            try:
                ratio = min(1.0, max(0.0, float(env.get("OTEL_TRACES_SAMPLER_ARG", "1"))))
            except ValueError:
                raise ValueError("OTEL_TRACES_SAMPLER_ARG must be a number in [0, 1]") from None
        changes = {"sample_ratio": ratio}
        if endpoint:
            changes["otlp_url"] = endpoint
        if env.get("OTEL_SERVICE_NAME"):
            changes["service_name"] = env["OTEL_SERVICE_NAME"]
        for key, value in changes.items():
            object.__setattr__(self, key, value)  # frozen: the environment is part of the value
        return self
