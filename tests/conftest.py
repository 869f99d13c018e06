"""Shared fixtures: offline models built once per session, an isolated hash cache, daemons."""

import os

import pytest

from helpers import ENV

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"


@pytest.fixture(autouse=True)
def isolated_cache_dir(tmp_path, monkeypatch):
    """Each test gets its own weight-hash cache, so no test sees another's remembered hashes."""
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "kvmesh-cache"))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from kvmesh.model.testmodels import make_test_model

    return make_test_model(tmp_path_factory.mktemp("models") / "tiny", "tiny")


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    from kvmesh.model.testmodels import make_test_model

    return make_test_model(tmp_path_factory.mktemp("models") / "tiny-qwen3", "tiny-qwen3")


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    """(model, tokenizer) of the tiny llama, in float32. Never change its dtype: see tiny_in."""
    import mlx_lm

    return mlx_lm.load(str(tiny_dir))


@pytest.fixture(scope="session")
def tiny_fp(tiny_dir):
    """The tiny model's fingerprint."""
    from kvmesh.model.fingerprint import FileHashCache, fingerprint

    return fingerprint(tiny_dir, FileHashCache(tiny_dir.parent / "hashes.sqlite3"))


@pytest.fixture(scope="session")
def qwen3(qwen3_dir):
    import mlx_lm

    return mlx_lm.load(str(qwen3_dir))


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
def serve():
    """serve(store_root, *args) -> address: a real daemon process serving that store on 127.0.0.1.

    No discovery (tests of discovery start their own daemons). Its data dir is <store_root>.data,
    its log <store_root>.log. Every process started is stopped at the end of the test.
    """
    from kvmesh.daemon.control import start_daemon

    def start(store_root, *args) -> str:
        daemon = start_daemon(
            f"{store_root}.data",
            ["--interface", "127.0.0.1", "--port", "0", "--store", str(store_root), "--no-discovery", *args],
            log=f"{store_root}.log",
            env=ENV,
        )
        start.processes[daemon.address] = daemon.process
        start.daemons.append(daemon)
        return daemon.address

    start.processes, start.daemons = {}, []
    yield start
    for daemon in start.daemons:
        daemon.stop()
