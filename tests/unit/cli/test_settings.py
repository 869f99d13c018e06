"""Each setting is declared once: its config key, KVMESH_ variable, flag and help all come from its field."""

import pytest

from kvmesh.cli import build_parser
from kvmesh.cli.daemon import SHARED_SETTINGS, daemon_config
from kvmesh.cli.serve import serve_options
from kvmesh.daemon.config import DaemonConfig, load_config
from kvmesh.errors import ConfigError
from kvmesh.net.policy import Policy
from kvmesh.serve.options import ServeOptions
from kvmesh.settings import flag_of, settings_of


def parse(*argv):
    return build_parser().parse_args([str(a) for a in argv])


def help_of(command):
    return build_parser()._subparsers._group_actions[0].choices[command].format_help()


@pytest.mark.parametrize(
    "command, tables, skip",
    [("daemon", (DaemonConfig, Policy), SHARED_SETTINGS), ("serve", (ServeOptions,), ("model",))],
)
def test_every_setting_has_a_flag_whose_help_states_its_default(command, tables, skip):
    text = " ".join(help_of(command).split())
    for table in tables:
        for name, f in settings_of(table).items():
            if name in skip:
                continue
            assert flag_of(f) in text, f"{table.__name__}.{name} has no flag"
            default = f.default
            if isinstance(default, (int, float)) and not isinstance(default, bool):
                assert f"(default {default}" in text or f"(default {default:,}" in text, name


def test_policy_settings_live_in_the_policy_and_come_flat_from_file_environment_and_flags(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text('share_models = ["m1"]\npeer-transfers = 3\nmax_transfers = 2\n')
    loaded = load_config(config, env={"KVMESH_PEER_CALLS_PER_SECOND": "7"})
    assert loaded.policy == Policy(share_models=("m1",), peer_transfers=3, peer_calls_per_second=7.0)
    assert loaded.max_transfers == 2

    args = parse(
        "--data-dir",
        tmp_path,
        "daemon",
        "--config",
        config,
        "--read-only",
        "--publisher",
        "n1",
        "--publisher",
        "n2",
        "--peer-rate",
        "9",
        "--grace",
        "2.5",
        "--port",
        "0",
    )
    flagged = daemon_config(args)
    assert flagged.policy.accept_publish is False and flagged.policy.publishers == ("n1", "n2")
    assert flagged.policy.peer_calls_per_second == 9.0 and flagged.policy.share_models == ("m1",)
    assert flagged.grace == 2.5 and flagged.port == 0 and flagged.data_dir == tmp_path


def test_a_flag_not_given_leaves_the_file_and_environment_alone(tmp_path, monkeypatch):
    config = tmp_path / "config.toml"
    config.write_text("port = 7100\nread-only = 1\n".replace("read-only = 1\n", "accept_publish = false\n"))
    monkeypatch.setenv("KVMESH_LOG_LEVEL", "debug")
    loaded = daemon_config(parse("daemon", "--config", config))
    assert loaded.port == 7100 and loaded.policy.accept_publish is False and loaded.log_level == "debug"


def test_config_file_then_environment_then_flags(tmp_path):
    config = tmp_path / "kvmesh.toml"
    config.write_text('port = 7100\nmax-transfers = 2\ninterfaces = ["10.0.0.5"]\nlog_format = "json"\n')
    env = {"KVMESH_PORT": "7200", "KVMESH_PEERS": "10.0.0.9:7077, 10.0.0.10:7077"}
    loaded = load_config(config, env=env, overrides={"max_transfers": 3, "log_format": None})
    assert loaded.port == 7200 and loaded.max_transfers == 3 and loaded.log_format == "json"
    assert loaded.interfaces == ("10.0.0.5",) and loaded.peers == ("10.0.0.9:7077", "10.0.0.10:7077")
    assert load_config(config, env={}).port == 7100
    assert DaemonConfig().port == 7077


@pytest.mark.parametrize(
    "text, message",
    [
        ("prot = 1\n", "unknown setting 'prot'"),
        ("port = 'many'\n", "bad value 'many' for port"),
        ("port = '7077'\n", "bad value '7077' for port: expected a whole number"),
        ("log_format = 'xml'\n", "log_format must be text or json, not 'xml'"),
        ("port = [\n", "cannot read the config"),
        ("peer_transfers = 'two'\n", "bad value 'two' for peer_transfers"),
        ("log_level = 'loud'\n", "log_level must be debug, info, warning or error, not 'loud'"),
        ("accept_publish = 'maybe'\n", "bad value 'maybe' for accept_publish"),
        ("max_transfers = 1.5\n", "bad value 1.5 for max_transfers"),
    ],
)
def test_a_bad_value_names_the_setting(tmp_path, text, message):
    config = tmp_path / "config.toml"
    config.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(config, env={})


def test_serve_takes_its_table_then_the_api_key_variable_then_flags(tmp_path, monkeypatch):
    config = tmp_path / "config.toml"
    config.write_text(
        'port = 7077\n[serve]\nmodel = "/models/m"\nport = 8000\nmax-tokens = 7\npeers = ["127.0.0.1:7078"]\n'
        'fetch = "always"\napi_key = "from-file"\n'
    )
    monkeypatch.setenv("KVMESH_API_KEY", "from-env")
    options = serve_options(parse("serve", "--config", config, "--port", 9000, "--compress"))
    assert options == ServeOptions(
        model="/models/m",
        port=9000,
        max_tokens=7,
        peers=("127.0.0.1:7078",),
        fetch="always",
        api_key="from-env",
        compress="default",
    )
    assert serve_options(parse("serve", "/other", "--config", config, "--api-key", "k")).model == "/other"
    assert serve_options(parse("serve", "/other", "--config", config, "--api-key", "k")).api_key == "k"


@pytest.mark.parametrize(
    "table, message",
    [
        ("[serve]\nprot = 1\n", "unknown setting 'prot'; known: allowed_hosts, api_key, compress, fetch"),
        ("[serve]\nfetch = 'never'\n", "fetch must be auto or always, not 'never'"),
        ("[serve]\nmax_tokens = -1\n", r"max_tokens must be 0 \(the rest of the context\) or more, not -1"),
        ("[serve]\nmax_requests = 0\n", "max_requests must be at least 1, not 0"),
        ("[serve]\nport = '80'\n", "bad value '80' for port"),
        ("serve = 3\n", r"\[serve\] must be a table"),
    ],
)
def test_a_bad_serve_table_is_a_clear_error(tmp_path, monkeypatch, table, message):
    monkeypatch.delenv("KVMESH_API_KEY", raising=False)
    config = tmp_path / "config.toml"
    config.write_text(table)
    with pytest.raises(ConfigError, match=message):
        serve_options(parse("serve", "m", "--config", config))


def test_argparse_refuses_a_choice_that_is_not_one(capsys):
    with pytest.raises(SystemExit):
        parse("daemon", "--log-format", "xml")
    assert "invalid choice: 'xml' (choose from text, json)" in capsys.readouterr().err.replace(
        "'text', 'json'", "text, json"
    )
