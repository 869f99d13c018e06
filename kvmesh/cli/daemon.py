"""`kvmesh daemon` and what asks it: `status`, `peers`; `service` installs it as a login service."""

import json
import os
import sys
from pathlib import Path
from typing import Any

from kvmesh.cli.common import (
    Args,
    Commands,
    check_data_dir,
    command,
    data_dir,
    message_dict,
    print_table,
    store_option,
)
from kvmesh.daemon.config import DaemonConfig
from kvmesh.net.policy import Policy
from kvmesh.settings import add_flags, from_flags

# Given by the options every command shares (--data-dir, --store), not by flags of their own.
SHARED_SETTINGS = ("data_dir", "store")


def daemon_config(args: Args) -> DaemonConfig:
    """The config file (--config, or the default one), then KVMESH_* variables, then the flags."""
    from kvmesh.daemon.config import load_config

    overrides = {
        "data_dir": args.data_dir,
        "store": args.store,
        **from_flags(DaemonConfig, args, skip=SHARED_SETTINGS),
        **from_flags(Policy, args),
    }
    return load_config(Path(args.config) if args.config else None, overrides=overrides)


def daemon(args: Args) -> int:
    from kvmesh.daemon.logs import setup_logging
    from kvmesh.daemon.process import Daemon
    from kvmesh.serve.options import load_serve_options

    config = daemon_config(args)
    check_data_dir(config.data_dir)  # the config file's data_dir too
    setup_logging(config.log_format, config.log_level)
    config_file = Path(args.config) if args.config else None
    serve_command = None
    if load_serve_options(config_file, env={}).model:  # the daemon runs `kvmesh serve` beside itself
        serve_command = [sys.executable, "-m", "kvmesh", "--data-dir", str(config.data_dir), "serve"]
        serve_command += ["--config", str(config_file)] if config_file else []
    Daemon(config, serve_command).run(grace=config.grace)
    return 0


def status(args: Args) -> int:
    import time

    from kvmesh.daemon.control import control_status
    from kvmesh.paths import state_file

    status = control_status(data_dir(args))
    # daemon.json is written once, as the daemon starts serving.
    uptime_s = max(0.0, time.time() - state_file(data_dir(args)).stat().st_mtime)
    info = status.info
    if args.json:
        described = {**message_dict(status), "peers": [peer_dict(p) for p in status.peers]}
        print(json.dumps({**described, "uptime_s": round(uptime_s)}, indent=2))
        return 0
    print(f"node {info.node_id} (kvmesh {info.version}) on {', '.join(status.listen)}, up {duration(uptime_s)}")
    budget = info.store.budget_bytes
    of = f" of a {budget:,}-byte budget ({info.store.bytes / budget:.0%})" if budget else " (no budget)"
    print(f"store: {info.store.entries} caches, {info.store.bytes:,} bytes{of}")
    print(f"peers: {sum(p.healthy for p in status.peers)} live of {len(status.peers)} known")
    t = info.transfers
    print(
        f"fetches served: {t.fetches_completed} done, {t.fetches_rejected} rejected, {t.fetches_failed} failed; "
        f"{t.transfers_active} active (cap {t.transfers_cap}); {t.chunk_bytes_sent:,} bytes of caches sent to "
        "peers, which they did not prefill"
    )
    return 0


def duration(seconds: float) -> str:
    """3725 -> `1h 2m`, 90 -> `1m 30s`: for people."""
    s = int(seconds)
    days, hours, minutes = s // 86400, s // 3600 % 24, s // 60 % 60
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    return f"{minutes}m {s % 60}s" if minutes else f"{s}s"


def source_name(source: int) -> str:
    """PEER_SOURCE_MDNS -> mdns."""
    from kvmesh.v1 import control_pb2 as cpb

    return cpb.PeerSource.Name(source).removeprefix("PEER_SOURCE_").lower()


def peer_dict(peer: Any) -> dict:
    """A peer as `peers --json` and `status --json` both print it (one set of names: found_by
    "mdns", not PEER_SOURCE_MDNS in one and mdns in the other)."""
    return {
        "node_id": peer.node_id,
        "host_name": peer.host_name,
        # The one dialled: the fastest working link of a peer on several (measured by the daemon).
        "address": peer.addresses[0] if peer.addresses else "",
        "addresses": list(peer.addresses),
        "links": [message_dict(link) for link in peer.links],
        "found_by": source_name(peer.source),  # mdns or static
        "healthy": peer.healthy,
        "failures": peer.failures,
        "version": peer.version,
    }


def peers(args: Args) -> int:
    from kvmesh.daemon.control import control_status, describe_links

    known = [p for p in control_status(data_dir(args)).peers if args.all or p.healthy]
    if args.json:
        print(json.dumps([peer_dict(p) for p in known], indent=2))
        return 0
    if not known:
        print("no live peers" if not args.all else "no peers known")
        return 0
    rows = [
        (
            p.node_id,
            p.host_name or "-",
            # The first address is the one dialled: the fastest link that works.
            describe_links(p),
            source_name(p.source),
            "live" if p.healthy else f"lost ({p.failures} failed checks)",
        )
        for p in known
    ]
    print_table(("NODE ID", "HOST", "ADDRESSES (ROUND TRIP, PROBED RATE)", "FOUND BY", "STATE"), rows)
    return 0


def chosen_data_dir(args: Args) -> Path | None:
    """The data dir the user chose (--data-dir, else $KVMESH_DATA_DIR), for the service to run on:
    a login service gets neither the flag nor the shell's environment. None: the platform's."""
    chosen = args.data_dir or os.environ.get("KVMESH_DATA_DIR")
    return Path(chosen) if chosen else None


def service(args: Args) -> int:
    from kvmesh.daemon.service_files import service_file

    platform = args.platform or ("macos" if sys.platform == "darwin" else "linux")
    default_path, content, enable = service_file(platform, data_dir=chosen_data_dir(args))
    if args.print:
        sys.stdout.write(content.decode())
        return 0
    path = Path(args.output) if args.output else default_path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    print(f"wrote {path}; turn it on with: {enable}")
    return 0


def add_commands(commands: Commands) -> None:
    sub = command(
        commands,
        "daemon",
        daemon,
        "run the daemon: serve the store, advertise, find peers",
        description="Settings come from --config (default: the platform config dir's config.toml), "
        "then KVMESH_<SETTING> variables, then these flags.",
    )
    sub.add_argument("--config", help="TOML file with the settings below (names with _ or -)")
    store_option(sub)
    add_flags(sub, DaemonConfig, skip=SHARED_SETTINGS)
    add_flags(sub, Policy)

    sub = command(commands, "status", status, "show what the local daemon is doing")
    sub.add_argument("--json", action="store_true", help="print JSON")

    sub = command(commands, "peers", peers, "list the peers the local daemon knows")
    sub.add_argument("--all", action="store_true", help="also peers that stopped answering")
    sub.add_argument("--json", action="store_true", help="print JSON")

    sub = command(commands, "service", service, "write a launchd (macOS) or systemd (Linux) service for the daemon")
    sub.add_argument("--platform", choices=["macos", "linux"], help="default: this machine's")
    sub.add_argument("--output", help="where to write it (default: the per-user location)")
    sub.add_argument("--print", action="store_true", help="print it instead of writing it")
