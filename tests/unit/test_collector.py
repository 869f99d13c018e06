"""kvmesh.collector: what a process made at start leaves the collector's walks; its garbage does not stay."""

import gc
import weakref

import pytest

from kvmesh.collector import freeze_startup_objects


class Node:
    """An object the collector tracks, which can be part of a cycle."""

    other: "Node | None" = None


@pytest.fixture
def thawed():
    """Gives the test process's objects back to the collector afterwards."""
    yield
    gc.unfreeze()


def walked() -> set[int]:
    return {id(o) for o in gc.get_objects()}


def test_objects_alive_at_the_call_leave_the_collectors_walks_and_later_ones_do_not(thawed):
    alive = [Node() for _ in range(100)]
    assert id(alive[0]) in walked()
    freeze_startup_objects()
    now = walked()
    assert not any(id(n) in now for n in alive)
    later = Node()
    assert id(later) in walked()


def test_cyclic_garbage_that_starting_left_is_collected_not_kept_for_good(thawed):
    a, b = Node(), Node()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    del a, b
    freeze_startup_objects()
    assert gone() is None
