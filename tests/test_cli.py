import json
import subprocess
import sys
from pathlib import Path

from kvmesh import __version__

# The console script the package installs, beside the interpreter running the tests.
KVMESH = str(Path(sys.executable).with_name("kvmesh"))


def run(*args, check=True):
    return subprocess.run([KVMESH, *args], capture_output=True, text=True, check=check)


def test_version():
    assert run("--version").stdout.strip() == f"kvmesh {__version__}"


def test_help_lists_commands():
    out = run("--help").stdout
    for command in ("model", "demo"):
        assert command in out
    assert "make-test" in run("model", "--help").stdout


def test_make_test_then_info(tmp_path):
    out = run("model", "make-test", str(tmp_path / "m"), "--preset", "tiny-qwen3").stdout
    assert "tiny-qwen3" in out
    info = json.loads(run("model", "info", str(tmp_path / "m"), "--json").stdout)
    assert info["model_type"] == "qwen3" and info["num_layers"] == 3


def test_usage_error_exits_2():
    result = run("model", "make-test", check=False)
    assert result.returncode == 2 and "usage:" in result.stderr


def test_make_test_into_non_empty_dir_fails_cleanly(tmp_path):
    (tmp_path / "x").write_text("x")
    result = run("model", "make-test", str(tmp_path), check=False)
    assert result.returncode == 1
    assert result.stderr.startswith(f"kvmesh: error: {tmp_path}: exists")


def test_demo_runs_and_checks_itself():
    result = run("demo", "--steps", "4")
    assert "identical" in result.stdout and "DIFFERENT" not in result.stdout
