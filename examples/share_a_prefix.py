#!/usr/bin/env python3
"""Share one prompt's KV cache between two "Macs" on this machine, with kvmesh's public API only.

Node A prefills a document and keeps its cache in its store, serving it to the mesh; node B wants to
ask a question about the same document: it looks the prompt up on A, fetches the cache (the manifest
is checked against B's model and prompt before any byte moves), prefills only the question and
generates. The tokens equal a full prefill's. Runs offline on a small random-weight model:

    scripts/dev run python examples/share_a_prefix.py
"""

import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import generate_step

import kvmesh

DOCUMENT = " ".join(f"Line {i}: the river carries silt from the hills to the delta." for i in range(40))
QUESTION = "\nQuestion: where does the silt go?"


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="kvmesh-example-") as tmp:
        root = Path(tmp)
        model_dir = kvmesh.make_test_model(root / "model", preset="tiny")
        model, tokenizer = mlx_lm.load(str(model_dir))
        fp = kvmesh.fingerprint(model_dir)
        document = tokenizer.encode(DOCUMENT)
        prompt = document + tokenizer.encode(QUESTION, add_special_tokens=False)

        # Node A: prefill the document once, store its cache, serve the store.
        store_a = kvmesh.CacheStore(root / "a")
        cached = kvmesh.prefill(model, document)
        stored = store_a.add(*kvmesh.encode_cache(cached.cache, fp, document))
        server = kvmesh.start_server(store_a, node_id="node-a", addresses="127.0.0.1:0")
        address = f"127.0.0.1:{server.port}"
        print(f"A stored {stored.cache_id}: {len(document)} tokens, {stored.encoding.encoded_bytes:,} bytes")

        try:
            # Node B: look the prompt up on A (only block hashes leave B), fetch, generate.
            with kvmesh.PeerClient(address) as peer:
                best = peer.lookup(fp.model_id, prompt[:-1])[0]
                profile = kvmesh.ReceiverProfile(fp, prompt=prompt)
                fetched = kvmesh.fetch_cache(peer, best.candidate.cache_id, profile, num_tokens=best.tokens)
            n = fetched.manifest.prefix.num_tokens
            tokens = [t for t, _ in kvmesh.generate_from_cache(model, fetched.cache, prompt[n:], max_tokens=12)]
            print(f"B fetched {n} tokens' cache ({fetched.wire_bytes:,} bytes) in {fetched.seconds:.3f} s")

            # The same through the mesh helper, which also keeps what it fetched in B's store.
            result = kvmesh.generate(model, fp, prompt, kvmesh.CacheStore(root / "b"), peers=[address], max_tokens=12)
            print(f"B via kvmesh.generate: prefix of {result.prefix.tokens} tokens from {result.prefix.where}")
        finally:
            server.stop()

        reference = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=12)]
        same = tokens == reference and result.tokens == reference
        print(f"tokens equal a full prefill's: {same}")
        return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
