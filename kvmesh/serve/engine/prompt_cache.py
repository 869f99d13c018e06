"""The server's prompt cache in three tiers: live caches in memory, the local store, then the mesh.

Memory is mlx-lm's own `LRUPromptCache` (`MemoryTier`): the caches of recent requests (prompt plus
completion) as mlx-lm left them, bounded in bytes and in number, least recently used first out; a
cache there also serves a shorter prefix of itself where trimming a copy gives exactly that prefix's
cache (`kvmesh.caches.kinds.trims_exactly`). What memory lacks is looked up in the local store and
on the mesh's peers (`kvmesh.reuse.find.find_prefix`: manifest first, block hashes only). After a
request its cache goes back to memory, and, when it covers at least `min_store_tokens`, into the local store too, where
every peer can find it.

Partitions: `usage.prompt_tokens_details.cached_tokens` tells a client how much of its prompt was
cached, so a client can read another's prompt back through it, a token at a time (a guessed
continuation comes back cached or not). A request that gives a `cache_salt` is in a partition of its
own: what it leaves is kept in memory under its salt only, never in the store (which the peers
read), so only requests with the same salt find it. It may still start from what every client
shares (unsalted requests' caches, the store, the mesh): that tells it nothing another client kept
apart. Unsalted requests share one partition (the default), and what one client learns there of
another's prompts is counted in whole blocks (BLOCK_SIZE, 128 tokens; OpenAI counts cached tokens
so too): an entry another client (another address) left, which the prompt does not extend, is
trimmed back only to the last block boundary they share (or as far as the client's own entries
reach), never to the very token where they part. So a guess at the next token of another's prompt
(a digit of a secret) changes what comes back only when it completes a whole block; before, 50
requests read 3 of 5 digits. A client's own entries serve it to the token (the same prompt again,
the next turn), and all of loopback's are one client's: the local tools are one user's. The store and
the peers serve whole blocks anyway. Clients that trust no other still give a `cache_salt`.

`look_up` runs on a lookup thread (a store read or a peer's transfer must hold no other request);
every other method on the server's generation thread. Memory is read and changed under a lock.
"""

import copy
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache

from kvmesh.caches.kinds import cached_tokens, trims_exactly
from kvmesh.caches.presses import Press
from kvmesh.caches.quality import tail_kl
from kvmesh.codec.basis import Basis
from kvmesh.codec.encode import encode_cache
from kvmesh.codec.prefix import BLOCK_SIZE
from kvmesh.compat import prompt_cache as compat
from kvmesh.compression import compress
from kvmesh.errors import KvmeshError
from kvmesh.model.fingerprint import ModelFingerprint
from kvmesh.net.mesh.credentials import MeshCredentials
from kvmesh.net.timeouts import TIMEOUTS
from kvmesh.reuse.find import find_prefix
from kvmesh.reuse.rates import Rates
from kvmesh.reuse.records import CachedPrefix
from kvmesh.serve.options import ServeOptions
from kvmesh.store import CacheStore

log = logging.getLogger(__name__)

MEMORY = "memory"


