"""Log setup: plain text or one JSON object per line.

The router logs one line per decision at debug level, with the request id Envoy generated
(``x-request-id``, also in Envoy's access log as ``%REQ(X-REQUEST-ID)%``) so the two can be
joined. Nothing secret or personal is logged at info level: no prompts, keys, session ids or users.
"""

from __future__ import annotations

import json
import logging
import time

# Attributes every LogRecord has; anything else on a record came from ``extra=`` and is a field.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and the record's extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        """Render ``record`` as a JSON line."""
        entry: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    """Configure the root logger once for the process."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Third-party chatter (HTTP client request lines, gRPC internals) stays out of info logs.
    for noisy in ("httpx", "httpx2", "openai", "grpc", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
