"""`kvmesh demo`: the whole mesh on one machine, on a built-in tiny model (no download, no LAN).

Three daemons join one mesh (mutual TLS), start on loopback with their own data directories and
find each other over mDNS (restricted to 127.0.0.1). Node A prefills a document; node B generates
from that document plus a question, fetching A's cache instead of prefilling; a machine outside the
mesh is refused; a consumer with other weights is refused before any byte; node C serves a
compressed copy. Every check must pass for exit code 0.
"""

import tempfile
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import generate_step
from rich.console import Console
from rich.table import Table

from kvmesh.caches.prefill import generate_from_cache, prefill
from kvmesh.caches.presses import make_press
from kvmesh.codec.compat import ReceiverProfile
from kvmesh.codec.encode import encode_cache
from kvmesh.compression import compress, model_basis
from kvmesh.daemon.control import DaemonProcess, control_status, live_peer_addresses, start_daemon
from kvmesh.errors import CacheRejected, KvmeshError, PeerError
from kvmesh.model.fingerprint import FileHashCache, fingerprint
from kvmesh.model.loaded import LoadedModel
from kvmesh.model.testmodels import make_test_model
from kvmesh.net.client import PeerClient
from kvmesh.net.mesh.credentials import load_credentials
from kvmesh.net.mesh.enrolment import enrol, init_mesh
from kvmesh.net.node_id import node_id
from kvmesh.paths import store_dir
from kvmesh.reuse.fetch import fetch_cache
from kvmesh.reuse.generate import generate
from kvmesh.store import CacheStore
from kvmesh.store.artifacts import artifact_store

NODES = ("A", "B", "C")


def start_daemons(root: Path, daemons: dict[str, DaemonProcess]) -> None:
    """Start a daemon per node into `daemons` (so the caller stops those started if one fails)."""
    for name in NODES:
        daemon = start_daemon(
            root / name, ["--interface", "127.0.0.1", "--port", "0", "--log-level", "warning"], log=root / f"{name}.log"
        )
        daemons[name] = daemon
        if daemon.state.mode != "mutual TLS":
            raise KvmeshError(
                f"daemon {name} did not start as a mesh member ({daemon.state.mode}); see {root / f'{name}.log'}"
            )


def wait_for_discovery(root: Path, timeout: float = 20.0) -> float:
    """Seconds until every daemon lists the other two as live peers."""
    start = time.perf_counter()
    while True:
        if all(sum(p.healthy for p in control_status(root / n).peers) == len(NODES) - 1 for n in NODES):
            return time.perf_counter() - start
        if time.perf_counter() - start > timeout:
            raise KvmeshError(f"the daemons did not find each other within {timeout:.0f} s")
        time.sleep(0.1)


@dataclass
class Demo:
    """What the demo's steps share: where it runs, the model, and the checks so far."""

    root: Path
    console: Console
    steps: int
    model: Any = None
    tokenizer: Any = None
    fp: Any = None
    other_fp: Any = None
    member: dict[str, Any] = field(default_factory=dict)
    checks: list[tuple[str, bool]] = field(default_factory=list)

    def check(self, what: str, ok: bool) -> None:
        self.checks.append((what, ok))
        self.console.print(f"  {'[green]ok[/]' if ok else '[red]FAILED[/]'}  {what}")


def build_models(demo: Demo) -> None:
    """The tiny model, and one with other weights for the consumer that must be refused."""
    hashes = FileHashCache(demo.root / "hashes.sqlite3")
    model_dir = make_test_model(demo.root / "tiny", "tiny")
    other_dir = make_test_model(demo.root / "tiny-other-weights", "tiny", seed=1)
    demo.fp, demo.other_fp = fingerprint(model_dir, hashes), fingerprint(other_dir, hashes)
    demo.model, demo.tokenizer = mlx_lm.load(str(model_dir))[:2]  # (its type also allows the config)
    fp = demo.fp
    demo.console.print(
        f"[bold]model[/] tiny llama built offline: id {fp.model_id}, {fp.num_layers} layers, "
        f"{fp.num_kv_heads} kv heads x {fp.head_dim}, {fp.dtype}"
    )


