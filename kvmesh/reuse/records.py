"""What a request found and generated: the one record from the tiers to what a user reads."""

from dataclasses import dataclass, field, replace

from kvmesh.reuse.choice import Decision


@dataclass
class CachedPrefix:
    """The cached prefix of a prompt as a tier found it (memory, the local store, a peer, or none),
    and what finding it cost: the one record from the tiers to what a user reads (`generate
    --json`, the server's usage and log line), all through `report`."""

    where: str  # "memory", "local store", "peer <address>", or "none"
    tokens: int = 0
    seconds: float = 0.0
    wire_bytes: int = 0
    cache_id: str = ""
    # Sources that were tried and failed or refused, with why.
    skipped: list[str] = field(default_factory=list)
    # Each choice between fetching a peer's copy and prefilling its tokens here, with its figures.
    fetch_or_prefill: list[Decision] = field(default_factory=list)
    # What prefilling the cached tokens here was expected to take, by the prefill rate the choices
    # weigh with (None without one): the time saved is reckoned from it, so the two never disagree.
    expected_prefill_s: float | None = None
    # The cache itself, None when none was found; generation takes it (`released` drops it).
    cache: list | None = field(default=None, repr=False)

    def released(self) -> "CachedPrefix":
        """This record without its cache: what outlives the request (the cache is generation's now)."""
        return replace(self, cache=None)

    def report(self) -> dict:
        """As `kvmesh generate --json` and the server's `usage.kvmesh` print it."""
        return {
            "prefix_from": self.where,
            "prefix_tokens": self.tokens,
            "prefix_s": round(self.seconds, 4),
            "wire_bytes": self.wire_bytes,
            "cache_id": self.cache_id,
            "skipped": list(self.skipped),
            "fetch_or_prefill": [str(d) for d in self.fetch_or_prefill],
        }


@dataclass
class Generation:
    """The tokens generated, where their prompt's cached prefix came from, and the timings."""

    tokens: list[int]
    prefix: CachedPrefix
    prompt_tokens: int
    # Time to the first token: prefill of the tokens the cache did not cover.
    prefill_s: float
    generate_s: float

    @property
    def estimated_saving_s(self) -> float | None:
        """Prefill time the cached tokens would have cost, minus getting them: by the prefill rate the
        fetch was weighed with when there is one, else at this run's prefill rate of the rest."""
        if not self.prefix.tokens:
            return None
        if self.prefix.expected_prefill_s is not None:
            return self.prefix.expected_prefill_s - self.prefix.seconds
        fed = self.prompt_tokens - self.prefix.tokens
        if fed < 8 or self.prefill_s <= 0:
            return None
        return self.prefix.tokens * self.prefill_s / fed - self.prefix.seconds
