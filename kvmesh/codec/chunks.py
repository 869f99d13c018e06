"""Chunks on the wire and on disk: framed, checked, decompressed, digested. Needs no MLX.

Each chunk holds whole token rows of one tensor, compressed on its own (zstd or nothing), with its
raw length and an xxh3-64 checksum of its raw bytes. A chunk travels, and lies in a store file, as
one frame: a fixed 32-byte header, then its bytes. The header is read with `struct`, and the bytes
stay where gRPC or the file put them (a memoryview) until they are decoded into the cache: no
protobuf parsing and no copy per chunk. The payload digest is xxh3-128 over every
chunk's (raw length, checksum) in order, so a receiver can verify completeness and order without a
second pass over the data, and a store can cut a dense cache's prefix without re-hashing it.

`ChunkChecker` is all a store or a server needs; turning MLX caches into chunks and back is
`kvmesh.codec.encode` and `kvmesh.codec.decode`.
"""

import os
import struct
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import xxhash
import zstandard

from kvmesh.codec.limits import max_encoded_length
from kvmesh.codec.manifest import ITEMSIZE, chunk_plan, tensor_dtype, tensor_specs
from kvmesh.errors import IntegrityError
from kvmesh.v1 import cache_pb2 as pb

T = TypeVar("T")
R = TypeVar("R")
_local = threading.local()
# A chunk's decoded bytes: a view of its frame (no codec), or what decompression made.
Raw = bytes | memoryview | np.ndarray
# Threads that decode chunks at once: one per core (zstd and numpy's copies release the GIL).
DECODE_THREADS = os.cpu_count() or 2
# magic, index, tensor, byte_offset, raw_length, checksum (xxh3-64 of the raw bytes).
FRAME_HEADER = struct.Struct("<4sIIQIQ")
FRAME_MAGIC = b"KVCF"


@dataclass
class Chunk:
    """One chunk: which bytes of which tensor it holds, their checksum, and its encoded `data`."""

    index: int
    tensor: int
    byte_offset: int
    raw_length: int
    checksum: int
    data: bytes | memoryview

    def header(self) -> bytes:
        return FRAME_HEADER.pack(FRAME_MAGIC, self.index, self.tensor, self.byte_offset, self.raw_length, self.checksum)

    def frame(self) -> bytes:
        """The chunk as it travels and is stored: header, then data."""
        return b"".join((self.header(), self.data))


def parse_frame(frame: bytes | memoryview, where: str = "chunk") -> Chunk:
    """The chunk in a frame; its data is a view of the frame, not a copy.

    IntegrityError when it is not a frame: too short, or another framing (an older peer's).
    """
    if len(frame) < FRAME_HEADER.size:
        raise IntegrityError(f"{where}: {len(frame)} bytes, too short for a chunk frame")
    magic, index, tensor, byte_offset, raw_length, checksum = FRAME_HEADER.unpack_from(frame)
    if magic != FRAME_MAGIC:
        raise IntegrityError(f"{where}: not a kvmesh chunk frame (magic {bytes(magic)!r})")
    return Chunk(index, tensor, byte_offset, raw_length, checksum, memoryview(frame)[FRAME_HEADER.size :])


# Several frames in one message (a fetch whose receiver asks for it, FetchOpen.frame_batches):
# magic, frame count, then each frame's length (u32), then the frames. A copy of many small chunks
# (an 8-bit cache: six tensors a layer) otherwise costs a message per chunk, which both ends and
# the peer port's relay handle one by one: 1,440 messages for 1,024 tokens of SmolLM2.
BATCH_HEADER = struct.Struct("<4sI")
BATCH_MAGIC = b"KVCB"
BATCH_LENGTH = struct.Struct("<I")
# A batch ends once it holds this many bytes; a frame this large or larger travels alone.
BATCH_BYTES = 256 << 10


def batch_frames(frames: Iterable[bytes], max_bytes: int = BATCH_BYTES) -> Iterator[tuple[bytes, list[int]]]:
    """Consecutive frames as messages of up to about `max_bytes` (a frame is never split): each a
    lone frame, or a batch of several; with the length of each frame in it."""
    pending: list[bytes] = []
    size = 0

    def message() -> tuple[bytes, list[int]]:
        lengths = [len(f) for f in pending]
        if len(pending) == 1:
            return pending[0], lengths
        header = BATCH_HEADER.pack(BATCH_MAGIC, len(pending)) + struct.pack(f"<{len(pending)}I", *lengths)
        return b"".join((header, *pending)), lengths

    for frame in frames:
        if pending and size + len(frame) > max_bytes:
            yield message()
            pending, size = [], 0
        pending.append(frame)
        size += len(frame)
    if pending:
        yield message()


