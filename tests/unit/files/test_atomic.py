"""The one atomic write: whole files or none, secrets private from their first byte."""

import stat

import pytest

from kvmesh.files.atomic import write_atomic


def test_a_write_replaces_the_whole_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "deep" / "state.json"
    write_atomic(target, "old")
    write_atomic(target, b"new")
    assert target.read_bytes() == b"new"
    assert [p.name for p in target.parent.iterdir()] == ["state.json"]


def test_a_secret_is_private_and_a_failed_write_keeps_the_old_file(tmp_path):
    target = tmp_path / "node.key"
    write_atomic(target, b"secret", mode=0o600, durable=True)
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    with pytest.raises(TypeError):
        write_atomic(target, 42)  # type: ignore[arg-type]
    assert target.read_bytes() == b"secret"
    assert [p.name for p in tmp_path.iterdir()] == ["node.key"]
