"""A coded copy of a full cache: its chunks decoded, transform coded at a level, encoded again.

A receiver on a slow link would rather fetch a transform-coded copy (5.1x smaller than float16 at
the default level) than a full one. When a sender holds only the full copy and the model's basis,
it codes the full copy at the level the receiver asks for (kvmesh.net.on_request), keeps that copy
and serves it. Needs MLX, but not the model: the basis is all the codec needs.

The sender cannot measure the coded copy's loss without the model. Its manifest carries the loss
its level measured on the bench's texts instead (metric LEVEL_KL), so receivers' quality floors
still hold it to a figure, and people can see where the figure came from.
"""

from collections.abc import Iterable

from kvmesh.codec.basis import Basis
from kvmesh.codec.chunks import parse_frame
from kvmesh.codec.coded import CodedLayer, code_at_level
from kvmesh.codec.decode import decode_chunks
from kvmesh.codec.encode import Encoded, encode_cache
from kvmesh.codec.levels import LEVELS
from kvmesh.codec.manifest import LEVEL_KL, uncodable_reason
from kvmesh.codec.prefix import PrefixKey
from kvmesh.errors import KvmeshError
from kvmesh.model.fingerprint import ModelFingerprint
from kvmesh.v1 import cache_pb2 as pb


def code_copy(
    manifest: pb.CacheManifest, records: Iterable[bytes], *, level: str, basis: Basis, node_id: str = ""
) -> Encoded:
    """The cache of `manifest`, from its chunk `records` (frames, as stored and sent), transform coded
    at `level` with `basis`: the coded copy's manifest and chunks (its sizes, digest and id are filled
    in as the chunks are consumed, as the store does). Raises KvmeshError when it cannot be coded
    (`uncodable_reason`, or a basis that covers none of its layers), IntegrityError when a record
    is damaged, or the level does not exist."""
    if why := uncodable_reason(manifest):
        raise KvmeshError(f"it cannot be transform coded: {why}")
    coded = code_at_level(decode_chunks(manifest, map(parse_frame, records)), basis, level)
    if not any(isinstance(layer, CodedLayer) for layer in coded):
        raise KvmeshError(f"the basis {basis.digest[:12]} covers none of its layers")
    fp, prefix = ModelFingerprint.from_proto(manifest.model), PrefixKey.from_proto(manifest.prefix)
    encoded = encode_cache(coded, fp, prefix, node_id=node_id)
    encoded.manifest.quality.CopyFrom(pb.Quality(metric=LEVEL_KL, value=LEVELS[level].kl))
    return encoded
