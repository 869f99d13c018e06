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

A blockwise entry (b"KVMESHC3", `kvmesh.store.blocks`) may hold, in place of a chunk's data, a
reference to where another entry file of the store holds the same block: its record is the frame
header, then REF (that entry's id, the data's offset and length in its file, and the data's
xxh3-64), its length flagged with REF_FLAG. Reading resolves it (checking those bytes against that
digest), so a reader sees frames as ever; `kvmesh cache export` writes them out whole.
"""

import os
import struct
from collections.abc import Callable, Iterator
from typing import BinaryIO

import xxhash

from kvmesh.codec.chunks import FRAME_HEADER, Chunk, parse_frame
from kvmesh.codec.limits import max_encoded_length
from kvmesh.errors import IntegrityError, StoreError
from kvmesh.v1 import cache_pb2 as pb

MAGIC, FOOTER_MAGIC = b"KVMESHC2", b"KVMESHF1"
MAGIC_V1 = b"KVMESHC1"
MAGIC_BLOCKS = b"KVMESHC3"
RECORD_HEADER = struct.Struct("<IQ")
# A reference record: the segment's cache id (16 bytes), the data's offset and length, its xxh3-64.
REF = struct.Struct("<16sQIQ")
REF_FLAG = 1 << 31
# Opens another entry file of the store, by cache id, for reading (its references resolve through it).
Segments = Callable[[str], BinaryIO]
FOOTER = struct.Struct("<IQ8s")
MAX_MANIFEST_BYTES = 16 << 20


def write_header(f: BinaryIO, *, blocks: bool = False) -> None:
    f.write(MAGIC_BLOCKS if blocks else MAGIC)


def write_record(f: BinaryIO, *parts: bytes | memoryview) -> None:
    """One record made of `parts` (a frame, or a chunk's header and data, written as they are)."""
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    f.write(RECORD_HEADER.pack(sum(len(p) for p in parts), h.intdigest()))
    for part in parts:
        f.write(part)


def write_chunk(f: BinaryIO, chunk: Chunk) -> int:
    """Write the chunk's record; the offset of its data in the file (where a reference points)."""
    write_record(f, chunk.header(), chunk.data)
    return f.tell() - len(chunk.data)


def write_ref(f: BinaryIO, chunk: Chunk, segment: str, offset: int) -> None:
    """A record of `chunk` whose data lies at `offset` in the entry file of `segment`."""
    ref = REF.pack(bytes.fromhex(segment), offset, len(chunk.data), xxhash.xxh3_64_intdigest(chunk.data))
    header = chunk.header()
    h = xxhash.xxh3_64()
    h.update(header)
    h.update(ref)
    f.write(RECORD_HEADER.pack((len(header) + len(ref)) | REF_FLAG, h.intdigest()))
    f.write(header)
    f.write(ref)


def write_footer(f: BinaryIO, manifest: pb.CacheManifest) -> None:
    data = manifest.SerializeToString()
    f.write(data)
    f.write(FOOTER.pack(len(data), xxhash.xxh3_64_intdigest(data), FOOTER_MAGIC))


def read_manifest(f: BinaryIO, source: str) -> pb.CacheManifest:
    """The manifest from an entry file's footer (the file position is left after the magic)."""
    try:
        if f.read(len(MAGIC)) not in (MAGIC, MAGIC_V1, MAGIC_BLOCKS):
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


def read_records(
    f: BinaryIO, manifest: pb.CacheManifest, source: str, segments: Segments | None = None
) -> Iterator[bytes]:
    """The chunk frames of an entry file, each checked against its record checksum; references
    resolved through `segments` (IntegrityError when there is none to resolve them)."""
    f.seek(0)
    v1 = f.read(len(MAGIC)) == MAGIC_V1
    limit = max_encoded_length(manifest.encoding.chunk_size) + 1024
    for i in range(manifest.encoding.chunk_count):
        header = f.read(RECORD_HEADER.size)
        if len(header) != RECORD_HEADER.size:
            raise IntegrityError(f"{source}: truncated at chunk {i}")
        length, checksum = RECORD_HEADER.unpack(header)
        ref = bool(length & REF_FLAG)
        length &= ~REF_FLAG
        if length > limit:
            raise IntegrityError(f"{source}: chunk {i} record of {length} bytes is oversized")
        data = f.read(length)
        if len(data) != length or xxhash.xxh3_64_intdigest(data) != checksum:
            raise IntegrityError(f"{source}: chunk {i} is damaged on disk")
        if ref:
            yield resolve(data, segments, f"{source}: chunk {i}", limit)
        else:
            yield frame_of_v1(data) if v1 else data


def resolve(record: bytes, segments: Segments | None, where: str, limit: int) -> bytes:
    """The frame a reference record stands for: its header, then the bytes it points to."""
    if len(record) != FRAME_HEADER.size + REF.size:
        raise IntegrityError(f"{where}: a malformed reference")
    if segments is None:
        raise IntegrityError(f"{where}: refers to another entry of a store (export it from there)")
    segment, offset, length, digest = REF.unpack_from(record, FRAME_HEADER.size)
    if length > limit:
        raise IntegrityError(f"{where}: a reference of {length} bytes is oversized")
    try:
        seg = segments(segment.hex())
        seg.seek(offset)
        data = seg.read(length)
    except FileNotFoundError:
        raise IntegrityError(f"{where}: the entry it refers to ({segment.hex()}) is gone") from None
    except OSError as e:
        raise StoreError(f"{where}: cannot read the entry it refers to: {e.strerror or e}") from e
    if len(data) != length or xxhash.xxh3_64_intdigest(data) != digest:
        raise IntegrityError(f"{where}: the block it refers to in {segment.hex()} is damaged")
    return record[: FRAME_HEADER.size] + data


def layout(f: BinaryIO, manifest: pb.CacheManifest) -> tuple[set[str], int, dict[int, tuple[int, int]]]:
    """What an entry file refers to and how many data bytes its references stand for, and where
    each chunk's data lies in it when it holds the data itself (by chunk index: offset, length),
    read from its record headers: the index's rows of them are rebuilt from this. Damage is left to
    the reads that check every record."""
    f.seek(0)
    blocks = f.read(len(MAGIC)) == MAGIC_BLOCKS
    refs, referred, inline = set(), 0, {}
    for i in range(manifest.encoding.chunk_count):
        header = f.read(RECORD_HEADER.size)
        if len(header) != RECORD_HEADER.size:
            break
        length, _ = RECORD_HEADER.unpack(header)
        if blocks and length & REF_FLAG:
            record = f.read(length & ~REF_FLAG)
            if len(record) == FRAME_HEADER.size + REF.size:
                segment, _, length, _ = REF.unpack_from(record, FRAME_HEADER.size)
                refs.add(segment.hex())
                referred += length
        else:
            inline[i] = (f.tell() + FRAME_HEADER.size, length - FRAME_HEADER.size)
            f.seek(length, os.SEEK_CUR)
    return refs, referred, inline


def frame_of_v1(record: bytes) -> bytes:
    """A kvmesh 0.2 record (a serialized protobuf Chunk) as a chunk frame."""
    c = pb.Chunk.FromString(record)
    return Chunk(c.index, c.tensor, c.byte_offset, c.raw_length, c.checksum, c.data).frame()


def read_chunks(
    f: BinaryIO, manifest: pb.CacheManifest, source: str, segments: Segments | None = None
) -> Iterator[Chunk]:
    for i, frame in enumerate(read_records(f, manifest, source, segments)):
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
