"""The entry file: one cache as it lies on disk and as `kvmesh cache export` writes it.

Layout:
    b"KVMESHC2"
    per chunk: u32 length | u64 xxh3-64 of the record | chunk frame (kvmesh.codec.chunks)
    serialized CacheManifest | u32 its length | u64 its xxh3-64 | b"KVMESHF1"

The chunks come first because the manifest is complete (sizes, digest, id) only once they are
encoded; a reader finds the manifest through the fixed-size footer. Every record carries its own
checksum, so damage on disk is found before a byte of it is served. A record is the frame a peer
sends, so serving a file is reading it.

Files of kvmesh 0.2 (b"KVMESHC1") hold each chunk as a serialized protobuf `Chunk`; they are read
all the same, each record turned into a frame as it is read.
"""

import os
import struct
from collections.abc import Iterator
from typing import BinaryIO

import xxhash

from kvmesh.codec.chunks import FRAME_HEADER, Chunk, parse_frame
from kvmesh.codec.limits import max_encoded_length
from kvmesh.errors import IntegrityError, StoreError
from kvmesh.v1 import cache_pb2 as pb

MAGIC, FOOTER_MAGIC = b"KVMESHC2", b"KVMESHF1"
MAGIC_V1 = b"KVMESHC1"
RECORD_HEADER = struct.Struct("<IQ")
FOOTER = struct.Struct("<IQ8s")
MAX_MANIFEST_BYTES = 16 << 20


def write_header(f: BinaryIO) -> None:
    f.write(MAGIC)


def write_record(f: BinaryIO, *parts: bytes | memoryview) -> None:
    """One record made of `parts` (a frame, or a chunk's header and data, written as they are)."""
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    f.write(RECORD_HEADER.pack(sum(len(p) for p in parts), h.intdigest()))
    for part in parts:
        f.write(part)


def write_chunk(f: BinaryIO, chunk: Chunk) -> None:
    write_record(f, chunk.header(), chunk.data)


def write_footer(f: BinaryIO, manifest: pb.CacheManifest) -> None:
    data = manifest.SerializeToString()
    f.write(data)
    f.write(FOOTER.pack(len(data), xxhash.xxh3_64_intdigest(data), FOOTER_MAGIC))


def read_manifest(f: BinaryIO, source: str) -> pb.CacheManifest:
    """The manifest from an entry file's footer (the file position is left after the magic)."""
    try:
        if f.read(len(MAGIC)) not in (MAGIC, MAGIC_V1):
            raise IntegrityError(f"{source}: not a kvmesh cache file")
        end = f.seek(0, os.SEEK_END)
        if end < len(MAGIC) + FOOTER.size:
            raise IntegrityError(f"{source}: truncated cache file")
        f.seek(end - FOOTER.size)
        length, checksum, magic = FOOTER.unpack(f.read(FOOTER.size))
        if magic != FOOTER_MAGIC or length > min(MAX_MANIFEST_BYTES, end - FOOTER.size - len(MAGIC)):
            raise IntegrityError(f"{source}: truncated or corrupt cache file (no manifest footer)")
        f.seek(end - FOOTER.size - length)
        data = f.read(length)
        if xxhash.xxh3_64_intdigest(data) != checksum:
            raise IntegrityError(f"{source}: the manifest is corrupt")
        manifest = pb.CacheManifest.FromString(data)
        f.seek(len(MAGIC))
        return manifest
    except OSError as e:
        raise StoreError(f"{source}: cannot read: {e.strerror or e}") from e


def read_records(f: BinaryIO, manifest: pb.CacheManifest, source: str) -> Iterator[bytes]:
    """The chunk frames of an entry file, each checked against its record checksum."""
    f.seek(0)
    v1 = f.read(len(MAGIC)) == MAGIC_V1
    limit = max_encoded_length(manifest.encoding.chunk_size) + 1024
    for i in range(manifest.encoding.chunk_count):
        header = f.read(RECORD_HEADER.size)
        if len(header) != RECORD_HEADER.size:
            raise IntegrityError(f"{source}: truncated at chunk {i}")
        length, checksum = RECORD_HEADER.unpack(header)
        if length > limit:
            raise IntegrityError(f"{source}: chunk {i} record of {length} bytes is oversized")
        data = f.read(length)
        if len(data) != length or xxhash.xxh3_64_intdigest(data) != checksum:
            raise IntegrityError(f"{source}: chunk {i} is damaged on disk")
        yield frame_of_v1(data) if v1 else data


def frame_of_v1(record: bytes) -> bytes:
    """A kvmesh 0.2 record (a serialized protobuf Chunk) as a chunk frame."""
    c = pb.Chunk.FromString(record)
    return Chunk(c.index, c.tensor, c.byte_offset, c.raw_length, c.checksum, c.data).frame()


def read_chunks(f: BinaryIO, manifest: pb.CacheManifest, source: str) -> Iterator[Chunk]:
    for i, frame in enumerate(read_records(f, manifest, source)):
        yield parse_frame(frame, f"{source}: chunk {i}")


def estimated_size(manifest: pb.CacheManifest) -> int:
    """About how many bytes the entry file of this manifest takes (a little more, never much less)."""
    per_chunk = RECORD_HEADER.size + FRAME_HEADER.size
    return (
        len(MAGIC)
        + manifest.encoding.encoded_bytes
        + manifest.encoding.chunk_count * per_chunk
        + manifest.ByteSize()
        + FOOTER.size
    )
