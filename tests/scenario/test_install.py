"""The README's install, as a Mac user follows it: `pip install .` from the checkout into a fresh
virtual environment puts a working `kvmesh` on that environment's PATH."""

import os
import subprocess
import sys

import pytest

from support.checkout import ROOT

pytestmark = pytest.mark.slow


def test_pip_install_of_the_checkout_gives_a_working_kvmesh(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    installed = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(ROOT)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert installed.returncode == 0, installed.stderr[-2000:]
    env = {**os.environ, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}", "KVMESH_DATA_DIR": str(tmp_path)}
    env.pop("PYTHONPATH", None)

    def kvmesh(*args: str) -> str:
        done = subprocess.run(["kvmesh", *args], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        return done.stdout

    from kvmesh import __version__

    assert kvmesh("--version").strip() == f"kvmesh {__version__}"
    kvmesh("model", "make-test", str(tmp_path / "tiny"))
    assert kvmesh("prefill", str(tmp_path / "tiny"), "--prompt", "A first cache. " * 20).startswith("stored ")
    listing = kvmesh("cache", "list").splitlines()
    assert listing[0].startswith("CACHE ID") and len(listing) == 2


def test_scripts_dev_installs_kvmesh_without_setuptools_editable_warning(tmp_path):
    """scripts/dev's own install, into a fresh environment that finds the dependencies already there
    (this one's, by a .pth file), so only kvmesh's editable build runs: without setuptools' warning."""
    import site

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    [packages] = list((venv / "lib").glob("python*/site-packages"))
    (packages / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    env = {**os.environ, "KVMESH_VENV": str(venv), "KVMESH_NO_REAL_MODEL": "1"}
    done = subprocess.run(
        [str(ROOT / "scripts" / "dev"), "run", "true"], capture_output=True, text=True, env=env, timeout=900
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"scripts/dev: installing kvmesh and its dependencies into {venv}" in done.stderr
    assert "Editable installation" not in done.stderr and "!!" not in done.stderr, done.stderr
