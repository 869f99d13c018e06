"""Watching streams and reading a peer's next message within a time (kvmesh.net.flow), on threads
every stream shares: none is started per watch, nor per read while one is free."""

import queue
import threading
import time

import pytest

from kvmesh.net.flow import IdleWatch, read_within

END = object()


def named(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def test_one_thread_watches_every_stream_and_cuts_each_at_its_own_limit():
    cut: dict[int, float] = {}
    all_cut = threading.Event()
    limits = {i: 0.2 + 0.05 * i for i in range(8)}
    watches, started = {}, {}
    for i, idle in limits.items():

        def cancel(i=i):
            cut[i] = time.monotonic()
            if len(cut) == 6:
                all_cut.set()

        watches[i] = IdleWatch(cancel, idle)
        started[i] = time.monotonic()
        watches[i].waiting()
    assert len(named("kvmesh-idle-watch")) == 1
    watches[3].alive()  # (its peer answered: it is not waiting)
    watches[5].stop()  # (its stream ended)
    assert all_cut.wait(30)
    assert sorted(cut) == [0, 1, 2, 4, 6, 7]
    for i, at in cut.items():
        assert at - started[i] >= limits[i] and f"sent nothing for {limits[i]:g} s" in watches[i].why
    assert watches[3].why is None and watches[5].why is None
    for watch in watches.values():
        watch.stop()


def test_reads_within_a_time_keep_their_threads_for_the_next():
    inbox: queue.Queue = queue.Queue()
    readers: list[threading.Thread] = []

    def messages():
        while (message := inbox.get()) is not END:
            readers.append(threading.current_thread())
            yield message

    stream = messages()
    for i in range(20):
        inbox.put(i)
        assert read_within(stream, 5) == i
    assert len(set(readers)) == 1  # (one after the other: each read on the thread of the one before)
    stalled: queue.Queue = queue.Queue()
    with pytest.raises(TimeoutError, match="nothing within"):
        read_within(iter(stalled.get, END), 0.05)
    inbox.put("meanwhile")
    assert read_within(stream, 5) == "meanwhile"  # (the stalled read holds its own thread)
    stalled.put(END)  # (its stream ends: its read finishes on its own)
    inbox.put(END)
    assert read_within(stream, 5) is None
    assert all(t.name == "kvmesh-read-within" and t.daemon for t in readers)


def test_a_read_that_fails_raises_in_the_caller():
    def broken():
        yield "first"
        raise ConnectionError("the stream broke")

    messages = broken()
    assert read_within(messages, 5) == "first"
    with pytest.raises(ConnectionError, match="the stream broke"):
        read_within(messages, 5)