def frames_in(message: bytes | memoryview, where: str = "message") -> list[memoryview]:
    """The frames in one message, views of it: the message itself when it is one frame, else each
    frame of a batch (`batch_frames`). IntegrityError when a batch's lengths do not add up."""
    view = memoryview(message)
    if bytes(view[:4]) != BATCH_MAGIC:
        return [view]
    if len(view) < BATCH_HEADER.size:
        raise IntegrityError(f"{where}: {len(view)} bytes, too short for a batch of chunk frames")
    _, count = BATCH_HEADER.unpack_from(view)
    start = BATCH_HEADER.size + count * BATCH_LENGTH.size
    if count < 1 or start > len(view):
        raise IntegrityError(f"{where}: a batch of {count} chunk frames does not fit in {len(view)} bytes")
    lengths = struct.unpack_from(f"<{count}I", view, BATCH_HEADER.size)
    if start + sum(lengths) != len(view):
        raise IntegrityError(f"{where}: its chunk frames add up to {sum(lengths)} bytes, it holds {len(view) - start}")
    frames = []
    for length in lengths:
        frames.append(view[start : start + length])
        start += length
    return frames


class FrameReader:
    """A stream's chunk frames one at a time, from messages that each hold one or a batch of them
    (`frames_in`): `next` takes a message, with `receive`, only once the last one's are all taken."""

    def __init__(self, receive: Callable[[str], bytes | memoryview]):
        self._receive = receive
        self._pending: deque[memoryview] = deque()

    def next(self, what: str) -> memoryview:
        if not self._pending:
            self._pending.extend(frames_in(self._receive(what), what))
        return self._pending.popleft()

    def check_done(self, announced: int) -> None:
        """IntegrityError when the latest message held more frames than the `announced` count."""
        if self._pending:
            raise IntegrityError(f"{len(self._pending)} chunk frames more than the {announced} announced")


def compressor(level: int) -> zstandard.ZstdCompressor:
    """zstd contexts are not thread-safe: one per thread and level."""
    cache = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local.decompressor


def shuffle(raw: np.ndarray, itemsize: int) -> np.ndarray:
    """Group the i-th byte of every value together: exponent bytes compress, mantissa bytes don't.

    One strided copy per byte plane: several times faster than a transposed copy in numpy.
    """
    values = raw.reshape(-1, itemsize)
    planes = np.empty((itemsize, values.shape[0]), np.uint8)
    for i in range(itemsize):
        planes[i] = values[:, i]
    return planes


def unshuffle(data: bytes, itemsize: int) -> np.ndarray:
    planes = np.frombuffer(data, np.uint8).reshape(itemsize, -1)
    values = np.empty((planes.shape[1], itemsize), np.uint8)
    for i in range(itemsize):
        values[:, i] = planes[i]
    return values


def payload_digest(slots: Iterable[tuple[int, int]]) -> bytes:
    """xxh3-128 (16 bytes) over the (raw length, checksum) of each chunk in order."""
    h = xxhash.xxh3_128()
    for raw_length, checksum in slots:
        h.update(struct.pack("<IQ", raw_length, checksum))
    return h.digest()


def ordered_map(
    fn: Callable[[T], R], items: Iterable[T], threads: int, *, inline: Callable[[T], bool] | None = None
) -> Iterator[R]:
    """fn over items on a thread pool, results in order, at most 2x threads results waiting.

    A result goes out as soon as it is done and the next item has come, not only once 2x threads
    items are in flight: a fetch's chunks come one by one off the wire, and a coded layer starts to
    decode when its chunk is out. Waiting for 2x threads (four on a 2-core box) held the first
    layer's decode back by as many chunks, and the last layers' until after the last byte (SmolLM2's
    coded cache over a 200 Mbit/s link, a throwaway A/B of 30 fetches each way: the first layer
    decoding at 8.6 ms against 21.6 before, the fetch 208.9 ms against 215.5, medians).

    An item that `inline` picks, when nothing is in flight, runs here and goes out at once: work
    too short to be worth a thread, whose result is waited for downstream (a coded layer's chunk,
    checked in 0.1 ms, then its layer decodes on threads of its own). On the pool it went out only
    with the next item, a chunk's wire time later: each of the first layers of SmolLM2's coded
    cache over a 1 Gbit/s link started to decode 1 ms after its chunk came.
    """
    if threads <= 1:
        yield from map(fn, items)
        return
    with ThreadPoolExecutor(threads) as pool:
        pending: deque[Future[R]] = deque()
        for item in items:
            if not pending and inline is not None and inline(item):
                yield fn(item)
                continue
            pending.append(pool.submit(fn, item))
            while pending and (len(pending) >= 2 * threads or pending[0].done()):
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


