"""Shared fixtures: offline models built once per session, an isolated hash cache, daemons; and the
tiers: a test that starts processes is `slow` (see pyproject.toml), and the fast tier starts none."""

import fcntl
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from support.daemons import Daemons

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

# Fixtures that start processes (the last two are test_serve's and test_security's): a test that uses
# one, itself or through another fixture, is slow.
PROCESS_FIXTURES = {"daemons", "serve", "http_server", "daemon_a"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def lan_tests_one_at_a_time(request):
    """A test marked `lan` holds the run's LAN lock from before its other fixtures start daemons until
    after they stop them, so no two such tests on pytest-xdist's workers hear each other's daemons.
    (A lock rather than xdist's groups: those rename test ids in a way pytest 9.2 ignores.)"""
    if request.node.get_closest_marker("lan") is None:
        yield
        return
    # One lock for the machine: loopback is the machine's, whichever run or checkout tests on it.
    with open(Path(tempfile.gettempdir()) / "kvmesh-tests-lan.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


# What a test starts on purpose: Python (a child script, the example, mlx-lm's command), the kvmesh
# command (the CLI, a daemon, a server, the demo) and `ip` (namespaces). Libraries that probe the
# system as they load (ctypes runs ldconfig) do not count.
STARTED_ON_PURPOSE = ("python", "kvmesh", "ip")


@pytest.fixture(autouse=True)
def fast_tests_start_no_process(request, monkeypatch):
    """The fast tier (`-m "not slow"`) starts no process: a test not marked slow that starts one of
    STARTED_ON_PURPOSE fails, so the marks stay true."""
    if request.node.get_closest_marker("slow") is not None:
        return
    start = subprocess.Popen._execute_child

    def refuse(self, args, *rest, **options):
        program = Path(os.fsdecode(args if isinstance(args, (str, bytes, os.PathLike)) else args[0])).name
        if program.startswith(STARTED_ON_PURPOSE):
            raise AssertionError(f"{request.node.nodeid} starts {program} but is not marked slow: {args!r}")
        return start(self, args, *rest, **options)

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)


@pytest.fixture(autouse=True)
def isolated_cache_dir(tmp_path, monkeypatch):
    """Each test gets its own weight-hash cache, so no test sees another's remembered hashes."""
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "kvmesh-cache"))


@pytest.fixture(scope="session")
def preset_dir(tmp_path_factory):
    """preset_dir(preset, seed=0) -> that preset's model directory (kvmesh.model.testmodels), built
    once per session and shared by every test that asks: a test that edits a model copies it first.
    Building one trains its tokenizer and writes its weights, a second or more on 2 cores."""
    from kvmesh.model.testmodels import make_test_model

    root = tmp_path_factory.mktemp("models")
    built = {}

    def build(preset: str, seed: int = 0) -> Path:
        if (preset, seed) not in built:
            name = preset if seed == 0 else f"{preset}-seed{seed}"
            built[preset, seed] = make_test_model(root / name, preset, seed=seed)
        return built[preset, seed]

    return build


@pytest.fixture(scope="session")
def preset_model(preset_dir):
    """preset_model(preset) -> (model, tokenizer) of preset_dir(preset), loaded once per session.
    Shared: never change its weights or dtype (load a copy for that, as tiny_in does)."""
    import mlx_lm

    loaded = {}

    def load(preset: str):
        if preset not in loaded:
            loaded[preset] = mlx_lm.load(str(preset_dir(preset)))
        return loaded[preset]

    return load


@pytest.fixture(scope="session")
def tiny_dir(preset_dir):
    return preset_dir("tiny")


@pytest.fixture(scope="session")
def tiny_loaded(tiny_dir):
    """The tiny model as `kvmesh serve` loads it, once for the session's in-process servers."""
    from kvmesh.model.loaded import load_model

    return load_model(str(tiny_dir))


@pytest.fixture(scope="session")
def qwen3_dir(preset_dir):
    return preset_dir("tiny-qwen3")


@pytest.fixture(scope="session")
def tiny(preset_model):
    """(model, tokenizer) of the tiny llama, in float32. Never change its dtype: see tiny_in."""
    return preset_model("tiny")


@pytest.fixture(scope="session")
def tiny_fp(tiny_dir):
    """The tiny model's fingerprint."""
    from kvmesh.model.fingerprint import FileHashCache, fingerprint

    return fingerprint(tiny_dir, FileHashCache(tiny_dir.parent / "hashes.sqlite3"))


@pytest.fixture(scope="session")
def qwen3(preset_model):
    return preset_model("tiny-qwen3")


@pytest.fixture(scope="session")
def prompt_ids(tiny):
    """A few hundred real tokens of English text."""
    from importlib import resources

    text = resources.files("kvmesh").joinpath("data/corpus.txt").read_text()
    return tiny[1].encode(text)[:300]


@pytest.fixture(scope="session")
def long_ids(tiny):
    """The whole packaged corpus as tokens (well over 1000)."""
    from importlib import resources

    return tiny[1].encode(resources.files("kvmesh").joinpath("data/corpus.txt").read_text())


@pytest.fixture(scope="session")
def tiny_in(tiny_dir):
    """tiny_in(dtype): a private copy of the tiny model in that dtype.

    Switching the shared model's dtype and back is lossy (bfloat16 -> float32 keeps the rounding),
    so tests that need another dtype get their own copy.
    """
    import mlx_lm

    copies = {}

    def load(dtype):
        if dtype not in copies:
            model, _ = mlx_lm.load(str(tiny_dir))
            model.set_dtype(dtype)
            copies[dtype] = model
        return copies[dtype]

    return load


@pytest.fixture
def daemons():
    """A support.daemons.Daemons: `daemons.start(data_dir, *args)` starts a loopback daemon (no mDNS
    unless discovery=True); every one is stopped at the end of the test."""
    started = Daemons()
    yield started
    started.stop_all()


@pytest.fixture
def grpc_peers():
    """A support.grpc_peers.GrpcPeers: `grpc_peers.start(store_root, ...)` serves that store with the
    real gRPC server in this process (no daemon process: see support.grpc_peers); every one is
    stopped at the end of the test."""
    from support.grpc_peers import GrpcPeers

    started = GrpcPeers()
    yield started
    started.stop_all()


@pytest.fixture
def serve(daemons):
    """serve(store_root, *args) -> address: a real daemon process serving that store on 127.0.0.1.

    No discovery (tests of discovery start their own daemons). Its data dir is <store_root>.data,
    its log <store_root>.log. Every process started is stopped at the end of the test.
    """

    def start(store_root, *args) -> str:
        daemon = daemons.start(f"{store_root}.data", "--store", store_root, *args, log=f"{store_root}.log")
        start.processes[daemon.address] = daemon.process
        return daemon.address

    start.processes = {}
    return start
