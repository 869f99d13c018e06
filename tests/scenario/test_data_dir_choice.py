"""The data dir as the user gives it: on a read-only file system (a real read-only bind mount, in a
mount namespace of the test's own), and as `$KVMESH_DATA_DIR` for the login service."""

import os
import shutil
import subprocess
import sys

import pytest

from support.processes import ENV, KVMESH, cli

pytestmark = pytest.mark.slow


def read_only(data_dir, *args) -> subprocess.CompletedProcess:
    """`kvmesh --data-dir DATA_DIR ARGS` with DATA_DIR bind-mounted read-only (EROFS for every write,
    root's included), in a mount namespace that ends with the command."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a read-only bind mount needs root and unshare(1)")
    where = str(data_dir)
    script = 'mount --bind "$1" "$1" && mount -o remount,ro,bind "$1" && shift && exec "$@"'
    command = ["unshare", "--mount", "--", "sh", "-c", script, "sh", where, KVMESH, "--data-dir", where, *args]
    return subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=300)


def test_generate_runs_on_a_read_only_data_dir_without_a_node_id(tiny_dir, tmp_path):
    """Before: generate made a node id to look for mesh credentials and failed with
    "[Errno 30] Read-only file system: '.../node-id.tmp'". A node without an id has joined no mesh:
    now none is made, and generate answers."""
    data = tmp_path / "data"
    cli("generate", tiny_dir, "--prompt", "The river", "--max-tokens", "2", "--no-mesh", data_dir=data)
    (data / "node-id").unlink(missing_ok=True)  # an older kvmesh made one here: this node never had one
    done = read_only(data, "generate", tiny_dir, "--prompt", "The river", "--max-tokens", "2")
    assert done.returncode == 0, done.stderr
    assert "2 tokens generated" in done.stderr and "node-id" not in done.stderr
    assert not (data / "node-id").exists()
    # A model this data dir never named: its name cannot be kept, which costs only the name.
    (data / "model-names.json").unlink()
    done = read_only(data, "generate", tiny_dir, "--prompt", "The river", "--max-tokens", "2")
    assert done.returncode == 0 and "cannot keep the model's name" in done.stderr, done.stderr


def test_a_command_that_needs_a_node_id_says_in_one_line_that_the_data_dir_cannot_take_it(tmp_path):
    done = read_only(tmp_path, "mesh", "init")
    assert done.returncode == 1
    assert done.stderr == (
        f"kvmesh: error: cannot keep this node's id in {tmp_path}: Read-only file system; give a writable "
        "--data-dir (or $KVMESH_DATA_DIR)\n"
    )


def test_the_service_runs_on_the_data_dir_of_kvmesh_data_dir(tmp_path):
    """Before: `KVMESH_DATA_DIR=X kvmesh service` wrote a service on the platform's data dir, so the
    daemon it ran served another node than the user's commands talk to."""
    chosen = tmp_path / "elsewhere"
    unit = cli("service", "--platform", "linux", "--print", env={"KVMESH_DATA_DIR": str(chosen)}).stdout
    daemon = f"{sys.executable} -m kvmesh --data-dir {chosen} daemon --log-format json"
    assert f"ExecStart={daemon}\n" in unit
    flag = cli("service", "--platform", "linux", "--print", data_dir=tmp_path / "flag", env={"KVMESH_DATA_DIR": "x"})
    assert f"--data-dir {tmp_path / 'flag'} daemon" in flag.stdout  # the flag wins, as everywhere
