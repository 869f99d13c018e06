"""The private names of uvicorn and mlx-lm that `kvmesh serve` uses (kvmesh.compat.uvicorn,
kvmesh.compat.prompt_cache), each checked for what the server assumes of it: a release that renames
one, moves its signature or changes what it does fails here, by name, instead of in a server that
stops with the wrong status or a memory tier that serves the wrong prefix."""

import asyncio
import inspect
import signal

import h11
import mlx.core as mx
import pytest
import uvicorn
from mlx_lm.models.cache import KVCache, LRUPromptCache
from sse_starlette.sse import AppStatus
from uvicorn.server import ServerState

from kvmesh.compat import prompt_cache as compat_cache
from kvmesh.compat import uvicorn as compat_uvicorn
from kvmesh.serve.connections import GuardedH11Protocol


async def no_app(scope, receive, send) -> None:
    raise AssertionError("no request is made")


def test_the_guarded_protocol_overrides_what_uvicorns_h11_protocol_defines():
    """GuardedH11Protocol overrides these methods and calls them through super(): each must still
    be H11Protocol's, with the parameters uvicorn and asyncio pass."""
    protocol = compat_uvicorn.H11Protocol
    assert issubclass(GuardedH11Protocol, protocol) and issubclass(protocol, asyncio.Protocol)
    expected = {
        "__init__": ["self", "config", "server_state", "app_state", "_loop"],
        "connection_made": ["self", "transport"],
        "connection_lost": ["self", "exc"],
        "data_received": ["self", "data"],
        "on_response_complete": ["self"],
        "pause_writing": ["self"],
        "resume_writing": ["self"],
    }
    for name, parameters in expected.items():
        assert name in vars(protocol), f"H11Protocol no longer defines {name}"
        assert list(inspect.signature(getattr(protocol, name)).parameters) == parameters, name


def test_an_h11_protocol_has_the_attributes_the_guard_reads():
    """The guard reads `conn` (its h11 state), `loop` (its deadlines) and `transport`."""
    config = uvicorn.Config(no_app, http=GuardedH11Protocol, lifespan="off", log_level="warning")
    config.load()
    assert config.http_protocol_class is GuardedH11Protocol  # uvicorn takes the class as given
    loop = asyncio.new_event_loop()
    try:
        made = compat_uvicorn.H11Protocol(config=config, server_state=ServerState(), app_state={}, _loop=loop)
        assert isinstance(made.conn, h11.Connection) and made.conn.their_state is h11.IDLE
        assert made.loop is loop and hasattr(made, "transport")
    finally:
        loop.close()


@pytest.fixture
def sigterm_calls():
    """The SIGTERM handler uvicorn restores when it stops, recording each call. sse-starlette's
    patch of `Server.handle_exit` ends every stream of the process once any server is told to exit
    (AppStatus.should_exit, never reset): the flag is put back, or later tests' streams end at once."""
    calls: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: calls.append(sig))
    exiting = AppStatus.should_exit
    yield calls
    AppStatus.should_exit = exiting
    signal.signal(signal.SIGTERM, previous)


def test_uvicorn_raises_again_the_signal_that_stopped_it_unless_forgotten(sigterm_calls):
    server = uvicorn.Server(uvicorn.Config(no_app, lifespan="off"))
    with server.capture_signals():
        server.handle_exit(signal.SIGTERM, None)  # what its handler does with a SIGTERM
    assert sigterm_calls == [signal.SIGTERM], "uvicorn no longer raises the signal again: forget nothing"

    sigterm_calls.clear()
    server = uvicorn.Server(uvicorn.Config(no_app, lifespan="off"))
    with server.capture_signals():
        server.handle_exit(signal.SIGTERM, None)
        compat_uvicorn.forget_captured_signals(server)
    assert sigterm_calls == []


def layers(tokens: int) -> list[KVCache]:
    cache = KVCache()
    cache.update_and_fetch(mx.zeros((1, 1, tokens, 4)), mx.zeros((1, 1, tokens, 4)))
    return [cache]


def test_the_prompt_caches_trie_finds_exact_shorter_and_longer_entries():
    cache = LRUPromptCache(max_size=4)
    held = layers(3)
    cache.insert_cache("m", [1, 2, 3], held)
    cache.insert_cache("m", [1, 2, 4, 5], layers(4))
    assert compat_cache.search(cache, "m", [1, 2, 3]).exact == [1, 2, 3]
    assert compat_cache.search(cache, "m", [1, 2, 3, 7]).shorter == [1, 2, 3]
    found = compat_cache.search(cache, "m", [1, 2, 4, 9])
    assert (found.exact, found.longer, found.common_prefix) == (None, [1, 2, 4, 5], 3)
    assert compat_cache.search(cache, "other", [1, 2, 3]).exact is None  # (the model key partitions it)
    entry = compat_cache.entry(cache, "m", [1, 2, 3])
    assert entry.prompt_cache is held and entry.cache_type == "assistant"
    with pytest.raises(KeyError):
        compat_cache.entry(cache, "m", [1, 2])


def test_a_touched_entry_is_the_last_evicted():
    cache = LRUPromptCache(max_size=2)
    cache.insert_cache("m", [1, 2, 3], layers(3))
    cache.insert_cache("m", [4, 5, 6], layers(3))
    compat_cache.touch(cache, "m", [1, 2, 3], "assistant")
    cache.insert_cache("m", [7, 8, 9], layers(3))  # over max_size: the least recently used goes
    assert compat_cache.search(cache, "m", [1, 2, 3]).exact == [1, 2, 3]
    assert compat_cache.search(cache, "m", [4, 5, 6]).exact is None
