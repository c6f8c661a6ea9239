"""``admin``, ``reload`` and ``usage``: who may use the admin paths, how the configuration is
read again while serving, and how tokens are counted per tenant."""

from __future__ import annotations

from pydantic import Field, SecretStr, field_validator

from gateway.core.settings_base import ConfigModel, readable_file
from gateway.core.settings_tenants import checked_digests

__all__ = ["AdminSettings", "ReloadSettings", "UsageSettings"]


class AdminSettings(ConfigModel):
    """Who may use the admin paths (/metrics, /debug/latency, /dashboard, /admin/*)."""

    keys: tuple[SecretStr, ...] = ()  # admin keys: plain, or "sha256:<hex of the key's sha256>"
    keys_env: str | None = None  # also: a comma-separated list in this environment variable
    keys_file: str | None = None  # also: a file of keys, one per line or comma-separated (a mounted Secret; read again on reload)

    @field_validator("keys_file")
    @classmethod
    def _keys_file_exists(cls, value: str | None) -> str | None:
        return None if value is None else readable_file(value)

    @field_validator("keys")
    @classmethod
    def _check_digests(cls, keys: tuple[SecretStr, ...]) -> tuple[SecretStr, ...]:
        return checked_digests(keys)


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
