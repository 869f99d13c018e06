"""The daemon's log: readable text on a terminal, or one JSON object per line for a service log."""

import json
import logging


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(log_format: str, level: str) -> None:
    """Log to stderr in `log_format` (text or json) from `level` (debug, info, warning, error) up."""
    handler = logging.StreamHandler()
    text = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler.setFormatter(JsonFormatter() if log_format == "json" else text)
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
