"""Flow control of gRPC streams: watching a stream for a silent or crawling peer, and reading a
message within a time.

gRPC has no per-message timeout, and a sleeping Mac's TCP stack can keep a connection open (and
answer keepalive pings) for minutes, so both sides watch their streams: the receiver of a fetch or
an artefact (a peer that sends nothing, or a trickle), the sender of a fetch (a receiver that
accepted and stopped reading would hold a transfer slot for good), and a service reading a call's
next message (a peer that stalls must not hold a slot).
"""

import collections
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

log = logging.getLogger(__name__)

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
        _WATCHER.add(self)

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

    def stop(self) -> None:
        _WATCHER.remove(self)


def watch_interval(idle: float) -> float:
    """Seconds between an IdleWatch's looks at a stream whose idle limit is `idle`."""
    return min(WATCH_INTERVAL_S, idle / 4)


class _Watcher:
    """The one thread that looks at every IdleWatch of the process, as often as the shortest idle
    limit among them asks (`watch_interval`).

    A thread of its own per watch was started on each fetch's path, at both ends: 0.3-0.7 ms each
    on a loaded 2-core machine, of a 1 Gbit/s fetch's 7 ms before its first chunk.
    """

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._watches: set[IdleWatch] = set()
        self._sleep = float("inf")  # how long the thread sleeps between looks now
        self._thread: threading.Thread | None = None

    def add(self, watch: IdleWatch) -> None:
        with self._changed:
            self._watches.add(watch)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvmesh-idle-watch", daemon=True)
                self._thread.start()
            if watch_interval(watch.idle) < self._sleep:
                self._changed.notify()

    def remove(self, watch: IdleWatch) -> bool:
        """Whether `watch` was being watched (it is not any more)."""
        with self._changed:
            if watch not in self._watches:
                return False
            self._watches.discard(watch)
            return True

    def _run(self) -> None:
        while True:
            with self._changed:
                self._sleep = min((watch_interval(w.idle) for w in self._watches), default=float("inf"))
                self._changed.wait(None if self._sleep == float("inf") else self._sleep)
                watches = list(self._watches)
            now = time.monotonic()
            for watch in watches:
                if (why := watch._problem(now)) is not None and self.remove(watch):
                    watch.why = why
                    try:
                        watch.cancel()
                    except Exception:  # (one stream's cancel must not end the watch of the others)
                        log.exception("cancelling a stream that %s failed", why)


class _Readers:
    """The threads that read a peer's next message for `read_within`, each kept for the next read
    once it is done: a thread started per read took 0.3-0.7 ms on a loaded 2-core machine, twice on
    each fetch's path (its open and its decision) and once per chunk of a publish. Daemon threads,
    and as many as reads wait at once: one that waits on a stream that never ends holds neither
    another read nor the process's exit."""

    def __init__(self) -> None:
        self._idle: list[queue.SimpleQueue] = []
        self._lock = threading.Lock()

    def read(self, messages: Iterator) -> Future:
        """The next of `messages` (None when they end), or the error reading it, to come."""
        read: Future = Future()
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), name="kvmesh-read-within", daemon=True).start()
        inbox.put((messages, read))
        return read

    def _serve(self, inbox: queue.SimpleQueue) -> None:
        while True:
            messages, read = inbox.get()
            error = None
            try:
                message = next(messages, None)
            except Exception as e:  # the stream broke: re-raised in the caller's thread
                error = e
            with self._lock:
                self._idle.append(inbox)  # (before the caller hears: its next read finds this thread free)
            if error is None:
                read.set_result(message)
            else:
                read.set_exception(error)


_WATCHER = _Watcher()
_READERS = _Readers()


def _forget_threads() -> None:
    """In a forked child: its parent's watcher and readers are not there, so it starts its own."""
    global _WATCHER, _READERS
    _WATCHER, _READERS = _Watcher(), _Readers()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_threads)


def read_within(messages: Iterator, seconds: float) -> Any:
    """The next of `messages` (None when they end), read on another thread; TimeoutError when none
    comes within `seconds` (the read is left to finish on its own: the caller ends the stream)."""
    read = _READERS.read(messages)
    try:
        return read.result(seconds)
    except FutureTimeout:
        raise TimeoutError(f"nothing within {seconds:.0f} s") from None