def shared_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many first tokens `a` and `b` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class MemoryTier(LRUPromptCache):
    """mlx-lm's prompt cache, its model key used for the partition (None: the shared one), with
    what the server needs besides: how many tokens of a prompt it serves, without copying a cache
    (asked on lookup threads, to know what the store and the peers must beat), and a copy of that
    prefix which leaves one token to feed and is never trimmed short. (`fetch_nearest_cache` returns
    the whole prompt's cache when it has it, and trusts `is_trimmable`: a sparse cache from a peer
    would come back with more tokens than it says.) Not thread-safe, as mlx-lm's: callers lock."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.owners: dict[tuple[bytes | None, tuple[int, ...]], str] = {}  # the client that left each entry

    def nearest(self, partition: bytes | None, tokens: Sequence[int], client: str = "") -> tuple[list[int] | None, int]:
        """The key of the entry of `partition` serving the longest prefix of `tokens[:-1]`, and how
        many tokens it serves: an entry the prompt extends, or one trimmed back to where the prompt
        leaves it (to a block boundary, for an entry of the shared partition `client` did not leave)."""
        query = list(tokens[:-1])
        found = compat.search(self, partition, query)
        if found.exact is not None:
            return found.exact, len(query)
        shorter = (found.shorter, len(found.shorter)) if found.shorter is not None else (None, 0)
        if found.longer is not None:
            common = found.common_prefix
            if partition is None and self.owners.get((None, tuple(found.longer))) != client:
                common = max(common // BLOCK_SIZE * BLOCK_SIZE, self.own_prefix(query, client))
            entry = compat.entry(self, partition, found.longer)
            if common > shorter[1] and trims_exactly(entry.prompt_cache, len(found.longer) - common):
                return found.longer, common
        return shorter

    def own_prefix(self, query: list[int], client: str) -> int:
        """The longest prefix of `query` that an entry `client` left in the shared partition holds:
        what another's entry may serve it to the token, since it tells the client nothing new."""
        own = (key for (partition, key), who in self.owners.items() if partition is None and who == client)
        return max((shared_length(key, query) for key in own), default=0)

    def best(
        self, partition: bytes | None, tokens: Sequence[int], client: str = ""
    ) -> tuple[bytes | None, list[int] | None, int]:
        """(partition, key, tokens served) of the best entry for a request of `partition` from
        `client`: of its own partition, or of the shared one (a longer prefix wins; its own on a tie)."""
        key, served = self.nearest(partition, tokens, client)
        if partition is not None:
            shared_key, shared = self.nearest(None, tokens, client)
            if shared > served:
                return None, shared_key, shared
        return partition, key, served

    def copy_of(self, partition: bytes | None, key: list[int], tokens: int) -> list[Any]:
        """A copy of entry `key`'s cache trimmed to its first `tokens` (as `nearest` found it); the
        entry becomes the most recently used."""
        entry = compat.entry(self, partition, key)
        cache = copy.deepcopy(entry.prompt_cache)
        if trim := len(key) - tokens:  # (recurrent state has no trim: `nearest` asks none of it)
            for layer in cache:
                layer.trim(trim)
        compat.touch(self, partition, key, entry.cache_type)
        return cache

    def insert_cache(
        self, model: Any, tokens: list[int], prompt_cache: list[Any], *, cache_type: str = "assistant", owner: str = ""
    ):
        """mlx-lm's, except that an entry larger than `max_bytes` on its own is kept alone (mlx-lm
        would evict every entry, then it): the next turn of its conversation needs it. `owner`: the
        client whose request left it."""
        budget = self.max_bytes
        self.max_bytes = max(budget, sum(c.nbytes for c in prompt_cache))
        try:
            super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
        finally:
            self.max_bytes = budget
        self.owners[(model, tuple(tokens))] = owner
        self.owners = {key: who for key, who in self.owners.items() if self._holds(*key)}  # (evicted ones go)

    def _holds(self, partition: bytes | None, key: tuple[int, ...]) -> bool:
        try:
            compat.entry(self, partition, list(key))
        except KeyError:
            return False
        return True


