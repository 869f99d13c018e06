"""The README's examples as a reader copies them: every `kvmesh` command line parses with the real
command line (no command or flag the CLI lacks), every command of its table exists, its TOML loads
as the settings it shows, and the Python example of `kvmesh serve` runs against a real server (its
address and model swapped for the tiny model's)."""

import argparse
import contextlib
import io
import re
import shlex
import subprocess
import sys

import pytest

from kvmesh.cli import build_parser
from support.checkout import ROOT
from support.daemons import start_server
from support.processes import ENV

README = ROOT / "README.md"


def blocks(language: str) -> list[str]:
    """The README's fenced code blocks in `language`."""
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(), flags=re.M | re.S)


def kvmesh_lines() -> list[list[str]]:
    """Each `kvmesh ...` command of the README's shell blocks, as the shell splits it (comments,
    `VAR=value` prefixes, `scripts/dev run` and a trailing `&` taken off)."""
    commands = []
    for block in blocks("sh"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                words = words[1:]
            if words[:2] == ["scripts/dev", "run"]:
                words = words[2:]
            if words and words[0] == "kvmesh":
                commands.append([w for w in words[1:] if w != "&"])
    return commands


def refusal(argv: list[str]) -> str | None:
    """What the real parser says against `argv`, or None when it takes it."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            build_parser().parse_args(argv)
        except SystemExit as e:
            return None if e.code == 0 else err.getvalue().strip().splitlines()[-1]
    return None


def test_every_kvmesh_command_in_the_readme_parses():
    commands = kvmesh_lines()
    assert len(commands) > 10  # (the extraction finds them)
    refused = {shlex.join(argv): why for argv in commands if (why := refusal(argv))}
    assert refused == {}


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def test_every_command_of_the_readme_table_exists():
    table = re.findall(r"^\| `kvmesh ([^`]+)`(?:, `kvmesh ([^`]+)`)? \|", README.read_text(), flags=re.M)
    assert len(table) > 15
    missing = []
    for cells in table:
        for cell in filter(None, cells):
            first, *others = cell.split(" / ")
            group = first.split()[0]  # ("mesh init / token": the group's commands after its first)
            for alternative in [first, *(f"{group} {o}" for o in others)]:
                parser = build_parser()
                for word in alternative.split():
                    if word.startswith(("[", "-")) or word.isupper() or "\\|" in word:
                        break
                    found = subcommands(parser).get(word)
                    if found is None:
                        missing.append(alternative)
                        break
                    parser = found
    assert missing == []


def test_the_readmes_settings_load_as_shown(tmp_path):
    from kvmesh.daemon.config import load_config

    tomllib = pytest.importorskip("tomllib") if sys.version_info >= (3, 11) else pytest.importorskip("tomli")
    config, codex = blocks("toml")
    path = tmp_path / "config.toml"
    path.write_text(config)
    loaded = load_config(path, env={})
    assert loaded.interfaces == ("192.168.1.10",) and loaded.peers == ("192.168.1.20:7077",)
    assert loaded.store_budget == 20_000_000_000
    provider = tomllib.loads(codex)["model_providers"]["kvmesh"]
    assert provider["wire_api"] == "responses" and provider["base_url"].endswith("/v1")


@pytest.mark.slow
def test_the_readmes_ask_example_runs_against_a_server(tiny_dir, tmp_path):
    (ask,) = [b for b in blocks("python") if "# ask.py" in b]
    server = start_server(tmp_path / "data", tiny_dir, "--no-mesh", log=tmp_path / "serve.log")
    try:
        script = ask.replace("http://127.0.0.1:8080/v1", server.url).replace('"Llama-3.2-1B"', '"tiny"')
        (tmp_path / "ask.py").write_text(script)
        (tmp_path / "handbook.md").write_text("Leave is approved by the team lead. " * 40)
        result = subprocess.run(
            [sys.executable, "ask.py"], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300
        )
    finally:
        server.stop()
    assert result.returncode == 0, result.stderr
    text, cached, kvmesh = result.stdout.rstrip("\n").split("\n")[-3:]
    assert cached == "0" and "'prefix_from': 'none'" in kvmesh  # (one Mac: nothing cached yet)
