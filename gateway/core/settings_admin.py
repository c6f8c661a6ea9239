"""``admin``, ``reload`` and ``usage``: who may use the admin paths, how the configuration is
read again while serving, and how tokens are counted per tenant."""

from __future__ import annotations

from pydantic import Field

from gateway.core.settings_base import ConfigModel
from gateway.core.settings_tenants import KeySettings

__all__ = ["AdminSettings", "ReloadSettings", "UsageSettings"]


class AdminSettings(KeySettings):
    """Who may use the admin paths (/metrics, /debug/latency, /dashboard, /admin/*): these keys."""


class ReloadSettings(ConfigModel):
    watch: bool = True  # re-read the configuration when its file (or a keys_file) changes, as a mounted ConfigMap does
    interval_s: float = Field(1.0, gt=0)  # how often the files are looked at (one stat() each)


class UsageSettings(ConfigModel):
    enabled: bool = True  # count tokens per tenant, model and target (streams are asked for their usage chunk)
    redis_url: str | None = None  # per-hour counts shared by every replica in this Redis (null: this process's memory)
    namespace: str = Field("edgegw", min_length=1)  # Redis key prefix
    flush_interval_s: float = Field(1.0, gt=0)  # counts are sent to Redis in one batch this often
    retention_days: int = Field(400, ge=1)  # hourly counts are kept this long
    timeout_s: float = Field(0.5, gt=0)  # per Redis call; slower counts as Redis being down (the counts wait for the next flush)
