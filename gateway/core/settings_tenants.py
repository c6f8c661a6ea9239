"""``auth``, ``tenants``, ``rate_limits`` and ``admission``: who may ask, how much, how
urgently, and what waits or is turned away in front of a target."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, SecretStr, field_validator

from gateway.core.settings_base import ConfigModel, readable_file

__all__ = [
    "AdmissionSettings",
    "KeySettings",
    "TokenQuotaSettings",
    "AuthSettings",
    "Priority",
    "RateLimitSettings",
    "TenantPolicy",
    "TenantSettings",
]


Priority = Literal["interactive", "standard", "batch"]


class TokenQuotaSettings(ConfigModel):
    monthly_tokens: int | None = Field(None, ge=1)  # prompt + completion tokens per calendar month (UTC); beyond: 429 insufficient_quota (null: none)


class TenantPolicy(ConfigModel):
    """What a tenant may do and how its requests are treated."""

    priority: Priority = "standard"  # interactive | standard | batch: the order of a contended target
    weight: float = Field(1.0, gt=0)  # share of a contended target, within its priority
    budget_ms: float | None = Field(None, gt=0)  # TTFT budget without x-latency-budget-ms (null: routing's default)
    requests_per_minute: int | None = Field(None, ge=1)  # null: no limit
    tokens_per_minute: int | None = Field(None, ge=1)  # prompt + completion tokens; null: no limit
    max_concurrency: int | None = Field(None, ge=1)  # requests in flight at once; null: no limit
    models: tuple[str, ...] = ()  # models (or aliases) it may ask for; empty: every model
    quota: TokenQuotaSettings = TokenQuotaSettings()  # token quotas counted by usage (gateway/admission/quota.py)


class KeySettings(ConfigModel):
    """Where a set of keys comes from (a tenant's API keys, the admin keys)."""

    keys: tuple[SecretStr, ...] = ()  # keys: plain, or "sha256:<hex of the key's sha256>"
    keys_env: str | None = None  # also: a comma-separated list in this environment variable
    keys_file: str | None = None  # also: a file of keys, one per line or comma-separated (a mounted Secret; read again on reload)

    @field_validator("keys_file")
    @classmethod
    def _keys_file_exists(cls, value: str | None) -> str | None:
        return None if value is None else readable_file(value)

    @field_validator("keys")
    @classmethod
    def _check_digests(cls, keys: tuple[SecretStr, ...]) -> tuple[SecretStr, ...]:
        for key in keys:
            value = key.get_secret_value()
            if value.startswith("sha256:") and not re.fullmatch(r"sha256:[0-9a-fA-F]{64}", value):
                raise ValueError("a sha256: key must be followed by 64 hex digits")
        return keys


class TenantSettings(TenantPolicy, KeySettings):
    name: str = Field(min_length=1)  # shown in metrics and logs (never a key)


class AuthSettings(ConfigModel):
    mode: Literal["off", "optional", "required"] = "off"  # required: 401 without a known key; optional: keyless is anonymous
    anonymous: TenantPolicy = TenantPolicy()  # how requests without a (known) key are treated


class RateLimitSettings(ConfigModel):
    backend: Literal["memory", "redis"] = "memory"  # redis: shared by every replica (one atomic script per check)
    redis_url: str = "redis://127.0.0.1:6379/0"  # for backend: redis
    timeout_s: float = Field(0.05, gt=0)  # per Redis call; slower counts as Redis being down
    cooldown_s: float = Field(5.0, ge=0)  # Redis is skipped this long after an error
    fail_closed: bool = False  # Redis down: refuse (503) instead of admitting
    namespace: str = Field("edgegw", min_length=1)  # Redis key prefix
    default_output_tokens: int = Field(256, ge=0)  # completion tokens assumed at admission without max_tokens


class AdmissionSettings(ConfigModel):
    predict: bool = True  # answer at once (degrade, 429 or 503 + Retry-After) what no target can start within its budget
    ageing_s: float = Field(10.0, gt=0)  # a waiting request moves up one priority class per this many seconds
    max_queue: int = Field(1024, ge=0)  # requests waiting per target before 503
