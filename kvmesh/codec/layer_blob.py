"""A transform-coded layer's blob as bytes, without MLX: its header, its segments, its packed codes,
and the blob of a shorter prefix of it (what the store and the daemon need to serve one).

The layout (`kvmesh.codec.transform` makes and decodes blobs): `MAGIC` (`MAGIC_RAW_DTYPE` when its
raw rows are not float16, `MAGIC_TAIL` when its last coded rows have steps of their own), a
little-endian u32 header length, a canonical JSON header, the segments.
"""

import json
import struct
import threading
from typing import Any

import numpy as np
import zstandard

from kvmesh.codec.cpu_kernels import ESCAPE, packed_codes

MAGIC = b"KVTC\x01"
MAGIC_RAW_DTYPE = b"KVTC\x02"
MAGIC_TAIL = b"KVTC\x03"
# A layer predicted from the one before (kvmesh.codec.prediction): its header says `predicted`.
MAGIC_PREDICTED = b"KVTC\x04"
MAGICS = (MAGIC, MAGIC_RAW_DTYPE, MAGIC_TAIL, MAGIC_PREDICTED)
# Bits per packed code, and bytes per value of the dtypes raw rows travel in.
WIDTHS = (2, 4, 8)
RAW_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


class TransformCodecError(ValueError):
    """Bytes this codec cannot decode, or arrays it cannot encode."""


def pack_zigzag(zz: np.ndarray, width: int) -> tuple[bytes, bytes]:
    """Zigzagged codes -> (packed codes of `width` bits, escapes): `kvmesh.codec.transform.pack_codes` at a
    given width (one compiled pass: `kvmesh.codec.cpu_kernels.packed_codes`)."""
    plane, escapes = packed_codes(np.ascontiguousarray(zz, dtype=np.uint32), width)
    return plane.tobytes(), escapes.astype("<u4").tobytes()


