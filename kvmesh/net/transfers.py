"""Counting a service's transfers, and bounding how many run and wait at once.

Each transfer holds one of the gRPC server's worker threads; the bounds keep threads free for health
checks, Info and Lookup, so that a busy peer never looks like a dead one. The counters are what
Info reports, and what tests read to prove what was (not) sent.
"""

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc

from kvmesh.v1 import service_pb2 as spb


@dataclass
class TransferCounters:
    """What the service did, for Info and for tests that must prove what was (not) sent.

    At most `cap` transfers run and `max_waiting` more wait for a slot; further ones are refused
    at once. Each holds one of the server's worker threads, so the bound keeps threads free for
    health checks, Info and Lookup: a busy peer must not look like a dead one.
    """

    cap: int
    max_waiting: int
    stats: spb.TransferStats = field(default_factory=spb.TransferStats)
    lock: threading.Lock = field(default_factory=threading.Lock)
    waiting: int = 0

    def __post_init__(self) -> None:
        self.stats.transfers_cap = self.cap
        self.slots = threading.BoundedSemaphore(self.cap)

    def add(self, name: str, n: int = 1) -> None:
        with self.lock:
            setattr(self.stats, name, getattr(self.stats, name) + n)

    def snapshot(self) -> spb.TransferStats:
        with self.lock:
            copy = spb.TransferStats()
            copy.CopyFrom(self.stats)
            return copy

    @contextmanager
    def arriving(self, context: grpc.ServicerContext):
        """Count a call waiting for its first message (a fetch's open) among the `max_waiting`: its
        thread is held all the same, so calls that never send one cannot take the reserved workers."""
        with self.lock:
            full = self.waiting >= self.max_waiting
            self.waiting += 0 if full else 1
        if full:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"busy: {self.max_waiting} calls are waiting")
        try:
            yield
        finally:
            with self.lock:
                self.waiting -= 1

    @contextmanager
    def slot(self, context: grpc.ServicerContext):
        """Hold one of the `cap` transfer slots, waiting for one while the caller is still there."""
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        if not self.slots.acquire(blocking=False):
            with self.lock:
                full = self.waiting >= self.max_waiting
                self.waiting += 0 if full else 1
            if full:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"busy: {self.cap} transfers in progress")
            try:
                while not self.slots.acquire(timeout=0.5):
                    if not context.is_active() or (deadline is not None and time.monotonic() > deadline):
                        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"busy: {self.cap} transfers in progress")
            finally:
                with self.lock:
                    self.waiting -= 1
        with self.lock:
            self.stats.transfers_active += 1
            self.stats.transfers_max_seen = max(self.stats.transfers_max_seen, self.stats.transfers_active)
        try:
            yield
        finally:
            with self.lock:
                self.stats.transfers_active -= 1
            self.slots.release()