def form_mesh(demo: Demo) -> None:
    """A makes the mesh; B and C join it, as `mesh token` + `mesh join` do."""
    root = demo.root
    init_mesh(root / "A", node_id(root / "A"), "demo")
    for name in NODES[1:]:
        enrol(root / "A", root / name, node_id(root / name))
    demo.member = {name: load_credentials(root / name) for name in NODES}


def fetch_on_b(demo: Demo, daemons: dict[str, DaemonProcess], document: list[int], prompt: list[int]) -> Any:
    """B generates from the document and a question on A's cache; its tokens must equal a full prefill's."""
    start = time.perf_counter()
    reference = [int(t) for t, _ in generate_step(mx.array(prompt), demo.model, max_tokens=demo.steps)]
    reference_s = time.perf_counter() - start
    result = generate(
        demo.model,
        demo.fp,
        prompt,
        CacheStore(store_dir(demo.root / "B")),
        peers=live_peer_addresses(demo.root / "B"),
        max_tokens=demo.steps,
        credentials=demo.member["B"],
    )
    source = result.prefix
    demo.console.print(
        f"[bold]B[/] generated from the document + a question: prefix of {source.tokens} tokens "
        f"from {source.where}, {source.wire_bytes:,} bytes on the wire in {source.seconds:.3f} s"
    )
    demo.check("B's tokens equal a local full prefill's", result.tokens == reference)
    demo.check(
        "B fetched the whole document from A",
        source.tokens == len(document) and source.where.endswith(daemons["A"].address),
    )
    return result, reference, reference_s


def refuse_strangers(demo: Demo, address: str, cache_id: str, prompt: list[int]) -> None:
    """A machine outside the mesh is refused at the handshake; other weights before any byte."""
    with PeerClient(address, timeout=5.0) as outsider:
        try:
            outsider.info()
            refused = False
        except PeerError:
            refused = True
    demo.console.print(
        "[bold]outsider[/] a client without the mesh's certificates tried A: "
        + ("refused at the TLS handshake" if refused else "ANSWERED")
    )
    demo.check("a machine outside the mesh is refused", refused)

    with PeerClient(address, credentials=demo.member["B"]) as a:
        sent_before = a.info().transfers.chunk_bytes_sent
        try:
            fetch_cache(a, cache_id, ReceiverProfile(demo.other_fp, prompt=prompt))
            rejected = None
        except CacheRejected as e:
            rejected = e.rejection
        sent_after = a.info().transfers.chunk_bytes_sent
    demo.console.print(
        f"[bold]other weights[/] a node with another model asked A for the cache: "
        f"{'refused: ' + str(rejected) if rejected else 'ACCEPTED'}"
    )
    demo.check(
        "a cache for other weights is refused before any byte", rejected is not None and sent_after == sent_before
    )


def print_table(demo: Demo, rows: list[tuple[str, str, str, str]]) -> None:
    table = Table(title="the document's prefix: prefill here vs fetch from a peer")
    for column in ("how", "seconds", "bytes on the wire", "tokens = full prefill"):
        table.add_column(column, justify="left" if column == "how" else "right")
    for row in rows:
        table.add_row(*row)
    demo.console.print(table)


def agreement(tokens: list[int], reference: list[int]) -> str:
    return f"{sum(x == y for x, y in zip(tokens, reference))} / {len(reference)}"


