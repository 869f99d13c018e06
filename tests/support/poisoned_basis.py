"""Stores that hold transform-coded caches whose basis is poisoned (NaN, inf or huge numbers, each
with the digest of its own bytes, so a digest check alone passes it), written past the store's
checks as a liar or an older kvmesh keeps them; and the peers (support.artifact_peer processes)
that serve them unchecked. Used by scripts/soak.py; the same poisons as tests/unit/codec/test_poisoned_basis.py.
"""

import json
import struct
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvmesh.caches.prefill import prefill
from kvmesh.caches.presses import make_press
from kvmesh.codec.basis import Basis, TensorBasis
from kvmesh.codec.calibration import fit_model_basis
from kvmesh.codec.coded import CodedLayer, TransformCoding, transform_code
from kvmesh.codec.encode import encode_cache
from kvmesh.codec.layer_blob import MAGIC, read_header
from kvmesh.model.fingerprint import ModelFingerprint
from kvmesh.store import CacheStore
from kvmesh.store.artifacts import artifact_store
from kvmesh.v1 import cache_pb2 as pb
from support import artifact_peer

Change = Callable[[list[TensorBasis], list[TensorBasis]], None]


def nan_component(keys: list[TensorBasis], values: list[TensorBasis]) -> None:
    keys[0].components[0, 0] = np.nan


def inf_mean(keys: list[TensorBasis], values: list[TensorBasis]) -> None:
    values[0].mean[0] = np.inf


def huge_rms(keys: list[TensorBasis], values: list[TensorBasis]) -> None:
    keys[0].rms[0] = 1e30


POISONS: dict[str, Change] = {"NaN component": nan_component, "inf mean": inf_mean, "huge RMS": huge_rms}


def altered(basis: Basis, change: Change) -> Basis:
    """A copy of `basis` that `change(keys, values)` altered in place (its digest is its own)."""

    def copy(tb: TensorBasis) -> TensorBasis:
        return TensorBasis(tb.mean.copy(), tb.components.copy(), tb.rms.copy())

    keys, values = [copy(k) for k in basis.keys], [copy(v) for v in basis.values]
    change(keys, values)
    return Basis(keys, values, list(basis.rotaries), json.loads(json.dumps(basis.info)))


def recoded(cache: list, basis: Basis) -> list:
    """The coded cache with every coded layer naming `basis` (its blob's header and its spec), as a
    sender that made that basis sends it."""
    out = []
    for layer in cache:
        if not isinstance(layer, CodedLayer):
            out.append(layer)
            continue
        header, body = read_header(layer.blob)
        header["basis"] = basis.digest
        text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
        spec = pb.TransformSpec()
        spec.CopyFrom(layer.spec)
        spec.basis_sha256 = basis.digest
        blob = MAGIC + struct.pack("<I", len(text)) + text + bytes(body)
        out.append(CodedLayer(blob, spec, layer.offset, layer.dtype, basis))
    return out


def keep_unchecked(root: Path, cache: list, basis: Basis, fp: ModelFingerprint, tokens: Sequence[int]) -> str:
    """Store `cache` in the store at `root` and the bytes of `basis` as they are (past the artefact
    store's checks); the cache's id."""
    manifest = CacheStore(root).add(*encode_cache(cache, fp, list(tokens)))
    path = artifact_store(root).path(basis.digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(basis.to_bytes())
    return manifest.cache_id


@dataclass
class Offer:
    """A cache a lying peer offers: its id, the tokens it covers, the basis digest it names, the poison."""

    cache_id: str
    tokens: list[int]
    digest: str
    poison: str
    address: str = ""


@dataclass
class PoisonedPeers:
    """Two support.artifact_peer processes: one serves caches coded with poisoned bases (one per
    poison), the other an honest coded cache whose manifest announces a 1 GiB basis."""

    root: Path
    offers: list[Offer] = field(default_factory=list)
    processes: list[subprocess.Popen] = field(default_factory=list)

    def start(self, model, tokenizer, fp: ModelFingerprint, prompts: Sequence[Sequence[int]]) -> None:
        """Fit the model's real basis, code a cache of each prompt (one per poison, then the honest
        one: `prompts` needs len(POISONS) + 1), keep them and start both peers."""
        basis = fit_model_basis(model, tokenizer, tokens_per_text=200).basis
        coding = TransformCoding(basis, step=0.02)
        poisoned, honest = self.root / "poisoned", self.root / "announcing"
        offers = []
        for (name, change), tokens in zip(POISONS.items(), prompts, strict=False):
            bad = altered(basis, change)
            cache = recoded(transform_code(prefill(model, list(tokens), make_press("full")).cache, coding), bad)
            offers.append(Offer(keep_unchecked(poisoned, cache, bad, fp, tokens), list(tokens), bad.digest, name))
        tokens = list(prompts[len(POISONS)])
        cache = transform_code(prefill(model, tokens, make_press("full")).cache, coding)
        announced = Offer(keep_unchecked(honest, cache, basis, fp, tokens), tokens, basis.digest, "1 GiB announced")
        for store, flags, group in ((poisoned, (), offers), (honest, ("--announce", 1 << 30), [announced])):
            process, address = artifact_peer.start(store, self.calls(store), *flags)
            self.processes.append(process)
            for offer in group:
                offer.address = address
        self.offers = [*offers, announced]

    @staticmethod
    def calls(store: Path) -> Path:
        return store.with_name(store.name + ".calls")

    def artifact_calls(self, offer: Offer) -> int:
        """How many Artifact calls the peer of `offer` answered for its basis."""
        calls = self.calls(self.root / ("announcing" if offer.poison == "1 GiB announced" else "poisoned"))
        if not calls.exists():
            return 0
        return sum(line.split()[0] == offer.digest for line in calls.read_text().splitlines())

    def close(self) -> None:
        for process in self.processes:
            process.kill()
            process.wait()
