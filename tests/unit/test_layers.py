"""The package's layers hold: what needs no MLX loads none, the store does not transcode, the public
API and the example work."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import kvmesh
from support.checkout import ROOT
from support.processes import ENV, cli

# Everything below the CLI that handles no arrays: the daemon imports only these.
MLX_FREE = [
    "kvmesh",
    "kvmesh.cli",
    "kvmesh.settings",
    "kvmesh.serve.options",
    "kvmesh.serve.api_errors",
    "kvmesh.serve.protocol.base",
    "kvmesh.serve.protocol.openai",
    "kvmesh.serve.protocol.anthropic",
    "kvmesh.serve.protocol.responses",
    "kvmesh.progress",
    "kvmesh.errors",
    "kvmesh.paths",
    "kvmesh.versions",
    "kvmesh.allocator",
    "kvmesh.collector",
    "kvmesh.model.fingerprint",
    "kvmesh.model.presets",
    "kvmesh.codec.prefix",
    "kvmesh.codec.limits",
    "kvmesh.codec.basis_file",
    "kvmesh.codec.manifest",
    "kvmesh.codec.compat",
    "kvmesh.codec.chunks",
    "kvmesh.codec.cut",
    "kvmesh.codec.layer_blob",
    "kvmesh.store",
    "kvmesh.store.entry_file",
    "kvmesh.reuse.rates",
    "kvmesh.reuse.choice",
    "kvmesh.net.timeouts",
    "kvmesh.net.transport",
    "kvmesh.net.messages",
    "kvmesh.net.client",
    "kvmesh.net.mesh.credentials",
    "kvmesh.net.mesh.enrolment",
    "kvmesh.net.mesh.member",
    "kvmesh.net.mesh.renewing",
    "kvmesh.net.node_id",
    "kvmesh.net.policy",
    "kvmesh.net.discovery.mdns",
    "kvmesh.net.discovery.health",
    "kvmesh.net.on_request",
    "kvmesh.net.server",
    "kvmesh.daemon.config",
    "kvmesh.daemon.control",
    "kvmesh.daemon.logs",
    "kvmesh.daemon.process",
    "kvmesh.daemon.service_files",
]
PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
if "kvmesh.cli" in sys.argv[1:]:
    sys.modules["kvmesh.cli"].build_parser()  # what `kvmesh --version` runs before it answers
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("mlx", "mlx_lm", "kvmesh", "grpc"))))
"""


def loaded_by(*modules: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", PROBE, *modules], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout))


@pytest.mark.slow
def test_the_network_store_and_daemon_load_no_mlx():
    loaded = loaded_by(*MLX_FREE)
    assert not {m for m in loaded if m.startswith(("mlx", "mlx_lm"))}, "an MLX-free module imported MLX"


@pytest.mark.slow
def test_the_store_only_stores():
    """No encoding, decoding, press or fingerprint construction below or beside the store."""
    loaded = loaded_by("kvmesh.store")
    for module in ("kvmesh.codec.encode", "kvmesh.codec.decode", "kvmesh.caches.presses", "kvmesh.caches.sparse"):
        assert module not in loaded
    for path in (ROOT / "kvmesh" / "store").glob("*.py"):
        imported = {node.module for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom)}
        assert not {m for m in imported if m and m.startswith(("kvmesh.caches", "kvmesh.model", "kvmesh.net"))}, path


@pytest.mark.slow
def test_version_loads_neither_mlx_nor_a_model():
    assert cli("--version").stdout.strip() == f"kvmesh {kvmesh.__version__}"
    loaded = loaded_by("kvmesh.cli")
    assert not {m for m in loaded if m.startswith(("mlx", "grpc"))}, "building the parser loads MLX or gRPC"


def test_the_public_api_names_resolve_and_are_documented():
    assert set(kvmesh.__all__) == {"PROTOCOL_VERSION", "SCHEMA_VERSION", "__version__", *kvmesh._EXPORTS}
    for name in kvmesh.__all__:
        value = getattr(kvmesh, name)
        if callable(value):
            assert value.__doc__, f"kvmesh.{name} has no docstring"
    with pytest.raises(AttributeError):
        kvmesh.no_such_thing  # noqa: B018


@pytest.mark.slow
def test_the_example_shares_a_prefix_with_identical_tokens():
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "share_a_prefix.py")],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "tokens equal a full prefill's: True" in result.stdout
    assert "prefix of" in result.stdout and "from peer 127.0.0.1:" in result.stdout


# Sizes a newcomer can read: a module is one job, a function one step of it.
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 120


def package_modules() -> dict[str, Path]:
    """Every hand-written module of the package by dotted name (the generated gRPC stubs aside)."""
    modules = {}
    for path in (ROOT / "kvmesh").rglob("*.py"):
        if "v1" in path.relative_to(ROOT / "kvmesh").parts:
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports, at its top or inside a function (both run)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            submodules = {f"{module}.{alias.name}" for alias in node.names} & modules.keys()
            # `from kvmesh.net import client` imports the submodule; the package's __init__ is not a step.
            found.update(submodules if len(submodules) == len(node.names) else {module, *submodules})
    return (found & modules.keys()) - {name}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        cycles.append(sorted(group))
    return cycles


def test_no_module_or_function_is_too_long_to_read():
    long_modules, long_functions = [], []
    for name, path in package_modules().items():
        tree = ast.parse(path.read_text())
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES:
            long_modules.append(f"{name}: {lines} lines")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{name}.{node.name}: {length} lines")
    assert not long_modules, f"modules over {MAX_MODULE_LINES} lines: {long_modules}"
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"


def test_no_import_cycle_even_through_function_level_imports():
    modules = package_modules()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert not import_cycles(graph)


def test_the_cycle_finder_finds_a_cycle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
