"""A cache into a store and back, in one call each."""


def put(store, cache, fp, tokens, press=None, **options):
    """Encode a sparse cache into a store (EncodeOptions from keywords); returns its manifest."""
    from kvmesh.codec.encode import EncodeOptions, encode_cache

    return store.add(*encode_cache(cache, fp, tokens, press, options=EncodeOptions(**options)))


def load(store, cache_id):
    """(manifest, decoded sparse cache) of a stored entry."""
    from kvmesh.codec.decode import decode_chunks

    manifest = store.manifest(cache_id)
    return manifest, decode_chunks(manifest, store.chunks(cache_id))
