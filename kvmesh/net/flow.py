"""Flow control of gRPC streams: watching a stream for a silent or crawling peer, and reading a
message within a time.

gRPC has no per-message timeout, and a sleeping Mac's TCP stack can keep a connection open (and
answer keepalive pings) for minutes, so both sides watch their streams: the receiver of a fetch or
an artefact (a peer that sends nothing, or a trickle), the sender of a fetch (a receiver that
accepted and stopped reading would hold a transfer slot for good), and a service reading a call's
next message (a peer that stalls must not hold a slot).
"""

import collections
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

SILENT = "sent nothing for {idle:g} s (asleep, frozen or cut off): transfer abandoned"
# How often an IdleWatch looks (at most: a quarter of a shorter idle limit): a stream is cancelled
# up to this long after its limit.
WATCH_INTERVAL_S = 0.25


class IdleWatch:
    """Calls `cancel` once the peer keeps this side waiting for `idle` seconds at a time, sends less
    than `min_rate` bytes a second (once `measure_rate` is called), or the stream outlives its
    `deadline`; `why` says which (None while none did).

    Only time spent waiting for the peer counts towards the idle limit and the rate (`waiting`,
    then `alive`): a side busy decoding, writing or reading its disk is not a slow peer. `silent`
    is the idle problem's wording, with `{idle}`.
    """

    def __init__(self, cancel: Callable[[], Any], idle: float, *, deadline: float | None = None, silent: str = SILENT):
        self.cancel, self.idle, self.silent = cancel, idle, silent
        self.deadline = None if deadline is None else time.monotonic() + deadline
        self.why: str | None = None
        self._waiting_since: float | None = None
        self._waited = 0.0  # seconds spent waiting for the peer so far, but for the current wait
        self._rate: tuple[float, float] | None = None  # (bytes per second, window in waited seconds)
        self._rate_from = 0.0
        self._arrivals: collections.deque[tuple[float, int]] = collections.deque()
        self._done = threading.Event()
        threading.Thread(target=self._watch, name="kvmesh-idle-watch", daemon=True).start()

    def waiting(self) -> None:
        """This side waits for the peer (its next message, or to take ours) from now."""
        self._waiting_since = time.monotonic()

    def alive(self, nbytes: int = 0) -> None:
        """The peer sent a message of `nbytes` (or took ours)."""
        if self._waiting_since is not None:
            self._waited += time.monotonic() - self._waiting_since
            self._waiting_since = None
        if self._rate is not None:
            self._arrivals.append((self._waited, nbytes))
            while self._arrivals and self._arrivals[0][0] < self._waited - self._rate[1]:
                self._arrivals.popleft()

    def allow(self, seconds: float) -> None:
        """The stream may take `seconds` more in all."""
        self.deadline = time.monotonic() + seconds

    def measure_rate(self, min_rate: float, window: float) -> None:
        """From now, the peer must send at least `min_rate` bytes a second over every `window`
        seconds of waiting for it."""
        self._rate, self._rate_from = (min_rate, window), self._waited

    def _problem(self, now: float) -> str | None:
        wait = 0.0 if self._waiting_since is None else now - self._waiting_since
        if wait > self.idle:
            return self.silent.format(idle=self.idle)
        if self.deadline is not None and now > self.deadline:
            return "the transfer outlived its deadline: abandoned"
        waited = self._waited + wait
        if self._rate is not None and waited - self._rate_from >= (window := self._rate[1]):
            got = sum(n for at, n in list(self._arrivals) if at >= waited - window)
            if got < self._rate[0] * window:
                return (
                    f"sent {got:,} bytes in {window:g} s, below the minimum of {self._rate[0] / 1024:,.0f} KiB/s "
                    "(a trickle): transfer abandoned"
                )
        return None

    def _watch(self) -> None:
        while not self._done.wait(watch_interval(self.idle)):
            if (why := self._problem(time.monotonic())) is not None:
                self.why = why
                self.cancel()
                return

    def stop(self) -> None:
        self._done.set()


def watch_interval(idle: float) -> float:
    """Seconds between an IdleWatch's looks at a stream whose idle limit is `idle`."""
    return min(WATCH_INTERVAL_S, idle / 4)


def read_within(messages: Iterator, seconds: float) -> Any:
    """The next of `messages` (None when they end), read on a thread; TimeoutError when none comes
    within `seconds` (the read is left to finish on its own: the caller ends the stream)."""
    box: dict = {}
    arrived = threading.Event()

    def read() -> None:
        try:
            box["message"] = next(messages, None)
        except Exception as e:  # the stream broke: re-raised in the caller's thread
            box["error"] = e
        arrived.set()

    threading.Thread(target=read, name="kvmesh-read-within", daemon=True).start()
    if not arrived.wait(seconds):
        raise TimeoutError(f"nothing within {seconds:.0f} s")
    if "error" in box:
        raise box["error"]
    return box["message"]
