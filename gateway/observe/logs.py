"""No credential in any log line: a filter every handler gets (``redact_logs``)."""

from __future__ import annotations

import logging
import re

__all__ = ["RedactSecrets", "redact_logs"]

_SECRET = re.compile(
    r"(?i)((?:proxy-)?authorization|x-api-key|api-key|cookie|set-cookie)(['\"]?\s*[:=,]\s*['\"]?(?:b['\"])?)[^\r\n'\"]*"
)
_BEARER = re.compile(r"(?i)\b(bearer\s+)[^\s'\"]+")


class RedactSecrets(logging.Filter):
    """Takes credentials out of a log record, whoever wrote it: the values of
    ``Authorization``, ``X-Api-Key``, ``Api-Key`` and cookie headers, and bearer tokens
    (uvicorn's protocol debug output prints handshake headers as they came)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = _BEARER.sub(r"\1[redacted]", _SECRET.sub(r"\1\2[redacted]", message))
        if redacted != message:
            record.msg, record.args = redacted, None
        return True


def redact_logs(*loggers: str) -> None:
    """Put ``RedactSecrets`` on every handler of the root logger and of ``loggers``."""
    for name in ("", *loggers):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, RedactSecrets) for f in handler.filters):
                handler.addFilter(RedactSecrets())
