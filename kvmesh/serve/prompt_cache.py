"""The server's prompt cache in three tiers: live caches in memory, the local store, then the mesh.

Memory holds the caches of recent requests (prompt plus completion) as mlx-lm left them, bounded in
bytes, least recently used first out; a dense cache there also serves any shorter prefix (it is
trimmed on a copy). What memory lacks is looked up in the local store and on the mesh's peers
(`kvmesh.generation.find_prefix`: manifest first, block hashes only). After a request its cache goes
back to memory, and, when it covers at least `min_store_tokens`, into the local store too, where
every peer can find it.

Partitions: `usage.prompt_tokens_details.cached_tokens` tells a client how much of its prompt was
cached, so a client can read another's prompt back through it, a token at a time (a guessed
continuation comes back cached or not). A request that gives a `cache_salt` is in a partition of its
own: what it leaves is kept in memory under its salt only, never in the store (which the peers
read), so only requests with the same salt find it. It may still start from what every client
shares (unsalted requests' caches, the store, the mesh): that tells it nothing another client kept
apart. Unsalted requests share one partition, as before.

`look_up` runs on a lookup thread (a store read or a peer's transfer must hold no other request);
every other method on the server's generation thread. Memory is read and changed under a lock.
"""

import copy
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from kvmesh.caches.kinds import cached_tokens
from kvmesh.caches.presses import Press
from kvmesh.caches.quality import tail_kl
from kvmesh.caches.sparse import stored_nbytes
from kvmesh.codec.basis import Basis
from kvmesh.codec.encode import encode_cache
from kvmesh.compression import compress
from kvmesh.errors import KvmeshError
from kvmesh.fetch_or_prefill import Rates
from kvmesh.generation import find_prefix
from kvmesh.model.fingerprint import ModelFingerprint
from kvmesh.net.credentials import MeshCredentials
from kvmesh.net.timeouts import TIMEOUTS
from kvmesh.store import CacheStore

log = logging.getLogger(__name__)