class MeshPromptCache:
    """Memory, then the local store, then the mesh; see the module docstring."""

    def __init__(
        self,
        model_fp: ModelFingerprint,
        store: CacheStore | None,
        peers: Sequence[str] | Callable[[], list[str]] = (),
        *,
        credentials: MeshCredentials | None = None,
        max_bytes: int = ServeOptions.memory_bytes,
        max_caches: int = ServeOptions.memory_caches,
        min_store_tokens: int = ServeOptions.min_store_tokens,
        idle_timeout: float = TIMEOUTS.stream_idle,
        rates: Rates | None = None,
    ):
        """`peers` is a list of addresses, or a function returning the live ones (the local daemon's).
        With `rates`, a peer's cache is fetched only when that beats prefilling it here."""
        self.model_fp, self.store, self.credentials, self.rates = model_fp, store, credentials, rates
        self._peers = peers
        self.min_store_tokens, self.idle_timeout = min_store_tokens, idle_timeout
        self.memory = MemoryTier(max_size=max_caches, max_bytes=max_bytes)
        self._lock = threading.Lock()  # memory is read on lookup threads, changed on the generation thread
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
        with self._lock:
            return self.memory.nbytes

    def look_up(self, tokens: Sequence[int], partition: bytes | None = None, client: str = "") -> CachedPrefix | None:
        """The store's or the peers' prefix of `tokens`, when longer than memory's (its `cache` None
        when neither had one: its `skipped` and `fetch_or_prefill` still say why); None when memory
        serves the whole prompt. Thread-safe: a lookup thread calls it while others generate."""
        with self._lock:
            *_, best = self.memory.best(partition, tokens, client)
        if best >= len(tokens) - 1:
            return None
        found = find_prefix(
            self.model_fp,
            tokens,
            self.store,
            peers=self.peers(),
            credentials=self.credentials,
            idle_timeout=self.idle_timeout,
            min_tokens=best,
            rates=self.rates,
        )
        if found.cache is not None:
            # Computed here, on this thread's MLX stream: a lazy array made on one thread cannot be
            # evaluated on another (MLX's streams are per thread), so the generation thread gets data.
            mx.eval([c.state for c in found.cache])
        return found

    def fetch(
        self,
        tokens: Sequence[int],
        partition: bytes | None = None,
        found: CachedPrefix | None = None,
        client: str = "",
    ) -> CachedPrefix:
        """The longest cached prefix of `tokens[:-1]` (generation needs one token to feed), as a cache
        this request may change: memory's are copies. Memory's caches of another `partition` (another
        salt) are never used; those of the shared one are. `found` is what `look_up` found earlier
        (memory may have gained a longer prefix since: the longer one serves); without it the store
        and the peers are asked here."""
        start = time.perf_counter()
        if found is None:
            found = self.look_up(tokens, partition, client)
        skipped = found.skipped if found is not None else []
        choices = found.fetch_or_prefill if found is not None else []
        with self._lock:
            owner, key, best = self.memory.best(partition, tokens, client)
            if found is not None and found.cache is not None and found.tokens > best:
                return found
            if key is None:
                return CachedPrefix(
                    "none", seconds=time.perf_counter() - start, skipped=skipped, fetch_or_prefill=choices
                )
            cache = self.memory.copy_of(owner, key, best)
        return CachedPrefix(
            MEMORY,
            tokens=best,
            seconds=time.perf_counter() - start,
            skipped=skipped,
            fetch_or_prefill=choices,
            cache=cache,
        )

    def insert(
        self, tokens: Sequence[int], cache: list[Any], partition: bytes | None = None, client: str = ""
    ) -> tuple[int, ...]:
        """Keep the cache of `tokens` (its offset many) in memory after a request of `client`, in
        `partition`; returns the tokens it covers, for `persist` (which a salted request skips)."""
        covered = tuple(tokens[: cached_tokens(cache)])
        if not covered:
            return covered
        mx.eval([c.state for c in cache])
        with self._lock:
            # (a list: mlx-lm's recency order finds its entries by comparing keys as it slices them)
            self.memory.insert_cache(partition, list(covered), cache, owner=client)
        return covered

    def persist(self, tokens: tuple[int, ...], cache: list[Any]) -> bool:
        """Keep a cache of at least `min_store_tokens` in the local store too, where peers find it:
        whether this call wrote it (by blocks, a conversation's next turn writes only its new ones)."""
        if self.store is None or len(tokens) < self.min_store_tokens:
            return False
        match = self.store.lookup(self.model_fp.model_id, tokens)
        if match is not None and match.tokens == len(tokens):
            return False  # already there
        try:
            pressed = self.press.apply(cache)
            loss = tail_kl(self.model, cache, pressed, tokens) if self.press.lossy and self.model else None
            if self.level is not None and self.basis is not None and self.model is not None:
                coded = compress(self.model, pressed, tokens, self.level, self.basis)
                pressed, loss = coded.cache, coded.tail_kl if coded.tail_kl is not None else loss
            self.store.add(*encode_cache(pressed, self.model_fp, list(tokens), self.press, tail_kl=loss))
        except KvmeshError as e:  # a full disk or a budget: memory still has it
            log.warning("not kept in the store: %s", e)
            return False
        return True
