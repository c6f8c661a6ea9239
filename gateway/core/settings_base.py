"""What every settings module is made of: the strict, frozen model (an unknown key is an
error, a value never changes once read), the error a bad file raises, and two small value
checks (a readable file, a duration)."""

from __future__ import annotations

import os
import re

from pydantic import BaseModel, ConfigDict

__all__ = ["ConfigError", "ConfigModel", "readable_file", "seconds"]


class ConfigError(Exception):
    """A configuration file that cannot be used; the message names the key and line."""


class ConfigModel(BaseModel):
    """A settings section: unknown keys are errors, values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def readable_file(value: str) -> str:
    if not os.path.isfile(value):
        raise ValueError(f"{value!r} is not a readable file")
    return value


def seconds(value: str | float) -> float:
    """``90``, ``"90s"``, ``"5m"``, ``"1h"``, ``"7d"`` -> seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", str(value))
    if match is None:
        raise ValueError(f"not a duration: {value!r} (e.g. 90s, 5m, 1h)")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]