class ChunkChecker:
    """Checks the chunks of one manifest as they arrive, in order, and decodes each.

    Every check happens before a chunk's bytes are used: position in the payload, tensor and byte
    range, encoded size, decoded length and checksum; `finish` checks completeness and the digest.
    """

    def __init__(self, manifest: pb.CacheManifest):
        self.manifest = manifest
        self.plan = chunk_plan(manifest)
        self.specs = tensor_specs(manifest)
        self.sums: list[tuple[int, int]] = []

    def verified(self, chunks: Iterable[Chunk], threads: int = 1) -> Iterator[Chunk]:
        """Each chunk once it proved to be the next one, intact (decompressed on `threads` threads,
        results in order); after the last, `finish`: a consumer that reaches the end got the whole
        payload the manifest describes, so a store writing them keeps nothing that fails."""

        def decode(c: Chunk) -> Chunk:
            self.decode(c)
            return c

        for chunk in ordered_map(decode, chunks, threads):
            self.accept(chunk)
            yield chunk
        self.finish()

    def decode(self, chunk: Chunk) -> Raw:
        """Check one chunk against its slot in the plan, then decode it and verify its checksum.

        Needs no state, so chunks can be decoded on several threads.
        """
        if chunk.index >= len(self.plan):
            raise IntegrityError(f"chunk {chunk.index} is beyond the {len(self.plan)} the manifest announced")
        slot = self.plan[chunk.index]
        if (chunk.tensor, chunk.byte_offset, chunk.raw_length) != (slot.tensor, slot.byte_offset, slot.raw_length):
            raise IntegrityError(
                f"chunk {chunk.index} claims tensor {chunk.tensor} bytes {chunk.byte_offset}+{chunk.raw_length}; "
                f"the manifest puts it at tensor {slot.tensor} bytes {slot.byte_offset}+{slot.raw_length}"
            )
        raw = self._decode(chunk)
        if xxhash.xxh3_64_intdigest(raw.data if isinstance(raw, np.ndarray) else raw) != chunk.checksum:
            raise IntegrityError(f"chunk {chunk.index} is corrupt: its checksum does not match its bytes")
        return raw

    def accept(self, chunk: Chunk) -> None:
        """Record a decoded chunk, which must be the next one in the payload."""
        expected = len(self.sums)
        if chunk.index != expected:
            raise IntegrityError(
                f"chunk {chunk.index} arrived where chunk {expected} was expected (reordered, duplicated or lost)"
            )
        self.sums.append((chunk.raw_length, chunk.checksum))

    def _decode(self, chunk: Chunk) -> Raw:
        encoding = self.manifest.encoding
        if encoding.codec == pb.CODEC_NONE:
            if len(chunk.data) != chunk.raw_length:
                raise IntegrityError(
                    f"chunk {chunk.index} holds {len(chunk.data)} bytes, {chunk.raw_length} were announced"
                )
            return chunk.data
        if len(chunk.data) > max_encoded_length(chunk.raw_length):
            raise IntegrityError(f"chunk {chunk.index} is oversized: {len(chunk.data)} encoded bytes")
        try:
            size = zstandard.frame_content_size(chunk.data)
            if size != chunk.raw_length:
                raise IntegrityError(f"chunk {chunk.index} decodes to {size} bytes, {chunk.raw_length} were announced")
            raw = _decompressor().decompress(chunk.data)
        except zstandard.ZstdError as e:
            raise IntegrityError(f"chunk {chunk.index} is not valid zstd data: {e}") from e
        dtype = tensor_dtype(self.specs[chunk.tensor])
        if encoding.byte_shuffle and dtype != "uint32":
            return unshuffle(raw, ITEMSIZE[dtype])
        return raw

    def finish(self) -> None:
        """Every chunk arrived, and their digest is the manifest's."""
        if len(self.sums) != len(self.plan):
            raise IntegrityError(f"truncated: {len(self.sums)} of {len(self.plan)} chunks arrived")
        expected = self.manifest.encoding.payload_digest
        if expected and payload_digest(self.sums) != expected:
            raise IntegrityError("the payload digest does not match: the payload is not the one described")
