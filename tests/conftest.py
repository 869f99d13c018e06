"""Shared fixtures: offline models built once per session, and an isolated hash cache."""

import os

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"


@pytest.fixture(autouse=True)
def isolated_cache_dir(tmp_path, monkeypatch):
    """Each test gets its own weight-hash cache, so no test sees another's remembered hashes."""
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "kvmesh-cache"))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from kvmesh.testmodels import make_test_model

    return make_test_model(tmp_path_factory.mktemp("models") / "tiny", "tiny")


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    from kvmesh.testmodels import make_test_model

    return make_test_model(tmp_path_factory.mktemp("models") / "tiny-qwen3", "tiny-qwen3")


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    """(model, tokenizer) of the tiny llama, in float32. Never change its dtype: see tiny_in."""
    import mlx_lm

    return mlx_lm.load(str(tiny_dir))


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

    No discovery (tests of discovery start their own daemons). The address comes from the line
    the daemon prints once it listens; its data dir is <store_root>.data. Every process started
    is terminated (or found already dead) at the end of the test.
    """
    from daemons import start_daemon

    def start(store_root, *args) -> str:
        daemon = start_daemon(f"{store_root}.data", "--store", str(store_root), "--no-discovery", *args,
                              log=f"{store_root}.log")
        start.processes[daemon.address] = daemon.process
        return daemon.address

    start.processes = {}
    yield start
    for process in start.processes.values():
        if process.poll() is None:
            process.terminate()
        process.wait(timeout=30)
