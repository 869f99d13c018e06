"""The committed stubs in kvmesh/v1 must be what scripts/gen_proto.py generates from proto/."""

import importlib.util

from support.checkout import ROOT


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_are_fresh(tmp_path):
    generated = load_generator().generate(tmp_path)
    assert generated, "no stubs generated: is proto/kvmesh/v1 empty?"
    committed = ROOT / "kvmesh" / "v1"
    names = {p.name for p in generated}
    assert names == {p.name for p in committed.iterdir() if p.is_file() and p.name != "__init__.py"}
    stale = [p.name for p in generated if p.read_bytes() != (committed / p.name).read_bytes()]
    assert not stale, f"stale stubs {stale}: run scripts/gen_proto.py and commit the result"
