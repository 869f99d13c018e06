"""Reusing a cached prefix: where one is found, whether fetching it beats prefilling, and generation.

- `records`: what a request found and generated (CachedPrefix, Generation), for the CLI and serve;
- `rates`: what this machine measured of its links, prefills and decoders (`rates.json`; no MLX);
- `choice`: the cost model and the typed decision between a prefill and each copy peers hold (no MLX);
- `fetch`: a peer's cache decoded, and kept, as it arrives;
- `weigh`: the choice for a request's candidates, with their links probed when never measured;
- `find`: the longest cached prefix of a prompt, from the local store or a peer;
- `calibration`: the prefill and decode rates measured once per model (`ensure_calibrated`);
- `generate`: generation from the prefix found.

Nothing is imported here: `kvmesh.reuse.rates` and `kvmesh.reuse.choice` load no MLX.
"""
