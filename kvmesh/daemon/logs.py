"""The daemon's log: readable text on a terminal, or one JSON object per line for a service log.

gRPC's C core writes its own lines to descriptor 2 (a refused TLS handshake is one, so a stranger on
the LAN would fill the log with them, several a second). The daemon keeps them out of its log
(`NativeLogs`): a refused handshake becomes one kvmesh line an hour, with the count, and every other
line of gRPC's a debug record; what is not gRPC's passes through unchanged.
"""

import faulthandler
import json
import logging
import os
import re
import sys
import threading
import time
from typing import TextIO

log = logging.getLogger("kvmesh.grpc")
# I1201 14:13:53.301818    5527 ssl_transport_security.cc:2563] Handshake failed with error ...
NATIVE_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ \S+:\d+\] (?P<message>.*)$")
# A refused handshake is logged once in this long; the others are counted.
REFUSALS_LOGGED_EVERY = 3600.0


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


class NativeLogs:
    """gRPC's own lines, read from descriptor 2 (a pipe now) on a thread and turned into the daemon's
    records; `out` is the real stderr, where the daemon's log goes."""

    def __init__(self, every: float = REFUSALS_LOGGED_EVERY):
        self.every = every
        self.refused = 0  # refused handshakes since the last line about them
        self._logged_at: float | None = None
        original = os.dup(2)
        read, write = os.pipe()
        os.dup2(write, 2)
        os.close(write)
        self.out: TextIO = os.fdopen(original, "w", buffering=1)
        faulthandler.enable(self.out)  # a fatal error's report must not wait in the pipe for a dead reader
        self._pipe = os.fdopen(read, "r", errors="replace")
        threading.Thread(target=self._read, name="kvmesh-native-logs", daemon=True).start()

    def _read(self) -> None:
        for line in self._pipe:
            try:
                self.handle(line)
            except Exception:  # never stop reading: gRPC would block on a full pipe
                self.out.write(line)

    def handle(self, line: str) -> None:
        match = NATIVE_LINE.match(line)
        if match is None:
            self.out.write(line)  # a traceback, a child's output: not gRPC's
            return
        message = match["message"]
        if "Handshake failed" in message:
            self.handshake_refused(message)
        else:
            log.debug("%s", message)

    def handshake_refused(self, message: str) -> None:
        """A connection failed the TLS handshake: a stranger (no certificate of this mesh), a member
        of another mesh, or no TLS at all. One line now, then one an hour with the count."""
        self.refused += 1
        now = time.monotonic()
        if self._logged_at is not None and now - self._logged_at < self.every:
            return
        why = re.search(r"OPENSSL_internal:(\w+)", message)
        log.warning(
            "%d connection%s failed the TLS handshake (%s): not members of this mesh; ignored, and counted, "
            "not logged, for the next %.0f minutes",
            self.refused,
            "" if self.refused == 1 else "s",
            why[1] if why else message[:80],
            self.every / 60,
        )
        self._logged_at, self.refused = now, 0


def setup_logging(log_format: str, level: str, *, native: bool = True) -> None:
    """Log to stderr in `log_format` (text or json) from `level` (debug, info, warning, error) up;
    with `native`, gRPC's own lines are kept out (`NativeLogs`)."""
    stream = NativeLogs().out if native else sys.stderr
    if native:
        sys.stderr = stream  # tracebacks and warnings go straight to the log, not through the pipe
    handler = logging.StreamHandler(stream)
    text = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler.setFormatter(JsonFormatter() if log_format == "json" else text)
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
