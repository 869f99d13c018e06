"""The entry file: one cache as it lies on disk and as `kvmesh cache export` writes it.

Layout:
    b"KVMESHC1"
    per chunk: u32 length | u64 xxh3-64 of the record | serialized Chunk
    serialized CacheManifest | u32 its length | u64 its xxh3-64 | b"KVMESHF1"

The chunks come first because the manifest is complete (sizes, digest, id) only once they are
encoded; a reader finds the manifest through the fixed-size footer. Every record carries its own
checksum, so damage on disk is found before a byte of it is served.
"""

import os
import struct
from collections.abc import Iterator
from typing import BinaryIO

import xxhash

from kvmesh.codec.limits import max_encoded_length
from kvmesh.errors import IntegrityError, StoreError
from kvmesh.v1 import cache_pb2 as pb

MAGIC, FOOTER_MAGIC = b"KVMESHC1", b"KVMESHF1"
RECORD_HEADER = struct.Struct("<IQ")
FOOTER = struct.Struct("<IQ8s")
MAX_MANIFEST_BYTES = 16 << 20


def write_header(f: BinaryIO) -> None:
    f.write(MAGIC)


def write_record(f: BinaryIO, data: bytes) -> None:
    f.write(RECORD_HEADER.pack(len(data), xxhash.xxh3_64_intdigest(data)))
    f.write(data)


def write_footer(f: BinaryIO, manifest: pb.CacheManifest) -> None:
    data = manifest.SerializeToString()
    f.write(data)
    f.write(FOOTER.pack(len(data), xxhash.xxh3_64_intdigest(data), FOOTER_MAGIC))


def read_manifest(f: BinaryIO, source: str) -> pb.CacheManifest:
    """The manifest from an entry file's footer (the file position is left after the magic)."""
    try:
        if f.read(len(MAGIC)) != MAGIC:
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
    """The chunk records after the magic, each checked against its record checksum."""
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
        yield data


def read_chunks(f: BinaryIO, manifest: pb.CacheManifest, source: str) -> Iterator[pb.Chunk]:
    return map(pb.Chunk.FromString, read_records(f, manifest, source))


def estimated_size(manifest: pb.CacheManifest) -> int:
    """About how many bytes the entry file of this manifest takes (a little more, never much less)."""
    per_chunk = RECORD_HEADER.size + 32  # record header, and the Chunk message's own fields
    return (
        len(MAGIC)
        + manifest.encoding.encoded_bytes
        + manifest.encoding.chunk_count * per_chunk
        + manifest.ByteSize()
        + FOOTER.size
    )