def cut_codes(width: int, plane: bytes, escapes: bytes, rows: int, cols: int, kept: int) -> tuple[bytes, bytes]:
    """The packed codes of a (rows, cols) array of codes, row-major -> those of its first `kept`
    columns, packed at the same width: (plane, escapes). Bytes stay bytes: one-byte codes are sliced
    as they are (with their escapes), smaller ones unpacked to a byte each and packed again."""
    packed = np.frombuffer(plane, dtype=np.uint8)
    per = 8 // width if width in WIDTHS else 0
    if not per or packed.size != -(-rows * cols // per):
        raise TransformCodecError(f"{packed.size} packed bytes for {rows * cols} codes of {width} bits")
    if width == 8:
        codes = packed.reshape(rows, cols)
        big = codes == ESCAPE
        esc = np.frombuffer(escapes, dtype="<u4")
        if esc.size != int(np.count_nonzero(big)):
            raise TransformCodecError("escape count does not match the plane")
        inside = np.zeros(big.shape, dtype=bool)
        inside[:, :kept] = True
        return codes[:, :kept].tobytes(), esc[inside[big]].tobytes()  # (escapes in the codes' order)
    shifts = (np.arange(per) * width).astype(np.uint8)
    codes = ((packed[:, None] >> shifts) & np.uint8((1 << width) - 1)).reshape(-1)[: rows * cols]
    return pack_zigzag(np.ascontiguousarray(codes.reshape(rows, cols)[:, :kept]).reshape(-1), width)


# The smallest hash table zstd has (2^6 entries) for a layer's segments, at the given level: so it
# finds few matches. What compresses packed codes is the entropy coding of their bytes (zstd's
# Huffman tables), which each match interrupts for a few bytes' gain; with its own table, level 1
# found more matches than paid. On SmolLM2's three bench texts (2026-12-05, a throwaway script):
# 1.5% smaller at the default level, 2.1% at `small` (6.90x -> 7.04x at step 0.48), as small as
# level 19 with ten times less coding time, and coded as fast as level 1 with its own table.
ZSTD_HASH_LOG = 6


class Writer:
    """A layer's blob as it is made: its segments, each added as it comes (zstd-coded or raw)."""

    def __init__(self, level: int):
        params = zstandard.ZstdCompressionParameters.from_level(level, hash_log=ZSTD_HASH_LOG)
        self.compressor = zstandard.ZstdCompressor(compression_params=params)
        self.segments: list[bytes] = []

    def add(self, blob: bytes, compress: bool) -> list[int]:
        """Add a segment; its reference in the header ([index, compressed])."""
        self.segments.append(self.compressor.compress(blob) if compress else blob)
        return [len(self.segments) - 1, int(compress)]

    def blob(self, header: dict, magic: bytes) -> bytes:
        """MAGIC, a u32 header length, the canonical JSON header (with the segments' offsets), the segments."""
        offsets, at = [], 0
        for seg in self.segments:
            offsets.append([at, len(seg)])
            at += len(seg)
        text = json.dumps({**header, "segments": offsets}, sort_keys=True, separators=(",", ":")).encode()
        return magic + struct.pack("<I", len(text)) + text + b"".join(self.segments)


def blob_magic(raw_dtypes: set[str], tail: bool, predicted: bool = False) -> bytes:
    """The magic of a blob whose raw rows are of `raw_dtypes`, that has a tail or not, and is
    predicted from the layer before or not: the oldest that says what it holds, so that an older
    kvmesh reads what it can and refuses what it would misread."""
    if predicted:
        return MAGIC_PREDICTED
    if tail:
        return MAGIC_TAIL
    return MAGIC if raw_dtypes == {"float16"} else MAGIC_RAW_DTYPE


def coding_fields(header: dict) -> dict[str, Any]:
    """What a layer's header says of its coding, by the names of the manifest's `TransformSpec`
    fields that state it too (raw rows, steps and components, its tail's, whether it is predicted
    from the layer before; a header without a tail: zeros). None for a field a malformed header lacks."""
    k, v = header.get("k", {}), header.get("v", {})
    return {
        "sinks": header.get("sinks"),
        "recent": header.get("recent"),
        "key_step": k.get("step"),
        "value_step": v.get("step"),
        "key_components": k.get("n"),
        "value_components": v.get("n"),
        "tail": header.get("tail", 0),
        "key_tail_step": k.get("tail", {}).get("step", 0.0),
        "value_tail_step": v.get("tail", {}).get("step", 0.0),
        "key_tail_components": k.get("tail", {}).get("n", 0),
        "value_tail_components": v.get("tail", {}).get("n", 0),
        "predicted": header.get("predicted", False),
    }


CODING_FIELDS = tuple(coding_fields({}))


def read_header(data: bytes | memoryview) -> tuple[dict, memoryview]:
    """The header of a layer's blob and the segments' bytes."""
    view = memoryview(data)
    magic = bytes(view[: len(MAGIC)])
    if magic not in MAGICS:
        if len(magic) == len(MAGIC) and magic[:4] == MAGIC[:4] and magic[4] > MAGICS[-1][4]:
            raise TransformCodecError(f"a transform-coded layer of a newer kvmesh (version {magic[4]}): upgrade kvmesh")
        raise TransformCodecError("not a transform-coded layer (bad magic)")
    try:
        (n,) = struct.unpack_from("<I", view, len(MAGIC))
        start = len(MAGIC) + 4
        header = json.loads(bytes(view[start : start + n]))
    except (struct.error, ValueError) as e:
        raise TransformCodecError(f"unreadable header: {e}") from None
    if not isinstance(header, dict):
        raise TransformCodecError("unreadable header: not an object")
    return header, view[start + n :]


_decompressors = threading.local()


def _decompressor() -> zstandard.ZstdDecompressor:
    """This thread's zstd decompressor (one is not to be shared by threads; making one per layer held
    the GIL 30-50 us a layer, while the other layer thread waited for it)."""
    found = getattr(_decompressors, "one", None)
    if found is None:
        found = _decompressors.one = zstandard.ZstdDecompressor()
    return found


class Segments:
    """The segments of a layer's blob, each read at most to the size it may have."""

    def __init__(self, header: dict, body: memoryview):
        self.offsets, self.body = header["segments"], body
        self.decompressor = _decompressor()

    def __call__(self, ref: list[int], size: int) -> bytes:
        """Segment `ref`, which must inflate to at most `size` bytes (never allocating more)."""
        at, length = self.offsets[ref[0]]
        blob = self.body[at : at + length]
        if not ref[1]:
            return bytes(blob)
        declared = zstandard.frame_content_size(blob)
        if declared > size:
            raise TransformCodecError(f"a segment declares {declared:,} bytes where at most {size:,} fit")
        return self.decompressor.decompress(blob, max_output_size=size)


def cut_rows(tokens: int, sinks: int, recent: int, num_tokens: int, tail: int = 0) -> tuple[int, int, int]:
    """(sinks, recent, tail) of the first `num_tokens` rows of a layer of `tokens` rows of which
    `sinks` lead and `recent` trail raw, the `tail` rows before those coded finer: each kind of row
    of the prefix is the whole's of that kind that lies in it."""
    kept_sinks = min(sinks, num_tokens)
    kept_tail = max(0, min(num_tokens, tokens - recent) - (tokens - recent - tail))
    coded_end = max(kept_sinks, min(num_tokens, tokens - recent))
    return kept_sinks, num_tokens - coded_end, kept_tail


def coded_regions(tokens: int, sinks: int, recent: int, tail: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The rows [lo, hi) of a layer's body and of its tail, between the raw sink and recent rows."""
    return (sinks, tokens - recent - tail), (tokens - recent - tail, tokens - recent)


def cut_layer(data: bytes | memoryview, num_tokens: int, level: int = 1) -> bytes:
    """The blob of a layer's first `num_tokens` rows, which decodes to exactly the first `num_tokens`
    rows the whole blob decodes to.

    Each row's coefficients are rounded on their own, so the prefix's codes are the whole's first
    rows, re-packed at the same widths; it keeps the steps, components and groups, and each group's
    centroid offset too (the whole layer's codes set it: an encoding of the prefix afresh would
    measure another, and decode to other numbers). Its raw rows are the whole's that lie in it.
    No basis is needed and nothing is decoded to numbers.
    """
    header, body = read_header(data)
    try:
        return _cut_layer(header, Segments(header, body), num_tokens, bytes(memoryview(data)[: len(MAGIC)]), level)
    except (KeyError, IndexError, TypeError, ValueError, zstandard.ZstdError) as e:
        if isinstance(e, TransformCodecError):
            raise
        raise TransformCodecError(f"a malformed layer blob: {type(e).__name__}: {e}") from None


def _cut_layer(header: dict, seg: Segments, num_tokens: int, magic: bytes, level: int) -> bytes:
    b, h, t, d = header["shape"]
    if not 0 < num_tokens <= t:
        raise TransformCodecError(f"a layer of {t} rows has no prefix of {num_tokens}")
    s, r, tail = header["sinks"], header["recent"], header.get("tail", 0)
    check_tail(header, t - s - r)
    kept_sinks, kept_recent, kept_tail = cut_rows(t, s, r, num_tokens, tail)
    body, kept_body = t - s - r - tail, num_tokens - kept_sinks - kept_recent - kept_tail
    out = Writer(level)
    cut = {k: v for k, v in header.items() if k not in ("segments", "tail")}
    cut.update(shape=[b, h, num_tokens, d], sinks=kept_sinks, recent=kept_recent)
    if kept_tail:
        cut["tail"] = kept_tail
    if "seg" in header["positions"]:
        pos = np.frombuffer(seg(header["positions"]["seg"], 4 * b * h * t), dtype="<i4").reshape(b, h, t)
        rows = np.ascontiguousarray(pos[:, :, :num_tokens]).tobytes()
        cut["positions"] = {"shape": [b, h, num_tokens], "seg": out.add(rows, True)}
    for kind in "kv":
        km = header[kind]
        cut[kind] = {k: v for k, v in km.items() if k != "tail"}
        cut[kind]["groups"] = _cut_groups(km["groups"], seg, out, b, body, kept_body)
        if kept_tail:  # (a prefix that keeps none of the tail is a blob without one)
            groups = _cut_groups(km["tail"]["groups"], seg, out, b, tail, kept_tail)
            cut[kind]["tail"] = {**km["tail"], "groups": groups}
        row = RAW_ITEMSIZE[km.get("raw_dtype", "float16")] * d
        raw = np.frombuffer(seg(km["raw"], b * h * (s + r) * row), np.uint8).reshape(b, h, s + r, row)
        kept = np.concatenate([raw[:, :, :kept_sinks], raw[:, :, s : s + kept_recent]], axis=2)
        cut[kind]["raw"] = out.add(kept.tobytes(), False)
    if not kept_tail and magic == MAGIC_TAIL:  # (a predicted layer has no tail)
        magic = blob_magic({header[kind].get("raw_dtype", "float16") for kind in "kv"}, tail=False)
    return out.blob(cut, magic)


def check_tail(header: dict, coded: int) -> None:
    """A header's tail: between 0 and its `coded` rows, with the keys' and values' own steps and
    components exactly when it has rows."""
    tail = header.get("tail", 0)
    if not (isinstance(tail, int) and 0 <= tail <= coded):
        raise TransformCodecError(f"a tail of {tail!r} rows where {coded} are coded")
    if any(("tail" in header[kind]) != bool(tail) for kind in "kv"):
        raise TransformCodecError(f"a tail of {tail} rows, and steps for it {'missing' if tail else 'without one'}")


def _cut_groups(groups: list, seg: Segments, out: Writer, b: int, rows: int, kept: int) -> list:
    """A region's runs of components, each cut from `rows` to its first `kept` rows, added to `out`."""
    cut = []
    for count, width, plane_ref, esc_ref, delta in groups:
        if width not in WIDTHS:
            raise TransformCodecError(f"a group of {count} components of {width} bits")
        values = count * b * rows  # codes (count, b, rows), component-major: rows of (count * b, rows)
        esc = seg(esc_ref, 4 * values) if esc_ref is not None else b""
        plane, esc = cut_codes(width, seg(plane_ref, -(-values // (8 // width))), esc, count * b, rows, kept)
        cut.append([count, width, out.add(plane, True), out.add(esc, True) if esc else None, delta])
    return cut