@dataclass
class PrefixHit:
    """A cache covering `tokens` of a prompt, and where it came from."""

    cache: list[Any] | None
    tokens: int
    where: str  # "memory", "local store", "peer HOST:PORT", or "none"
    wire_bytes: int = 0
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)
    # Each choice between fetching a peer's cache and prefilling here (kvmesh.fetch_or_prefill).
    choices: list[str] = field(default_factory=list)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class MeshPromptCache:
    """Memory, then the local store, then the mesh; see the module docstring."""

    def __init__(
        self,
        model_fp: ModelFingerprint,
        store: CacheStore | None,
        peers: Sequence[str] | Callable[[], list[str]] = (),
        *,
        credentials: MeshCredentials | None = None,
        max_bytes: int = 2 << 30,
        min_store_tokens: int = 512,
        idle_timeout: float = TIMEOUTS.stream_idle,
        rates: Rates | None = None,
    ):
        """`peers` is a list of addresses, or a function returning the live ones (the local daemon's).
        With `rates`, a peer's cache is fetched only when that beats prefilling it here."""
        self.model_fp, self.store, self.credentials, self.rates = model_fp, store, credentials, rates
        self._peers = peers
        self.max_bytes, self.min_store_tokens, self.idle_timeout = max_bytes, min_store_tokens, idle_timeout
        # (partition, tokens) -> (cache, bytes); partition None is the one every unsalted request shares.
        self._memory: OrderedDict[tuple[bytes | None, tuple[int, ...]], tuple[list[Any], int]] = OrderedDict()
        self._lock = threading.Lock()  # memory is scanned on lookup threads, changed on the generation thread
        # How caches are kept in the store: as they are, unless `compress_with` was called.
        self.press, self.model = Press(), None
        self.level: str | None = None
        self.basis: Basis | None = None

    def compress_with(self, press: Press, model: Any, *, level: str | None = None, basis: Basis | None = None) -> None:
        """Keep caches in the store compressed by `press`, then transform coded at `level` with
        `basis` (kvmesh.compression), their loss measured with `model`.

        Only presses that need no second look at the prompt (its queries, a reconstruction pass): the
        cache is kept after the request, when those are gone.
        """
        if press.needs_queries or press.needs_reconstruction:
            raise KvmeshError(f"{press.method} needs the prompt's own passes; the server keeps caches after them")
        if (level is None) != (basis is None):
            raise KvmeshError("a compression level needs the model's basis, and a basis its level")
        self.press, self.model, self.level, self.basis = press, model, level, basis

    def peers(self) -> list[str]:
        return list(self._peers() if callable(self._peers) else self._peers)

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self._memory.values())

    def _memory_best(
        self, tokens: Sequence[int], partition: bytes | None
    ) -> tuple[tuple[bytes | None, tuple[int, ...]] | None, int]:
        """Memory's entry with the longest usable prefix of `tokens[:-1]`, and that prefix's length."""
        limit = len(tokens) - 1
        best_key, best = None, 0
        with self._lock:
            for key, (entry, _) in self._memory.items():
                if key[0] is not None and key[0] != partition:
                    continue
                n = min(common_prefix(key[1], tokens), limit)
                trimmable = all(type(c) in (KVCache, QuantizedKVCache) for c in entry)
                if n > best and (n == len(key[1]) or trimmable):
                    best_key, best = key, n
        return best_key, best

    def look_up(self, tokens: Sequence[int], partition: bytes | None = None) -> PrefixHit | None:
        """The store's or the peers' prefix of `tokens`, when longer than memory's (its `cache` None
        when neither had one: its `skipped` and `choices` still say why); None when memory serves
        the whole prompt. Thread-safe: a lookup thread calls it while others generate."""
        start = time.perf_counter()
        _, best = self._memory_best(tokens, partition)
        if best >= len(tokens) - 1:
            return None
        found, source = find_prefix(
            self.model_fp,
            tokens,
            self.store,
            peers=self.peers(),
            credentials=self.credentials,
            idle_timeout=self.idle_timeout,
            min_tokens=best,
            rates=self.rates,
        )
        if found is not None:
            # Computed here, on this thread's MLX stream: a lazy array made on one thread cannot be
            # evaluated on another (MLX's streams are per thread), so the generation thread gets data.
            mx.eval([c.state for c in found])
        return PrefixHit(
            found,
            source.tokens if found is not None else 0,
            source.where if found is not None else "none",
            wire_bytes=source.wire_bytes,
            seconds=source.seconds if found is not None else time.perf_counter() - start,
            skipped=source.skipped,
            choices=source.choices,
        )

    def fetch(self, tokens: Sequence[int], partition: bytes | None = None, found: PrefixHit | None = None) -> PrefixHit:
        """The longest cached prefix of `tokens[:-1]` (generation needs one token to feed), as a cache
        this request may change: memory's are copies. Memory's caches of another `partition` (another
        salt) are never used; those of the shared one are. `found` is what `look_up` found earlier
        (memory may have gained a longer prefix since: the longer one serves); without it the store
        and the peers are asked here."""
        start = time.perf_counter()
        if found is None:
            found = self.look_up(tokens, partition)
        best_key, best = self._memory_best(tokens, partition)
        skipped = found.skipped if found is not None else []
        choices = found.choices if found is not None else []
        if found is not None and found.cache is not None and found.tokens > best:
            return found
        if best_key is None:
            return PrefixHit(None, 0, "none", seconds=time.perf_counter() - start, skipped=skipped, choices=choices)
        with self._lock:
            self._memory.move_to_end(best_key)
            cache = copy.deepcopy(self._memory[best_key][0])
        if best < len(best_key[1]):
            for layer in cache:
                layer.trim(layer.offset - best)  # only trimmable (KVCache) layers get here
        return PrefixHit(cache, best, "memory", seconds=time.perf_counter() - start, skipped=skipped, choices=choices)

    def insert(self, tokens: Sequence[int], cache: list[Any], partition: bytes | None = None) -> tuple[int, ...]:
        """Keep the cache of `tokens` (its offset many) in memory after a request, in `partition`;
        returns the tokens it covers, for `persist` (which a salted request skips)."""
        covered = tuple(tokens[: cached_tokens(cache)])
        if not covered:
            return covered
        mx.eval([c.state for c in cache])
        size = sum(stored_nbytes(c) for c in cache)
        key = (partition, covered)
        with self._lock:
            self._memory[key] = (cache, size)
            self._memory.move_to_end(key)
            # A longer cache serves every prefix of itself: drop the entries of its partition it covers.
            for old in [k for k in self._memory if k != key and k[0] == partition and covered[: len(k[1])] == k[1]]:
                del self._memory[old]
            while sum(size for _, size in self._memory.values()) > self.max_bytes and len(self._memory) > 1:
                self._memory.popitem(last=False)
        return covered

    def persist(self, tokens: tuple[int, ...], cache: list[Any]) -> None:
        """Keep a cache of at least `min_store_tokens` in the local store too, where peers find it."""
        if self.store is None or len(tokens) < self.min_store_tokens:
            return
        match = self.store.lookup(self.model_fp.model_id, tokens)
        if match is not None and match.tokens == len(tokens):
            return  # already there
        try:
            pressed = self.press.apply(cache)
            loss = tail_kl(self.model, cache, pressed, tokens) if self.press.lossy and self.model else None
            if self.level is not None and self.basis is not None and self.model is not None:
                coded = compress(self.model, pressed, tokens, self.level, self.basis)
                pressed, loss = coded.cache, coded.tail_kl if coded.tail_kl is not None else loss
            self.store.add(*encode_cache(pressed, self.model_fp, list(tokens), self.press, tail_kl=loss))
        except KvmeshError as e:  # a full disk or a budget: memory still has it
            log.warning("not kept in the store: %s", e)