def run_mesh(demo: Demo, daemons: dict[str, DaemonProcess]) -> None:
    """The demo's story on running daemons: A prefills, B fetches, strangers are refused, C's copies."""
    root, console, model, fp, steps = demo.root, demo.console, demo.model, demo.fp, demo.steps
    start_daemons(root, daemons)
    seconds = wait_for_discovery(root)
    console.print(
        f"[bold]mesh[/] A made a mesh, B and C joined it; daemons on "
        f"{', '.join(d.address for d in daemons.values())} found each other over mDNS in "
        f"{seconds:.1f} s and speak mutual TLS"
    )
    document = demo.tokenizer.encode(resources.files("kvmesh").joinpath("data/corpus.txt").read_text())
    question = demo.tokenizer.encode("\nQuestions: what is a cache?", add_special_tokens=False)
    prompt = document + question

    start = time.perf_counter()
    cached = prefill(model, document)
    prefill_s = time.perf_counter() - start
    CacheStore(store_dir(root / "A")).add(*encode_cache(cached.cache, fp, document))
    console.print(
        f"[bold]A[/] prefilled the {len(document)}-token document in {prefill_s:.2f} s "
        f"and stored its cache ({cached.nbytes:,} bytes)"
    )
    snap = make_press("snapkv", {"ratio": 0.75, "kv_bits": 8})
    store_c = CacheStore(store_dir(root / "C"))
    snapped = store_c.add(*encode_cache(prefill(model, document, snap).cache, fp, document, snap))
    console.print("[bold]C[/] holds a snapkv-compressed copy (a quarter of the tokens, 8-bit)")

    result, reference, reference_s = fetch_on_b(demo, daemons, document, prompt)
    source = result.prefix
    refuse_strangers(demo, daemons["A"].address, source.cache_id, prompt)

    basis, _ = model_basis(store_c.root, LoadedModel(model, demo.tokenizer, fp), tokens_per_text=256)
    coded = compress(model, cached.cache, document, "default", basis)
    transformed = store_c.add(*encode_cache(coded.cache, fp, document, tail_kl=coded.tail_kl))
    console.print(
        f"[bold]C[/] now holds a transform-coded copy too (`--compress`: the model's basis, "
        f"{basis.nbytes:,} bytes, fitted on C; measured loss {coded.tail_kl:.4f} nats/token)"
    )

    with PeerClient(daemons["C"].address, credentials=demo.member["B"]) as c:
        compressed = fetch_cache(c, snapped.cache_id, ReceiverProfile(fp, prompt=prompt))
        store_b = CacheStore(store_dir(root / "B"))
        small = fetch_cache(c, transformed.cache_id, ReceiverProfile(fp, prompt=prompt), store=store_b)
    tokens = [t for t, _ in generate_from_cache(model, compressed.cache, question, max_tokens=steps)]
    demo.check("C's compressed cache arrives and generates", len(tokens) == steps)
    coded_tokens = [t for t, _ in generate_from_cache(model, small.cache, question, max_tokens=steps)]
    demo.check(
        "C's transform-coded cache arrives after its basis and generates",
        artifact_store(store_b.root).has(basis.digest) and len(coded_tokens) == steps,
    )
    print_table(
        demo,
        [
            (f"prefill {len(document)} tokens (A)", f"{prefill_s:.3f}", "-", "-"),
            (f"no cache: prompt + {steps} tokens (mlx-lm)", f"{reference_s:.3f}", "-", f"{steps} / {steps}"),
            (
                "fetch full cache from A (B)",
                f"{source.seconds:.3f}",
                f"{source.wire_bytes:,}",
                agreement(result.tokens, reference),
            ),
            (
                "fetch snapkv 8-bit from C",
                f"{compressed.seconds:.3f}",
                f"{compressed.wire_bytes:,}",
                agreement(tokens, reference),
            ),
            (
                "fetch transform-coded from C (+ basis once)",
                f"{small.seconds:.3f}",
                f"{small.wire_bytes:,}",
                agreement(coded_tokens, reference),
            ),
        ],
    )


def run_demo(steps: int = 24) -> int:
    """The demo, exit code 0 when every check passed; the daemons are stopped whatever happens."""
    with tempfile.TemporaryDirectory(prefix="kvmesh-demo-") as tmp:
        demo = Demo(root=Path(tmp), console=Console(width=110), steps=steps)
        build_models(demo)
        form_mesh(demo)
        daemons: dict[str, DaemonProcess] = {}
        try:
            run_mesh(demo, daemons)
        finally:
            for daemon in daemons.values():  # all at once: each takes a moment to say goodbye
                daemon.process.terminate()
            for daemon in daemons.values():
                daemon.stop()
    failed = [what for what, ok in demo.checks if not ok]
    demo.console.print("[green]all checks passed[/]" if not failed else f"[red]{len(failed)} check(s) failed[/]")
    return 1 if failed else 0
