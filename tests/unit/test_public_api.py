"""The public API's shape: the facade's three lists name the same things, options are passed by
keyword, and the network client hands whoever decodes the chunks only what it checked itself: the
frames, and a trailer that must state what the manifest announced (tests/unit/test_layers.py checks that
it loads no MLX)."""

import ast
import dataclasses
import inspect
import sys
from pathlib import Path

import pytest

import kvmesh
from kvmesh.errors import IntegrityError
from kvmesh.net.messages import check_trailer, trailer
from kvmesh.v1 import cache_pb2 as pb
from kvmesh.v1 import service_pb2 as spb

INIT = Path(kvmesh.__file__)
# At most this many arguments by position (self aside); the rest are keyword-only options.
MAX_POSITIONAL = 4


def facade() -> tuple[dict[str, str], list[str], dict[str, str], set[str]]:
    """kvmesh/__init__.py as written: _EXPORTS, __all__, the TYPE_CHECKING imports (name -> module)
    and the names imported eagerly from kvmesh's own modules."""
    exports: dict[str, str] = {}
    listed: list[str] = []
    typed: dict[str, str] = {}
    eager: set[str] = set()
    for node in ast.parse(INIT.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id == "_EXPORTS":
                exports = ast.literal_eval(node.value)
            elif node.targets[0].id == "__all__":
                listed = ast.literal_eval(node.value)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvmesh"):
            eager |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imported in node.body:
                assert isinstance(imported, ast.ImportFrom), ast.dump(imported)
                for alias in imported.names:
                    assert alias.asname is None or alias.asname == alias.name, alias.name
                    typed[alias.name] = str(imported.module)
    return exports, listed, typed, eager


def test_the_facades_lists_name_the_same_things():
    exports, listed, typed, eager = facade()
    assert exports and listed and typed
    assert len(listed) == len(set(listed)), "__all__ names something twice"
    assert set(listed) == set(exports) | eager, "__all__ and _EXPORTS differ"
    # Type checkers see exactly what runs: every lazily exported name, from the module it loads from.
    assert typed == exports, "the TYPE_CHECKING imports and _EXPORTS differ"
    for name, module in exports.items():
        assert getattr(kvmesh, name).__module__ == module or name in vars(sys.modules[module]), name


def signatures():
    """(what, signature) of every exported function, and of each exported class's constructor and
    public methods (a dataclass's generated constructor aside: it mirrors its fields)."""
    for name in kvmesh.__all__:
        value = getattr(kvmesh, name)
        if inspect.isfunction(value):
            yield name, inspect.signature(value)
        elif inspect.isclass(value) and value.__module__.startswith("kvmesh"):
            for attr, member in vars(value).items():
                if not inspect.isfunction(member) or (attr.startswith("_") and attr != "__init__"):
                    continue
                if attr == "__init__" and dataclasses.is_dataclass(value):
                    continue
                yield f"{name}.{attr}", inspect.signature(member)


def test_options_are_keyword_only():
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    checked = 0
    for what, signature in signatures():
        names = [p.name for p in signature.parameters.values() if p.kind in positional and p.name != "self"]
        assert len(names) <= MAX_POSITIONAL, f"{what} takes {len(names)} arguments by position: {names}"
        checked += 1
    assert checked > 20


def test_a_trailer_must_state_what_the_manifest_announced():
    manifest = pb.CacheManifest()
    manifest.encoding.payload_digest, manifest.encoding.chunk_count = bytes(range(16)), 3
    check_trailer(spb.FetchResponse(trailer=trailer(manifest)), manifest)
    check_trailer(spb.PublishRequest(trailer=trailer(manifest)), manifest)
    other = pb.CacheManifest()
    other.CopyFrom(manifest)
    other.encoding.payload_digest = bytes(16)
    with pytest.raises(IntegrityError, match="digest differs"):
        check_trailer(spb.FetchResponse(trailer=trailer(other)), manifest)
    other.CopyFrom(manifest)
    other.encoding.chunk_count = 4
    with pytest.raises(IntegrityError, match="chunk count differs"):
        check_trailer(spb.PublishRequest(trailer=trailer(other)), manifest)
    with pytest.raises(IntegrityError, match="manifest where the trailer was due"):
        check_trailer(spb.FetchResponse(manifest=manifest), manifest)
