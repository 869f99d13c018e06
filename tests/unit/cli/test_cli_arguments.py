"""What a person types wrong is refused by the parser in one line, before any model loads."""

import json
import re

import pytest

from kvmesh.caches.presses import make_press
from kvmesh.cli import build_parser
from kvmesh.daemon.config import DaemonConfig
from kvmesh.errors import ConfigError, PressConfigError
from kvmesh.net.addresses import peer_address
from kvmesh.serve.options import ServeOptions


def refusal(capsys, *argv):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(list(argv))
    assert exited.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--temp", "-1"], "argument --temp: must be in [0, inf), not -1"),
        (["--temp", "nan"], "argument --temp: must be in [0, inf), not nan"),
        (["--top-p", "0"], "argument --top-p: must be in (0, 1], not 0"),
        (["--top-p", "1.5"], "argument --top-p: must be in (0, 1], not 1.5"),
        (["--max-tokens", "0"], "argument --max-tokens: must be at least 1, not 0"),
    ],
)
def test_generate_refuses_sampling_settings_that_make_no_sense(capsys, argv, message):
    assert refusal(capsys, "generate", "m", "--prompt", "p", *argv) == f"kvmesh generate: error: {message}"


def test_kv_bits_offers_the_widths_there_are(capsys):
    line = refusal(capsys, "prefill", "m", "--prompt", "p", "--kv-bits", "7")
    assert line == "kvmesh prefill: error: argument --kv-bits: invalid choice: 7 (choose from 2, 3, 4, 5, 6, 8)"


def test_a_ratio_and_a_budget_together_are_refused():
    with pytest.raises(PressConfigError, match=r"snapkv: give ratio .* or budget .*, not both"):
        make_press("snapkv", {"ratio": 0.5, "budget": 64})


def test_every_group_and_positional_has_help():
    parser = build_parser()
    commands = parser._subparsers._group_actions[0]
    for name, sub in commands.choices.items():
        assert sub.description, f"kvmesh {name} has no description"
        groups = [a for a in sub._actions if a.choices and isinstance(a.choices, dict)]
        subs = [(f"{name} {n}", p) for g in groups for n, p in g.choices.items()] or [(name, sub)]
        for full, parser_ in subs:
            for action in parser_._actions:
                if not action.option_strings and not isinstance(action.choices, dict):
                    assert action.help, f"kvmesh {full}: positional {action.dest} has no help"


@pytest.mark.parametrize(
    "argv",
    [
        ["--data-dir", "D", "cache", "--store", "S", "list"],
        ["cache", "list", "--data-dir", "D", "--store", "S"],
        ["--data-dir", "D", "cache", "list", "--store", "S"],
        ["cache", "--store", "S", "list", "--data-dir", "D"],
    ],
)
def test_data_dir_and_store_go_before_or_after_the_command(argv):
    args = build_parser().parse_args(argv)
    assert (args.data_dir, args.store) == ("D", "S")


def test_without_them_each_command_sees_none():
    args = build_parser().parse_args(["cache", "list"])
    assert (args.data_dir, args.store) == (None, None)
    assert build_parser().parse_args(["status"]).data_dir is None


@pytest.mark.parametrize(
    "given, dialled",
    [
        ("localhost", "localhost:7077"),
        ("192.168.1.20", "192.168.1.20:7077"),
        ("192.168.1.20:7100", "192.168.1.20:7100"),
        (" 10.0.0.5:7077 ", "10.0.0.5:7077"),
        ("fe80::1%en0", "[fe80::1%en0]:7077"),
        ("[fe80::1%en0]:7100", "[fe80::1%en0]:7100"),
        ("[::1]", "[::1]:7077"),
    ],
)
def test_a_peer_without_a_port_is_dialled_on_kvmeshs(given, dialled):
    assert peer_address(given) == dialled


@pytest.mark.parametrize(
    "given, message",
    [
        ("192.168.1.20:http", "the port must be a number in 1..65535"),
        ("192.168.1.20:70000", "the port must be a number in 1..65535"),
        (":7077", "give an address, host:port"),
        ("[::1]7077", "give an address, host:port"),
        ("my mac:7077", "give an address, host:port"),
    ],
)
def test_a_malformed_peer_says_what_to_give(given, message):
    with pytest.raises(ConfigError, match=re.escape(f"peer {given!r}: {message}")):
        peer_address(given)


def test_settings_tables_take_peers_as_they_are_dialled_and_interfaces_as_addresses():
    assert DaemonConfig(peers=("localhost",)).peers == ("localhost:7077",)
    assert ServeOptions(peers=("127.0.0.1",)).peers == ("127.0.0.1:7077",)
    with pytest.raises(ConfigError, match="interface 'notanip' is not an IP address: give one of this machine's"):
        DaemonConfig(interfaces=("notanip",))


def test_cache_list_has_a_header_the_model_name_and_the_press_with_its_bits(
    tiny, tiny_fp, prompt_ids, tmp_path, capsys
):
    from kvmesh.caches.prefill import prefill
    from kvmesh.caches.presses import make_press
    from kvmesh.cli import main
    from kvmesh.store import CacheStore
    from support.stores import put

    store = CacheStore(tmp_path / "store")
    for method, config in (("quantize", {"kv_bits": 3}), ("snapkv", {"ratio": 0.5, "window": 16})):
        press = make_press(method, config)
        put(store, prefill(tiny[0], prompt_ids, press).cache, tiny_fp, prompt_ids, press)
    data = ["--data-dir", str(tmp_path / "node")]  # where no model's name was kept: named by its type
    assert main([*data, "cache", "--store", str(tmp_path / "store"), "list"]) == 0
    header, *lines = capsys.readouterr().out.splitlines()
    assert header.split() == ["CACHE", "ID", "MODEL", "TOKENS", "COMPRESSION", "SERVES", "BYTES", "LAST", "USED"]
    assert len(lines) == 2 and all(f"llama ({tiny_fp.model_id[:8]})" in line for line in lines)
    assert {("quantize 3-bit" in line, "snapkv 50% kept" in line) for line in lines} == {(True, False), (False, True)}
    assert main([*data, "cache", "--store", str(tmp_path / "store"), "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert sorted(e["compression"] for e in listed) == ["quantize 3-bit", "snapkv 50% kept"]
