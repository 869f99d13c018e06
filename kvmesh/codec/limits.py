"""The sizes every manifest and chunk is held to, on both ends. Plain integers: no imports.

A receiver checks a manifest against these before it allocates anything, and both gRPC ends size
their message limits from the largest chunk allowed.
"""

MAX_LAYERS = 1024
MIN_CHUNK_SIZE = 4 << 10
MAX_CHUNK_SIZE = 16 << 20
MAX_BLOCK_SIZE = 1 << 16
# sha256 prefix hashes; the xxh3-128 payload digest.
HASH_BYTES = 32
DIGEST_BYTES = 16
# A per-model artefact (a transform basis): an 8B model's is ~130 MB in float16.
MAX_ARTIFACT_BYTES = 1 << 30
MAX_ARTIFACTS = 4


def is_sha256_hex(text: str) -> bool:
    """64 lowercase hex digits: how artefacts (transform bases) are named, on the wire and on disk."""
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


def max_encoded_length(raw_length: int) -> int:
    """zstd's worst case (ZSTD_COMPRESSBOUND) for incompressible data, rounded up."""
    return raw_length + (raw_length >> 7) + 512
