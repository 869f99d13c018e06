"""What the tests and the scripts under scripts/ share that is not a fixture (fixtures live in
tests/conftest.py). pytest finds this package through `pythonpath` in pyproject.toml, the scripts
through the PYTHONPATH that `scripts/dev run` sets.

- `processes`: the `kvmesh` command as a user runs it (`cli`), mlx-lm's (`mlx_lm_cli`), their
  environment (`ENV`), and a process's resident memory (`rss`)
- `daemons`: real `kvmesh daemon` and `kvmesh serve` processes, started and stopped
- `stores`: a cache into a store (`put`) and back (`load`)
- `references`: what mlx-lm generates from a full prefill (the reference every cached path must
  equal), continuations of a cache, and bit-for-bit comparisons of caches and log-probabilities
- `waiting`: polling state that lives in another process
- `namespaces`: hosts in network namespaces (needs Linux, root and iproute2)
- `real_model`: SmolLM2-135M-Instruct, the real model, and the BLAS that makes it quick on Linux
- `bench_caches`: the real KV cache of the `small` preset that the transfer benchmarks tile
- `quality_probes`: what the quality benchmarks probe a compressed cache with on the real model

Importing this package imports none of them: each module imports only what it needs.
"""
