"""Deterministic hashes of token prefixes.

Peers must agree on these across processes and machines, so token ids are hashed as fixed-width
little-endian integers with sha256 (never Python's `hash()`). Hashes are chained block by block:
block i's hash covers every token up to the end of block i, and the prefix hash continues the
chain over the last partial block. So a peer can say "I hold your prompt's first k blocks" while
the prompt never leaves the requester, and the first k blocks of a cache carry their own prefix
hash (its block hash k - 1) without anyone knowing the tokens.

Which cache serves which prefix of a prompt is decided here too, for the store's lookups, a peer's
answers and the requester's checks of them alike.
"""

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvmesh.v1 import cache_pb2 as pb

BLOCK_SIZE = 128
_CHAIN_SEED = hashlib.sha256(b"kvmesh-prefix-v1").digest()


def _chain(tokens: Sequence[int], block_size: int) -> tuple[list[bytes], bytes]:
    """(hashes of the complete blocks, hash of the whole prefix)."""
    data = np.asarray(tokens, dtype="<u4").tobytes()
    width = block_size * 4
    blocks, previous = [], _CHAIN_SEED
    full = len(data) - len(data) % width
    for start in range(0, full, width):
        previous = hashlib.sha256(previous + data[start : start + width]).digest()
        blocks.append(previous)
    if full == len(data):
        return blocks, previous
    return blocks, hashlib.sha256(previous + data[full:]).digest()


def block_hashes(tokens: Sequence[int], block_size: int = BLOCK_SIZE) -> list[bytes]:
    """Hash i (32 bytes) covers tokens [0, (i + 1) * block_size); an incomplete last block gets none."""
    return _chain(tokens, block_size)[0]


def prefix_sha256(tokens: Sequence[int], block_size: int = BLOCK_SIZE) -> bytes:
    """The chained hash (32 bytes) of the whole prefix."""
    return _chain(tokens, block_size)[1]


def shared_tokens(blocks: int, num_tokens: int) -> int:
    """The tokens of a cache of `num_tokens` covered by its first `blocks` blocks."""
    return min(blocks * BLOCK_SIZE, num_tokens)


def may_serve(num_tokens: int, cuttable: bool, blocks: int) -> bool:
    """Whether a cache whose first `blocks` blocks match a prompt's may serve some of it, as known from
    block hashes alone: every complete block matches (it may be exactly a prefix of the prompt, which
    `tokens_served` tells where the prompt is), or it evicted nothing (`cuttable`) and shares a block."""
    return blocks >= num_tokens // BLOCK_SIZE or (cuttable and blocks > 0)


def tokens_served(tokens: Sequence[int], num_tokens: int, sha256: bytes, cuttable: bool, shared: int) -> int:
    """How many of the prompt's `tokens` a cache serves: all its `num_tokens` when it is exactly a
    prefix of them (its prefix hash `sha256` says), else, when it evicted nothing (`cuttable`), the
    `shared` tokens of its leading blocks that match (a shorter prefix is cut from it); 0 when none."""
    if num_tokens <= len(tokens) and prefix_sha256(tokens[:num_tokens]) == sha256:
        return num_tokens
    return shared if cuttable else 0


@dataclass(frozen=True)
class PrefixKey:
    """All a cache says about the prompt it was made from."""

    num_tokens: int
    sha256: bytes
    block_size: int
    block_hashes: tuple[bytes, ...]

    @classmethod
    def of(cls, tokens: Sequence[int], block_size: int = BLOCK_SIZE) -> "PrefixKey":
        blocks, whole = _chain(tokens, block_size)
        return cls(len(tokens), whole, block_size, tuple(blocks))

    @classmethod
    def from_proto(cls, msg: pb.Prefix) -> "PrefixKey":
        return cls(msg.num_tokens, msg.sha256, msg.block_size, tuple(msg.block_hashes))

    def to_proto(self) -> pb.Prefix:
        return pb.Prefix(
            num_tokens=self.num_tokens, sha256=self.sha256, block_size=self.block_size, block_hashes=self.block_hashes
        )

    def first_blocks(self, k: int) -> "PrefixKey":
        """The key of the first k complete blocks."""
        if not 0 < k <= len(self.block_hashes):
            raise ValueError(f"cannot take {k} of {len(self.block_hashes)} blocks")
        return PrefixKey(k * self.block_size, self.block_hashes[k - 1], self.block_size, self.block_hashes[:k])
