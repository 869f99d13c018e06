"""Log lines a stranger or a removed member can repeat at will: each said once per key per hour.

Whoever sends adverts, refused calls or wrong join proofs in a loop would otherwise write the
daemon's log (and disk) at the rate it sends them.
"""

import threading
import time

# A repeated line is written again after this long, per key.
REPEAT_LOG_AFTER = 3600.0


class Quiet:
    """Says whether something is worth a log line: once per key per `every` seconds, so a stranger
    repeating itself fills no log."""

    def __init__(self, every: float = REPEAT_LOG_AFTER, keep: int = 1024):
        self.every, self.keep = every, keep
        self._last: dict[object, float] = {}
        self._lock = threading.Lock()

    def due(self, key: object) -> bool:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.every:
                return False
            if len(self._last) >= self.keep:  # forget the oldest: bounded, whatever a stranger sends
                for old in sorted(self._last, key=self._last.__getitem__)[: self.keep // 2]:
                    del self._last[old]
            self._last[key] = now
            return True
