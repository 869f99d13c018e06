"""The local daemon's live peers, asked with a short deadline and remembered for a while.

Without `--peer`, each request looks for its prefix on the peers the local daemon sees alive. A
daemon that is frozen (stopped, swapping, stuck) accepts the connection and never answers, and the
Control call's own deadline (5 s, made for a person at a terminal) then cost every request 5 s. So
the server asks with a deadline of its own (`local_daemon_timeout`, 0.5 s) and reuses the answer, or the
silence (no peers: the request goes on with memory and the store), for `local_daemon_cache` seconds:
while the daemon is frozen a request waits for it at most once in that time.
"""

import logging
import threading
import time
from pathlib import Path

from kvmesh.daemon.control import control_status
from kvmesh.errors import KvmeshError

log = logging.getLogger(__name__)


class DaemonPeers:
    """A callable for MeshPromptCache's `peers`: the daemon's live peer addresses, cached."""

    def __init__(self, data_dir: Path | str, *, timeout: float, cache_seconds: float):
        self.data_dir, self.timeout, self.cache_seconds = data_dir, timeout, cache_seconds
        self._lock = threading.Lock()
        self._peers: list[str] = []
        self._until = float("-inf")  # when the remembered answer is stale (monotonic seconds)
        self._failing = False  # the last ask failed: said once in the log, again when it recovers
        self.asked = 0  # calls made to the daemon (the tests count them)

    def __call__(self) -> list[str]:
        with self._lock:
            if time.monotonic() >= self._until:
                self._peers = self._ask()
                self._until = time.monotonic() + self.cache_seconds
            return list(self._peers)

    def _ask(self) -> list[str]:
        """The daemon's answer now, or no peers when it does not give one within the deadline."""
        self.asked += 1
        try:
            status = control_status(self.data_dir, timeout=self.timeout)
        except KvmeshError as e:  # none runs (no mesh here), or it does not answer in time
            if not self._failing:
                log.warning("serving without the mesh's peers for now: %s", e)
            self._failing = True
            return []
        if self._failing:
            log.warning("the local daemon answers again: asking its peers")
        self._failing = False
        return [p.addresses[0] for p in status.peers if p.healthy and p.addresses]
