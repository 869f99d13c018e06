"""The three version numbers of kvmesh, and how each evolves.

- `__version__` (the package, semantic versioning): any release. Peers show it; nothing checks it.
- `SCHEMA_VERSION` (the cache manifest, `CacheManifest.schema_version`): raised whenever a manifest
  or the chunk and entry-file encoding it describes changes so that an older reader would misread
  it. Readers refuse other schemas before any chunk moves (reject reason `schema`), and a store
  opened by a newer kvmesh sets aside entries of a schema it cannot read. A manifest is written in
  the oldest schema that describes it, so that a change only new caches use leaves older peers able
  to read the rest: schema 4 adds transform-coded layers predicted from the layer before
  (`TransformSpec.predicted`), schema 3 is schema 4 without them, schema 2 is schema 3 without
  transform-coded layers' tails (`TransformSpec.tail`).
- `PROTOCOL_VERSION` (the peer-to-peer gRPC service): raised whenever a message of
  `kvmesh.v1.KvMesh` changes incompatibly. Peers advertise it in mDNS (`pv`) and `Info`; discovery
  ignores peers of another protocol.

Field numbers in `proto/` are never reused or renumbered; additions that old readers may ignore
need no bump. The loopback `Control` service changes with the package (CLI and daemon ship together).
"""

__version__ = "0.2.0"
SCHEMA_VERSION = 4
# The first schemas with transform-coded layers' tails and with predicted layers, and the schemas
# this kvmesh reads (and writes: the oldest that describes a manifest,
# kvmesh.codec.manifest.manifest_schema).
TAIL_SCHEMA = 3
PREDICTED_SCHEMA = 4
READABLE_SCHEMAS = (2, TAIL_SCHEMA, PREDICTED_SCHEMA)
PROTOCOL_VERSION = 3
