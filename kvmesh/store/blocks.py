"""Blocks stored once: a blockwise entry keeps the chunks of blocks another entry holds as references.

A blockwise cache (Encoding.block_rows: `kvmesh.codec.manifest.block_rows_for`) has one chunk per
128-token block of each per-token KV tensor, so a conversation's turns, or an agent's calls that
share a system prompt and tools, share the chunks of their common blocks, byte for byte. Each such
chunk is a piece, named by a key of what determines its bytes: the model, the chained hash of its
block (which covers every token up to it), the tensor and its layout, and the encoding. The index
maps keys to the entry file that holds the piece's data (`pieces`); a writer that finds a piece
there, with the same bytes (their xxh3-64 and length), writes a reference in place of the data
(`kvmesh.store.entry_file.write_ref`). A piece whose bytes differ (a prefill that came out
otherwise) is written whole: a reference only ever stands for the same bytes.

An entry file whose data others refer to is kept, out of the listings once it is evicted, until
none does (`kvmesh.store.eviction`); the budget counts each file, and so each shared block, once.
Caches that do not go by blocks (sliding windows, recurrent state, coded or pressed caches) are
stored whole, as before.
"""

import hashlib
import struct
from dataclasses import dataclass, field
from typing import BinaryIO

import xxhash

from kvmesh.codec.chunks import Chunk
from kvmesh.codec.manifest import chunk_plan, leaf_layers
from kvmesh.store import entry_file
from kvmesh.v1 import cache_pb2 as pb


@dataclass(frozen=True)
class Piece:
    """Where a block's chunk data lies: in the entry file of `segment`, at `offset`, `length` bytes."""

    segment: str
    offset: int
    length: int
    digest: int


def piece_keys(manifest: pb.CacheManifest) -> dict[int, bytes]:
    """The key of each chunk (by index) of a blockwise manifest that holds one whole block."""
    block = manifest.encoding.block_rows
    if not block:
        return {}
    e = manifest.encoding
    encoding = struct.pack("<iiii", e.codec, e.level, e.byte_shuffle, block)
    tensors = []
    for _, layer in leaf_layers(manifest.layers):
        for t in layer.tensors:
            layout = struct.pack(f"<iii{len(t.shape)}Q", layer.kind, layer.bits, layer.group_size, *t.shape[1:], 0)
            tensors.append(t.name.encode() + struct.pack("<i", t.dtype) + layout)
    hashes = manifest.prefix.block_hashes
    model = manifest.model.model_id.encode()
    keys = {}
    # A chunk is one block, or an equal part of one (kvmesh.codec.manifest.block_chunk_rows); the
    # last of a tensor may hold a block's first rows only, which no other cache need share.
    plan = chunk_plan(manifest)
    part: dict[int, int] = {}
    for slot in plan:
        part[slot.tensor] = max(part.get(slot.tensor, 0), slot.raw_length // slot.row_bytes)
    for i, slot in enumerate(plan):
        first, rows = slot.byte_offset // slot.row_bytes, slot.raw_length // slot.row_bytes
        if rows == part[slot.tensor] and (j := first // block) < len(hashes):
            where = struct.pack("<II", slot.tensor, first % block)
            h = hashlib.sha256(model + b"\0" + hashes[j] + where + tensors[slot.tensor])
            keys[i] = h.digest() + encoding
    return keys


def data_digest(data: bytes | memoryview) -> int:
    """A piece's xxh3-64, signed (SQLite's integers are)."""
    return struct.unpack("<q", xxhash.xxh3_64_digest(data))[0]


@dataclass
class BlockWriter:
    """Writes a blockwise entry's chunks: a reference for each piece `found` holds with the same
    bytes, the data for the others (noted in `new`, to be indexed as this entry's)."""

    keys: dict[int, bytes]
    found: dict[bytes, Piece]
    new: list[tuple[bytes, int, int, int]] = field(default_factory=list)  # key, offset, length, digest
    refs: set[str] = field(default_factory=set)
    referred: int = 0  # data bytes written as references

    def write(self, f: BinaryIO, chunk: Chunk) -> None:
        key = self.keys.get(chunk.index)
        digest = data_digest(chunk.data) if key is not None else 0
        piece = self.found.get(key) if key is not None else None
        if piece is not None and (piece.length, piece.digest) == (len(chunk.data), digest):
            entry_file.write_ref(f, chunk, piece.segment, piece.offset)
            self.refs.add(piece.segment)
            self.referred += len(chunk.data)
            return
        offset = entry_file.write_chunk(f, chunk)
        if key is not None:
            self.new.append((key, offset, len(chunk.data), digest))


def pieces_of(f: BinaryIO, manifest: pb.CacheManifest, inline: dict[int, tuple[int, int]]) -> list[tuple]:
    """The pieces an entry file holds (key, offset, length, digest), from where its chunks' data
    lies (`kvmesh.store.entry_file.layout`): what a rebuilt index offers later writers to share."""
    found = []
    for index, key in piece_keys(manifest).items():
        if (place := inline.get(index)) is not None:
            f.seek(place[0])
            found.append((key, *place, data_digest(f.read(place[1]))))
    return found
